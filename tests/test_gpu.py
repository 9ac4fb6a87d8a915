"""The CUDA decode path (pinned staging, CUDA-graph segments, bf16) keeps dense exactness. Needs a GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy
from transformers import AutoModelForCausalLM

from topk_decode import KVStore
from topk_decode.prefill.build import build_cache

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_caches(tmp_path_factory, model_factory, docs_dir):
    """The tiny Llama GQA model prefilled on the GPU in fp32 and in bf16."""
    model_dir = model_factory("llama_gqa")
    made = {}
    for dtype in ("fp32", "bf16"):
        out = tmp_path_factory.mktemp(f"gpu-{dtype}") / "cache"
        build_cache(docs_dir, out, model_dir, chunk_size=61, device="cuda", dtype=dtype)
        made[dtype] = out
    return made, model_dir


def test_cuda_fp32_generate_ids_equals_hf_generate(cuda_caches):
    caches, model_dir = cuda_caches
    store = KVStore.open(caches["fp32"], k=100_000, device="cuda", dtype="fp32")
    prompt = [5, 17, 42, 99, 7]
    ours = store.generate_ids(prompt, max_new_tokens=24)
    assert ours == hf_greedy(model_dir, store.context_ids + prompt, 24, device="cuda")


def test_cuda_bf16_one_token_steps_match_hf_logits(cuda_caches):
    """One-token steps go through the graphed segments: their logits must match HF's bf16 forward."""
    caches, model_dir = cuda_caches
    store = KVStore.open(caches["bf16"], k=100_000, device="cuda", dtype="bf16")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    conv = store.decoder.new_conversation()
    tokens = [5, 17, 42, 99, 7, 11]
    ours = store.decoder.forward(tokens[:2], conv)
    for t in tokens[2:]:
        ours = store.decoder.forward([t], conv)
    with torch.no_grad():
        ref = model(torch.tensor([store.context_ids + tokens], device="cuda")).logits[0, -1].float()
    cos = torch.nn.functional.cosine_similarity(ours.float(), ref, dim=0)
    assert cos > 0.999, f"cosine {cos:.5f}"
    assert int(ours.argmax()) == int(ref.argmax())


def test_cuda_small_k_retrieves_exactly_k_per_query_head_and_layer(cuda_caches):
    caches, _ = cuda_caches
    store = KVStore.open(caches["bf16"], k=8, device="cuda", n_sink=4, n_tail=16)
    conv = store.decoder.new_conversation()
    store.decoder.forward([5, 17, 42], conv)
    before = conv.stats.retrieved
    logits = store.decoder.forward([7], conv)  # one token: the graphed path
    shape = store.decoder.shape
    assert conv.stats.retrieved - before == 8 * shape.n_heads * shape.n_layers
    assert torch.isfinite(logits).all()


def test_flash_window_part_equals_the_fp32_window_part():
    """The one-token window part runs on the flash kernel (GQA, with its lse): same as the fp32 formula."""
    from topk_decode.decode import merge

    torch.manual_seed(0)
    H, hkv, D, W = 32, 8, 128, 77
    q = torch.randn(H, 1, D, device="cuda").to(torch.bfloat16)
    buf_k = torch.randn(hkv, 128, D, device="cuda").to(torch.bfloat16)  # a window buffer, partly filled
    buf_v = torch.randn(hkv, 128, D, device="cuda").to(torch.bfloat16)
    out, lse = merge.window_attention(q, buf_k[:, :W], buf_v[:, :W], None, D**-0.5)
    assert merge._FLASH_OK, "the flash path was not taken"
    ref_out, ref_lse = merge.window_attention(q.float(), buf_k[:, :W].float(), buf_v[:, :W].float(), None, D**-0.5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(out.float(), ref_out, rtol=2e-2, atol=2e-2)


def test_chunk_window_part_on_fused_cuda_kernels_equals_the_dense_fp32_one():
    """A prompt chunk's window part (flash in bf16, memory-efficient attention in fp32): the dense formula."""
    from topk_decode.decode import merge

    torch.manual_seed(2)
    H, hkv, D, T, W = 32, 8, 128, 300, 1000
    visible = torch.arange(W, device="cuda")[None, :] <= (W - T + torch.arange(T, device="cuda"))[:, None]
    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float32, 1e-4)):
        q = torch.randn(H, T, D, device="cuda").to(dtype)
        buf_k = torch.randn(hkv, 1024, D, device="cuda").to(dtype)
        buf_v = torch.randn(hkv, 1024, D, device="cuda").to(dtype)
        out, lse = merge.chunk_window_attention(q, buf_k[:, :W], buf_v[:, :W], D**-0.5)
        assert merge.FUSED_KERNELS["cuda"], "the fused kernels were not taken"
        ref_out, ref_lse = merge.window_attention(
            q.float(), buf_k[:, :W].float(), buf_v[:, :W].float(), visible, D**-0.5
        )
        torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)


def test_masked_fixed_capacity_window_part_equals_the_fp32_window_part():
    """Inside the graphs the window part runs over the whole buffer with a mask (efficient kernel)."""
    from topk_decode.decode import merge

    torch.manual_seed(1)
    H, hkv, D, C, W = 32, 8, 128, 256, 77
    q = torch.randn(H, 1, D, device="cuda").to(torch.bfloat16)
    buf_k = torch.randn(hkv, C, D, device="cuda").to(torch.bfloat16)  # slots ≥ W hold stale values
    buf_v = torch.randn(hkv, C, D, device="cuda").to(torch.bfloat16)
    visible = (torch.arange(C, device="cuda") < W)[None]
    bias = torch.zeros(1, 1, 1, C, device="cuda", dtype=torch.bfloat16).masked_fill(~visible, float("-inf"))
    out, lse = merge.fixed_window_attention(q, buf_k, buf_v, bias, visible, D**-0.5)
    assert merge._EFFICIENT_OK, "the efficient-attention path was not taken"
    ref_out, ref_lse = merge.window_attention(q.float(), buf_k[:, :W].float(), buf_v[:, :W].float(), None, D**-0.5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(out, ref_out, rtol=2e-2, atol=2e-2)


def test_cuda_graphs_interleaved_conversations_decode_as_each_alone(cuda_caches):
    """The graphs' window buffers are lent to one conversation at a time; switching keeps each exact."""
    caches, _ = cuda_caches
    store = KVStore.open(caches["bf16"], k=8, device="cuda", n_sink=4, n_tail=16)
    dec = store.decoder

    def run(conv, tok, n):
        out = []
        for _ in range(n):
            tok = int(dec.forward([tok], conv).argmax())
            out.append(tok)
        return out

    alone = []
    for prompt in ([5, 6, 7], [9, 10]):
        conv = dec.new_conversation()
        dec.forward(prompt, conv)
        alone.append(run(conv, 3, 5))
    a, b = dec.new_conversation(), dec.new_conversation()
    dec.forward([5, 6, 7], a)
    dec.forward([9, 10], b)
    got = [[], []]
    ta = tb = 3
    for _ in range(5):
        ta, tb = run(a, ta, 1)[0], run(b, tb, 1)[0]
        got[0].append(ta)
        got[1].append(tb)
    assert got == alone
    assert dec.segments.graphs is not None


def _one_token_logits(store, compile: bool, steps: int = 6) -> torch.Tensor:
    """Greedy one-token steps (the graphed path) with the step compiled or not: (steps, V) logits."""
    store.decoder.reset_segments(compile=compile)
    conv = store.decoder.new_conversation()
    logits = store.decoder.forward([5, 17, 42], conv)
    out = []
    for _ in range(steps):
        logits = store.decoder.forward([int(logits.argmax())], conv)
        out.append(logits)
    assert store.decoder.segments.graphs is not None
    assert store.decoder.segments.compiled is compile
    return torch.stack(out)


def test_compiled_step_computes_what_the_uncompiled_step_does(cuda_caches):
    """torch.compile fuses each layer's small ops inside the graphs; in fp32 the logits stay the same."""
    caches, _ = cuda_caches
    store = KVStore.open(caches["fp32"], k=8, device="cuda", dtype="fp32", n_sink=4, n_tail=16)
    plain = _one_token_logits(store, compile=False)
    fused = _one_token_logits(store, compile=True)
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)


def test_failed_compilation_falls_back_to_the_uncompiled_step_with_a_warning(cuda_caches, monkeypatch):
    from topk_decode.decode import layer
    from topk_decode.errors import TopkWarning

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(layer, "compiled_boundary", lambda: broken)
    caches, _ = cuda_caches
    store = KVStore.open(caches["fp32"], k=8, device="cuda", dtype="fp32", n_sink=4, n_tail=16)
    plain = _one_token_logits(store, compile=False)
    store.decoder.reset_segments(compile=True)
    conv = store.decoder.new_conversation()
    logits = store.decoder.forward([5, 17, 42], conv)
    with pytest.warns(TopkWarning, match="torch.compile of the decode step failed"):
        logits = store.decoder.forward([int(logits.argmax())], conv)
    assert store.decoder.segments.compiled is False and store.decoder.segments.graphs is not None
    torch.testing.assert_close(logits, plain[0], rtol=0, atol=0)


@pytest.mark.parametrize(
    "strategy,options",
    [
        ("auto", {}),
        ("routed", {"rank": "keys", "pq_values": 8, "probe_fraction": 0.1, "device_read": "false"}),
        ("routed", {"rank": "keys", "pq_values": 8, "probe_fraction": 0.1}),  # device_read=auto: the GPU reads
        ("routed", {"probe_fraction": 0.1}),  # clusters ranked on the GPU, which reads their rows itself
    ],
)
def test_cuda_int8_cache_decodes_close_to_its_bf16_cache(tmp_path, model_factory, docs_dir, strategy, options):
    """`--kv-dtype int8` on the GPU: prefilled in bf16 and stored as int8, decoded through the graphed one-token
    segments with the context part crossing in fp32: close to the bf16 cache (flat, auto's choice on int8: the same
    greedy tokens; routed ranking keys on the device, which scales the query by the key scales first)."""
    model_dir = model_factory("llama_gqa")
    made = {}
    for kv in (None, "int8"):
        out = tmp_path / f"c-{kv}"
        build_cache(docs_dir, out, model_dir, chunk_size=61, device="cuda", dtype="bf16", kv_dtype=kv)
        made[kv] = KVStore.open(out, k=16, device="cuda", dtype="bf16", strategy=strategy, strategy_options=options)
    assert made["int8"].decoder.config.strategy == ("flat" if strategy == "auto" else strategy)
    prompt = [5, 17, 42, 99, 7]
    logits = []
    for store in made.values():
        conv = store.decoder.new_conversation()
        store.decoder.forward(prompt[:2], conv)
        for t in prompt[2:]:
            out = store.decoder.forward([t], conv)
        logits.append(out.float())
    cos = torch.nn.functional.cosine_similarity(logits[0], logits[1], dim=0)
    assert cos > 0.999, f"cosine {cos:.5f}"
    if strategy == "routed":
        routes = made["int8"].decoder.segments.routes
        assert routes is not None and routes.rank_keys == ("rank" in options) and routes.tables[0].kscale is not None
        # device_read: the GPU read the int8 rows and their value scales from the host's RAM itself
        why = made["int8"].decoder.strategy.device_read_off
        assert routes.attends(0) == (options.get("device_read") != "false"), why
    else:
        assert made[None].generate_ids(prompt, 12) == made["int8"].generate_ids(prompt, 12)
    for store in made.values():
        store.close()
