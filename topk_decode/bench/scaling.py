"""`topk bench --prefill-only --gpus 1,2,4`: the sequence-parallel prefill's scaling over ranks.

For each rank count W, W fresh processes (one per GPU; gloo CPU processes with device "cpu") build the
named shape with the same seeded random weights on their device, then prefill the same N random tokens
together (prefill/distributed.py); rank 0 writes every layer's KV to a real cache directory on disk
through the cache writer, whose size is recorded and which is then removed (with `keep_cache`, the last row's
cache is committed there instead, for `topk bench --kv-cache` to decode from). One JSON row per W:
tokens/s, scaling efficiency against W=1 of the same run, the exchange's share of the time, peak GPU
memory and host RSS of every rank, disk bytes. With `layers`, only the first layers are built and run
(every layer of a shape costs the same), and the whole-model figures are scaled from them.
"""

from __future__ import annotations

import json
import multiprocessing
import queue as queue_module
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from topk_decode.errors import TopkError
from topk_decode.prefill.layerwise import CHUNK_SIZE


@dataclass
class ScalingConfig:
    """What one scaling run measures.

    Args:
        model: a named shape (random weights, see shapes.py).
        contexts: context lengths N in tokens.
        gpus: rank counts W, each run in fresh processes.
        layers: run only the first layers (None: all); whole-model figures are scaled by n_layers / layers.
        chunk: prefill chunk length.
        device, dtype: "cuda" (one GPU per rank, NCCL) or "cpu" (gloo processes); weight dtype.
        out: directory for prefill_scaling_<model>.json and the (removed) caches.
        seed: weights and tokens seed.
        keep_cache: commit the cache of the last row (the last context at the last rank count) to this
            directory instead of removing it (None: every cache is removed).
    """

    model: str = "qwen2.5-7b"
    contexts: list[int] = field(default_factory=lambda: [1 << 20])
    gpus: list[int] = field(default_factory=lambda: [1, 2, 4])
    layers: int | None = None
    chunk: int = CHUNK_SIZE
    device: str = "cuda"
    dtype: str = "bf16"
    out: str = "bench-results"
    seed: int = 0
    keep_cache: str | None = None


def smoke_scaling_config(out: str) -> ScalingConfig:
    """The CPU smoke run: the tiny shape, 2K tokens, 1 and 2 gloo ranks, seconds."""
    return ScalingConfig(model="tiny", contexts=[2048], gpus=[1, 2], chunk=256, device="cpu", dtype="fp32", out=out)


def _rank_main(
    rank: int, world: int, cfg: ScalingConfig, n: int, init_method: str, cache: str, keep: bool, results
) -> None:
    """One rank of one measurement: build the shape, prefill N tokens with the others, report (rank 0 commits
    the cache at `cache` when `keep`, else removes it)."""
    import torch
    import torch.distributed as dist

    from topk_decode.bench.measure import cpu_rss
    from topk_decode.bench.shapes import build_model
    from topk_decode.cpus import usable_cpus
    from topk_decode.model.loading import parse_dtype
    from topk_decode.prefill.distributed import Ranks, layer_flops, plan_slices, run_rank
    from topk_decode.prefill.distributed_launch import parent_alive_check

    try:
        cuda = cfg.device.startswith("cuda")
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(max(1, usable_cpus() // world))
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=world)
        model = build_model(cfg.model, device, parse_dtype(cfg.dtype), layers=cfg.layers)
        gen = torch.Generator().manual_seed(cfg.seed)
        ids = torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist()
        slices = plan_slices(n, world, cfg.chunk, layer_flops(model.config))
        writer = None
        if rank == 0:
            from topk_decode.store.cache_dir import CacheWriter

            writer = CacheWriter(cache, overwrite=not keep)  # a kept cache never replaces what is there
        ranks = Ranks(rank, world, device, parent_alive_check())
        dist.barrier()
        try:
            _, stats = run_rank(model, ids, ranks, slices, cfg.chunk, writer.write_layer if writer else None)
            disk = sum(f.stat().st_size for f in writer.tmp.rglob("*") if f.is_file()) if writer else None
            if writer is not None and keep:
                writer.write_tokens(ids)
                writer.commit(kept_manifest(model.config, n, cfg))
                writer = None
        finally:
            if writer is not None:
                writer.abort()
        rss, hwm = cpu_rss()
        results.put(
            {
                "rank": rank,
                "seconds": stats.seconds,
                "exchange_s": stats.exchange_seconds,
                "peak_gpu": stats.peak_device_bytes,
                "rss": rss,
                "peak_rss": hwm,
                "disk": disk,
                "slices": slices,
                "layers": len(model.model.layers),
            }
        )
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported as the row's status by the launcher
        results.put(
            {
                "rank": rank,
                "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                "traceback": traceback.format_exc(),
            }
        )
        raise SystemExit(1) from None


def kept_manifest(config, n: int, cfg: ScalingConfig) -> dict:
    """The manifest of a kept cache: the named shape's prefill of N random tokens with seeded random weights."""
    from topk_decode.bench.synthetic import shape_manifest
    from topk_decode.model.blocks import ModelShape
    from topk_decode.model.loading import parse_dtype

    shape = ModelShape.from_config(config)
    manifest = shape_manifest(
        shape.n_layers,
        shape.n_kv_heads,
        shape.head_dim,
        n,
        parse_dtype(cfg.dtype),
        shape.model_type,
        synthetic=False,
        n_heads=shape.n_heads,
        model=f"<random weights: {cfg.model}>",
    )
    manifest["shape"]["vocab_size"] = shape.vocab_size
    return {k: v for k, v in manifest.items() if k not in ("format_version", "files")}


def _measure(cfg: ScalingConfig, n: int, world: int, cache: Path, keep: bool = False) -> list[dict]:
    """Run one W-rank prefill of N tokens in fresh processes; the ranks' reports (or raise TopkError)."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    store = tempfile.mkdtemp(prefix="topk-bench-ranks-")
    procs = [
        ctx.Process(
            target=_rank_main, args=(r, world, cfg, n, f"file://{store}/store", str(cache), keep, results), daemon=True
        )
        for r in range(world)
    ]
    reports: list[dict] = []
    try:
        for p in procs:
            p.start()
        while len(reports) < world:
            try:
                reports.append(results.get(timeout=0.5))
            except queue_module.Empty:
                pass
            failed = [r for r in reports if "error" in r]
            if failed:
                raise TopkError(f"rank {failed[0]['rank']}: {failed[0]['error']}")
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead and len(reports) < world:
                time.sleep(1)  # its report may still be in the queue
                while True:
                    try:
                        reports.append(results.get_nowait())
                    except queue_module.Empty:
                        break
                failed = [r for r in reports if "error" in r]
                raise TopkError(
                    f"rank {failed[0]['rank']}: {failed[0]['error']}"
                    if failed
                    else f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode})"
                )
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
        shutil.rmtree(store, ignore_errors=True)
    return sorted(reports, key=lambda r: r["rank"])


def run_scaling(cfg: ScalingConfig, log: Callable[[str], None] = print) -> dict:
    """Measure every (context, rank count); write prefill_scaling_<model>.json under cfg.out after each row."""
    import torch

    from topk_decode.bench.run import environment
    from topk_decode.bench.shapes import SHAPES, make_config
    from topk_decode.model.blocks import ModelShape

    if cfg.model not in SHAPES:
        raise TopkError(
            f"--prefill-only measures a named shape with random weights ({', '.join(SHAPES)}), not {cfg.model!r}"
        )
    if cfg.chunk < 1 or not cfg.contexts or min(cfg.contexts) < 1:
        raise TopkError("--prefill-chunk and the context lengths must be positive")
    if not cfg.gpus or min(cfg.gpus) < 1:
        raise TopkError("--gpus must list positive rank counts, e.g. 1,2,4")
    if cfg.keep_cache is not None and Path(cfg.keep_cache).exists():
        raise TopkError(f"--keep-cache {cfg.keep_cache} exists: name a new directory")
    cuda = cfg.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise TopkError("CUDA is not available here: use --device cpu (or --smoke)")
    shape = ModelShape.from_config(make_config(cfg.model))
    layers = min(cfg.layers or shape.n_layers, shape.n_layers)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"prefill_scaling_{cfg.model}.json"
    data = {
        "config": asdict(cfg),
        "environment": environment(torch.device("cuda", 0) if cuda else torch.device("cpu")),
        "rows": [],
    }
    visible = torch.cuda.device_count() if cuda else None
    for n in cfg.contexts:
        base = None
        for world in cfg.gpus:
            row = {"model": cfg.model, "context": n, "ranks": world, "layers_run": layers, "layers": shape.n_layers}
            disk_need = 2 * layers * shape.n_kv_heads * n * shape.head_dim * (2 if cfg.dtype in ("bf16", "fp16") else 4)
            if visible is not None and world > visible:
                row["status"] = f"skipped: needs {world} GPUs, {visible} visible"
            elif shutil.disk_usage(out).free < 1.05 * disk_need:
                row["status"] = f"skipped: the cache needs {disk_need / 2**30:.1f} GiB on disk, {out} has less free"
            else:
                try:
                    last = n == cfg.contexts[-1] and world == cfg.gpus[-1]
                    keep = last and cfg.keep_cache is not None
                    cache = Path(cfg.keep_cache) if keep else out / f"prefill-cache-{cfg.model}-{n}-{world}"
                    reports = _measure(cfg, n, world, cache, keep)
                    if keep:
                        row["kept_cache"] = str(cache)
                    lead = reports[0]
                    scale = shape.n_layers / layers
                    tps = n / lead["seconds"]
                    row.update(
                        status="ok",
                        seconds=round(lead["seconds"], 2),
                        tokens_per_s=round(tps, 1),
                        model_seconds=round(lead["seconds"] * scale, 1),
                        model_tokens_per_s=round(tps / scale, 1),
                        exchange_share=round(lead["exchange_s"] / lead["seconds"], 4),
                        peak_gpu_gib=[
                            None if r["peak_gpu"] is None else round(r["peak_gpu"] / 2**30, 2) for r in reports
                        ],
                        rss_gib=[round(r["rss"] / 2**30, 2) for r in reports],
                        peak_rss_gib=[round(r["peak_rss"] / 2**30, 2) for r in reports],
                        disk_bytes=lead["disk"],
                        slices=[list(s) for s in lead["slices"]],
                    )
                    if world == 1:
                        base = tps
                    row["scaling_efficiency"] = round(tps / (world * base), 3) if base else None
                    row["speedup"] = round(tps / base, 2) if base else None
                except TopkError as e:
                    row["status"] = f"error: {e}"
            data["rows"].append(row)
            path.write_text(json.dumps(data, indent=1))
            log(json.dumps(row))
    data["path"] = str(path)
    return data


__all__ = ["ScalingConfig", "smoke_scaling_config", "run_scaling"]
