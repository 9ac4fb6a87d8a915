"""Probe: routed's exact part on the GPU (`device_read`), reading a layer's rows from the host's RAM.

Per "layer" of Llama-3-8B's shape at --tokens (8 KV heads, 4 query heads each, d = 128, int8 keys and values, the
values' per-token scales), with the rows a rank=keys step reads (4 % of the tokens per KV head, at random positions,
in order) and k = 1,024, times on CUDA (median over --reps, each rep on the next of --layers layers so that the GPU's
L2 holds none of it):

- scores: index/routed/device_read.py `read_scores` (the rows' keys read over PCIe, scored);
- topk: torch.topk of each query's scores, their softmax weights;
- values: `weighted_values` (each query's top-k value rows read over PCIe, summed);
- layer: the three in a row, and the same captured as one CUDA graph;
for the host arrays in huge pages (store/huge_pages.py) registered with CUDA, and in torch's pinned memory; the
results are checked against the torch reference on the CPU.

    python scripts/probe_device_read.py [--tokens 131072] [--layers 32] [--out probe.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from topk_decode.bench.measure import cuda_median_ms
from topk_decode.index.routed.device_read import HostKV, read_scores, weighted_values
from topk_decode.store import huge_pages


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--read", type=float, default=0.04)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--reps", type=int, default=64)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dev = torch.device("cuda")
    hkv, n, d, g, L = a.kv_heads, a.tokens, a.dim, a.group, a.layers
    w_rows = int(a.read * n)
    gen = torch.Generator().manual_seed(0)
    report: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "tokens": n,
        "layers": L,
        "kv_heads": hkv,
        "group": g,
        "dim": d,
        "rows_per_head": w_rows,
        "k": a.k,
        "cases": [],
    }
    src_k = torch.randint(-127, 128, (hkv, n, d), dtype=torch.int8, generator=gen)
    src_v = torch.randint(-127, 128, (hkv, n, d), dtype=torch.int8, generator=gen)
    src_s = torch.rand(hkv, n, generator=gen) / 127
    pos = [torch.rand(hkv, n, generator=gen).argsort(1)[:, :w_rows].sort(1).values.int().to(dev) for _ in range(8)]
    q = torch.randn(hkv, g, d, generator=gen).to(dev) / 2000
    for memory in ("huge_pages_registered", "torch_pinned"):
        t0 = time.perf_counter()
        if memory == "torch_pinned":
            ks = [src_k.pin_memory() for _ in range(L)]
            vs = [src_v.pin_memory() for _ in range(L)]
            ss = [src_s.pin_memory() for _ in range(L)]
            host = HostKV(ks, vs, ss, torch.device("cpu"))  # already page-locked: not registered again
        else:
            ks = [huge_pages.huge_copy(src_k) for _ in range(L)]
            vs = [huge_pages.huge_copy(src_v) for _ in range(L)]
            ss = [huge_pages.huge_copy(src_s) for _ in range(L)]
            host = HostKV(ks, vs, ss, dev)
        ready_s = time.perf_counter() - t0

        def scores(i):
            return read_scores(host.keys[i % L], pos[i % 8], q)

        def part(i):
            s = read_scores(host.keys[i % L], pos[i % 8], q)
            top = s.topk(a.k, dim=-1)
            m = top.values.amax(-1, keepdim=True)
            wts = (top.values - m).exp()
            sel = pos[i % 8].gather(1, top.indices.view(hkv, -1)).view(hkv, g, a.k)
            return weighted_values(host.values[i % L], host.value_scales[i % L], sel, wts)

        s0 = scores(0)
        top0 = s0.topk(a.k, dim=-1)
        sel0 = pos[0].gather(1, top0.indices.view(hkv, -1)).view(hkv, g, a.k)
        w0 = (top0.values - top0.values.amax(-1, keepdim=True)).exp()
        ref_s = read_scores(ks[0], pos[0].cpu(), q.cpu())
        ref_o = weighted_values(vs[0], ss[0], sel0.cpu(), w0.cpu())
        o0 = part(0)
        case = {
            "memory": memory,
            "ready_s": round(ready_s, 2),
            "scores_equal": bool(torch.allclose(s0.cpu(), ref_s, rtol=1e-4, atol=1e-4)),
            "values_equal": bool(torch.allclose(o0.cpu(), ref_o, rtol=1e-3, atol=1e-3)),
            "scores_ms": cuda_median_ms(scores, a.reps),
            "topk_ms": cuda_median_ms(lambda i: s0.topk(a.k, dim=-1), a.reps),
            "values_ms": cuda_median_ms(
                lambda i: weighted_values(host.values[i % L], host.value_scales[i % L], sel0, w0), a.reps
            ),
            "layer_ms": cuda_median_ms(part, a.reps),
        }
        # one graph of all layers' parts: what a captured step replays
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(L):
                part(i)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(L):
                part(i)
        case["graph_all_layers_ms"] = cuda_median_ms(lambda i: graph.replay(), 20)
        case["bytes_per_layer"] = hkv * w_rows * d + hkv * g * a.k * (d + 4)
        print(json.dumps(case), flush=True)
        report["cases"].append(case)
        host.close()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
