"""Probe: what each piece of routed's device stage costs per layer at a long context (CUDA; no model, no build).

Random residual codes in the device's form (index/routed/device_codes.py) for one layer of --kv-heads KV heads,
--group queries each, d = --dim, --tokens rows in clusters of 16 on average (random cuts, as k-means leaves them),
times (median of --reps, CUDA events): row_scores at each --key-m beside the per-cluster kernel it replaced (checked
against it), segment_lse, top_rows of 4 % of the rows, residual_sum at --value-m sub-vectors (rank=keys' estimate
with pq_values) as a Triton histogram and as torch scatter-adds, and as an experiment the histogram by tensor-core
products with one-hot code tiles (`dot_residual_sum`, tf32 and ieee; checked against torch's).

    python scripts/probe_device_stage.py [--tokens 131072] [--out probe.json]
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from topk_decode.bench.measure import cuda_median_ms
from topk_decode.index.routed.device_codes import (
    DeviceCodes,
    DeviceValueCodes,
    code_tables,
    residual_sum,
    row_scores,
    segment_lse,
)
from topk_decode.index.routed.pq import top_rows


@functools.cache
def per_cluster_kernel():
    """The per-cluster row-score kernel, compiled once (Triton, CUDA)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(
        packed, lut, base, offsets, bits, out, N, C, NB, M2: tl.constexpr, GP: tl.constexpr, BLOCK: tl.constexpr
    ):
        c = tl.program_id(0)
        h = tl.program_id(1)
        start = tl.load(offsets + h * (C + 1) + c)
        end = tl.load(offsets + h * (C + 1) + c + 1)
        g = tl.arange(0, GP)
        g_lut = (h * GP + g) * (2 * M2 * 16)
        b_c = tl.load(base + (h * GP + g) * C + c)
        for r0 in range(start, end, BLOCK):
            rows = r0 + tl.arange(0, BLOCK)
            inside = rows < end
            byte = tl.load(bits + h * NB + rows // 8, mask=inside, other=0).to(tl.int32)
            ok = inside & (((byte >> (rows % 8)) & 1) != 0)
            acc = tl.zeros([BLOCK, GP], tl.float32) + b_c[None, :]
            for j in tl.static_range(M2):
                b = tl.load(packed + (h * M2 + j) * N + rows, mask=inside, other=0).to(tl.int32)
                acc += tl.load(lut + g_lut[None, :] + (2 * j * 16) + (b & 15)[:, None])
                acc += tl.load(lut + g_lut[None, :] + ((2 * j + 1) * 16) + (b >> 4)[:, None])
            acc = tl.where(ok[:, None], acc, float("-inf"))
            tl.store(out + (h * GP + g[None, :]) * N + rows[:, None], acc, mask=inside[:, None])

    return kernel


def per_cluster_row_scores(codes: DeviceCodes, q32: torch.Tensor, scale: float, base: torch.Tensor) -> torch.Tensor:
    """`row_scores` by the kernel it replaced (one program per cluster and KV head, 32 lanes for ~16 rows): the
    baseline of the probe's comparison (Triton, CUDA)."""
    hkv, g, _ = q32.shape
    a = codes.fix_ids.shape[1]
    shift = torch.bmm(q32, codes.fix_delta.transpose(1, 2)).mul_(scale)
    base = base.scatter_add(-1, codes.fix_ids[:, None, :].expand(hkv, g, a), shift).contiguous()
    lut = code_tables(codes, q32, scale).contiguous()
    m = lut.shape[2]
    n, c = codes.packed.shape[2], codes.offsets.shape[1] - 1
    out = torch.empty((hkv, g, n), dtype=torch.float32, device=q32.device)
    per_cluster_kernel()[(c, hkv)](
        codes.packed,
        lut,
        base,
        codes.offsets,
        codes.searchable,
        out,
        n,
        c,
        codes.searchable.shape[1],
        M2=m // 2,
        GP=g,
        BLOCK=32,
    )
    return out


@functools.cache
def dot_hist_kernel():
    """An experiment for `residual_sum`: the weighted histogram by tensor-core products of each block's weights with
    one-hot code tiles, (16 × BLOCK)·(BLOCK × 16) per sub-vector, instead of a (G, BLOCK, 16) broadcast and sum
    (Triton, CUDA)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(packed, w, hist, N, G, CHUNK, M2: tl.constexpr, PRECISION: tl.constexpr, BLOCK: tl.constexpr):
        c = tl.program_id(0)
        h = tl.program_id(1)
        start = c * CHUNK
        g = tl.arange(0, 16)  # tl.dot's smallest tile: the queries padded to 16
        bins = tl.arange(0, 16)
        for j in tl.static_range(M2):
            lo = tl.zeros([16, 16], tl.float32)
            hi = tl.zeros([16, 16], tl.float32)
            for r0 in range(start, start + CHUNK, BLOCK):
                rows = r0 + tl.arange(0, BLOCK)
                ok = rows < N
                b = tl.load(packed + (h * M2 + j) * N + rows, mask=ok, other=0).to(tl.int32)
                wt = tl.load(
                    w + (h * G + g[:, None]) * N + rows[None, :], mask=ok[None, :] & (g[:, None] < G), other=0.0
                )
                one_lo = ((b & 15)[:, None] == bins[None, :]).to(tl.float32)
                one_hi = ((b >> 4)[:, None] == bins[None, :]).to(tl.float32)
                lo += tl.dot(wt, one_lo, input_precision=PRECISION)
                hi += tl.dot(wt, one_hi, input_precision=PRECISION)
            at = hist + ((h * 16 + g[:, None]) * (2 * M2) + 2 * j) * 16 + bins[None, :]
            tl.atomic_add(at, lo)
            tl.atomic_add(at + 16, hi)

    return kernel


def dot_residual_sum(vc: DeviceValueCodes, w: torch.Tensor, precision: str = "tf32", chunk: int = 2048):
    """`residual_sum` with the experimental tensor-core histogram (`dot_hist_kernel`)."""
    hkv, g, n = w.shape
    m2 = vc.packed.shape[1]
    hist = torch.zeros((hkv, 16, 2 * m2 * 16), dtype=torch.float32, device=w.device)
    dot_hist_kernel()[(-(-n // chunk), hkv)](vc.packed, w, hist, n, g, chunk, M2=m2, PRECISION=precision, BLOCK=64)
    out = torch.einsum("hgjb,hjbd->hgjd", hist[:, :g].reshape(hkv, g, 2 * m2, 16), vc.books)
    return out.reshape(hkv, g, -1)[:, :, : vc.means.shape[2]]


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
        old = per_cluster_row_scores(codes, q, 0.088, base)
        report["rows"][f"per_cluster_row_scores_m{m}_ms"] = cuda_median_ms(
            lambda i: per_cluster_row_scores(codes, q, 0.088, base), a.reps
        )
        report["rows"][f"per_cluster_row_scores_m{m}_max_diff"] = float((old - scores).abs().max())
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
    for precision in ("tf32", "ieee"):
        key = f"dot_residual_sum_m{vm}_{precision}"
        try:
            alt = dot_residual_sum(vc, w, precision)
            report["rows"][f"{key}_rel_err"] = float((alt - ref).abs().max() / ref.abs().max())
            report["rows"][f"{key}_ms"] = cuda_median_ms(lambda i: dot_residual_sum(vc, w, precision), a.reps)
        except Exception as e:  # noqa: BLE001 - an experiment: report, go on
            report["rows"][f"{key}_error"] = f"{type(e).__name__}: {e}"[:300]
    print(json.dumps(report), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
