"""Probe: what each piece of routed's device stage costs per layer at a long context (CUDA; no model, no build).

Random residual codes in the device's form (index/routed/device_codes.py) for one layer of --kv-heads KV heads,
--group queries each, d = --dim, --tokens rows in clusters of 16 on average (random cuts, as k-means leaves them),
times (median of --reps, CUDA events): row_scores at each --key-m, segment_lse, top_rows of 4 % of the rows,
residual_sum at --value-m sub-vectors (rank=keys' estimate with pq_values) as a Triton histogram and as torch
scatter-adds (checked against each other). Experiments measured here and dropped are in docs/BENCHMARKS.md.

    python scripts/probe_device_stage.py [--tokens 131072] [--out probe.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from topk_decode.bench.measure import cuda_median_ms
from topk_decode.index.routed.device_codes import (
    DeviceCodes,
    DeviceValueCodes,
    residual_sum,
    row_scores,
    segment_lse,
)
from topk_decode.index.routed.pq import top_rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--key-m", default="16,32,64,128")
    p.add_argument("--value-m", type=int, default=32)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dev = torch.device("cuda")
    hkv, n, d, g = a.kv_heads, a.tokens, a.dim, a.group
    c = n // 16
    cuts = torch.sort(torch.randint(0, n, (hkv, c - 1)), 1).values
    offsets = torch.cat([torch.zeros(hkv, 1, dtype=torch.long), cuts, torch.full((hkv, 1), n)], 1).int().to(dev)
    bits = torch.full((hkv, -(-n // 8)), 255, dtype=torch.uint8, device=dev)
    q = torch.randn(hkv, g, d, device=dev)
    base = torch.randn(hkv, g, c, device=dev)
    report: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "tokens": n,
        "kv_heads": hkv,
        "group": g,
        "dim": d,
        "rows": {},
    }
    scores = None
    for m in [int(x) for x in a.key_m.split(",")]:
        codes = DeviceCodes(
            torch.randint(0, 256, (hkv, m // 2, n), dtype=torch.uint8, device=dev),
            torch.randn(hkv, m, 16, d // m, device=dev),
            offsets,
            bits,
            torch.zeros(hkv, 0, dtype=torch.int64, device=dev),
            torch.zeros(hkv, 0, d, device=dev),
        )
        report["rows"][f"row_scores_m{m}_ms"] = cuda_median_ms(lambda i: row_scores(codes, q, 0.088, base), a.reps)
        scores = row_scores(codes, q, 0.088, base)
    report["rows"]["segment_lse_ms"] = cuda_median_ms(lambda i: segment_lse(scores, offsets), a.reps)
    share = scores.amax(1)
    report["rows"]["top_rows_4pct_ms"] = cuda_median_ms(lambda i: top_rows(share, int(0.04 * n)), a.reps)
    vm = a.value_m
    vc = DeviceValueCodes(
        torch.randint(0, 256, (hkv, vm // 2, n), dtype=torch.uint8, device=dev),
        torch.randn(hkv, vm, 16, d // vm, device=dev),
        torch.randn(hkv, c, d, device=dev).bfloat16(),
    )
    w = torch.rand(hkv, g, n, device=dev)
    report["rows"][f"residual_sum_m{vm}_triton_ms"] = cuda_median_ms(lambda i: residual_sum(vc, w), a.reps)
    report["rows"][f"residual_sum_m{vm}_torch_ms"] = cuda_median_ms(lambda i: residual_sum(vc, w, triton=False), a.reps)
    fast, ref = residual_sum(vc, w), residual_sum(vc, w, triton=False)  # sums of ~10^5 weights: against their size
    report["rows"]["residual_sum_rel_err"] = float((fast - ref).abs().max() / ref.abs().max())
    print(json.dumps(report), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
