"""Peak RSS of one long prompt step over the demo cache (the prompt's working memory, CPU).

    python -m topk_decode prefill examples/docs --out /tmp/demo.cache
    python scripts/prompt_memory.py /tmp/demo.cache --tokens 8192 [--prompt-chunk 512]

Prints the process's peak RSS before and after feeding `--tokens` synthetic prompt tokens through
`TopKDecoder.forward` at k = 32 (flat). `--prompt-chunk` larger than `--tokens` runs the prompt as one
step (the behaviour before prompts were chunked).
"""

from __future__ import annotations

import argparse
import resource
import time
import warnings

from topk_decode.api import KVStore


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cache")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--prompt-chunk", type=int, default=512)
    a = ap.parse_args()
    warnings.simplefilter("ignore")   # positions past the demo model's: expected here
    store = KVStore.open(a.cache, k=32, device="cpu", prompt_chunk=a.prompt_chunk)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    ids = [(7 * i) % 500 + 10 for i in range(a.tokens)]
    t = time.perf_counter()
    store.decoder.forward(ids, store.decoder.new_conversation())
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(f"tokens {a.tokens}  prompt_chunk {a.prompt_chunk}  peak RSS before {before} MiB, after {after} MiB  "
          f"({time.perf_counter() - t:.1f} s)")


if __name__ == "__main__":
    main()
