"""The CPU context part of attention in its real conditions: right after each layer's flat search.

    python scripts/context_probe.py --context 131072 --reps 12

Synthetic Llama-3-8B-shaped KV (32 layers, 8 KV heads, D = 128, bf16) in RAM and the flat strategy's
torch backend at k = 1024. Every layer runs the search, then one variant of the context part, timed
alone; the variants take turns, so they see the same cache state after the same searches. Prints and
writes per-layer medians (µs). CPU only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from topk_decode.bench.synthetic import synthetic_kv
from topk_decode.decode.context import ContextAttention
from topk_decode.index import get_strategy


def timed_attend(ctx: ContextAttention, layer: int, sel, o: torch.Tensor, mz: torch.Tensor, parts: dict) -> None:
    """ContextAttention.attend's steps for a full selection (small ops on one thread), each timed."""
    clock = time.perf_counter
    hkv, Q, K = sel.ids.shape
    R = hkv * Q
    t0 = clock()
    w, w_low, rows, aux = ctx._buffers(R, K)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    t1 = clock()
    torch.mul(sel.scores.view(R, K), ctx.scale, out=w)          # first read of the search's scores
    t2 = clock()
    m = torch.amax(w, dim=-1, keepdim=True, out=mz[:, :1])
    w.sub_(m).exp_()
    torch.sum(w, dim=-1, keepdim=True, out=mz[:, 1:])
    w_low.copy_(w)
    t3 = clock()
    torch.add(sel.ids, ctx._row_base, out=rows.view(hkv, Q, K))   # first read of the search's ids
    t4 = clock()
    torch.set_num_threads(threads)
    t5 = clock()
    torch.ops.aten._embedding_bag_forward_only.out(
        ctx.values_flat[layer], rows, ctx._bag_offsets(R, K), False, 0, False, w_low.view(-1), False, -1,
        out0=o, out1=aux[0], out2=aux[1], out3=aux[2])
    t6 = clock()
    for name, a, b in (("buffers+threads", t0, t1), ("scale (reads scores)", t1, t2), ("softmax ops", t2, t3),
                       ("row ids (reads ids)", t3, t4), ("threads back", t4, t5), ("embedding_bag", t5, t6)):
        parts.setdefault(name, []).append(1e6 * (b - a))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--out", default="context_probe.json")
    ap.add_argument("--baseline", default=None, help="a context.py of another revision, run as one more variant")
    a = ap.parse_args()
    hkv, G, D = 8, 4, 128
    ckv = synthetic_kv(a.layers, hkv, D, a.context, torch.bfloat16)
    strat = get_strategy("flat")(ckv, 0, a.context, {"backend": "torch"})
    strat.prepare()
    ctx = ContextAttention(ckv.values, D ** -0.5)
    o, mz = torch.empty((hkv * G, D), dtype=torch.bfloat16), torch.empty((hkv * G, 2))

    variants = {
        "current": lambda layer, sel: ctx.attend(layer, sel, o, mz),
        "current_timed_steps": lambda layer, sel: timed_attend(ctx, layer, sel, o, mz, parts),
    }
    if a.baseline:   # the older ContextAttention, writing (R, D+1) = normalised output | lse
        import importlib.util

        spec = importlib.util.spec_from_file_location("baseline_context", a.baseline)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        old = mod.ContextAttention(ckv.values, D ** -0.5)
        old_out = torch.empty((hkv * G, D + 1))
        variants["baseline"] = lambda layer, sel: old.attend(layer, sel, old_out)
    parts: dict[str, list[float]] = {}
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {v: [] for v in variants}
    ref = {}
    for rep in range(a.reps):
        for name, fn in variants.items():
            for layer in range(a.layers):
                q = torch.randn((hkv, G, D), generator=gen).to(torch.bfloat16).float()
                sel = strat.select(layer, q, a.k)
                t = time.perf_counter()
                fn(layer, sel)
                times[name].append(1e6 * (time.perf_counter() - t))
                if rep == 0 and layer == 0:
                    ref[name] = (torch.cat([o.float(), mz], 1), sel)
    # the variants agree on the same selection
    base_out, base_sel = ref["current"]
    errs = {}
    for name, fn in variants.items():
        if name != "baseline":
            fn(0, base_sel)
            errs[name] = float((torch.cat([o.float(), mz], 1) - base_out).abs().max())
    res = {"context": a.context, "k": a.k, "threads": torch.get_num_threads(), "max_abs_diff_vs_current": errs,
           "median_us_per_layer": {n: round(statistics.median(v), 1) for n, v in times.items()},
           "mean_us_per_layer": {n: round(statistics.fmean(v), 1) for n, v in times.items()},
           "current_steps_median_us": {n: round(statistics.median(v), 1) for n, v in parts.items()},
           "current_steps_mean_us": {n: round(statistics.fmean(v), 1) for n, v in parts.items()}}
    text = json.dumps(res, indent=1)
    print(text)
    with open(a.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
