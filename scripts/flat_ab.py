"""A/B of flat's select (search only) between two package checkouts:
python scripts/flat_ab.py PKGROOT N [BACKEND]   (BACKEND: torch by default, or numba)

PKGROOT is a directory holding a `topk_decode` package (e.g. `git archive OLD topk_decode | tar -x -C old`);
run it alternately for the old and the new checkout on the same host (docs/BENCHMARKS.md, runs 11 and 18).
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, sys.argv[1])
import torch
from topk_decode.store.cache_dir import ContextKV
from topk_decode.index.flat import FlatStrategy
N = int(sys.argv[2]); L, H, D, G = 32, 8, 128, 4
g = torch.Generator().manual_seed(0)
keys = [torch.randn(H, N, D, generator=g).to(torch.bfloat16) for _ in range(L)]
man = {"shape": {"n_layers": L, "n_kv_heads": H, "head_dim": D}, "files": {}}
ckv = ContextKV(path=Path("/nonexistent"), manifest=man, tokens=list(range(N)), keys=keys, values=keys)
backend = sys.argv[3] if len(sys.argv) > 3 else "torch"
s = FlatStrategy(ckv, 4, N - 64, {"backend": backend}); s.prepare()
qs = [torch.randn(H, G, D, generator=g).to(torch.bfloat16).float() for _ in range(L)]
times = []
for rep in range(6):
    t = time.perf_counter()
    for l in range(L):
        s.select(l, qs[l], 1024)
    times.append(time.perf_counter() - t)
print(sys.argv[1], N, backend, "threads", torch.get_num_threads(), "ms per 32 layers:", [round(1e3 * x, 1) for x in times], "median", round(1e3 * statistics.median(times[1:]), 1))
