"""Profile: where a one-token decode step's device time goes, kernel by kernel (CUDA; torch.profiler).

Builds a named shape with random weights (bench/shapes.py), random KV at --context (bench/synthetic.py; int8 with
--kv-dtype int8), opens the decoder as `topk bench` does (--strategy, --opt, --k, --gpu-memory), warms it up, then
profiles --steps one-token steps with the captured graphs and --steps more with the same segments run eagerly
(kernels are the same; launches are not), and prints each run's wall time per step and its kernels ranked by device
time per step. Writes the tables with --out.

    python benchmarks/bench_profile_step.py --model llama-3-8b --context 128K --kv-dtype int8 --strategy routed \
        --opt rank=keys --opt pq_values=32 --gpu-memory 16GiB [--out profile.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from topk_decode.bench.measure import parse_bytes, parse_tokens, set_gpu_budget, sync
from topk_decode.bench.run import device_routes_row
from topk_decode.bench.shapes import build_model, make_config
from topk_decode.bench.synthetic import synthetic_kv
from topk_decode.cli.common import parse_options
from topk_decode.config import DecodeConfig
from topk_decode.decode.engine import TopKDecoder


def kernel_table(prof, steps: int, rows: int) -> list[dict]:
    """The profiled kernels by device time: name, ms per step, calls per step."""
    out = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
            out.append({"kernel": e.key[:110], "ms": t / 1e3 / steps, "calls": e.count / steps})
    out.sort(key=lambda r: -r["ms"])
    return out[:rows]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--context", default="128K")
    p.add_argument("--kv-dtype", default=None)
    p.add_argument("--strategy", default="routed")
    p.add_argument("--opt", action="append", default=[])
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--gpu-memory", default="16GiB")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dev = torch.device(a.device)
    n = parse_tokens(a.context)
    model = build_model(a.model, dev, torch.bfloat16)
    cfg = make_config(a.model)
    hkv = cfg.num_key_value_heads
    t0 = time.perf_counter()
    ckv = synthetic_kv(cfg.num_hidden_layers, hkv, cfg.hidden_size // cfg.num_attention_heads, n, kv_dtype=a.kv_dtype)
    report: dict = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "args": vars(a),
        "kv_s": round(time.perf_counter() - t0, 1),
    }
    set_gpu_budget(dev, parse_bytes(a.gpu_memory))
    config = DecodeConfig(k=a.k, strategy=a.strategy, strategy_options=parse_options(a.opt))
    t0 = time.perf_counter()
    decoder = TopKDecoder(model, ckv, config, graphs=dev.type == "cuda")
    report["open_s"] = round(time.perf_counter() - t0, 1)
    print(f"opened in {report['open_s']} s (KV {report['kv_s']} s)", flush=True)
    conv = decoder.new_conversation()
    logits = decoder.forward([5], conv)
    for _ in range(3):
        logits = decoder.forward([int(torch.argmax(logits))], conv)
    seg = decoder.segments
    report["captured"] = seg is not None and seg.graphs is not None  # else the "graphs" run below ran eagerly too
    report.update(device_routes_row(decoder))
    graphs = seg.graphs if seg is not None else None
    for mode in ("graphs", "eager"):
        if mode == "eager" and seg is not None:
            seg.graphs = None
        acts = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * (dev.type == "cuda")
        sync(dev)
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(a.steps):
                logits = decoder.forward([int(torch.argmax(logits))], conv)
            sync(dev)
        wall = (time.perf_counter() - t0) / a.steps * 1e3
        table = kernel_table(prof, a.steps, a.rows)
        report[mode] = {"ms_per_step_profiled": round(wall, 2), "kernels": table}
        print(f"== {mode}: {wall:.2f} ms/step under the profiler; kernels (ms/step, calls/step):")
        for r in table:
            print(f"{r['ms']:8.3f} {r['calls']:6.0f}  {r['kernel']}")
    if seg is not None:
        seg.graphs = graphs
    print(json.dumps({k: v for k, v in report.items() if k not in ("graphs", "eager")}))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    decoder.close()


if __name__ == "__main__":
    main()
