"""`topk prefill`: documents → tokens → layer-wise KV → a complete cache directory, or nothing."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from topk_decode.errors import TopkError, TopkWarning
from topk_decode.model.blocks import ModelShape
from topk_decode.model.loading import (  # noqa: F401
    load_config,
    load_model,
    load_tokenizer,
    model_fingerprint,
    parse_dtype,  # parse_dtype re-exported (api, eval, bench import it from here)
)
from topk_decode.prefill.documents import collect_documents, layout_context
from topk_decode.prefill.layerwise import CHUNK_SIZE, PrefillStats, prefill_layers
from topk_decode.store.cache_dir import CacheWriter, check_output
from topk_decode.store.format import LAST_LOGITS, dtype_name
from topk_decode.store.locking import unwritable

# Default seconds between resume checkpoints: each writes the N × hidden residual stream (twice one
# layer's KV for Llama-3-8B), so they are spaced minutes apart: few extra writes, bounded lost work.
CHECKPOINT_EVERY_S = 300.0


def pick_device(device: str | None = None) -> torch.device:
    """The requested device, else CUDA when available, else CPU."""
    if device:
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise TopkError(f"device {device!r} requested but CUDA is not available")
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def warn_leftovers(out: Path) -> None:
    """Name the partial directories that killed prefills of an older version left beside `out`.

    They are not deleted here. (This version's writers use one `.NAME.partial`, kept for --resume.)
    """
    for partial in sorted(out.parent.glob(f".{out.name}.partial-*")):
        size = sum(f.stat().st_size for f in partial.rglob("*") if f.is_file())
        warnings.warn(
            f"{partial} ({size / 2**30:.2f} GiB) is left over from an interrupted prefill "
            f"and is not a cache; delete it to free the space",
            TopkWarning,
            stacklevel=3,
        )


def _say(on_note: Callable[[str], None] | None, text: str) -> None:
    if on_note is not None:
        on_note(text)
    else:
        warnings.warn(text, TopkWarning, stacklevel=3)


def _check_space(out: Path, need: int, on_note: Callable[[str], None] | None) -> None:
    """Warn before hours of work when the disk visibly cannot hold the cache."""
    try:
        free = shutil.disk_usage(out.parent).free
    except OSError:
        return
    if free < need:
        _say(
            on_note,
            f"the cache needs about {need / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB are free "
            f"in {out.parent}; the prefill will fail when the disk is full",
        )


def check_context_length(n_tokens: int, max_positions: int, allow_long_context: bool = False) -> None:
    """Refuse a context longer than the model's positions (TopkError with both numbers), or with
    `allow_long_context` only warn: positions past the maximum are outside what the model was trained
    for, and a RoPE scaling the model's config does not declare is not ours to invent."""
    if n_tokens <= max_positions:
        return
    if not allow_long_context:
        raise TopkError(
            f"the context has {n_tokens:,} tokens but the model has {max_positions:,} positions "
            f"(max_position_embeddings): prefill fewer documents or a model with more positions, or "
            f"pass --allow-long-context (Python: allow_long_context=True) to prefill it anyway, "
            f"with answers that degrade past the model's positions"
        )
    warnings.warn(
        f"the context has {n_tokens:,} tokens, more than the model's maximum positions "
        f"({max_positions:,}); answers may degrade",
        TopkWarning,
        stacklevel=3,
    )


def build_cache(
    docs: str | os.PathLike,
    out: str | os.PathLike,
    model_dir: str | os.PathLike,
    chunk_size: int = CHUNK_SIZE,
    overwrite: bool = False,
    device: str | None = None,
    dtype: str | None = None,
    on_start: Callable[[int, int, list[str]], None] | None = None,
    progress: Callable[[int], None] | None = None,
    offload_weights: bool = False,
    resume: bool = False,
    checkpoint_every: float = CHECKPOINT_EVERY_S,
    on_note: Callable[[str], None] | None = None,
    allow_long_context: bool = False,
    follow_symlinks: bool = False,
    include: list[str] | tuple[str, ...] = (),
    exclude: list[str] | tuple[str, ...] = (),
    prefill_fn: Callable[..., tuple[torch.Tensor, PrefillStats]] | None = None,
    kv_dtype: str | None = None,
) -> tuple[Path, PrefillStats]:
    """Prefill documents with a model and write the cache directory atomically.

    Args:
        docs: a documents directory (every text file, recursively) or one text file.
        out: the cache directory to create.
        model_dir: local HF checkpoint directory.
        chunk_size: prefill chunk length in tokens.
        overwrite: replace an existing cache at `out` once the new one is complete (only a directory
            that is a topk cache and nothing else, or an empty one).
        device: "cuda", "cpu", ... (default: CUDA when available).
        dtype: "bf16" / "fp16" / "fp32" (default: bf16 on CUDA, fp32 on CPU).
        on_start: called as on_start(n_tokens, n_layers, skipped_files) before the heavy work.
        progress: called with the tokens processed by each chunk of each layer (on resume, first
            with all the tokens of the layers kept).
        offload_weights: keep the weights in CPU RAM and stream one layer at a time to the device
            (prefill an 8B model within a 16 GiB GPU budget).
        resume: continue the partial prefill an interrupted run of the same command left (its
            checkpointed layers are verified against their checksums and kept); without one, start over.
        checkpoint_every: seconds between resume checkpoints (each writes the N × hidden residual stream).
        on_note: called with one-line notes (resume, kept partial directory); default: TopkWarning.
        allow_long_context: prefill a context longer than the model's positions (with a warning) instead
            of refusing it before any model compute (`check_context_length`).
        follow_symlinks: also read links that leave the documents folder (`collect_documents`).
        include, exclude: gitignore-style patterns read despite the default skips and .gitignore, and
            never read (exclude wins); see `list_files`.
        prefill_fn: runs the layers, with `prefill_layers`' arguments (default: `prefill_layers`, this
            process alone; prefill/distributed_launch.py passes rank 0 of a group of processes).
        kv_dtype: "int8" stores the keys and values as int8 with per-channel key and per-token value scales
            (store/quant.py; half of bf16's bytes); None: in the model's dtype.
    Returns:
        the cache path and the prefill statistics.
    """
    if chunk_size <= 0:
        raise TopkError(f"--chunk-size must be positive, got {chunk_size}")
    out, model_dir = Path(out), Path(model_dir)
    check_output(out, overwrite)
    documents, skipped = collect_documents(docs, follow_symlinks=follow_symlinks, include=include, exclude=exclude)
    fingerprint = model_fingerprint(model_dir)
    tokenizer = load_tokenizer(model_dir)
    layout = layout_context(documents, tokenizer)
    shape = ModelShape.from_config(load_config(model_dir))
    n = len(layout.ids)
    check_context_length(n, shape.max_positions, allow_long_context)  # before the weights load
    dev = pick_device(device)
    weights_dtype = parse_dtype(dtype) or (torch.bfloat16 if dev.type == "cuda" else None)
    writer = CacheWriter(out, overwrite=overwrite, resume=resume, kv_dtype=kv_dtype)  # the lock: one prefill per --out
    warn_leftovers(out)
    try:
        model = load_model(model_dir, "cpu" if offload_weights else dev, weights_dtype)
        model_dtype = next(model.parameters()).dtype
        key = {
            "model": fingerprint,
            "n_tokens": n,
            "n_layers": shape.n_layers,
            "chunk_size": chunk_size,
            "tokens": hashlib.blake2b(np.asarray(layout.ids, dtype=np.int32).tobytes(), digest_size=16).hexdigest(),
            "dtype": dtype_name(model_dtype),
            "kv_dtype": writer.stored_dtype(model_dtype),
            "device": dev.type,
            "offload_weights": offload_weights,
        }
        start, hidden = 0, None
        if resume:
            start, hidden, why = writer.resume_point(key)
            if start:
                kept = "layer 0" if start == 1 else f"layers 0-{start - 1}"
                _say(on_note, f"resuming at layer {start} of {shape.n_layers}: {kept} verified and kept")
            elif writer.found_partial:
                _say(on_note, f"nothing to resume in {writer.tmp} ({why}): starting over")
            else:
                _say(on_note, f"no interrupted prefill of {out} to resume: starting over")
        stored = 1 if kv_dtype else model_dtype.itemsize  # int8: one byte, and the value scales 4 per token
        layer_bytes = 2 * shape.n_kv_heads * n * shape.head_dim * stored + (4 * shape.n_kv_heads * n if kv_dtype else 0)
        _check_space(out, (shape.n_layers - start) * layer_bytes + 4 * n + 4 * shape.vocab_size, on_note)
        if on_start is not None:
            on_start(n, shape.n_layers, skipped)
        if progress is not None and start:
            progress(n * start)
        # On CUDA, write_layer runs in prefill's drain thread (one layer at a time, in order, overlapped with
        # the next layer's compute); prefill_layers returns or raises only once it is done, so neither
        # commit() nor abort() below can race a write.
        last_logits, stats = (prefill_fn or prefill_layers)(
            model,
            layout.ids,
            writer.write_layer,
            chunk_size,
            progress,
            offload_weights=offload_weights,
            device=dev,
            start_layer=start,
            hidden=hidden,
            checkpoint_every=checkpoint_every,
            checkpoint=lambda next_layer, h: writer.checkpoint(key, next_layer, h),
        )
        writer.write_tokens(layout.ids)
        writer.write_array(LAST_LOGITS, last_logits.float())
        manifest = {
            "model": {
                "path": str(model_dir.resolve()),
                "fingerprint": fingerprint,
                "model_type": shape.model_type,
                "dtype": dtype_name(model_dtype),
            },
            "shape": {
                "n_layers": shape.n_layers,
                "n_heads": shape.n_heads,
                "n_kv_heads": shape.n_kv_heads,
                "head_dim": shape.head_dim,
                "vocab_size": shape.vocab_size,
            },
            "kv_dtype": writer.stored_dtype(model_dtype),
            "n_tokens": n,
            "documents": layout.documents,
            "skipped": skipped,
            "prompt": layout.prompt.to_dict(),
            "prefill": {
                "chunk_size": chunk_size,
                "device": str(dev),
                "seconds": round(stats.seconds, 3),
                "tokens_per_s": round(stats.tokens_per_s, 1),
                "peak_device_bytes": stats.peak_device_bytes,
                "resumed_at_layer": start,
                "ranks": stats.ranks,
            },
        }
        return writer.commit(manifest), stats
    except BaseException as e:
        disk = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)
        # A full disk needs its space back; any other failure (an interruption, SIGTERM, kill, a crash)
        # keeps a partial prefill that has a checkpoint, for --resume.
        if writer.abort(keep_resumable=not disk):
            n_kept = writer.resumable_layers
            _say(
                on_note,
                f"kept {n_kept} finished layer{'s' if n_kept > 1 else ''} in {writer.tmp}: run the same "
                f"command with --resume to continue (or delete that directory)",
            )
        if disk:
            raise TopkError(f"{unwritable(out, e)}; the partial cache was removed") from None
        raise
