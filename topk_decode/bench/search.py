"""Search floor: one layer's flat exact top-k on the host CPU, per backend, through FlatStrategy itself."""

from __future__ import annotations

import time

import torch

from topk_decode.bench.synthetic import synthetic_kv


def search_floor(
    n_tokens: int,
    n_kv_heads: int = 8,
    head_dim: int = 128,
    group: int = 4,
    k: int = 1024,
    backends: tuple[str, ...] = ("torch", "faiss"),
    reps: int = 5,
    seed: int = 0,
) -> list[dict]:
    """Milliseconds per layer of `FlatStrategy.select` for each backend on random bf16 keys.

    Args:
        n_tokens: keys per head.
        n_kv_heads, head_dim: one layer's KV shape (Llama-3-8B: 8, 128).
        group: query heads per KV head (Llama-3-8B: 4).
        k: results per query head.
        backends: flat backends to time.
        reps: timed searches (after one warm-up).
        seed: random seed.
    Returns:
        one dict per backend: ms per layer, index build seconds, and bytes the index adds to RAM.
    """
    from topk_decode.index.flat import FlatStrategy

    ckv = synthetic_kv(1, n_kv_heads, head_dim, n_tokens, torch.bfloat16, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    qs = [torch.randn((n_kv_heads, group, head_dim), generator=gen).bfloat16().float() for _ in range(reps + 1)]
    rows = []
    torch_threads = torch.get_num_threads()
    for backend in backends:
        # The faiss backend sets the OpenMP runtime it shares with torch to one thread: undo that, so
        # whatever is timed next (the other backend, torch_scan_stages) runs on the threads it began with.
        torch.set_num_threads(torch_threads)
        strat = FlatStrategy(ckv, 4, n_tokens - 64, {"backend": backend})
        t = time.perf_counter()
        strat.prepare()
        build = time.perf_counter() - t
        strat.select(0, qs[0], k)
        t = time.perf_counter()
        for q in qs[1:]:
            strat.select(0, q, k)
        ms = 1e3 * (time.perf_counter() - t) / reps
        extra = 0 if backend == "torch" else sum(ix.sa_code_size() * ix.ntotal for row in strat.indices for ix in row)
        rows.append(
            {
                "backend": backend,
                "n_tokens": n_tokens,
                "ms_per_layer": round(ms, 2),
                "build_s": round(build, 2),
                "index_extra_ram_gib": round(extra / (1 << 30), 3),
                "threads": torch.get_num_threads(),
                "fp32_rescans": strat.stats.extra.get("fp32_rescans", 0),
            }
        )
    torch.set_num_threads(torch_threads)
    return rows


def torch_scan_stages(
    n_tokens: int, n_kv_heads: int = 8, head_dim: int = 128, group: int = 4, k: int = 1024, reps: int = 5, seed: int = 0
) -> dict:
    """Where the torch backend's time goes: ms per layer of each stage of `half_scan`.

    `select_ms` is the candidate selection `half_scan` runs (`topk_by_threshold`); `topk_ms` is the
    plain `torch.topk` over all N scores it replaces, timed on the same scores for comparison.

    Args:
        n_tokens, n_kv_heads, head_dim, group, k: as in `search_floor`.
        reps: timed repetitions (after one warm-up).
        seed: random seed.
    """
    from topk_decode.index.flat.select_topk import topk_by_threshold

    ckv = synthetic_kv(1, n_kv_heads, head_dim, n_tokens, torch.bfloat16, seed)
    keys = ckv.keys[0]
    q = torch.randn((n_kv_heads, group, head_dim)).bfloat16()
    buf = torch.empty((n_kv_heads, group, n_tokens), dtype=torch.bfloat16)
    kc = k + max(32, k // 4)
    buffers: dict = {}
    times = {"bmm_ms": 0.0, "topk_ms": 0.0, "select_ms": 0.0, "rescore_ms": 0.0}
    for i in range(reps + 1):
        t0 = time.perf_counter()
        torch.bmm(q, keys.transpose(1, 2), out=buf)
        t1 = time.perf_counter()
        buf.topk(kc, dim=-1)
        t2 = time.perf_counter()
        _, cand = topk_by_threshold(buf, kc, sorted=False, buffers=buffers)
        t3 = time.perf_counter()
        rows = cand + (torch.arange(n_kv_heads) * n_tokens).view(-1, 1, 1)
        sel = keys.reshape(-1, head_dim).index_select(0, rows.view(-1)).view(n_kv_heads * group, kc, head_dim)
        torch.bmm(sel.float(), q.float().reshape(n_kv_heads * group, head_dim, 1)).view(n_kv_heads, group, kc).topk(k)
        t4 = time.perf_counter()
        if i:
            for name, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                times[name] += 1e3 * dt / reps
    return {
        "n_tokens": n_tokens,
        "threads": torch.get_num_threads(),
        **{name: round(v, 2) for name, v in times.items()},
    }


if __name__ == "__main__":
    import json
    import sys

    for n in [int(a) for a in sys.argv[1:]] or [131072]:
        for row in search_floor(n):
            print(json.dumps(row), flush=True)
        print(json.dumps(torch_scan_stages(n)), flush=True)
