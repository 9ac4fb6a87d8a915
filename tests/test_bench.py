"""`topk bench`: the CPU smoke run works end to end, and its building blocks do what they say."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from topk_decode.bench.measure import parse_bytes, parse_tokens
from topk_decode.bench.shapes import SHAPES, make_config
from topk_decode.bench.synthetic import kv_bytes, synthetic_kv
from topk_decode.errors import TopkError
from topk_decode.index.base import StrategyStats
from topk_decode.index.flat.strategy import fp32_scan, half_scan


@pytest.fixture(scope="module")
def smoke_results(tmp_path_factory):
    from topk_decode.cli.app import app

    out = tmp_path_factory.mktemp("bench")
    res = CliRunner().invoke(app, ["bench", "--smoke", "--out", str(out)])
    assert res.exit_code == 0, res.output
    return json.loads((out / "bench_tiny.json").read_text()), out


def test_smoke_run_measures_topk_and_hf_dense_at_every_context(smoke_results):
    data, _ = smoke_results
    rows = {(r["system"], r["context"]): r for r in data["rows"]}
    for n in (512, 1024):
        assert rows[("topk", n)]["status"] == "ok" and rows[("topk", n)]["tokens_per_s"] > 0
        assert rows[("hf-dense", n)]["status"] == "ok" and rows[("hf-dense", n)]["prefill_tokens_per_s"] > 0
    assert rows[("topk", 512)]["kv"] == "prefill" and rows[("topk", 1024)]["kv"] == "synthetic"


def test_smoke_run_reports_the_step_breakdown_and_memory(smoke_results):
    data, _ = smoke_results
    row = next(r for r in data["rows"] if r["system"] == "topk")
    assert set(row["breakdown"]) == {"gpu_ms", "d2h_ms", "search_ms", "context_ms", "h2d_ms"}
    parts = row["breakdown"]
    assert parts["search_ms"] > 0 and parts["context_ms"] > 0 and row["cpu_rss_gib"] > 0
    # gpu_ms is the step's remainder: it is negative if the separately timed parts overlap (double counting),
    # and the decoder's own step time must fit inside the benchmark's wall clock around it (± rounding)
    assert all(v >= 0 for v in parts.values()), parts
    assert sum(parts.values()) <= row["ms_per_step"] + 0.05, (parts, row["ms_per_step"])


def test_smoke_run_of_a_named_random_shape_does_not_compare_tokens_with_dense(smoke_results):
    data, _ = smoke_results
    topk = [r for r in data["rows"] if r["system"] == "topk"]
    assert topk and not any(k.startswith("tokens_equal_dense") or k == "tokens_compared" for r in topk for k in r)


def test_bench_of_a_checkpoint_dir_counts_the_tokens_equal_to_hf_dense(tmp_path, model_factory):
    """`topk bench --model DIR`: flat with k ≥ the context is dense-exact, so every greedy token matches HF dense's;
    synthetic KV (not the context's) says why it has no count."""
    from topk_decode.bench.run import BenchConfig, run_bench

    cfg = BenchConfig(
        model=str(model_factory("llama_gqa")),
        contexts=[256, 384],
        systems=["topk"],
        k=100000,
        steps=4,
        warmup=2,
        prefill_max=256,  # 384: synthetic KV
        prefill_chunk=128,
        offload_prefill=False,
        device="cpu",
        dtype="fp32",
        out=str(tmp_path),
    )
    rows = {r["context"]: r for r in run_bench(cfg, log=lambda line: None)["rows"] if r["system"] == "topk"}
    exact = rows[256]
    assert exact["status"] == "ok" and exact["kv"] == "prefill" and exact["ran"] == "flat"
    assert exact["tokens_equal_dense"] == exact["tokens_compared"] == 1 + cfg.warmup + cfg.steps
    synthetic = rows[384]
    assert synthetic["kv"] == "synthetic" and synthetic["tokens_equal_dense"] is None
    assert "synthetic" in synthetic["tokens_equal_dense_reason"]


def test_tokens_equal_dense_counts_up_to_the_first_divergence():
    from topk_decode.bench.run import tokens_equal_dense

    assert tokens_equal_dense([1, 2, 3, 4], [1, 2, 9, 4]) == {"tokens_equal_dense": 2, "tokens_compared": 4}
    assert tokens_equal_dense([1, 2], [1, 2, 3]) == {"tokens_equal_dense": 2, "tokens_compared": 2}
    assert tokens_equal_dense([1], None) == {}
    assert tokens_equal_dense([1], "why")["tokens_equal_dense"] is None


def test_smoke_run_marks_the_offloaded_cache_as_skipped_on_cpu_and_writes_a_plot(smoke_results):
    data, out = smoke_results
    off = [r for r in data["rows"] if r["system"] == "hf-offload"]
    assert off and all(r["status"].startswith("skipped") for r in off)
    assert (out / "bench_tiny.png").stat().st_size > 1000


def test_named_shapes_have_the_real_models_geometry():
    llama = make_config("llama-3-8b")
    assert (
        llama.num_hidden_layers,
        llama.num_attention_heads,
        llama.num_key_value_heads,
        llama.head_dim,
        llama.hidden_size,
        llama.intermediate_size,
        llama.vocab_size,
    ) == (32, 32, 8, 128, 4096, 14336, 128256)
    qwen = make_config("qwen2.5-7b")
    assert (
        qwen.num_hidden_layers,
        qwen.num_attention_heads,
        qwen.num_key_value_heads,
        qwen.hidden_size // qwen.num_attention_heads,
        qwen.intermediate_size,
        qwen.vocab_size,
    ) == (28, 28, 4, 128, 18944, 152064)
    small = make_config("llama-3.2-1b")
    assert (small.num_hidden_layers, small.head_dim, small.hidden_size) == (16, 64, 2048)
    assert {"llama-3-8b", "qwen2.5-7b", "llama-3.2-1b"} <= set(SHAPES)


def test_qwen_1m_context_kv_is_57_gib_in_bf16():
    assert kv_bytes(28, 4, 128, 1 << 20, torch.bfloat16) / 2**30 == pytest.approx(56.0)


def test_unknown_shape_and_bad_sizes_are_user_errors():
    with pytest.raises(TopkError):
        make_config("gpt-17")
    with pytest.raises(TopkError):
        parse_bytes("sixteen gigs")
    with pytest.raises(TopkError):
        parse_tokens("1.5M")
    assert parse_bytes("16GiB") == 16 << 30 and parse_tokens("128K") == 131072 and parse_tokens("1M") == 1 << 20


def test_synthetic_kv_can_be_written_as_a_real_cache_dir(tmp_path):
    mem = synthetic_kv(2, 2, 16, 300, torch.bfloat16, seed=3)
    disk = synthetic_kv(2, 2, 16, 300, torch.bfloat16, seed=3, path=tmp_path / "c")
    assert disk.keys[1].shape == (2, 300, 16) and disk.dtype == torch.bfloat16
    assert torch.equal(mem.keys[1], disk.keys[1]) and torch.equal(mem.values[0], disk.values[0])
    mem8 = synthetic_kv(2, 2, 16, 300, torch.bfloat16, seed=3, kv_dtype="int8")
    disk8 = synthetic_kv(2, 2, 16, 300, torch.bfloat16, seed=3, path=tmp_path / "c8", kv_dtype="int8")
    assert disk8.manifest["kv_dtype"] == mem8.manifest["kv_dtype"] == "int8" and disk8.dtype == torch.int8
    for a, b in ((mem8.keys, disk8.keys), (mem8.key_scales, disk8.key_scales), (mem8.value_scales, disk8.value_scales)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_bench_decodes_int8_kv_with_flat(tmp_path):
    """`topk bench --kv-dtype int8`: the prefilled KV quantised as the cache stores it, decoded by flat."""
    from topk_decode.bench.run import run_bench, smoke_config

    cfg = smoke_config(str(tmp_path))
    cfg.systems, cfg.offload_prefill, cfg.contexts, cfg.k, cfg.kv_dtype = ["topk"], False, [1024], 16, "int8"
    row = next(r for r in run_bench(cfg, log=lambda line: None)["rows"] if r["system"] == "topk")
    assert row["status"] == "ok" and row["kv_dtype"] == "int8" and row["ran"] == "flat" and row["tokens_per_s"] > 0
    cfg.kv_cache = str(tmp_path)
    with pytest.raises(TopkError, match="--kv-dtype applies to the bench's own KV"):
        cfg.validate()


def test_half_precision_scan_returns_the_exact_fp32_top_k():
    torch.manual_seed(0)
    keys = torch.randn(3, 4000, 32).bfloat16()
    q = torch.randn(3, 5, 32).bfloat16().float()
    sel = half_scan(keys, q, 100, 7, 3900, StrategyStats())
    scores, ids = fp32_scan(keys, q, 100, 7, 3900)
    assert torch.equal(sel.ids.sort(-1).values, ids.sort(-1).values)
    assert torch.allclose(sel.scores, scores, rtol=0, atol=1e-5)
    assert sel.ids.min() >= 7 and sel.ids.max() < 3900


def test_half_precision_scan_rescans_rows_whose_certificate_fails():
    # Every key identical: the half-precision ranking cannot separate them, the certificate fails,
    # and the fp32 rescan still returns exact scores.
    keys = torch.ones(1, 500, 8, dtype=torch.bfloat16)
    q = torch.ones(1, 2, 8)
    stats = StrategyStats()
    sel = half_scan(keys, q, 10, 0, 500, stats)
    assert stats.extra["fp32_rescans"] == 2
    assert torch.all(sel.scores == 8.0)


@pytest.mark.parametrize("k", [8, 100000])
def test_one_token_segments_match_the_module_by_module_step(built_cache, k):
    # The fixed-buffer segments (CUDA graphs on a GPU) must compute what the eager path does. Their window
    # part sums over the whole fixed capacity with masked slots, so fp32 rounding may differ in the last bit.
    from topk_decode.config import DecodeConfig
    from topk_decode.decode.engine import TopKDecoder
    from topk_decode.model.loading import load_model
    from topk_decode.store.cache_dir import open_cache

    cache, model_dir = built_cache
    model, ckv = load_model(model_dir, "cpu"), open_cache(cache)
    runs = []
    for graphs in (False, True):
        dec = TopKDecoder(model, ckv, DecodeConfig(k=k, strategy_options={"backend": "torch"}), graphs=graphs)
        conv = dec.new_conversation()
        logits = [dec.forward([5, 6, 7], conv)]
        for _ in range(4):
            logits.append(dec.forward([int(logits[-1].argmax())], conv))
        runs.append(torch.stack(logits))
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-6, atol=1e-6)


def test_a_checkpoints_context_is_real_text_and_a_named_shapes_random_ids():
    """`context_tokens`: a checkpoint's bench context is CPython's documentation topics in its own tokenizer (so that
    its rows' tokens against HF dense's mean something), the same for the same seed, repeated past the topics'
    length; a named shape's is random ids."""
    import torch

    from topk_decode.bench.run import context_tokens
    from topk_decode.model.loading import load_tokenizer

    demo = "topk_decode/demo_model"
    tokens = context_tokens(demo, 0, 600, torch.Generator().manual_seed(0))
    assert len(tokens) == 600 and tokens == context_tokens(demo, 0, 600, torch.Generator().manual_seed(0))
    assert tokens != context_tokens(demo, 0, 600, torch.Generator().manual_seed(1))  # another order of the topics
    text = load_tokenizer(demo).decode(tokens)
    from pydoc_data.topics import topics

    assert any(topic[:200] in text for topic in topics.values())  # whole topics, as written
    many = context_tokens(demo, 0, 700_000, torch.Generator().manual_seed(0))  # the topics: ~300K of its tokens
    head = many[:200]
    period = next(i for i in range(1, len(many) - 200) if many[i : i + 200] == head)  # where the topics start again
    assert len(many) == 700_000 and 200_000 < period < 400_000 and many[period:] == many[: len(many) - period]
    ids = context_tokens(None, 1000, 64, torch.Generator().manual_seed(0))
    assert len(ids) == 64 and all(3 <= i < 1000 for i in ids)
