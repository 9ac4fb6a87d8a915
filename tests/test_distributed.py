"""`topk prefill --gpus N`: the sequence-parallel prefill writes the cache one process writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from topk_decode.cli.app import app
from topk_decode.demo import default_model_dir
from topk_decode.errors import TopkError
from topk_decode.prefill.build import build_cache
from topk_decode.prefill.distributed import layer_flops, plan_slices
from topk_decode.prefill.distributed_launch import RankSpec, build_cache_ranks, leader, plan_group
from topk_decode.store import open_cache

CHUNK = 64  # small chunks: the ~900-token documents give each rank several
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo_model() -> Path:
    return default_model_dir()[0]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, docs_dir, demo_model) -> Path:
    """The reference: the same documents prefilled by this process alone (fp32, CPU)."""
    out = tmp_path_factory.mktemp("one") / "cache"
    build_cache(docs_dir, out, demo_model, chunk_size=CHUNK, device="cpu")
    return out


def files(cache: Path) -> dict:
    """Every file of the cache with its size and blake2b checksum (all but the manifest's timings)."""
    return json.loads((cache / "manifest.json").read_text())["files"]


def assert_same_cache(cache: Path, reference: Path) -> None:
    assert files(cache) == files(reference)  # byte-identical KV, tokens and last logits
    a, b = open_cache(cache, verify=True), open_cache(reference, verify=True)
    assert a.tokens == b.tokens and a.n_tokens > 8 * CHUNK
    assert all(torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values))


def test_two_gloo_ranks_write_the_cache_one_process_writes(tmp_path, docs_dir, demo_model, one_process):
    out = tmp_path / "cache"
    threads = torch.get_num_threads()
    result = CliRunner().invoke(
        app, ["prefill", str(docs_dir), "--out", str(out), "--device", "cpu", "--gpus", "2", "--chunk-size", str(CHUNK)]
    )
    assert result.exit_code == 0, result.output
    assert_same_cache(out, one_process)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["prefill"]["ranks"] == 2
    assert torch.get_num_threads() == threads  # rank 0 gave the CPUs it shared back


def test_two_gloo_ranks_write_the_int8_cache_one_process_writes(tmp_path, docs_dir, demo_model):
    """`--kv-dtype int8` with `--gpus 2`: rank 0's writer quantises the gathered layers as one process does
    (`KVStore.build(..., kv_dtype="int8")` here, the Python API's way)."""
    from topk_decode import KVStore

    reference = tmp_path / "one"
    KVStore.build(docs_dir, reference, demo_model, chunk_size=CHUNK, device="cpu", kv_dtype="int8").close()
    out = tmp_path / "two"
    args = ["prefill", str(docs_dir), "--out", str(out), "--device", "cpu", "--gpus", "2", "--chunk-size", str(CHUNK)]
    result = CliRunner().invoke(app, [*args, "--kv-dtype", "int8"])
    assert result.exit_code == 0, result.output
    assert files(out) == files(reference) and "kv/value_scales.000.bin" in files(out)


def test_bad_documents_found_after_the_ranks_started_are_one_line_and_stop_them(tmp_path):
    """An error rank 0 finds after spawning (no text in the folder) is one `error:` line; the ranks stop."""
    import multiprocessing

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0")
    result = CliRunner().invoke(
        app, ["prefill", str(docs), "--out", str(tmp_path / "c"), "--device", "cpu", "--gpus", "2"]
    )
    assert result.exit_code == 2, result.output
    assert len([line for line in result.stderr.splitlines() if line.startswith("error: ")]) == 1, result.stderr
    assert not (tmp_path / "c").exists() and not multiprocessing.active_children()


@pytest.mark.slow  # two 2-rank prefills: ~30 s on the shared 2-core box
def test_interrupted_two_rank_prefill_resumes_to_the_same_cache(
    tmp_path, docs_dir, demo_model, one_process, monkeypatch
):
    """Rank 0 (this process) fails writing layer 2: the checkpoint (gathered from both ranks) is kept and a
    resumed two-rank run (the residual stream scattered back) finishes the same cache."""
    from topk_decode.store.cache_dir import CacheWriter

    out = tmp_path / "cache"
    write = CacheWriter.write_layer

    def failing(self, layer, keys, values):
        if layer == 2:
            raise KeyboardInterrupt
        write(self, layer, keys, values)

    monkeypatch.setattr(CacheWriter, "write_layer", failing)
    notes: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        build_cache_ranks(
            docs_dir, out, demo_model, 2, device="cpu", chunk_size=CHUNK, checkpoint_every=0, on_note=notes.append
        )
    assert not out.exists() and any("kept 2 finished layers" in n for n in notes)
    monkeypatch.setattr(CacheWriter, "write_layer", write)
    path, stats = build_cache_ranks(
        docs_dir, out, demo_model, 2, device="cpu", chunk_size=CHUNK, resume=True, on_note=notes.append
    )
    assert stats.resumed_at_layer == 2 and stats.ranks == 2
    assert_same_cache(path, one_process)


def test_a_failing_rank_fails_the_prefill_in_one_line_and_leaves_no_cache(tmp_path, docs_dir, demo_model):
    from topk_decode.prefill.distributed_launch import plan_group as plan

    out = tmp_path / "cache"
    group = plan(2, "cpu")
    with pytest.raises(TopkError, match="prefill rank 1 failed"):
        with leader(group, RankSpec(str(tmp_path / "no-such-model"), None, CHUNK)) as prefill_fn:
            build_cache(docs_dir, out, demo_model, chunk_size=CHUNK, device="cpu", prefill_fn=prefill_fn)
    assert not out.exists() and not any(tmp_path.glob(".cache.partial*"))


@pytest.mark.slow
def test_torchrun_ranks_write_the_cache_one_process_writes(tmp_path, docs_dir, one_process):
    out = tmp_path / "cache"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "topk_decode",
            "prefill",
            str(docs_dir),
            "--out",
            str(out),
            "--device",
            "cpu",
            "--chunk-size",
            str(CHUNK),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("wrote ") == 1  # rank 0 alone speaks
    assert_same_cache(out, one_process)


def test_slices_hold_whole_chunks_cover_the_context_and_balance_flops():
    flops = (1000.0, 10.0)
    for n, world in ((10_000, 4), (100, 3), (64 * 7, 2), (1, 2)):
        slices = plan_slices(n, world, 64, flops)
        assert len(slices) == world and slices[0][0] == 0 and slices[-1][1] == n
        assert all(a <= b for a, b in slices) and all(b == c for (_, b), (c, _) in zip(slices, slices[1:]))
        assert all(a % 64 == 0 for a, b in slices if b > a)
    slices = plan_slices(1 << 20, 4, 4096, (1.0, 1.0))  # attention-bound: later ranks take fewer tokens
    sizes = [b - a for a, b in slices]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 2 * sizes[-1]
    cost = [sum(1.0 + i for i in range(a, b, 512)) for a, b in slices]
    assert max(cost) / min(cost) < 1.05


def test_layer_flops_count_the_attention_and_mlp(demo_model):
    from topk_decode.model.loading import load_config

    cfg = load_config(demo_model)
    linear, per_key = layer_flops(cfg)
    assert per_key == 4 * cfg.num_attention_heads * cfg.head_dim
    assert linear > 2 * 3 * cfg.hidden_size * cfg.intermediate_size


@pytest.mark.parametrize(
    "gpus, device, env, message",
    [
        (0, "cpu", {}, "--gpus must be a positive integer"),
        (-2, None, {}, "--gpus must be a positive integer"),
        (3, "cpu", {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "torchrun started 2 processes"),
    ],
)
def test_bad_gpus_is_refused(gpus, device, env, message, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(TopkError, match=message):
        plan_group(gpus, device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_gpus_without_cuda_says_how_to_use_cpu_processes(tmp_path, docs_dir):
    result = CliRunner().invoke(app, ["prefill", str(docs_dir), "--out", str(tmp_path / "c"), "--gpus", "2"])
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "no CUDA GPU is visible" in errors[0] and "--device cpu --gpus 2" in errors[0]
    assert not (tmp_path / "c").exists()


def test_one_rank_and_no_gpus_run_the_single_process_prefill(monkeypatch):
    assert plan_group(None, "cpu") is None and plan_group(1, "cpu") is None
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    assert plan_group(None, "cpu") is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    group = plan_group(None, "cpu")
    assert group is not None and group.torchrun and group.backend == "gloo" and group.device_name == "cpu"


def relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    """‖x − y‖ / ‖y‖ over a whole tensor, in fp32."""
    return float((x.float() - y.float()).norm() / y.float().norm())


@pytest.mark.gpu
def test_two_gpu_ranks_match_one_gpu(tmp_path, docs_dir, demo_model, monkeypatch):
    """bf16 on 2 GPUs (NCCL): byte-identical to one GPU taking the same (chunked) attention kernels, as a
    resumed prefill is (docs/USAGE.md "Commands")."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    import topk_decode.prefill.layerwise as layerwise

    monkeypatch.setattr(layerwise, "whole_layer_attention_fits", lambda *a, **k: False)
    chunked = build_cache(docs_dir, tmp_path / "chunked", demo_model, chunk_size=CHUNK, device="cuda:0")[0]
    two = build_cache_ranks(docs_dir, tmp_path / "two", demo_model, 2, device="cuda", chunk_size=CHUNK)[0]
    assert files(two) == files(chunked)


@pytest.mark.gpu
def test_chunked_attention_close_to_whole_layer_on_a_gpu(tmp_path, docs_dir, demo_model, monkeypatch):
    """The kernels the ranks take (chunked attention) against one GPU's default whole-layer attention, bf16:
    not the same bytes (other summation orders, compounded over the layers: an elementwise bound fails on a few
    values, docs/SCALE.md), so the whole of each layer's keys and values within 1 %."""
    import topk_decode.prefill.layerwise as layerwise

    whole = build_cache(docs_dir, tmp_path / "whole", demo_model, chunk_size=CHUNK, device="cuda:0")[0]
    monkeypatch.setattr(layerwise, "whole_layer_attention_fits", lambda *a, **k: False)
    chunked = build_cache(docs_dir, tmp_path / "chunked", demo_model, chunk_size=CHUNK, device="cuda:0")[0]
    a, b = open_cache(chunked), open_cache(whole)
    errors = [relative_error(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values)]
    print(f"relative error per layer file: max {max(errors):.2e}, mean {sum(errors) / len(errors):.2e}")
    assert max(errors) < 1e-2


@pytest.mark.slow  # three fresh processes import torch and transformers: ~50 s on the shared 2-core box
def test_prefill_scaling_bench_runs_on_cpu_ranks(tmp_path):
    """`topk bench --prefill-only` at a smoke size: one row per rank count, with what the device run records."""
    from topk_decode.bench.scaling import run_scaling, smoke_scaling_config

    cfg = smoke_scaling_config(str(tmp_path))
    cfg.contexts = [768]
    data = run_scaling(cfg, log=lambda line: None)
    rows = data["rows"]
    assert [r["ranks"] for r in rows] == [1, 2] and all(r["status"] == "ok" for r in rows), rows
    two = rows[1]
    assert two["scaling_efficiency"] == pytest.approx(two["tokens_per_s"] / (2 * rows[0]["tokens_per_s"]), rel=1e-2)
    assert len(two["rss_gib"]) == 2 and two["peak_gpu_gib"] == [None, None]
    assert two["disk_bytes"] == 2 * 2 * 2 * 768 * 16 * 4  # tiny: 2 layers × K,V × Hkv 2 × N × D 16 × fp32
    assert [tuple(s) for s in two["slices"]] == [(0, two["slices"][0][1]), (two["slices"][0][1], 768)]
    assert json.loads(Path(data["path"]).read_text())["rows"] == rows
    assert not any(tmp_path.glob("prefill-cache-*")) and not any(tmp_path.glob(".prefill-cache-*"))


@pytest.mark.slow  # one fresh process imports torch and transformers, then a decode bench: ~30 s
def test_prefill_scaling_keeps_its_last_cache_for_the_decode_bench(tmp_path):
    """`--prefill-only --keep-cache` commits the last row's cache, which `topk bench --kv-cache` decodes from."""
    from dataclasses import replace

    from topk_decode.bench.run import open_kv_cache, run_bench, smoke_config
    from topk_decode.bench.scaling import run_scaling, smoke_scaling_config
    from topk_decode.bench.shapes import make_config
    from topk_decode.model.blocks import ModelShape
    from topk_decode.store.cache_dir import open_cache

    kept = tmp_path / "kept"
    cfg = smoke_scaling_config(str(tmp_path / "rows"))
    cfg.contexts, cfg.gpus, cfg.keep_cache = [640], [1], str(kept)
    rows = run_scaling(cfg, log=lambda line: None)["rows"]
    assert rows[0]["status"] == "ok" and rows[0]["kept_cache"] == str(kept)
    ckv = open_cache(kept)  # complete: every file hashed against the manifest
    assert ckv.n_tokens == 640 and len(ckv.keys) == 2 and ckv.manifest["synthetic"] is False
    with pytest.raises(TopkError, match="exists"):
        run_scaling(cfg, log=lambda line: None)

    bench = replace(
        smoke_config(str(tmp_path / "bench")),
        systems=["topk"],
        kv_cache=str(kept),
        offload_prefill=False,
        strategy="auto",
    )
    row = [r for r in run_bench(bench, log=lambda line: None)["rows"] if r["system"] == "topk"]
    assert [(r["context"], r["kv"], r["status"]) for r in row] == [(640, "cache", "ok")]
    assert row[0]["tokens_per_s"] > 0 and row[0]["ran"] == "flat"  # auto, resolved for 640 tokens
    with pytest.raises(TopkError, match="no such cache directory"):  # before any model is built
        replace(bench, kv_cache=str(tmp_path / "missing")).validate()
    with pytest.raises(TopkError, match="holds KV of shape"):  # a model of another shape is refused up front
        open_kv_cache(str(kept), ModelShape.from_config(make_config("llama-3.2-1b")))


def test_prefill_scaling_refuses_a_checkpoint_directory_and_bad_counts(tmp_path):
    from topk_decode.bench.scaling import ScalingConfig, run_scaling

    with pytest.raises(TopkError, match="named shape"):
        run_scaling(ScalingConfig(model=str(tmp_path), device="cpu", out=str(tmp_path)))
    with pytest.raises(TopkError, match="positive rank counts"):
        run_scaling(ScalingConfig(model="tiny", gpus=[0], device="cpu", out=str(tmp_path)))


def test_sharded_decode_simulation_counts_the_bytes_each_layout_moves():
    """benchmarks/bench_sharded_decode.py's message sizes and implied times (docs/SCALE.md quotes them)."""
    import importlib.util

    from topk_decode.bench.shapes import make_config
    from topk_decode.model.blocks import ModelShape

    spec = importlib.util.spec_from_file_location(
        "bench_sharded_decode", REPO / "benchmarks" / "bench_sharded_decode.py"
    )
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    shape = ModelShape.from_config(make_config("llama-3-8b"))
    b = sim.message_bytes(shape, 2)
    assert b["query_per_layer"] == 32 * 128 * 2 and b["reply_per_layer"] == 32 * (128 * 2 + 4)
    assert b["head_per_token"] == 32 * (8192 + 8320) == 528384 and b["pipeline_per_token"] == 3 * 4096 * 2
    t = sim.implied(b, rtt_us=43.1, wire_rtt_us=20.0, nvlink_rtt_us=10.0)
    assert t["head @ 10 Gbit/s"]["ms_per_token"] == pytest.approx(1e3 * (32 * 63.1e-6 + 528384 / 1.25e9), abs=1e-3)
    assert (
        t["head @ 10 Gbit/s"]["tok_s_ceiling"]
        < t["head @ 25 Gbit/s"]["tok_s_ceiling"]
        < t["head @ NVLink node"]["tok_s_ceiling"]
    )
