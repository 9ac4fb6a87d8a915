"""Peak RSS of one long prompt step (the prompt's working memory, CPU).

    python -m topk_decode prefill examples/docs --out /tmp/demo.cache
    python scripts/prompt_memory.py /tmp/demo.cache --tokens 8192 [--prompt-chunk 512]
    python scripts/prompt_memory.py --synthetic 1048576 --tokens 512 [--scratch-mib 1024]

Prints the process's peak RSS before and after feeding `--tokens` synthetic prompt tokens through
`TopKDecoder.forward` at k = 32 (flat). `--prompt-chunk` larger than `--tokens` runs the prompt as one
step (the behaviour before prompts were chunked). `--synthetic N` decodes the demo model over N tokens
of random bf16 KV in RAM instead of a cache (bench/synthetic.py): a long context, where the search's
per-chunk scores (query heads × chunk × N) dominate and `--scratch-mib` bounds them.
"""

from __future__ import annotations

import argparse
import resource
import time
import warnings

import torch

from topk_decode.api import KVStore
from topk_decode.config import DecodeConfig
from topk_decode.decode.engine import TopKDecoder


def _decoder(a: argparse.Namespace) -> TopKDecoder:
    if a.cache:
        return KVStore.open(
            a.cache, k=32, device="cpu", prompt_chunk=a.prompt_chunk, prompt_scratch_mib=a.scratch_mib
        ).decoder
    from topk_decode.bench.synthetic import synthetic_kv
    from topk_decode.demo import default_model_dir
    from topk_decode.model.loading import load_model

    model = load_model(default_model_dir()[0], "cpu")
    c = model.config
    ckv = synthetic_kv(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, a.synthetic, torch.bfloat16)
    cfg = DecodeConfig(
        k=32, strategy_options={"backend": "torch"}, prompt_chunk=a.prompt_chunk, prompt_scratch_mib=a.scratch_mib
    )
    return TopKDecoder(model, ckv, cfg)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cache", nargs="?")
    ap.add_argument("--synthetic", type=int, default=0, help="context tokens of random KV instead of a cache")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--prompt-chunk", type=int, default=512)
    ap.add_argument("--scratch-mib", type=int, default=1024)
    a = ap.parse_args()
    if not a.cache and not a.synthetic:
        ap.error("give a cache directory or --synthetic N")
    warnings.simplefilter("ignore")  # positions past the demo model's: expected here
    dec = _decoder(a)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    ids = [(7 * i) % 500 + 10 for i in range(a.tokens)]
    t = time.perf_counter()
    dec.forward(ids, dec.new_conversation())
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(
        f"tokens {a.tokens}  prompt_chunk {a.prompt_chunk}  scratch {a.scratch_mib} MiB  "
        f"chunk used {dec.prompt_chunk_tokens()}  peak RSS before {before} MiB, after {after} MiB  "
        f"({time.perf_counter() - t:.1f} s)"
    )


if __name__ == "__main__":
    main()
