"""Probe: what each piece of routed's device stage costs per layer at a long context (CUDA; no model, no build).

Random residual codes in the device's form (index/routed/device_codes.py) for one layer of --kv-heads KV heads,
--group queries each, d = --dim, --tokens rows in clusters of 16, times (median of --reps, CUDA events):
row_scores at each --key-m, segment_lse, top_rows of 4 % of the rows, residual_sum at --value-m sub-vectors
(rank=keys' estimate with pq_values); and, as an experiment for the next kernel, `decoded_row_scores`: each row's
residual decoded from the codebooks (D lookups a row) and dotted with the queries, where the package's kernel looks up
m tables per query (m·G lookups a row), checked against `row_scores`.

    python scripts/probe_device_stage.py [--tokens 131072] [--out probe.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from topk_decode.bench.measure import cuda_median_ms
from topk_decode.index.routed.device_codes import DeviceCodes, DeviceValueCodes, residual_sum, row_scores, segment_lse
from topk_decode.index.routed.pq import top_rows


def decoded_row_scores(codes: DeviceCodes, q32: torch.Tensor, scale: float, base: torch.Tensor) -> torch.Tensor:
    """`row_scores` by decoding each row's residual and one dot product per block (Triton, CUDA; D = m·dsub)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(
        packed,
        books,
        qs,
        base,
        offsets,
        bits,
        out,
        N,
        C,
        NB,
        M2: tl.constexpr,
        DSUB: tl.constexpr,
        D: tl.constexpr,
        GP: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        c = tl.program_id(0)
        h = tl.program_id(1)
        start = tl.load(offsets + h * (C + 1) + c)
        end = tl.load(offsets + h * (C + 1) + c + 1)
        d = tl.arange(0, D)
        j = d // DSUB
        g = tl.arange(0, GP)
        q_t = tl.load(qs + (h * GP + g[None, :]) * D + d[:, None])  # (D, GP)
        b_c = tl.load(base + (h * GP + g) * C + c)
        for r0 in range(start, end, BLOCK):
            rows = r0 + tl.arange(0, BLOCK)
            inside = rows < end
            byte = tl.load(packed + (h * M2 + j[None, :] // 2) * N + rows[:, None], mask=inside[:, None], other=0)
            byte = byte.to(tl.int32)
            code = tl.where((j % 2)[None, :] == 0, byte & 15, byte >> 4)
            r = tl.load(books + ((h * 2 * M2 + j[None, :]) * 16 + code) * DSUB + (d % DSUB)[None, :])  # (BLOCK, D)
            acc = tl.dot(r, q_t, input_precision="ieee") + b_c[None, :]  # (BLOCK, GP)
            flag = tl.load(bits + h * NB + rows // 8, mask=inside, other=0).to(tl.int32)
            ok = inside & (((flag >> (rows % 8)) & 1) != 0)
            acc = tl.where(ok[:, None], acc, float("-inf"))
            tl.store(out + (h * GP + g[None, :]) * N + rows[:, None], acc, mask=inside[:, None])

    hkv, g, d = q32.shape
    gp = 16  # tl.dot's smallest tile
    a = codes.fix_ids.shape[1]
    shift = torch.bmm(q32, codes.fix_delta.transpose(1, 2)).mul_(scale)
    base = base.scatter_add(-1, codes.fix_ids[:, None, :].expand(hkv, g, a), shift)
    qs = torch.zeros(hkv, gp, d, device=q32.device)
    qs[:, :g] = q32 * scale
    basep = torch.zeros(hkv, gp, base.shape[2], device=q32.device)
    basep[:, :g] = base
    n, c = codes.packed.shape[2], codes.offsets.shape[1] - 1
    out = torch.empty((hkv, gp, n), dtype=torch.float32, device=q32.device)
    kernel[(c, hkv)](
        codes.packed,
        codes.books,
        qs,
        basep,
        codes.offsets,
        codes.searchable,
        out,
        n,
        c,
        codes.searchable.shape[1],
        M2=codes.packed.shape[1],
        DSUB=codes.books.shape[3],
        D=d,
        GP=gp,
        BLOCK=16,
    )
    return out[:, :g]


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
    offsets = (torch.arange(c + 1, dtype=torch.int32) * 16).expand(hkv, c + 1).contiguous().to(dev)
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
        try:
            alt = decoded_row_scores(codes, q, 0.088, base)
            report["rows"][f"decoded_row_scores_m{m}_ms"] = cuda_median_ms(
                lambda i: decoded_row_scores(codes, q, 0.088, base), a.reps
            )
            report["rows"][f"decoded_row_scores_m{m}_max_err"] = float((alt - scores).abs().max())
        except Exception as e:  # noqa: BLE001 - an experiment: report, go on
            report["rows"][f"decoded_row_scores_m{m}_error"] = f"{type(e).__name__}: {e}"[:300]
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
    a, b = residual_sum(vc, w), residual_sum(vc, w, triton=False)  # sums of ~10^5 weights: compared to their size
    report["rows"]["residual_sum_rel_err"] = float((a - b).abs().max() / b.abs().max())
    print(json.dumps(report), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
