"""What flat's numba search costs one thread per key, for a checkout: A/B two checkouts on any machine.

On the 16-core GPU host flat's scan is bound by its arithmetic more than by DRAM (docs/BENCHMARKS.md
run 20): one thread's cost per key over one head's keys, with the block size the host would use, shows
a change's effect there without the host. Run it for each checkout, alternately:
    python scripts/flat_thread_cost.py PKGROOT      (PKGROOT holds a `topk_decode`, e.g. `.` or an old one)
Prints one JSON line per (queries per KV head, block) with ns per key (best of 5 rounds of 5 searches).
"""
import json
import sys
import time

sys.path.insert(0, sys.argv[1])
import torch  # noqa: E402

from topk_decode.index import flat_kernel  # noqa: E402

# (keys, queries per KV head, block): the 128K Llama-3-8B host split (4 blocks of 32K per head), one
# block for the whole head, and the 1M Qwen2.5-7B host split seen from one head (blocks of 64K)
SHAPES = ((131072, 4, 32768), (131072, 4, 131072), (262144, 7, 65536))
torch.manual_seed(0)
for n, G, block in SHAPES:
    keys = torch.randn(1, n, 128).bfloat16()
    q = torch.randn(1, G, 128).bfloat16().float()          # bf16-exact, as the decoder's queries
    flat_kernel.search(keys, q, 1024, 0, n, 1, block=block)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(5):
            flat_kernel.search(keys, q, 1024, 0, n, 1, block=block)
        best = min(best, (time.perf_counter() - t) / 5)
    print(json.dumps({"pkg": sys.argv[1], "n": n, "queries": G, "block": block, "k": 1024,
                      "ns_per_key": round(best / n * 1e9, 2)}), flush=True)
