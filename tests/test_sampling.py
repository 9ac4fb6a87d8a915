"""Sampling (temperature, top-p, seed), system prompts after the documents, and answer sources."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from topk_decode import KVStore
from topk_decode.cli.app import app
from topk_decode.decode.messages import conversation_text
from topk_decode.decode.sampling import Sampling
from topk_decode.decode.sources import SourceTracker
from topk_decode.errors import TopkError
from topk_decode.index import Selection
from topk_decode.prefill.documents import RAW_QUESTION, PromptFormat, prompt_format

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# a template that always renders system messages first, wherever they are in the list
HOISTING = (
    "{% for m in messages if m['role'] == 'system' %}[SYS] {{ m['content'] }}\n{% endfor %}"
    "{% for m in messages if m['role'] != 'system' %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


# ---- the sampler -----------------------------------------------------------------------------------
def test_temperature_zero_is_argmax():
    logits = torch.randn(100)
    assert Sampling().pick(logits) == int(torch.argmax(logits))
    assert Sampling().greedy and not Sampling(temperature=0.5).greedy


def test_a_tiny_top_p_keeps_only_the_most_likely_token_at_any_temperature():
    logits = torch.randn(50)
    s = Sampling(temperature=5.0, top_p=1e-6, seed=0)
    assert {s.pick(logits) for _ in range(50)} == {int(torch.argmax(logits))}


def test_top_p_never_draws_outside_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    s = Sampling(temperature=1.0, top_p=0.8, seed=1)
    draws = [s.pick(logits) for _ in range(400)]
    assert set(draws) == {0, 1}  # 0.5 + 0.3 reach 0.8: tokens 2 and 3 are cut


def test_the_same_seed_repeats_its_draws_and_another_seed_does_not():
    logits = torch.zeros(1000)
    s1, s2, s3 = Sampling(1.0, seed=3), Sampling(1.0, seed=3), Sampling(1.0, seed=4)
    d1, d2, d3 = ([s.pick(logits) for _ in range(20)] for s in (s1, s2, s3))
    assert d1 == d2 and d1 != d3


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=-0.1),
        dict(temperature="hot"),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(seed=1.5),
        dict(seed=True),
    ],
)
def test_bad_sampling_values_are_user_errors(kw):
    with pytest.raises(TopkError):
        Sampling(**kw)


def test_penalties_and_logit_bias_follow_openais_formula_within_one_answer():
    logits = torch.tensor([3.0, 2.5, 0.0, -1.0])
    s = Sampling(presence_penalty=1.0, frequency_penalty=0.5, logit_bias={3: 5.0})
    assert not s.plain and Sampling(logprobs=None).plain
    assert s.pick(logits) == 3  # -1 + 5 beats 3
    assert s.pick(logits) == 0  # 4 - 0.5 - 1 = 2.5 < 3: token 0 now
    assert s.adjusted(logits).tolist() == pytest.approx([3 - 1.5, 2.5, 0.0, 4 - 1.5])
    s.start_answer()  # a new answer counts from zero
    assert s.adjusted(logits).tolist() == pytest.approx([3.0, 2.5, 0.0, 4.0])
    with pytest.raises(TopkError, match="vocabulary"):
        Sampling(logit_bias={4: 1.0}).pick(logits)


def test_logprobs_record_the_models_own_distribution_and_the_most_likely_alternatives():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5])
    s = Sampling(logprobs=2, logit_bias={1: -100.0})
    assert s.pick(logits) == 2  # the bias moved the pick, not the recorded distribution
    tok, logprob, top = s.picked[0]
    expected = torch.log_softmax(logits, -1)
    assert tok == 2 and logprob == pytest.approx(float(expected[2]))
    assert [t for t, _ in top] == [1, 2] and top[0][1] == pytest.approx(float(expected[1]))
    assert Sampling(logprobs=0).pick(logits) == 1


@pytest.mark.parametrize(
    "kw",
    [
        dict(presence_penalty=2.5),
        dict(frequency_penalty="x"),
        dict(logit_bias={-1: 1}),
        dict(logit_bias={"5": 1}),
        dict(logit_bias={5: 101}),
        dict(logprobs=21),
        dict(logprobs=True),
    ],
)
def test_bad_penalty_bias_and_logprobs_values_are_user_errors(kw):
    with pytest.raises(TopkError):
        Sampling(**kw)


def test_seeded_sampling_over_a_covering_budget_draws_what_dense_hf_logits_draw(built_cache):
    from transformers import AutoModelForCausalLM

    cache, model_dir = built_cache
    store = KVStore.open(cache, k=100_000, device="cpu")
    prompt = store.tokenizer("Question: what does the report say?", add_special_tokens=False).input_ids
    ours = store.decoder.generate(store.decoder.new_conversation(), prompt, 16, set(), Sampling(1.0, 0.9, seed=5))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, ref, sampler = store.context_ids + prompt, [], Sampling(1.0, 0.9, seed=5)
    with torch.no_grad():
        for _ in range(16):
            ref.append(sampler.pick(hf(torch.tensor([ids + ref])).logits[0, -1]))
    assert ours == ref


def test_sessions_are_greedy_by_default_and_repeat_with_a_seed(built_cache):
    cache, _ = built_cache
    store = KVStore.open(cache, k=64, device="cpu")
    q = "what is in the notes?"
    greedy = store.ask(q, max_new_tokens=12)
    assert greedy == store.ask(q, max_new_tokens=12, temperature=0.0)
    a = store.ask(q, max_new_tokens=12, temperature=1.0, seed=11)
    assert a == store.ask(q, max_new_tokens=12, temperature=1.0, seed=11)


# ---- conversations after the documents ---------------------------------------------------------------
def test_raw_layout_of_one_question_is_what_chat_asks():
    fmt = PromptFormat("raw")
    assert conversation_text([{"role": "user", "content": "Q?"}], fmt, None) == fmt.question_text("Q?", True)
    text = conversation_text(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "A?"},
            {"role": "assistant", "content": "a."},
            {"role": "user", "content": "B?"},
        ],
        fmt,
        None,
    )
    assert text == "\nBe brief." + RAW_QUESTION.format(question="A?") + " a." + "\n" + RAW_QUESTION.format(
        question="B?"
    )


@pytest.fixture(scope="module")
def chatml_tokenizer(tmp_path_factory):
    from topk_decode.model.tiny import make_tokenizer

    return make_tokenizer(tmp_path_factory.mktemp("chatml"), chat_template=CHATML)


def test_a_chat_template_renders_the_conversation_after_the_cached_prefix(chatml_tokenizer):
    fmt = prompt_format(chatml_tokenizer)
    assert fmt.kind == "chat"
    one = conversation_text([{"role": "user", "content": "Q?"}], fmt, chatml_tokenizer)
    assert one == fmt.question_text("Q?", first_turn=True)
    with_system = conversation_text(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q?"}], fmt, chatml_tokenizer
    )
    # the documents' user turn closes, a system turn follows, then the question's own user turn
    assert with_system == (
        "<|im_end|>\n<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_that_moves_the_system_message_before_the_documents_is_refused(chatml_tokenizer):
    chatml_tokenizer.chat_template = HOISTING
    try:
        fmt = prompt_format(chatml_tokenizer)
        assert conversation_text([{"role": "user", "content": "Q?"}], fmt, chatml_tokenizer)
        with pytest.raises(TopkError, match="system"):
            conversation_text(
                [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"}], fmt, chatml_tokenizer
            )
    finally:
        chatml_tokenizer.chat_template = CHATML


@pytest.mark.parametrize(
    "messages, fragment",
    [
        ([], "empty"),
        ([{"role": "tool", "content": "x"}], "role"),
        ([{"role": "user", "content": None}], "text"),
        ([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}], "last message"),
    ],
)
def test_malformed_conversations_are_user_errors(messages, fragment):
    with pytest.raises(TopkError, match=fragment):
        conversation_text(messages, PromptFormat("raw"), None)


def test_a_session_replies_to_a_one_message_conversation_as_it_answers_the_question(built_cache):
    cache, _ = built_cache
    store = KVStore.open(cache, k=64, device="cpu")
    q = "what is in the notes?"
    reply = "".join(store.session().reply([{"role": "user", "content": q}], max_new_tokens=10)).strip()
    assert reply == store.ask(q, max_new_tokens=10)
    chat = store.session()
    chat.ask(q, max_new_tokens=4)
    with pytest.raises(TopkError, match="fresh"):
        chat.reply([{"role": "user", "content": q}])


# ---- sources ---------------------------------------------------------------------------------------
def _selection(ids, scores):
    return Selection(torch.tensor(ids, dtype=torch.int64), torch.tensor(scores, dtype=torch.float32))


def test_source_tracker_credits_the_document_whose_tokens_took_the_attention():
    docs = [{"name": "a", "start": 2, "end": 10}, {"name": "b", "start": 10, "end": 20}]
    tr = SourceTracker(docs, scale=1.0, group_size=1, n_layers=4)  # counts layer 3 only
    assert tr.first_layer == 3
    q = torch.zeros(1, 1, 4)
    tr(0, q, _selection([[[3, 4]]], [[[50.0, 50.0]]]), None)  # an early layer: ignored
    tr(3, q, _selection([[[3, 12, -1]]], [[[0.0, 8.0, 99.0]]]), None)  # -1 is an empty slot: ignored
    # a two-token step (Hkv=1, G=1, T=2): only its last position predicts an answer token
    tr(3, q, _selection([[[4, 5], [15, 16]]], [[[9.0, 9.0], [0.0, 0.0]]]), None)
    src = tr.sources(min_weight=0.0)
    assert [s["document"] for s in src] == ["b", "a"]
    assert src[0]["weight"] > 0.9 and abs(sum(s["weight"] for s in src) - 1) < 1e-3


def test_ask_returns_sources_from_the_document_table(built_cache):
    cache, _ = built_cache
    store = KVStore.open(cache, k=64, device="cpu")
    answer, sources = store.ask("what is in the notes?", max_new_tokens=8, return_sources=True)
    assert isinstance(answer, str) and sources
    assert {s["document"] for s in sources} <= {d["name"] for d in store.documents}
    assert all(0 < s["weight"] <= 1 for s in sources)
    assert answer == store.ask("what is in the notes?", max_new_tokens=8)  # tracking changes no token
    with pytest.raises(TopkError, match="stream"):
        store.ask("x", stream=True, return_sources=True)


# ---- topk chat ---------------------------------------------------------------------------------------
def test_chat_sampling_options_repeat_with_a_seed_and_bad_values_are_one_line(built_cache):
    cache, _ = built_cache
    args = ["chat", str(cache), "--device", "cpu", "--max-new-tokens", "8", "--prompt", "what is in the notes?"]
    one = CliRunner().invoke(app, args + ["--temperature", "0.9", "--seed", "4", "--system", "Be brief."])
    two = CliRunner().invoke(app, args + ["--temperature", "0.9", "--seed", "4", "--system", "Be brief."])
    assert one.exit_code == 0 and one.stdout == two.stdout
    bad = CliRunner().invoke(app, args + ["--top-p", "0"])
    assert bad.exit_code == 2 and bad.stderr.startswith("error: top_p")


def test_chat_sources_command_lists_documents_after_an_answer(built_cache):
    cache, _ = built_cache
    result = CliRunner().invoke(
        app,
        ["chat", str(cache), "--device", "cpu", "--max-new-tokens", "6"],
        input="/sources\nwhat is in the notes?\n/sources\n",
    )
    assert result.exit_code == 0, result.output
    assert "(no answer yet)" in result.stdout
    assert any(name in result.stdout for name in ("alpha.txt", "gamma.txt", "notes/beta.md"))
