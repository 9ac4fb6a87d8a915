"""With a budget that covers the whole context, top-k decoding must be dense attention exactly."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy
from transformers import AutoModelForCausalLM, AutoTokenizer

from topk_decode import KVStore
from topk_decode.prefill.build import build_cache

FAMILIES = ["llama_gqa", "llama_mha", "qwen2", "mistral"]


@pytest.fixture(scope="module")
def caches(tmp_path_factory, model_factory, docs_dir):
    """One fp32 CPU cache per family, prefilled with a chunk size that does not divide N."""
    made = {}
    for name in FAMILIES:
        model_dir = model_factory(name)
        out = tmp_path_factory.mktemp(f"exact-{name}") / "cache"
        build_cache(docs_dir, out, model_dir, chunk_size=61, device="cpu")
        made[name] = (out, model_dir)
    return made


@pytest.mark.parametrize("name", FAMILIES)
def test_generate_ids_equals_hf_generate_when_k_covers_context(caches, name):
    cache, model_dir = caches[name]
    store = KVStore.open(cache, k=100_000, device="cpu")
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = tok("Question: what does the report say?", add_special_tokens=False).input_ids
    ours = store.generate_ids(prompt, max_new_tokens=24)
    assert ours == hf_greedy(model_dir, store.context_ids + prompt, 24)


@pytest.mark.parametrize("name", FAMILIES)
def test_last_step_logits_match_hf_forward(caches, name):
    cache, model_dir = caches[name]
    store = KVStore.open(cache, k=100_000, device="cpu", n_sink=2, n_tail=7)
    prompt = [5, 17, 42, 99]
    conv = store.decoder.new_conversation()
    ours = store.decoder.forward(prompt, conv)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([store.context_ids + prompt])).logits[0, -1]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_sinks_and_tail_do_not_change_dense_result(caches):
    cache, _ = caches["llama_gqa"]
    prompt = [7, 8, 9]
    outs = [
        KVStore.open(cache, k=100_000, device="cpu", n_sink=s, n_tail=t).generate_ids(prompt, 12)
        for s, t in [(0, 0), (4, 64), (16, 300)]
    ]
    assert outs[0] == outs[1] == outs[2]


def test_small_k_reads_fewer_tokens_than_the_context(caches):
    cache, _ = caches["llama_gqa"]
    store = KVStore.open(cache, k=8, device="cpu", n_sink=4, n_tail=16)
    session = store.session()
    session.ask("what?", max_new_tokens=3)
    n_layers, hkv = store.ckv.n_layers, store.ckv.n_kv_heads
    group = store.decoder.shape.group_size
    # every fed token retrieves exactly k = 8 context tokens per query head and layer: never the whole context
    st = session.conv.stats
    assert st.retrieved == 8 * hkv * group * n_layers * st.tokens
    assert store.decoder.strategy.stats.searches > 0


def test_multi_turn_session_equals_one_long_generation(caches):
    """A second turn continues the first exactly: same tokens as decoding the concatenation at once."""
    cache, model_dir = caches["llama_gqa"]
    store = KVStore.open(cache, k=100_000, device="cpu")
    conv = store.decoder.new_conversation()
    first = store.decoder.generate(conv, [10, 11, 12], 5)
    second = store.decoder.generate(conv, [13, 14], 5)
    whole = store.generate_ids([10, 11, 12] + first + [13, 14], 5)
    assert second == whole
