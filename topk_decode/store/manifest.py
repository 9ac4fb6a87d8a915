"""The manifest's schema, its own checksum, and the test "is this directory one of our caches?".

A manifest is trusted only after `validate_manifest`: every field the reader uses has the right type,
every file the shapes imply is listed in `files` with exactly the size the shapes give (an emptied
`files` table cannot switch the checks off), and — from format 2 on — the manifest's checksum over
its canonical JSON matches.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from topk_decode.errors import TopkError
from topk_decode.store.format import (
    FORMAT_MARKER,
    KV_DTYPES,
    KV_FILE,
    LAST_LOGITS,
    MANIFEST,
    QUANTIZED,
    READABLE_VERSIONS,
    TOKENS,
    TOP_LEVEL,
    itemsize,
    key_scales_file,
    keys_file,
    value_scales_file,
    values_file,
)

CHECKSUM_FIELD = "manifest_blake2b"


def manifest_checksum(manifest: dict) -> str:
    """blake2b-128 of the manifest's canonical JSON (sorted keys, no spaces), its checksum field left out."""
    body = {k: v for k, v in manifest.items() if k != CHECKSUM_FIELD}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _is_int(x, lo: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= lo


def expected_sizes(manifest: dict) -> dict[str, int]:
    """Byte size of every file the manifest's shapes imply (keys/values Hkv·N·D·itemsize, tokens 4·N)."""
    shape, n = manifest["shape"], manifest["n_tokens"]
    item = itemsize(manifest["kv_dtype"])
    layer_bytes = shape["n_kv_heads"] * n * shape["head_dim"] * item
    sizes = {TOKENS: 4 * n}
    for layer in range(shape["n_layers"]):
        sizes[keys_file(layer)] = sizes[values_file(layer)] = layer_bytes
        if manifest["kv_dtype"] == QUANTIZED:  # float32 scales: keys per channel, values per token
            sizes[key_scales_file(layer)] = 4 * shape["n_kv_heads"] * shape["head_dim"]
            sizes[value_scales_file(layer)] = 4 * shape["n_kv_heads"] * n
    if LAST_LOGITS in manifest["files"] and _is_int(shape.get("vocab_size"), 1):
        sizes[LAST_LOGITS] = 4 * shape["vocab_size"]
    return sizes


def validate_manifest(manifest, where: Path) -> dict:
    """Check a parsed manifest against the schema; raise TopkError("corrupted cache manifest ...") if not.

    Args:
        manifest: what json.loads returned.
        where: the manifest file (for the message).
    Returns:
        the manifest.
    """

    def bad(why: str) -> TopkError:
        return TopkError(f"corrupted cache manifest {where}: {why}")

    if not isinstance(manifest, dict):
        raise bad("not a JSON object")
    version = manifest.get("format_version")
    if manifest.get("format") != FORMAT_MARKER and version != 1:  # format 1 had no marker (is_topk_cache)
        raise TopkError(
            f"{where.parent} is not a topk cache: its {MANIFEST} has no topk format marker (another "
            f"program's file?); point at a directory written by `topk prefill`"
        )
    if version not in READABLE_VERSIONS:
        raise TopkError(
            f"{where.parent} has cache format {version!r}, this version reads "
            f"{', '.join(map(str, READABLE_VERSIONS))}: prefill it again"
        )
    for key in ("shape", "kv_dtype", "n_tokens", "files", "model"):
        if key not in manifest:
            raise bad(f"missing {key!r}")
    if version >= 2:
        if manifest.get("format") != FORMAT_MARKER:
            raise bad(f"format marker is {manifest.get('format')!r}, expected {FORMAT_MARKER!r}")
        if manifest.get(CHECKSUM_FIELD) != manifest_checksum(manifest):
            raise bad("its checksum does not match its content (edited or damaged)")
    shape, files = manifest["shape"], manifest["files"]
    if not isinstance(shape, dict) or not isinstance(manifest["model"], dict):
        raise bad("'shape' and 'model' must be objects")
    for key in ("n_layers", "n_kv_heads", "head_dim"):
        if not _is_int(shape.get(key), 1):
            raise bad(f"shape.{key} must be a positive integer, got {shape.get(key)!r}")
    for key, lo in (("n_heads", 1), ("vocab_size", 0)):
        if key in shape and not _is_int(shape[key], lo):
            raise bad(f"shape.{key} must be an integer ≥ {lo}, got {shape[key]!r}")
    if not _is_int(manifest["n_tokens"], 1):
        raise bad(f"n_tokens must be a positive integer, got {manifest['n_tokens']!r}")
    if manifest["kv_dtype"] not in KV_DTYPES:
        raise bad(f"unknown kv_dtype {manifest['kv_dtype']!r}")
    if not isinstance(files, dict):
        raise bad("'files' must be an object")
    for rel, meta in files.items():
        if (
            not isinstance(meta, dict)
            or not _is_int(meta.get("bytes"))
            or not isinstance(meta.get("blake2b"), str)
            or len(meta["blake2b"]) != 32
        ):
            raise bad(f"files[{rel!r}] must hold an integer 'bytes' and a 32-hex 'blake2b'")
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise bad(f"file name {rel!r} points outside the cache")
    for rel, size in expected_sizes(manifest).items():
        if rel not in files:
            raise bad(f"{rel} is not listed in 'files'")
        if files[rel]["bytes"] != size:
            raise bad(f"{rel} is listed with {files[rel]['bytes']} bytes, the shapes give {size}")
    docs = manifest.get("documents", [])
    if not isinstance(docs, list) or not all(
        isinstance(d, dict) and _is_int(d.get("start")) and _is_int(d.get("end")) and isinstance(d.get("name"), str)
        for d in docs
    ):
        raise bad("'documents' must be a list of {name, start, end}")
    for d in docs:  # "places" (where a document's pages, slides ... start) is optional: older caches lack it
        places = d.get("places", [])
        if not isinstance(places, list) or not all(
            isinstance(p, dict) and _is_int(p.get("start")) and isinstance(p.get("label"), str) for p in places
        ):
            raise bad(f"the places of document {d['name']!r} must be a list of {{label, start}}")
    return manifest


def is_topk_cache(path: Path) -> tuple[bool, str]:
    """Whether `path` is a directory that holds one of our caches and nothing else.

    Only such a directory may be replaced by `--overwrite`: a readable manifest with our format
    marker (format 1 had none: its version and fields stand in for it), and only our names inside —
    the top-level files, kv/keys|values.NNN.bin, and index/NAME/ strategy directories of plain files.

    Returns:
        (True, "") or (False, the reason in a few words).
    """
    mf = path / MANIFEST
    try:
        manifest = json.loads(mf.read_text())
    except (OSError, ValueError):
        return False, f"it has no readable {MANIFEST} of a topk cache"
    if not isinstance(manifest, dict):
        return False, f"its {MANIFEST} is not a topk cache manifest"
    v1 = manifest.get("format_version") == 1 and all(k in manifest for k in ("shape", "files", "model", "kv_dtype"))
    if manifest.get("format") != FORMAT_MARKER and not v1:
        return False, f"its {MANIFEST} is not a topk cache manifest"
    for entry in path.iterdir():
        if entry.name not in TOP_LEVEL:
            return False, f"it holds {entry.name!r}, which a topk cache never contains"
        if entry.name in ("kv", "index") and (entry.is_symlink() or not entry.is_dir()):
            return False, f"its {entry.name!r} is not a directory"
        if entry.name not in ("kv", "index") and (entry.is_symlink() or not entry.is_file()):
            return False, f"its {entry.name!r} is not a plain file"
    for entry in (path / "kv").iterdir() if (path / "kv").is_dir() else ():
        if not KV_FILE.fullmatch(entry.name) or entry.is_symlink() or not entry.is_file():
            return False, f"it holds kv/{entry.name}, which a topk cache never contains"
    for strategy in (path / "index").iterdir() if (path / "index").is_dir() else ():
        if strategy.is_symlink() or not strategy.is_dir():
            return False, f"it holds index/{strategy.name}, which is not a strategy directory"
        for entry in strategy.iterdir():
            if entry.is_symlink() or not entry.is_file():
                return False, f"it holds index/{strategy.name}/{entry.name}, which is not a plain file"
    return True, ""


__all__ = ["CHECKSUM_FIELD", "manifest_checksum", "expected_sizes", "validate_manifest", "is_topk_cache"]
