"""Writing a cache directory atomically and opening it as memory-mapped tensors.

A cache is only a cache once `manifest.json` exists: the writer fills the hidden sibling directory
`.NAME.partial`, writes the manifest last, then swaps the directory into place in one atomic rename.
An interrupted prefill leaves at most that partial directory, which never opens as a cache (and
which `--resume` continues, see resume.py). Writers hold a lock; readers pin the directory they
open (see locking.py): docs/DESIGN.md "Cache format" states the guarantees.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for annotations: imported where used, so start-up needs neither
    import numpy as np
    import torch

from topk_decode.errors import TopkError
from topk_decode.store.format import (
    FORMAT_MARKER,
    FORMAT_VERSION,
    MANIFEST,
    QUANTIZED,
    TOKENS,
    as_torch,
    blake2_stream,
    check_kv_dtype,
    dtype_name,
    key_scales_file,
    keys_file,
    numpy_storage,
    partial_path,
    value_scales_file,
    values_file,
)
from topk_decode.store.locking import PinnedDir, WriterLock, exchange, lock_dir, unwritable
from topk_decode.store.manifest import CHECKSUM_FIELD, is_topk_cache, manifest_checksum, validate_manifest
from topk_decode.store.resume import checkpoint_layers, drop_checkpoint, load_checkpoint, save_checkpoint

# Full checksums are verified at open up to this total size; above it, sizes only (hashing 100+ GiB
# at every open would take minutes). `topk info --verify` always hashes everything.
VERIFY_LIMIT_BYTES = 2 << 30


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse to write over anything the user made, and over a cache unless told to.

    `--overwrite` replaces only an empty directory or a directory that is one of our caches and holds
    nothing else (see `is_topk_cache`); anything else is refused, untouched.
    """
    if out.is_symlink():
        raise TopkError(f"{out} is a symbolic link; pass the directory it points to as --out")
    if out.exists() and not out.is_dir():
        raise TopkError(f"{out} exists and is not a directory")
    if out.exists() and not overwrite:
        raise TopkError(f"{out} already exists (use --overwrite to replace it)")
    try:
        non_empty = out.exists() and any(out.iterdir())
        ok, why = is_topk_cache(out) if non_empty else (True, "")
    except OSError as e:
        raise TopkError(f"cannot inspect {out} ({e.strerror}); refusing to replace it") from None
    if non_empty and not ok:
        raise TopkError(f"{out} is not a topk cache ({why}); refusing to replace it with --overwrite")


class CacheWriter:
    """Writes one cache directory; nothing is visible at `out` until `commit()`.

    Holds the writer lock of `out` from construction to `commit()` / `abort()`: a second writer of the
    same `out` fails at once with TopkError.

    Args:
        out: the final cache directory.
        overwrite: replace an existing cache at `out` (only once the new one is complete).
        resume: keep a partial directory left by an interrupted prefill of `out` (see `resume_point`);
            without it, a partial directory holding a checkpoint is refused, one without is removed.
        kv_dtype: "int8" stores each layer's keys and values as int8 with their scales (store/quant.py);
            None stores them as given.
    """

    def __init__(
        self, out: str | os.PathLike, overwrite: bool = False, resume: bool = False, kv_dtype: str | None = None
    ) -> None:
        self.out = Path(out)
        self.overwrite = overwrite
        check_kv_dtype(kv_dtype)
        self.kv_dtype = kv_dtype
        self.lock = WriterLock(self.out)
        try:
            check_output(self.out, overwrite)
            self.tmp = partial_path(self.out)
            self.resumed_from = 0
            self.found_partial = self.tmp.exists()
            if self.tmp.exists():
                kept = checkpoint_layers(self.tmp)
                if kept and not resume:
                    raise TopkError(
                        f"an interrupted prefill of {self.out} left {kept} finished layer(s) in "
                        f"{self.tmp}: continue it with --resume, or delete that directory"
                    )
                if not kept:
                    shutil.rmtree(self.tmp)  # nothing to resume: we hold the lock, nobody writes it
            (self.tmp / "kv").mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self.lock.release()
            raise unwritable(self.out, e) from None
        except BaseException:
            self.lock.release()
            raise
        self.files: dict[str, dict] = {}

    def resume_point(self, key: dict) -> tuple[int, torch.Tensor | None, str]:
        """Where a prefill with this key can continue in the partial directory.

        Args:
            key: what the prefill's numbers depend on (model, tokens, chunk size, dtype, device kind).
        Returns:
            (first layer to compute, residual stream entering it or None, why nothing was kept or "").
        """
        layer, files, hidden, why = load_checkpoint(self.tmp, key)
        if layer == 0:  # nothing usable: start from an empty partial directory
            shutil.rmtree(self.tmp)
            (self.tmp / "kv").mkdir(parents=True)
        self.files.update(files)
        self.resumed_from = layer
        return layer, hidden, why

    def checkpoint(self, key: dict, next_layer: int, hidden: torch.Tensor) -> None:
        """Record a resume point: layers below `next_layer` are written; `hidden` (N, C) enters it."""
        save_checkpoint(self.tmp, key, next_layer, self.files, hidden)

    def write_array(self, rel: str, tensor: torch.Tensor) -> None:
        """Write a tensor's raw bytes (C order) to `rel` inside the cache and record size and checksum."""
        # numpy and torch are imported here, not at the top: `topk info` and error paths start without them.
        import numpy as np
        import torch

        t = tensor.detach().contiguous().cpu()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        path = self.tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        arr = t.numpy()
        with open(path, "wb") as f:
            _write_hook(rel, f, arr)
        h = hashlib.blake2b(arr.reshape(-1).view(np.uint8).data, digest_size=16).hexdigest()  # no copy
        self.files[rel] = {"bytes": path.stat().st_size, "blake2b": h}

    def write_layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write one layer's keys and values, each (Hkv, N, D) (int8 with their scales where the writer's
        `kv_dtype` says so)."""
        if self.kv_dtype == QUANTIZED:
            from topk_decode.store.quant import quantize_keys, quantize_values

            (keys, key_scales), (values, value_scales) = quantize_keys(keys), quantize_values(values)
            self.write_array(key_scales_file(layer), key_scales)
            self.write_array(value_scales_file(layer), value_scales)
        self.write_array(keys_file(layer), keys)
        self.write_array(values_file(layer), values)

    def stored_dtype(self, dtype: torch.dtype) -> str:
        """The manifest's `kv_dtype` of a cache whose layers this writer writes from `dtype` tensors."""
        return self.kv_dtype or dtype_name(dtype)

    def write_tokens(self, ids: list[int]) -> None:
        """Write the context token ids as int32."""
        import torch

        self.write_array(TOKENS, torch.tensor(ids, dtype=torch.int32))

    def commit(self, manifest: dict) -> Path:
        """Write the manifest last and swap the finished cache into place (one atomic rename)."""
        self.finish(manifest)
        return self.swap()

    def finish(self, manifest: dict) -> Path:
        """Write the manifest last: the partial directory is then a complete cache (still hidden, not yet at
        `out`), which may be opened to build strategy artifacts in it before `swap()` (`topk prefill --append`)."""
        manifest = dict(
            manifest,
            format=FORMAT_MARKER,
            format_version=FORMAT_VERSION,
            files=self.files,
            created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        )
        manifest[CHECKSUM_FIELD] = manifest_checksum(manifest)
        validate_manifest(manifest, self.tmp / MANIFEST)  # never commit what a reader would refuse
        drop_checkpoint(self.tmp)
        tmp_manifest = self.tmp / (MANIFEST + ".tmp")
        with open(tmp_manifest, "w") as f:
            f.write(json.dumps(manifest, indent=2))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_manifest, self.tmp / MANIFEST)
        return self.tmp

    def swap(self) -> Path:
        """Put the finished cache (`finish`) at `out` in one atomic rename; an old cache there is deleted."""
        check_output(self.out, self.overwrite)  # the user may have put something there meanwhile
        if self.out.exists() and exchange(self.tmp, self.out):
            # self.tmp now names the old cache: delete it once no reader is still opening it.
            fd = lock_dir(self.tmp, shared=False)
            shutil.rmtree(self.tmp, ignore_errors=True)
            if fd is not None:
                os.close(fd)
        elif self.out.exists():  # no RENAME_EXCHANGE: two renames
            old = self.out.with_name(f".{self.out.name}.old-{os.getpid()}")
            os.replace(self.out, old)
            os.replace(self.tmp, self.out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.tmp, self.out)
        self.lock.release()
        return self.out

    @property
    def resumable_layers(self) -> int:
        """Finished layers a `--resume` would keep from the partial directory (0: nothing to resume)."""
        return checkpoint_layers(self.tmp) if self.tmp.exists() else 0

    def abort(self, keep_resumable: bool = False) -> bool:
        """Give up: remove the partial directory, or keep it when it holds a checkpoint and `keep_resumable`.

        The existing cache at `out`, if any, is untouched. Returns True when the partial directory was kept.
        """
        kept = keep_resumable and self.resumable_layers > 0
        if not kept:
            shutil.rmtree(self.tmp, ignore_errors=True)
        self.lock.release()
        return kept


def _write_hook(rel: str, f, arr: np.ndarray) -> None:
    """Write `arr` to `f`. Two test hooks stand in for a pre-empted machine: TOPK_TEST_WRITE_DELAY_S
    slows every write (time to send a signal), TOPK_TEST_DIE_WRITING=REL kills the process (SIGKILL)
    half-way through writing REL (a kill -9 mid-layer)."""
    import numpy as np

    if os.environ.get("TOPK_TEST_WRITE_DELAY_S"):
        time.sleep(float(os.environ["TOPK_TEST_WRITE_DELAY_S"]))
    if os.environ.get("TOPK_TEST_DIE_WRITING") == rel:
        import signal

        f.write(arr.reshape(-1).view(np.uint8)[: arr.nbytes // 2].tobytes())
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    # Not arr.tofile: on a full disk numpy raises an OSError without errno ("N requested and M written").
    f.write(arr.reshape(-1).view(np.uint8).data)


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
    cache_id: str = ""  # blake2b of the manifest file: strategy artifacts record it (built for this cache)
    # int8 caches (store/quant.py): per layer (Hkv, D) key scales and (Hkv, N) value scales, float32; else None
    key_scales: list[torch.Tensor] | None = field(default=None, repr=False)
    value_scales: list[torch.Tensor] | None = field(default=None, repr=False)

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

    @property
    def quantized(self) -> bool:
        """Whether keys and values are stored as int8 with scales (store/quant.py)."""
        return self.key_scales is not None

    def search_queries(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """(Hkv, Q, D) float32 queries as a strategy scores them against this cache's stored keys: scaled by an int8
        cache's key scales (their dot products with the int8 keys are the dequantised keys' scores), else q."""
        if self.key_scales is None:
            return q
        from topk_decode.store.quant import scaled_queries

        return scaled_queries(q, self.key_scales[layer])

    def kv_rows(self, layer: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of positions `idx` (M,) of one layer, (Hkv, M, D) each, dequantised to float32 from
        an int8 cache, else in the stored dtype (the decoder's window copies the sinks and tail this way)."""
        k, v = self.keys[layer].index_select(1, idx), self.values[layer].index_select(1, idx)
        if self.key_scales is None:
            return k, v
        from topk_decode.store.quant import dequantize_keys, dequantize_values

        vs = self.value_scales[layer].index_select(1, idx)
        return dequantize_keys(k, self.key_scales[layer]), dequantize_values(v, vs)

    def nbytes(self) -> int:
        """Bytes of all stored files."""
        return sum(f["bytes"] for f in self.manifest["files"].values())


def _load_manifest(d: PinnedDir) -> tuple[dict, str]:
    """Read, parse and validate the manifest of a pinned cache directory; also its blake2b (the cache id)."""
    where = d.path / MANIFEST
    if d.size(MANIFEST) is None:
        raise TopkError(f"{d.path} is not a topk cache (no {MANIFEST}; an interrupted prefill?)")
    try:
        with d.open(MANIFEST) as f:
            raw = f.read()
        manifest = json.loads(raw)
    except (OSError, ValueError) as e:
        raise TopkError(f"corrupted cache manifest {where}: {e}") from None
    return validate_manifest(manifest, where), hashlib.blake2b(raw, digest_size=16).hexdigest()


def _pinned(path: Path) -> PinnedDir:
    """Pin the cache directory at `path`, retrying when a commit removed the one we pinned."""
    if not path.is_dir():
        partial = partial_path(path)
        hint = (
            f" (an interrupted prefill left {partial}: continue it with `topk prefill ... --out {path} --resume`)"
            if partial.is_dir()
            else ""
        )
        raise TopkError(f"cache not found: {path}{hint}")
    for _ in range(5):
        d = PinnedDir(path)
        if not d.emptied() or not path.is_dir():
            return d
        d.__exit__()  # an old cache, deleted by a commit after we pinned it: pin the new one
    return PinnedDir(path)


def read_manifest(path: str | os.PathLike) -> dict:
    """Read and validate the manifest of a cache directory (no array is touched)."""
    with _pinned(Path(path)) as d:
        return _load_manifest(d)[0]


def verify_files(d: PinnedDir | Path, manifest: dict, full: bool | None = None) -> int:
    """Check every recorded file's size, and its checksum when `full` (default: caches ≤ 2 GiB).

    Args:
        d: the pinned cache directory (or its path).
        manifest: the validated manifest (its `files` table covers every file the shapes imply).
        full: hash every file (True), sizes only (False), or hash only caches ≤ 2 GiB (None).
    Returns:
        the number of files hashed.
    """
    if isinstance(d, Path):
        with _pinned(d) as pinned:
            return verify_files(pinned, manifest, full)
    files = manifest["files"]
    total = sum(f["bytes"] for f in files.values())
    if full is None:
        full = total <= VERIFY_LIMIT_BYTES
    for rel, meta in files.items():
        p = d.path / rel
        size = d.size(rel)
        if size is None:
            raise TopkError(f"corrupted cache: missing file {p}")
        if size != meta["bytes"]:
            raise TopkError(f"corrupted cache: {p} has {size} bytes, expected {meta['bytes']} (truncated?)")
    if full:
        for rel, meta in files.items():
            with d.open(rel) as f:
                if blake2_stream(f) != meta["blake2b"]:
                    raise TopkError(f"corrupted cache: checksum mismatch in {d.path / rel}")
    return len(files) if full else 0


def check_cache(path: str | os.PathLike, full: bool = False) -> tuple[dict, str, int]:
    """Validate a cache without mapping it (`topk info`): manifest schema and checksum, file sizes, and
    with `full` every file's checksum.

    Returns:
        (manifest, cache id, number of files hashed).
    """
    with _pinned(Path(path)) as d:
        manifest, cache_id = _load_manifest(d)
        return manifest, cache_id, verify_files(d, manifest, full)


def open_cache(path: str | os.PathLike, verify: bool | None = None) -> ContextKV:
    """Open a cache directory: validate it, then memory-map tokens, keys and values (no copy).

    Everything is read through one pinned directory descriptor, so a prefill committing over this
    cache meanwhile yields the old cache or the new one, never a mix.

    Args:
        path: the cache directory.
        verify: hash every file (True), check sizes only (False), or hash only caches ≤ 2 GiB (None).
    """
    import numpy as np

    path = Path(path)
    with _pinned(path) as d:
        manifest, cache_id = _load_manifest(d)
        verify_files(d, manifest, verify)
        shape = manifest["shape"]
        n, hkv, hd = manifest["n_tokens"], shape["n_kv_heads"], shape["head_dim"]
        name = manifest["kv_dtype"]
        storage = numpy_storage(name)

        def mmap(rel: str) -> torch.Tensor:
            with d.open(rel) as f:  # the map outlives the file object
                arr = np.memmap(f, dtype=storage, mode="r", shape=(hkv, n, hd))
            return as_torch(arr, name)

        with d.open(TOKENS) as f:
            tokens = np.fromfile(f, dtype=np.int32).tolist()
        keys = [mmap(keys_file(layer)) for layer in range(shape["n_layers"])]
        values = [mmap(values_file(layer)) for layer in range(shape["n_layers"])]
        key_scales = value_scales = None
        if name == QUANTIZED:  # small: read into RAM
            import torch

            def scales(rel: str, rows: int) -> torch.Tensor:
                with d.open(rel) as f:
                    return torch.from_numpy(np.fromfile(f, dtype=np.float32).reshape(hkv, rows))

            key_scales = [scales(key_scales_file(layer), hd) for layer in range(shape["n_layers"])]
            value_scales = [scales(value_scales_file(layer), n) for layer in range(shape["n_layers"])]
    return ContextKV(
        path=path,
        manifest=manifest,
        tokens=tokens,
        keys=keys,
        values=values,
        cache_id=cache_id,
        key_scales=key_scales,
        value_scales=value_scales,
    )


__all__ = [
    "check_output",
    "CacheWriter",
    "ContextKV",
    "open_cache",
    "check_cache",
    "read_manifest",
    "verify_files",
    "dtype_name",
]
