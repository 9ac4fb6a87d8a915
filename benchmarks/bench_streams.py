"""Aggregate decode tokens/s of S concurrent streams over one cache, decoded together or one step at a time.

Each stream is a conversation on its own thread (as `topk serve` runs requests): its prompt runs alone
(untimed), then every stream takes `--tokens` greedy one-token steps at once, timed from the first to the
last. With batching (the default) a `StepBatcher` (decode/batch.py) joins their steps into batched model
steps; `--no-batch` is the old behaviour, steps interleaved one at a time under the step lock.

    # a real cache (the demo cache on the CPU)
    python benchmarks/bench_streams.py --cache demo-cache --device cpu --dtype fp32 --streams 1,2,4
    # a model shape with random weights over random context KV (the GPU host: Llama-3-8B shape, 128K)
    python benchmarks/bench_streams.py --model llama-3-8b --context 128K --k 1024 --gpu-memory 16GiB --streams 1,2,4,8

Prints one JSON line per row: streams, batching, aggregate and per-stream tokens/s, mean batch, the
per-conversation step breakdown (ms), and the speed-up over one stream.
"""

from __future__ import annotations

import argparse
import json
import platform
import threading
import time

import torch


def open_decoder(args):
    """(decoder, vocabulary size, description) for a cache or a synthetic shape."""
    from topk_decode.config import DecodeConfig
    from topk_decode.decode.engine import TopKDecoder
    from topk_decode.prefill.build import parse_dtype, pick_device

    device = pick_device(args.device)
    dtype = parse_dtype(args.dtype)
    if args.cache:
        from topk_decode.api import KVStore

        store = KVStore.open(args.cache, k=args.k, strategy=args.strategy, device=args.device, dtype=args.dtype)
        return store.decoder, store.decoder.shape.vocab_size, f"cache {args.cache} ({store.ckv.n_tokens:,} tokens)"
    from topk_decode.bench.measure import parse_bytes, parse_tokens, set_gpu_budget
    from topk_decode.bench.shapes import build_model
    from topk_decode.bench.synthetic import synthetic_kv
    from topk_decode.model.blocks import ModelShape

    model = build_model(args.model, device, dtype or torch.bfloat16)
    shape = ModelShape.from_config(model.config)
    n = parse_tokens(args.context)
    ckv = synthetic_kv(shape.n_layers, shape.n_kv_heads, shape.head_dim, n, next(model.parameters()).dtype)
    if args.gpu_memory and device.type == "cuda":
        set_gpu_budget(device, parse_bytes(args.gpu_memory))
    config = DecodeConfig(k=args.k, strategy=args.strategy)
    return TopKDecoder(model, ckv, config), shape.vocab_size, f"{args.model} shape, random KV, {n:,} tokens"


def run_streams(decoder, vocab: int, streams: int, tokens: int, batch: bool) -> dict:
    """Time `tokens` greedy steps of `streams` concurrent conversations; the row's figures."""
    from topk_decode.decode.batch import StepBatcher

    convs = [decoder.new_conversation() for _ in range(streams)]
    first = []
    for i, conv in enumerate(convs):  # distinct prompts, run alone and untimed
        prompt = [(7 + 13 * i + j) % vocab for j in range(8 + 3 * i)]
        first.append(int(torch.argmax(decoder.forward(prompt, conv))))
    for i, conv in enumerate(convs):  # one untimed step each (first-step costs: graphs, compile, caches)
        first[i] = int(torch.argmax(decoder.forward([first[i]], conv)))
    batcher = StepBatcher(max_batch=streams) if batch and streams > 1 else None
    if batcher is not None:
        batcher.attach([decoder])
    for conv in convs:
        conv.stats = type(conv.stats)()
    start = threading.Barrier(streams + 1)

    def stream(i: int) -> None:
        tok = first[i]
        start.wait()
        for _ in range(tokens):
            tok = int(torch.argmax(decoder.forward([tok], convs[i])))
        if batcher is not None:
            batcher.leave(convs[i])

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    decoder.batcher = None
    s = [c.stats.summary() for c in convs]
    mean = {k: round(sum(x[k] for x in s) / streams, 2) for k in ("ms_per_step", "search_ms", "context_ms")}
    return {
        "streams": streams,
        "batching": batcher is not None,
        "tokens_per_s": round(streams * tokens / wall, 2),
        "per_stream_tokens_per_s": round(tokens / wall, 2),
        "mean_batch": round(batcher.stepped / batcher.batches, 2) if batcher is not None else 1.0,
        "conversation_step_ms": mean,
        "wall_s": round(wall, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache", help="a cache directory (else --model and --context: random weights and KV)")
    p.add_argument("--model", default="llama-3-8b", help="a named shape (llama-3-8b, tiny, ...) or checkpoint")
    p.add_argument("--context", default="128K", help="context tokens of the synthetic KV")
    p.add_argument("--streams", default="1,2,4", help="comma-separated stream counts")
    p.add_argument("--tokens", type=int, default=32, help="timed tokens per stream")
    p.add_argument("--k", type=int, default=256)
    p.add_argument("--strategy", default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--gpu-memory", default=None, help="GPU budget, e.g. 16GiB")
    p.add_argument("--no-batch", action="store_true", help="also time each stream count without batching")
    args = p.parse_args()
    decoder, vocab, what = open_decoder(args)
    env = {
        "what": what,
        "strategy": decoder.config.strategy,
        "k": args.k,
        "device": str(decoder.device),
        "host": platform.node(),
        "cpus": torch.get_num_threads(),
        "time": time.strftime("%Y-%m-%d %H:%M"),
    }
    print(json.dumps(env), flush=True)
    base = None
    for n in [int(x) for x in args.streams.split(",")]:
        for batch in [True, False] if args.no_batch and n > 1 else [True]:
            row = run_streams(decoder, vocab, n, args.tokens, batch)
            base = base or row["tokens_per_s"]
            row["speedup"] = round(row["tokens_per_s"] / base, 2)
            print(json.dumps(row), flush=True)
    decoder.close()


if __name__ == "__main__":
    main()
