"""`topk bench`: decode/prefill speed of top-k decoding beside HF transformers, as JSON + PNG; `--streams`:
concurrent answers as the server runs them (bench/streams.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from topk_decode.cli.common import PromptChunkTokensOption, ThreadsOption, say_note, use_threads
from topk_decode.errors import TopkError
from topk_decode.serve.turns import PROMPT_CHUNK_TOKENS


def bench_command(
    model: Annotated[
        str,
        typer.Option(
            "--model",
            "-m",
            help="Named shape with random weights (llama-3-8b, qwen2.5-7b, llama-3.2-1b, tiny) or a checkpoint directory / "
            "GGUF file (real weights: each top-k row also counts its greedy tokens equal to HF dense's).",
        ),
    ] = "llama-3-8b",
    context: Annotated[
        str | None,
        typer.Option(
            "--context",
            "-c",
            help="Comma-separated context lengths, e.g. 32K,128K,512K,1M (default: 32K,128K; with --streams one "
            "length, default 32K).",
        ),
    ] = None,
    systems: Annotated[
        str, typer.Option("--systems", help="Comma-separated: topk, hf-dense, hf-offload.")
    ] = "topk,hf-dense,hf-offload",
    k: Annotated[int, typer.Option("--k", help="Retrieved tokens per query head and layer.")] = 1024,
    strategy: Annotated[
        str, typer.Option("--strategy", help="Selection strategy of the top-k rows: flat (exact) or e.g. routed.")
    ] = "flat",
    opt: Annotated[
        list[str] | None,
        typer.Option("--opt", help="Strategy option key=value, e.g. probe_fraction=0.02 (repeatable)."),
    ] = None,
    backend: Annotated[
        str,
        typer.Option(
            "--backend",
            help="Flat search backend: auto (numba for long bf16 "
            "contexts, else torch), torch, numba or faiss (--opt applies to the other "
            "strategies).",
        ),
    ] = "auto",
    steps: Annotated[int, typer.Option("--steps", help="Timed decode steps per row.")] = 16,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed decode steps before timing.")] = 3,
    gpu_memory: Annotated[
        str | None,
        typer.Option(
            "--gpu-memory",
            help="GPU budget for top-k decoding and the offloaded prefill, e.g. 16GiB (enforced with torch.cuda.set_per_process_memory_fraction).",
        ),
    ] = None,
    kv: Annotated[
        str,
        typer.Option("--kv", help="auto (real prefill up to --prefill-max, synthetic above), prefill, or synthetic."),
    ] = "auto",
    kv_dtype: Annotated[
        str | None,
        typer.Option(
            "--kv-dtype",
            help="int8: the top-k rows decode the prefilled or synthetic KV stored as `topk prefill --kv-dtype int8` "
            "stores it; default: the model's dtype.",
        ),
    ] = None,
    kv_cache: Annotated[
        str | None,
        typer.Option(
            "--kv-cache",
            help="Decode over this cache directory's KV (e.g. one --prefill-only --keep-cache kept) instead of a "
            "prefill: its length is the context; the model must have its shape.",
        ),
    ] = None,
    prefill_max: Annotated[
        str, typer.Option("--prefill-max", help="Longest context prefilled for real under --kv auto.")
    ] = "128K",
    hf_max: Annotated[
        str, typer.Option("--hf-max-context", help="Longest context the HF baselines run at (their prefill is slow).")
    ] = "128K",
    prefill_chunk: Annotated[int, typer.Option("--prefill-chunk", help="Layer-wise prefill chunk length.")] = 8192,
    offload_prefill: Annotated[
        bool,
        typer.Option(
            "--offload-prefill/--no-offload-prefill",
            help="Also prefill with weights streamed from the CPU, under the budget.",
        ),
    ] = True,
    graphs: Annotated[
        bool, typer.Option("--graphs/--no-graphs", help="Replay each one-token step's dense part as CUDA graphs.")
    ] = True,
    compile: Annotated[
        bool,
        typer.Option("--compile/--no-compile", help="Fuse each layer's small ops in those graphs with torch.compile."),
    ] = True,
    device: Annotated[
        str | None, typer.Option("--device", help="cuda or cpu (default: cuda; with --streams, cuda when available).")
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype", help="bf16, fp16 or fp32 (default: bf16; with --streams, bf16 on CUDA and fp32 on the CPU)."
        ),
    ] = None,
    out: Annotated[
        str, typer.Option("--out", "-o", help="Directory for bench_<model>.json and .png.")
    ] = "bench-results",
    smoke: Annotated[
        bool,
        typer.Option(
            "--smoke",
            help="CI smoke run: tiny shape on the CPU, seconds (other options ignored except --out and --threads).",
        ),
    ] = False,
    threads: ThreadsOption = None,
    prefill_only: Annotated[
        bool,
        typer.Option(
            "--prefill-only",
            help="Measure only the sequence-parallel prefill "
            "(topk prefill --gpus) of a named shape on each rank count of --gpus: tokens/s, scaling, "
            "memory, disk (docs/SCALE.md). Uses --model, --context, --prefill-chunk, --device, "
            "--dtype, --out, --smoke.",
        ),
    ] = False,
    gpus: Annotated[str, typer.Option("--gpus", help="With --prefill-only: comma-separated rank counts.")] = "1,2,4",
    layers: Annotated[
        int | None,
        typer.Option(
            "--layers",
            help="With --prefill-only: run only the first N layers "
            "(every layer costs the same; whole-model figures are scaled).",
            min=1,
        ),
    ] = None,
    streams: Annotated[
        str | None,
        typer.Option(
            "--streams",
            help="Measure concurrent answers as `topk serve` runs them instead, one row per comma-separated stream "
            "count (e.g. 1,2,4,8): aggregate tokens/s, each stream's time to first token and inter-token latency "
            "(p50/p99), over --cache or a --model shape with random KV of one --context length (timing only). Uses "
            "--steps (tokens per stream), --long-prompt, --prompt-chunk-tokens, --k, --strategy, --opt, --device, "
            "--dtype, --gpu-memory, --out.",
        ),
    ] = None,
    cache: Annotated[
        str | None,
        typer.Option(
            "--cache",
            help="With --streams: a cache directory, decoded with the model it was prefilled with (real weights), "
            "e.g. the demo cache.",
        ),
    ] = None,
    long_prompt: Annotated[
        str | None,
        typer.Option(
            "--long-prompt",
            help="With --streams: each stream count also runs with one more stream sending a prompt of this many "
            "tokens (e.g. 20K) first; the short streams' time to first token and inter-token latency are measured "
            "while it runs.",
        ),
    ] = None,
    prompt_chunk_tokens: PromptChunkTokensOption = PROMPT_CHUNK_TOKENS,
    keep_cache: Annotated[
        str | None,
        typer.Option(
            "--keep-cache",
            help="With --prefill-only: commit the last row's cache (last context, last rank count) to this new "
            "directory instead of removing it, for --kv-cache.",
        ),
    ] = None,
) -> None:
    """Measure decode tokens/s (with a per-step breakdown), peak GPU memory and CPU RSS of top-k decoding
    beside HF transformers dense and offloaded decoding, at several context lengths; with --streams, concurrent
    answers as `topk serve` runs them (throughput, time to first token, inter-token latency)."""
    use_threads(threads)
    from topk_decode.bench.measure import parse_bytes, parse_tokens
    from topk_decode.bench.run import BenchConfig, run_bench, smoke_config
    from topk_decode.cli.common import parse_options

    for option, given in (("--cache", cache), ("--long-prompt", long_prompt)):
        if given is not None and streams is None:
            raise TopkError(f"{option} goes with --streams")
    if streams is not None:
        _streams(streams, cache, long_prompt, prompt_chunk_tokens, model, context, k, strategy, opt, steps, device,
                 dtype, gpu_memory, out, kv_dtype)  # fmt: skip
        return
    device, dtype, context = device or "cuda", dtype or "bf16", context or "32K,128K"
    if prefill_only:
        _prefill_scaling(model, context, gpus, layers, prefill_chunk, device, dtype, out, smoke, keep_cache)
        return
    if smoke:
        cfg = smoke_config(out)
    else:
        cfg = BenchConfig(
            model=model,
            contexts=[parse_tokens(c) for c in context.split(",") if c.strip()],
            systems=[s.strip() for s in systems.split(",") if s.strip()],
            k=k,
            strategy=strategy,
            strategy_options=parse_options(opt),
            backend=backend,
            steps=steps,
            warmup=warmup,
            gpu_memory=parse_bytes(gpu_memory) if gpu_memory else None,
            kv=kv,
            kv_dtype=kv_dtype,
            kv_cache=kv_cache,
            prefill_max=parse_tokens(prefill_max),
            hf_max=parse_tokens(hf_max),
            prefill_chunk=prefill_chunk,
            offload_prefill=offload_prefill,
            graphs=graphs,
            compile=compile,
            device=device,
            dtype=dtype,
            out=out,
        )
    data = run_bench(cfg, log=lambda line: typer.echo(line, err=True))
    _print_table(data)
    say_note(
        f"results: {cfg.out}/bench_{data['model']['name']}.json"
        + (f", plot: {data['plot']}" if data.get("plot") else "")
    )


def _streams(
    streams,
    cache,
    long_prompt,
    chunk,
    model,
    context,
    k,
    strategy,
    opt,
    steps,
    device,
    dtype,
    gpu_memory,
    out,
    kv_dtype,
):
    """`--streams`: concurrent answers as the server runs them (bench/streams.py), one table row per run."""
    from topk_decode.bench.measure import parse_bytes, parse_tokens
    from topk_decode.bench.streams import StreamsConfig, run_streams
    from topk_decode.cli.common import parse_options

    try:
        counts = [int(n) for n in streams.split(",") if n.strip()]
    except ValueError:
        raise TopkError(f"--streams must list stream counts such as 1,2,4,8, got {streams!r}") from None
    lengths = [c for c in (context or "32K").split(",") if c.strip()]
    if cache is None and len(lengths) != 1:
        raise TopkError(f"--streams runs over one --context length, got {context!r}")
    cfg = StreamsConfig(
        streams=counts,
        steps=steps,
        long_prompt=parse_tokens(long_prompt) if long_prompt is not None else 0,
        prompt_chunk_tokens=chunk,
        cache=cache,
        model=model,
        context=parse_tokens(lengths[0]) if cache is None else 0,
        kv_dtype=kv_dtype,
        k=k,
        strategy=strategy,
        strategy_options=parse_options(opt),
        device=device,
        dtype=dtype,
        gpu_memory=parse_bytes(gpu_memory) if gpu_memory else None,
        out=out,
    )
    data = run_streams(cfg, log=lambda line: typer.echo(line, err=True))
    _print_streams(data)
    if data["timing_only"]:
        say_note("random weights or random KV: the rows are timing only (their tokens mean nothing)")
    say_note(f"results: {data['path']}")


def _print_streams(data: dict) -> None:
    """One line per row: streams, long prompt, tokens, tok/s, TTFT p50/max, ITL p50/p99, and during the long prompt
    its prefill seconds, the short streams' ITL p99 then, and whether their first tokens came before its own."""
    from rich.table import Table

    from topk_decode.cli.common import console

    t = Table(title=f"topk bench --streams — {data['what']}")
    long = any(r["long_prompt_tokens"] for r in data["rows"])
    cols = ["streams", "long prompt", "tokens", "tok/s", "TTFT p50 ms", "TTFT max ms", "ITL p50 ms", "ITL p99 ms"]
    cols += ["long prefill s", "ITL p99 during ms", "firsts before long"] if long else []
    for col in cols:
        t.add_column(col)
    fmt = lambda v, f="{:,.1f}": "" if v is None else f.format(v)  # noqa: E731
    for r in data["rows"]:
        cells = [
            str(r["streams"]),
            f"{r['long_prompt_tokens']:,}" if r["long_prompt_tokens"] else "",
            str(r["tokens_generated"]),
            fmt(r["tokens_per_s"], "{:,.2f}"),
            fmt(r["ttft_ms_p50"]),
            fmt(r["ttft_ms_max"]),
            fmt(r["itl_ms_p50"]),
            fmt(r["itl_ms_p99"]),
        ]
        if long:
            on = bool(r["long_prompt_tokens"])
            cells += [
                fmt(r.get("long_prefill_s"), "{:,.2f}") if on else "",
                fmt(r.get("itl_during_long_ms_p99")) if on else "",
                ("yes" if r["short_first_tokens_before_long"] else "no") if on else "",
            ]
        t.add_row(*cells)
    console().print(t)


def _prefill_scaling(model, context, gpus, layers, chunk, device, dtype, out, smoke, keep_cache) -> None:
    """`--prefill-only`: the sequence-parallel prefill on each rank count (bench/scaling.py)."""
    from topk_decode.bench.measure import parse_tokens
    from topk_decode.bench.scaling import ScalingConfig, run_scaling, smoke_scaling_config

    try:
        counts = [int(g) for g in gpus.split(",") if g.strip()]
    except ValueError:
        raise TopkError(f"--gpus must list rank counts such as 1,2,4, got {gpus!r}") from None
    cfg = (
        smoke_scaling_config(out)
        if smoke
        else ScalingConfig(
            model=model,
            contexts=[parse_tokens(c) for c in context.split(",") if c.strip()],
            gpus=counts,
            layers=layers,
            chunk=chunk,
            device=device,
            dtype=dtype,
            out=out,
            keep_cache=keep_cache,
        )
    )
    data = run_scaling(cfg, log=lambda line: typer.echo(line, err=True))
    say_note(f"results: {data['path']}")


def _print_table(data: dict) -> None:
    """One line per row: system, context, kv source, tokens/s, ms/step, peak GPU, RSS, status; with a real
    checkpoint, "= dense": how many of a top-k row's greedy tokens equal HF dense's (before the first divergence)."""
    from rich.table import Table

    from topk_decode.cli.common import console

    t = Table(title=f"topk bench — {data['model']['name']}")
    checked = any("tokens_equal_dense" in r for r in data["rows"])  # a real checkpoint's top-k rows
    for col in (
        "system",
        "context",
        "kv",
        "tok/s",
        *(["= dense"] if checked else []),
        "ms/step",
        "prefill tok/s",
        "keys read %",
        "peak GPU GiB",
        "RSS GiB",
        "status",
    ):
        t.add_column(col)
    fmt = lambda v, f="{:,.2f}": "" if v is None else f.format(v)  # noqa: E731
    for r in data["rows"]:
        decode = not r["system"].startswith("topk-prefill")
        t.add_row(
            r["system"],
            f"{r['context']:,}",
            r.get("kv") or "",
            fmt(r.get("tokens_per_s")) if decode else "",
            *([_equal_dense(r)] if checked else []),
            fmt(r.get("ms_per_step"), "{:,.1f}"),
            fmt(r.get("tokens_per_s") if not decode else r.get("prefill_tokens_per_s"), "{:,.0f}"),
            fmt(r.get("keys_read_pct"), "{:,.1f}"),
            fmt(r.get("peak_gpu_gib")),
            fmt(r.get("cpu_rss_gib")),
            r["status"],
        )
    console().print(t)


def _equal_dense(row: dict) -> str:
    """A top-k row's "= dense" cell: equal/compared tokens, "n/a" where the reference is missing (the reason is
    in the JSON and the log line), "" for other rows."""
    if "tokens_equal_dense" not in row:
        return ""
    if row["tokens_equal_dense"] is None:
        return "n/a"
    return f"{row['tokens_equal_dense']}/{row['tokens_compared']}"
