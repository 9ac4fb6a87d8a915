"""Long prompts run in bounded chunks with the same result, and a prompt that cannot fit is refused cleanly."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy

from topk_decode import KVStore
from topk_decode.errors import TopkError

PROMPT = [(7 * i + 3) % 250 + 5 for i in range(45)]  # 45 tokens: chunks of 7 leave a 3-token remainder


def _logits(store: KVStore, prompt: list[int]) -> torch.Tensor:
    return store.decoder.forward(prompt, store.decoder.new_conversation())


def test_chunked_prompt_equals_one_step_and_hf(built_cache):
    cache, model_dir = built_cache
    whole = KVStore.open(cache, k=100_000, device="cpu", prompt_chunk=10_000)
    chunked = KVStore.open(cache, k=100_000, device="cpu", prompt_chunk=7)
    torch.testing.assert_close(_logits(chunked, PROMPT), _logits(whole, PROMPT), rtol=1e-5, atol=1e-5)
    ours = chunked.generate_ids(PROMPT, max_new_tokens=10)
    assert ours == whole.generate_ids(PROMPT, max_new_tokens=10)
    assert ours == hf_greedy(model_dir, chunked.context_ids + PROMPT, 10)


@pytest.mark.parametrize("strategy,options", [("flat", {"backend": "faiss"}), ("flat", {"backend": "torch"})])
def test_chunked_prompt_with_small_k_equals_one_step(built_cache, strategy, options):
    cache, _ = built_cache
    outs = [
        KVStore.open(
            cache, k=8, strategy=strategy, strategy_options=options, device="cpu", prompt_chunk=chunk
        ).generate_ids(PROMPT, max_new_tokens=8)
        for chunk in (10_000, 7, 1)
    ]
    assert outs[0] == outs[1] == outs[2]


def test_prompt_runs_in_chunks_of_the_configured_size(built_cache):
    cache, _ = built_cache
    store = KVStore.open(cache, k=8, device="cpu", prompt_chunk=7)
    conv = store.decoder.new_conversation()
    group, n_layers = store.decoder.shape.group_size, store.decoder.shape.n_layers
    tokens_per_search: list[int] = []
    conv.observer = lambda layer, q, sel, c: tokens_per_search.append(q.shape[1] // group)
    store.decoder.forward(PROMPT, conv)
    # every layer saw the prompt as chunks of 7, 7, ..., 3: the step never held more than 7 queries
    assert tokens_per_search == [t for t in [7] * 6 + [3] for _ in range(n_layers)]
    assert conv.window.n_new == len(PROMPT)


def test_chunks_shrink_over_a_long_context_to_keep_the_search_scratch_bounded(built_cache):
    cache, _ = built_cache
    store = KVStore.open(cache, k=8, device="cpu", prompt_chunk=512, prompt_scratch_mib=1)
    dec = store.decoder
    per_token = 4 * dec.shape.n_heads * dec.strategy.n_searchable  # bytes of scores per chunk token
    assert dec.prompt_chunk_tokens() == (1 << 20) // per_token < 512
    conv = dec.new_conversation()
    seen: list[int] = []
    conv.observer = lambda layer, q, sel, c: seen.append(q.shape[1] // dec.shape.group_size)
    prompt = PROMPT * 4
    logits = dec.forward(prompt, conv)
    assert max(seen) == dec.prompt_chunk_tokens() and sum(seen) == len(prompt) * dec.shape.n_layers
    whole = KVStore.open(cache, k=8, device="cpu", prompt_chunk=10_000, prompt_scratch_mib=1 << 20)
    assert whole.decoder.prompt_chunk_tokens() == 10_000
    torch.testing.assert_close(logits, _logits(whole, prompt), rtol=1e-5, atol=1e-5)


def test_prompt_past_the_window_limit_is_refused_and_the_conversation_kept(built_cache):
    cache, _ = built_cache
    store = KVStore.open(cache, k=8, device="cpu", max_window_tokens=60)
    with pytest.raises(TopkError, match="too long.*max_window_tokens"):
        store.generate_ids(list(range(5, 66)), max_new_tokens=2)
    session = store.session()
    conv = session.conv
    store.decoder.generate(conv, PROMPT, 4)
    held, pending = conv.window.n_new, list(conv.pending)
    with pytest.raises(TopkError, match="with the 48 this conversation holds"):
        store.decoder.generate(conv, PROMPT, 4)
    assert conv.window.n_new == held and conv.pending == pending
    # the conversation goes on where it was
    fresh = store.decoder.new_conversation()
    first = store.decoder.generate(fresh, PROMPT, 4)
    assert store.decoder.generate(conv, [9, 10], 3) == store.decoder.generate(fresh, [9, 10], 3)
    assert first


def test_interrupted_prompt_leaves_the_conversation_as_it_was(built_cache):
    cache, _ = built_cache
    store = KVStore.open(cache, k=8, device="cpu", prompt_chunk=7)
    conv = store.decoder.new_conversation()
    store.decoder.generate(conv, [11, 12, 13], 3)
    held, pending = conv.window.n_new, list(conv.pending)
    calls = []

    def stop_in_third_chunk(layer, q, sel, c):
        calls.append(layer)
        if len(calls) > 2 * store.decoder.shape.n_layers:
            raise KeyboardInterrupt

    conv.observer = stop_in_third_chunk
    with pytest.raises(KeyboardInterrupt):
        store.decoder.forward(PROMPT, conv)
    assert conv.window.n_new == held and conv.pending == pending
    conv.observer = None
    ref = store.decoder.new_conversation()
    store.decoder.generate(ref, [11, 12, 13], 3)
    assert store.decoder.generate(conv, [20, 21], 4) == store.decoder.generate(ref, [20, 21], 4)


def test_prompt_chunk_must_be_positive(built_cache):
    cache, _ = built_cache
    with pytest.raises(TopkError, match="prompt_chunk"):
        KVStore.open(cache, device="cpu", prompt_chunk=0)


def test_a_refused_question_does_not_count_as_a_turn(built_cache):
    cache, _ = built_cache
    store = KVStore.open(cache, k=8, device="cpu", max_window_tokens=40)
    session = store.session()
    with pytest.raises(TopkError, match="too long"):
        session.ask("why " * 60, max_new_tokens=3)
    with pytest.raises(TopkError, match="too long"):
        list(session.ask("why " * 60, max_new_tokens=3, stream=True))
    assert session.ask("why?", max_new_tokens=3) == store.session().ask("why?", max_new_tokens=3)
    assert session.turns == 1


def test_prompts_of_many_lengths_do_not_pile_up_search_buffers(tmp_path, model_factory, docs_dir):
    from topk_decode.prefill.build import build_cache

    cache = tmp_path / "bf16"
    build_cache(docs_dir, cache, model_factory("llama_gqa"), chunk_size=97, device="cpu", dtype="bf16")
    store = KVStore.open(cache, k=8, device="cpu", dtype="bf16", strategy_options={"backend": "torch"})
    for n in (40, 45, 33):
        store.generate_ids(PROMPT[:n], max_new_tokens=3)
    kept = store.decoder.strategy._buffers
    assert kept, "one-token steps reuse their scan buffers (the half-precision path ran)"
    kept_q = {key[1] for key in kept if key[0] != "sel" and key[0] != "sel32"}
    assert kept_q == {store.decoder.shape.group_size}, kept_q  # none kept for the prompts' lengths
