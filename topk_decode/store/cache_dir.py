"""Writing a cache directory atomically and opening it as memory-mapped tensors.

A cache is only a cache once `manifest.json` exists: the writer fills a hidden sibling directory,
writes the manifest last, then renames the directory into place. An interrupted prefill therefore
leaves only a `.CACHE.partial-*` directory behind, which never opens as a cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from topk_decode.errors import TopkError
from topk_decode.store.format import (
    FORMAT_VERSION,
    MANIFEST,
    TOKENS,
    as_torch,
    dtype_name,
    keys_file,
    numpy_storage,
    values_file,
)

# Full checksums are verified at open up to this total size; above it, sizes only (hashing 100+ GiB
# at every open would take minutes). `topk info --verify` always hashes everything.
VERIFY_LIMIT_BYTES = 2 << 30


def _blake2(path: Path) -> str:
    """blake2b-128 of a whole file, read in 8 MiB blocks."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse to write over anything the user made, and over a cache unless told to."""
    if out.exists() and not out.is_dir():
        raise TopkError(f"{out} exists and is not a directory")
    if out.exists() and not overwrite:
        raise TopkError(f"{out} already exists (use --overwrite to replace it)")
    if out.exists() and any(out.iterdir()) and not (out / MANIFEST).exists():
        # Never delete a non-empty directory that is not one of our caches.
        raise TopkError(f"{out} is a non-empty directory that is not a topk cache; refusing to replace it")


class CacheWriter:
    """Writes one cache directory; nothing is visible at `out` until `commit()`.

    Args:
        out: the final cache directory.
        overwrite: replace an existing cache at `out` (only once the new one is complete).
    """

    def __init__(self, out: str | os.PathLike, overwrite: bool = False) -> None:
        self.out = Path(out)
        check_output(self.out, overwrite)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.partial-", dir=self.out.parent))
        (self.tmp / "kv").mkdir()
        self.files: dict[str, dict] = {}

    def write_array(self, rel: str, tensor: torch.Tensor) -> None:
        """Write a tensor's raw bytes (C order) to `rel` inside the cache and record size and checksum."""
        t = tensor.detach().contiguous().cpu()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        path = self.tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        arr = t.numpy()
        with open(path, "wb") as f:
            arr.tofile(f)
        h = hashlib.blake2b(arr.reshape(-1).view(np.uint8).data, digest_size=16).hexdigest()  # no copy
        self.files[rel] = {"bytes": path.stat().st_size, "blake2b": h}

    def write_layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write one layer's keys and values, each (Hkv, N, D)."""
        self.write_array(keys_file(layer), keys)
        self.write_array(values_file(layer), values)

    def write_tokens(self, ids: list[int]) -> None:
        """Write the context token ids as int32."""
        self.write_array(TOKENS, torch.tensor(ids, dtype=torch.int32))

    def commit(self, manifest: dict) -> Path:
        """Write the manifest last and move the finished cache into place."""
        manifest = dict(manifest, format_version=FORMAT_VERSION, files=self.files,
                        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        tmp_manifest = self.tmp / (MANIFEST + ".tmp")
        tmp_manifest.write_text(json.dumps(manifest, indent=2))
        os.replace(tmp_manifest, self.tmp / MANIFEST)
        old = None
        if self.out.exists():
            old = self.out.with_name(f".{self.out.name}.old-{os.getpid()}")
            os.replace(self.out, old)
        os.replace(self.tmp, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.out

    def abort(self) -> None:
        """Remove the partial directory (the existing cache, if any, is untouched)."""
        shutil.rmtree(self.tmp, ignore_errors=True)


@dataclass
class ContextKV:
    """An opened cache: manifest plus zero-copy CPU tensors of the context KV.

    keys[l], values[l]: (Hkv, N, D) tensors memory-mapped from disk, in the stored dtype.
    """

    path: Path
    manifest: dict
    tokens: list[int]
    keys: list[torch.Tensor] = field(repr=False)
    values: list[torch.Tensor] = field(repr=False)

    @property
    def n_tokens(self) -> int:
        """Number of context tokens N."""
        return len(self.tokens)

    @property
    def n_layers(self) -> int:
        return self.manifest["shape"]["n_layers"]

    @property
    def n_kv_heads(self) -> int:
        return self.manifest["shape"]["n_kv_heads"]

    @property
    def head_dim(self) -> int:
        return self.manifest["shape"]["head_dim"]

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    def nbytes(self) -> int:
        """Bytes of all stored files."""
        return sum(f["bytes"] for f in self.manifest["files"].values())


def read_manifest(path: str | os.PathLike) -> dict:
    """Read and check the manifest of a cache directory (no array is touched)."""
    path = Path(path)
    if not path.is_dir():
        raise TopkError(f"cache not found: {path}")
    mf = path / MANIFEST
    if not mf.is_file():
        raise TopkError(f"{path} is not a topk cache (no {MANIFEST}; an interrupted prefill?)")
    try:
        manifest = json.loads(mf.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TopkError(f"corrupted cache manifest {mf}: {e}") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise TopkError(f"{path} has cache format {manifest.get('format_version')}, this version reads {FORMAT_VERSION}")
    for key in ("shape", "kv_dtype", "n_tokens", "files", "model"):
        if key not in manifest:
            raise TopkError(f"corrupted cache manifest {mf}: missing {key!r}")
    return manifest


def verify_files(path: Path, manifest: dict, full: bool | None = None) -> None:
    """Check every recorded file's size, and its checksum when `full` (default: small caches only)."""
    files = manifest["files"]
    total = sum(f["bytes"] for f in files.values())
    if full is None:
        full = total <= VERIFY_LIMIT_BYTES
    for rel, meta in files.items():
        p = path / rel
        if not p.is_file():
            raise TopkError(f"corrupted cache: missing file {p}")
        size = p.stat().st_size
        if size != meta["bytes"]:
            raise TopkError(f"corrupted cache: {p} has {size} bytes, expected {meta['bytes']} (truncated?)")
        if full and _blake2(p) != meta["blake2b"]:
            raise TopkError(f"corrupted cache: checksum mismatch in {p}")


def open_cache(path: str | os.PathLike, verify: bool | None = None) -> ContextKV:
    """Open a cache directory: validate it, then memory-map tokens, keys and values (no copy).

    Args:
        path: the cache directory.
        verify: hash every file (True), check sizes only (False), or hash only caches ≤ 2 GiB (None).
    """
    path = Path(path)
    manifest = read_manifest(path)
    verify_files(path, manifest, verify)
    shape = manifest["shape"]
    n, hkv, d = manifest["n_tokens"], shape["n_kv_heads"], shape["head_dim"]
    name = manifest["kv_dtype"]
    storage = numpy_storage(name)

    def mmap(rel: str) -> torch.Tensor:
        arr = np.memmap(path / rel, dtype=storage, mode="r", shape=(hkv, n, d))
        return as_torch(arr, name)

    tokens = np.fromfile(path / TOKENS, dtype=np.int32).tolist()
    if len(tokens) != n:
        raise TopkError(f"corrupted cache: {path / TOKENS} holds {len(tokens)} tokens, manifest says {n}")
    keys = [mmap(keys_file(layer)) for layer in range(shape["n_layers"])]
    values = [mmap(values_file(layer)) for layer in range(shape["n_layers"])]
    return ContextKV(path=path, manifest=manifest, tokens=tokens, keys=keys, values=values)


__all__ = ["check_output", "CacheWriter", "ContextKV", "open_cache", "read_manifest", "verify_files", "dtype_name"]
