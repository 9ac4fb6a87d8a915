"""`topk info CACHE`: what a cache holds, what it costs on disk and in RAM, which strategies it has."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from topk_decode.cli.common import console, dir_size, gpu_present, human_bytes


def cache_facts(path: Path, verify: bool = False) -> dict:
    """Collect the facts `topk info` shows, after checking the files (sizes; checksums with `verify`).

    Args:
        path: the cache directory.
        verify: hash every file against the manifest's checksums (reads the whole cache).
    """
    # Nothing here imports torch or a strategy's module: `topk info` answers in well under a second.
    from topk_decode.index import STRATEGIES, keeps_artifacts, reads_int8
    from topk_decode.index.artifacts import artifact_dir, artifacts_match, read_done, verify_done
    from topk_decode.index.auto import choose
    from topk_decode.store.cache_dir import check_cache
    from topk_decode.store.format import QUANTIZED

    m, cache_id, hashed = check_cache(path, full=verify)
    # Ready: strategies that need no files (flat, tokenselect) and those whose artifacts are complete and
    # were built from this cache; their files are checked (sizes; checksums with `verify`) like the cache's.
    ready = []
    unreadable = sorted(n for n in STRATEGIES if m["kv_dtype"] == QUANTIZED and not reads_int8(n))
    for n in sorted(STRATEGIES):
        if n in unreadable:
            continue
        if not keeps_artifacts(n):
            ready.append(n)
        elif artifacts_match(path, n, {}, cache_id):
            d = artifact_dir(path, n)
            verify_done(d, full=verify)
            hashed += len(read_done(d)["files"]) if verify else 0
            ready.append(n)
    files = m["files"]
    kv_bytes = sum(f["bytes"] for rel, f in files.items() if rel.startswith("kv/"))
    key_bytes = sum(f["bytes"] for rel, f in files.items() if rel.startswith("kv/keys."))
    model_dir = Path(m["model"]["path"]) if m["model"].get("path") else None
    present = model_dir is not None and model_dir.exists()
    if present and model_dir.is_file():  # a GGUF file: its (quantized) size
        weights = [model_dir]
    else:
        weights = [p for p in model_dir.glob("*") if p.suffix in (".safetensors", ".bin")] if present else []
    return {
        "path": str(path.resolve()),
        "model": {**m["model"], "present": present},
        "n_tokens": m["n_tokens"],
        "shape": m["shape"],
        "kv_dtype": m["kv_dtype"],
        "documents": m.get("documents", []),
        "skipped": m.get("skipped", []),
        "disk": {"total_bytes": dir_size(path), "kv_bytes": kv_bytes},
        "ram": {
            # np.memmap: nothing is read at open; pages come in (OS page cache) as retrieval touches them.
            "kv_memory_mapped_bytes": kv_bytes,
            # Estimate: flat's Faiss indices (`--opt backend=faiss`) hold one more copy of the keys, at the
            # stored precision (IndexFlatIP fp32 / ScalarQuantizer fp16, bf16); the default backends scan the map.
            "flat_faiss_index_bytes_estimate": key_bytes,
            "model_weights_bytes": sum(p.stat().st_size for p in weights) if weights else None,
        },
        "prefill": m.get("prefill", {}),
        "strategies": ready,
        "auto": vars(choose(m["n_tokens"])),  # {"strategy", "reason", "options"} on a GPU
        "auto_cpu": vars(choose(m["n_tokens"], gpu=False)),  # ... and on a CPU
        "strategies_not_built": sorted(n for n in STRATEGIES if n not in ready and n not in unreadable),
        "strategies_not_reading_this_kv": unreadable,  # an int8 cache: those that do not read it yet
        # what was really checked: the manifest's schema + checksum always, then sizes or every checksum
        "checked": "checksums" if verify else "sizes",
        "files_hashed": hashed,
        "created": m.get("created"),
    }


def info_command(
    cache: Annotated[Path, typer.Argument(help="The cache directory.")],
    verify: Annotated[
        bool,
        typer.Option(
            "--verify", help="Hash every file (KV, tokens, strategy artifacts) against its recorded checksum."
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the facts as JSON.")] = False,
) -> None:
    """Show a cache's model, documents, sizes, prefill statistics and available strategies."""
    facts = cache_facts(cache, verify)
    if as_json:
        typer.echo(json.dumps(facts, indent=2))
        return
    _print(facts)


def _print(f: dict) -> None:
    """Human-readable rendering of `cache_facts`."""
    from rich.markup import escape
    from rich.table import Table

    out = console()
    say = lambda text: out.print(text, markup=False, soft_wrap=True)  # noqa: E731 - paths may hold [brackets]
    m, s, ram = f["model"], f["shape"], f["ram"]
    checked = (
        f"manifest, sizes and checksums of {f['files_hashed']} files checked"
        if f["checked"] == "checksums"
        else "manifest and file sizes checked; --verify also hashes every file"
    )
    say(f"cache:      {f['path']}  ({checked})")
    say(f"model:      {m.get('path')}{'' if m['present'] else '  (missing: pass --model DIR to chat)'}")
    say(f"            type {m.get('model_type')}, fingerprint {m.get('fingerprint')}, dtype {m.get('dtype')}")
    say(f"tokens:     {f['n_tokens']:,}")
    say(
        f"layout:     {s['n_layers']} layers, {s['n_kv_heads']} KV heads ({s['n_heads']} query heads), "
        f"head dim {s['head_dim']}, KV stored as {f['kv_dtype']}"
    )
    say(f"on disk:    {human_bytes(f['disk']['total_bytes'])} total, {human_bytes(f['disk']['kv_bytes'])} KV")
    say(
        f"in RAM:     KV memory-mapped ({human_bytes(ram['kv_memory_mapped_bytes'])}, paged in as retrieval "
        f"touches it); flat with --opt backend=faiss would hold ≈ "
        f"{human_bytes(ram['flat_faiss_index_bytes_estimate'])} more (estimate: a copy of the keys)"
    )
    if ram["model_weights_bytes"] is not None:
        where = (
            "on the GPU at decode time" if gpu_present() else "in RAM at decode time: no GPU here, it runs on the CPU"
        )
        say(f"            model weights {human_bytes(ram['model_weights_bytes'])} ({where})")
    p = f["prefill"]
    if p:
        peak = "n/a on CPU" if p.get("peak_device_bytes") is None else human_bytes(p["peak_device_bytes"])
        say(
            f"prefill:    {p.get('seconds')} s, {p.get('tokens_per_s')} tok/s on {p.get('device')}, "
            f"chunk {p.get('chunk_size')}, peak GPU memory {peak}"
        )

    def runs(choice: dict) -> str:
        opts = " ".join(f"{k}={v}" for k, v in choice["options"].items())
        return f"{choice['strategy']}{' ' + opts if opts else ''} ({choice['reason']})"

    if f["auto"] == f["auto_cpu"]:
        say(f"default:    auto runs {runs(f['auto'])}")
    else:
        say(f"default:    auto runs {runs(f['auto'])} on a GPU; on a CPU {runs(f['auto_cpu'])}")
    say(
        f"strategies: {', '.join(f['strategies'])} ready"
        + (
            f"; {', '.join(f['strategies_not_built'])} build their artifacts on first use "
            "(or at prefill with --strategy)"
            if f["strategies_not_built"]
            else ""
        )
        + (
            f"; {', '.join(f['strategies_not_reading_this_kv'])} do not read {f['kv_dtype']} caches yet"
            if f["strategies_not_reading_this_kv"]
            else ""
        )
    )
    table = Table(title=f"{len(f['documents'])} documents")
    for col, just in (("document", "left"), ("start", "right"), ("end", "right"), ("tokens", "right")):
        table.add_column(col, justify=just)
    for d in f["documents"]:
        table.add_row(escape(d["name"]), f"{d['start']:,}", f"{d['end']:,}", f"{d['end'] - d['start']:,}")
    out.print(table)
    from topk_decode.prefill.documents import summarize_skipped

    for line in summarize_skipped(f["skipped"]):
        say(f"skipped at prefill: {line}")
