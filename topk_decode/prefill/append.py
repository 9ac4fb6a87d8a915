"""`topk prefill NEW_DOCS --append CACHE` (`KVStore.append`): add documents to a cache without prefilling it again.

The new documents follow the cached ones exactly as `layout_context` would lay them out together, and the
model runs over the new tokens only, each chunk attending to the cached keys of every layer (the
`past` path of `prefill_layers`). The chunks start at the last multiple of the cache's chunk size at or
before its end: the cached tokens after it (fewer than one chunk) are computed again, inside the same
chunk as the first new tokens, so every chunk is the one a prefill of old + new documents runs and the
cache written equals that prefill's (byte for byte on the CPU; see docs/DOCUMENTS.md).

Atomic like a prefill: the appended cache is written whole into the partial directory beside the cache
(the cached layers copied, the new positions added), its strategy artifacts are rebuilt there, and one
atomic rename swaps it in. A failure or interruption before the swap leaves the old cache untouched and
removes the partial directory; a reader sees the old cache or the new one, never a mix.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

from topk_decode.errors import TopkError
from topk_decode.prefill.documents import collect_documents, has_headers, layout_more, safe_name
from topk_decode.prefill.layerwise import CHUNK_SIZE
from topk_decode.store.format import LAST_LOGITS, QUANTIZED, torch_dtype

# A cache written before the manifest recorded its chunk size was prefilled with the default of the time.


def recompute_from(n_cached: int, chunk_size: int) -> int:
    """The first position an append computes: the start of the chunk holding the cache's end."""
    return (n_cached // chunk_size) * chunk_size


def strategies_to_rebuild(cache: Path, n_tokens: int) -> dict[str, dict]:
    """The strategies whose artifacts an appended cache gets: those the cache has (with their recorded
    build options), and the one `auto` picks for the new context length when it keeps artifacts."""
    from topk_decode.index import STRATEGIES, artifacts_complete, get_strategy, keeps_artifacts
    from topk_decode.index.artifacts import artifact_dir, read_done, recorded_options
    from topk_decode.index.auto import choose

    out: dict[str, dict] = {}
    for name in STRATEGIES:
        if not keeps_artifacts(name) or not artifacts_complete(cache, name):
            continue
        declared = get_strategy(name).OPTIONS
        opts = {k: v for k, v in (recorded_options(cache, name) or {}).items() if declared is None or k in declared}
        if name == "duo":  # its artifact is the head pattern itself (per model, not per token): built again from it
            files = list(read_done(artifact_dir(cache, name))["files"])
            opts["pattern"] = str(artifact_dir(cache, name) / files[0])
        out[name] = opts
    auto = choose(n_tokens)  # what a GPU will run (index/auto.py): the decode machine is not known here
    if keeps_artifacts(auto.strategy):
        out[auto.strategy] = {**out.get(auto.strategy, {}), **auto.options}
    return out


def check_new_names(cached: list[dict], names: list[str]) -> None:
    """Refuse documents whose names the cache already holds (`--replace` is not there yet)."""
    have = {d["name"] for d in cached}
    clash = [n for n in names if safe_name(n) in have]
    if clash:
        shown = ", ".join(safe_name(n) for n in clash[:3]) + (f" and {len(clash) - 3} more" if len(clash) > 3 else "")
        raise TopkError(
            f"the cache already holds {shown}: appending a document of the same name is refused "
            f"(replacing one, --replace, is not supported yet; rename it or prefill again)"
        )


def append_cache(
    docs: str | os.PathLike,
    cache: str | os.PathLike,
    model_dir: str | os.PathLike | None = None,
    chunk_size: int | None = None,
    device: str | None = None,
    dtype: str | None = None,
    on_start: Callable[[int, int, list[str]], None] | None = None,
    progress: Callable[[int], None] | None = None,
    offload_weights: bool = False,
    allow_long_context: bool = False,
    follow_symlinks: bool = False,
    include: list[str] | tuple[str, ...] = (),
    exclude: list[str] | tuple[str, ...] = (),
    strategies: dict[str, dict] | None = None,
    on_strategy: Callable[[str], Callable[[int, int], None] | None] | None = None,
):
    """Append documents to an existing cache: the model runs over the new tokens only; the result, swapped in
    atomically, equals a prefill of the cached documents followed by the new ones.

    Args:
        docs: a documents folder or one file (read as `collect_documents` reads them).
        cache: the cache directory to extend.
        model_dir: the checkpoint (default: the one the cache records); its fingerprint must match.
        chunk_size: prefill chunk length (default: the cache's own, which makes the result equal a prefill
            of everything with it).
        device: "cuda", "cpu", ... (default: CUDA when available).
        dtype: must be the cache's dtype when given (default: it).
        on_start: called as on_start(n_tokens_computed, n_layers, skipped_files) before the heavy work.
        progress: called with the tokens processed by each chunk of each layer.
        offload_weights: stream the weights one layer at a time (as `build_cache`).
        allow_long_context: as `build_cache`.
        follow_symlinks, include, exclude: as `collect_documents`.
        strategies: strategy name → build options: artifacts built into the appended cache before the swap,
            besides those `strategies_to_rebuild` names (what the cache had, and auto's choice for the new length).
        on_strategy: called with a strategy's name before its build; returns its progress callback or None.
    Returns:
        (the cache path, PrefillStats of the new tokens, the names of the files skipped with why).
    """
    from topk_decode.index import prepare_artifacts
    from topk_decode.model.blocks import ModelShape
    from topk_decode.model.loading import load_config, load_model, load_tokenizer, model_fingerprint, parse_dtype
    from topk_decode.prefill.build import check_context_length, pick_device
    from topk_decode.prefill.layerwise import prefill_layers
    from topk_decode.store.cache_dir import CacheWriter, open_cache, read_manifest
    from topk_decode.store.locking import unwritable
    from topk_decode.store.manifest import CHECKSUM_FIELD

    cache = Path(cache)
    read_manifest(cache)  # "cache not found" / not a cache: before anything is locked
    if chunk_size is not None and chunk_size <= 0:
        raise TopkError(f"--chunk-size must be positive, got {chunk_size}")
    documents, skipped = collect_documents(docs, follow_symlinks=follow_symlinks, include=include, exclude=exclude)
    writer = CacheWriter(cache, overwrite=True)  # the writer lock: no prefill or append of this cache meanwhile
    try:
        old = open_cache(cache)  # under the lock: the version this append extends
        manifest = old.manifest
        if not has_headers(manifest.get("documents", []), manifest.get("prompt", {})):
            raise TopkError(
                f"{cache} holds one raw-text document without a document header; documents appended "
                f"after it would change its tokens: prefill all the documents together instead"
            )
        check_new_names(manifest.get("documents", []), [d.name for d in documents])
        recorded = manifest["model"]
        model_dir = Path(model_dir) if model_dir is not None else Path(recorded["path"])
        if not model_dir.exists():
            raise TopkError(f"the cache's model {model_dir} is not there any more; pass --model DIR")
        fingerprint = model_fingerprint(model_dir)
        if fingerprint != recorded["fingerprint"]:
            raise TopkError(
                f"model {model_dir} (fingerprint {fingerprint}) is not the model this cache was built "
                f"with ({recorded['path']}, fingerprint {recorded['fingerprint']})"
            )
        if manifest["kv_dtype"] == QUANTIZED:
            raise TopkError(
                f"{cache} holds int8 keys and values, which --append does not extend yet: prefill the documents "
                "again with --kv-dtype int8"
            )
        kv_dtype = torch_dtype(manifest["kv_dtype"])
        if dtype is not None and parse_dtype(dtype) != kv_dtype:
            raise TopkError(
                f"{cache} holds {manifest['kv_dtype']} keys and values: append with that dtype (leave --dtype out)"
            )
        prefill_record = manifest.get("prefill", {})
        chunk = chunk_size or prefill_record.get("chunk_size", CHUNK_SIZE)
        tokenizer = load_tokenizer(model_dir)
        n_old = old.n_tokens
        new_ids, new_table = layout_more(documents, tokenizer, n_old)
        ids = old.tokens + new_ids
        shape = ModelShape.from_config(load_config(model_dir))
        check_context_length(len(ids), shape.max_positions, allow_long_context)
        start = recompute_from(n_old, chunk)
        dev = pick_device(device)
        if on_start is not None:
            on_start(len(ids) - start, shape.n_layers, skipped)
        model = load_model(model_dir, "cpu" if offload_weights else dev, kv_dtype)
        last_logits, stats = prefill_layers(
            model,
            ids[start:],
            writer.write_layer,
            chunk,
            progress,
            offload_weights=offload_weights,
            device=dev,
            past=lambda layer: (old.keys[layer][:, :start], old.values[layer][:, :start]),
        )
        writer.write_tokens(ids)
        writer.write_array(LAST_LOGITS, last_logits.float())
        kept = {
            k: v
            for k, v in manifest.items()
            if k not in ("format", "format_version", "files", "created", CHECKSUM_FIELD)
        }
        appends = list(prefill_record.get("appended", [])) + [
            {
                "documents": len(documents),
                "n_tokens": len(new_ids),
                "computed_from": start,
                "chunk_size": chunk,
                "device": str(dev),
                "seconds": round(stats.seconds, 3),
            }
        ]
        new_manifest = dict(
            kept,
            model=dict(recorded, path=str(model_dir.resolve())),
            n_tokens=len(ids),
            documents=manifest.get("documents", []) + new_table,
            skipped=list(manifest.get("skipped", [])) + skipped,
            prefill=dict(prefill_record, appended=appends),
        )
        old = None  # the old cache's maps: not needed past here
        built = writer.finish(new_manifest)
        wanted = {**strategies_to_rebuild(cache, len(ids)), **(strategies or {})}
        if wanted:
            ckv = open_cache(built, verify=False)  # just written and checksummed by us
            for name, opts in wanted.items():
                prepare_artifacts(ckv, [name], opts, on_strategy(name) if on_strategy is not None else None)
            del ckv
        return writer.swap(), stats, skipped
    except BaseException as e:
        writer.abort()  # the old cache stays exactly as it was
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
            raise TopkError(f"{unwritable(cache, e)}; the cache is unchanged") from None
        raise


__all__ = ["append_cache", "recompute_from", "strategies_to_rebuild", "check_new_names"]
