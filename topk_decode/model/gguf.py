"""GGUF model files (llama.cpp, ollama) as `--model`: dequantized once into a cached HF checkpoint.

A GGUF file is checked cheaply first (magic, version, architecture, that its tensors fit in the file),
then transformers dequantizes it and we save an ordinary bf16 checkpoint directory in
`$XDG_CACHE_HOME/topk-decode/models/<sha256 of the file>` (default `~/.cache/...`; `$TOPK_CACHE_HOME/models`
when that is set). The directory is
written under a temporary name and renamed when complete, under a file lock, so two processes never
clash and an interrupted conversion never looks finished. The model fingerprint of a GGUF file (and of
its converted directory) is derived from the file's sha256.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from topk_decode.errors import TopkError

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
# general.architecture values we convert; each maps to a transformers model_type the decoder supports.
SUPPORTED_GGUF_ARCHS = ("llama", "qwen2", "mistral")
# Written last inside the converted directory: its presence means "complete", and it names the source.
MARKER = "topk_gguf_source.json"
_HASH_CHUNK = 1 << 24

Progress = Callable[[str], None]


@dataclass
class GGUFInfo:
    """What the header of a GGUF file says."""

    path: Path
    version: int
    architecture: str
    n_tensors: int
    size: int  # bytes on disk
    data_end: int  # byte offset where the last tensor ends (≤ size for a complete file)


def cache_root() -> Path:
    """Where converted checkpoints live: `$TOPK_CACHE_HOME/models` when set (topk-decode's cache folder,
    as for the random demo model), else `$XDG_CACHE_HOME/topk-decode/models` (default `~/.cache/...`)."""
    if os.environ.get("TOPK_CACHE_HOME"):
        return Path(os.environ["TOPK_CACHE_HOME"]) / "models"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "topk-decode" / "models"


def is_gguf_file(path: str | os.PathLike) -> bool:
    """True for a regular file named *.gguf or starting with the GGUF magic (ollama blobs have no suffix).

    Args:
        path: any path.
    """
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    try:
        with open(p, "rb") as fh:
            return fh.read(4) == GGUF_MAGIC
    except OSError:
        return False


def stderr_progress(message: str) -> None:
    """Default progress: a `note:` line on stderr (a conversion takes long enough to need saying)."""
    print(f"note: {message}", file=sys.stderr, flush=True)


def _require_packages() -> None:
    """transformers' GGUF loader needs `gguf` (the parser) and `accelerate` (its loading path)."""
    missing = []
    for name in ("gguf", "accelerate"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise TopkError(
            f"reading GGUF files needs the package(s) {' and '.join(missing)}: "
            f"pip install {' '.join(missing)}  (or pip install 'topk-decode[gguf]')"
        )


# GGUF metadata value types → byte size (8 = string, 9 = array are variable).
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


class _Header:
    """A bounds-checked little-endian reader over the header of a GGUF file (no tensor data is read)."""

    def __init__(self, fh, size: int) -> None:
        self.fh, self.size = fh, size

    def read(self, n: int) -> bytes:
        if n < 0 or self.fh.tell() + n > self.size:
            raise EOFError
        return self.fh.read(n)

    def u32(self) -> int:
        return struct.unpack("<I", self.read(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.read(8))[0]

    def string(self) -> str:
        return self.read(self.u64()).decode("utf-8", "replace")

    def skip(self, n: int) -> None:
        if n < 0 or self.fh.tell() + n > self.size:
            raise EOFError
        self.fh.seek(n, 1)

    def value(self, vtype: int):
        """Read one metadata value; arrays are skipped (None): only scalars and strings are needed."""
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item, count = self.u32(), self.u64()
            if item == _STRING:
                for _ in range(count):
                    self.skip(self.u64())
            elif item in _SCALAR_SIZES:
                self.skip(count * _SCALAR_SIZES[item])
            else:
                raise ValueError(f"unknown array item type {item}")
            return None
        if vtype not in _SCALAR_SIZES:
            raise ValueError(f"unknown metadata value type {vtype}")
        raw = self.read(_SCALAR_SIZES[vtype])
        return int.from_bytes(raw, "little") if vtype in (0, 2, 4, 10) else raw


_INSPECTED: dict[tuple, GGUFInfo] = {}


def inspect_gguf(path: str | os.PathLike) -> GGUFInfo:
    """Check a GGUF file without loading it: magic, version, architecture, and that no tensor runs past EOF.

    Only the header is parsed (the tokenizer's vocabulary arrays are skipped), so this is fast even
    for a multi-GB file; the result is remembered per (path, size, mtime) within the process.

    Args:
        path: the GGUF file.
    Raises:
        TopkError: one line naming what is wrong (missing, not GGUF, truncated, unsupported architecture).
    """
    p = Path(path)
    if not p.is_file():
        raise TopkError(f"GGUF file not found: {p}")
    st = p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    if key in _INSPECTED:
        return _INSPECTED[key]
    size = st.st_size
    with open(p, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8 or head[:4] != GGUF_MAGIC:
            raise TopkError(f"not a GGUF file (bad magic {head[:4]!r}, expected b'GGUF'): {p}")
        version = struct.unpack("<I", head[4:8])[0]
        if version not in GGUF_VERSIONS:
            raise TopkError(f"unsupported GGUF version {version} in {p} (supported: {GGUF_VERSIONS})")
        _require_packages()
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        h = _Header(fh, size)
        try:
            n_tensors, n_kv = h.u64(), h.u64()
            meta = {}
            for _ in range(n_kv):
                name = h.string()
                meta[name] = h.value(h.u32())
            tensors = []  # (type, n_elements, offset)
            for _ in range(n_tensors):
                h.string()
                dims = [h.u64() for _ in range(h.u32())]
                ttype, offset = h.u32(), h.u64()
                n_el = 1
                for d in dims:
                    n_el *= d
                tensors.append((ttype, n_el, offset))
        except EOFError:
            raise TopkError(f"truncated GGUF file {p} ({size} bytes): its header runs past the end") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise TopkError(f"corrupt GGUF file {p}: {e}") from None
        header_end = fh.tell()
    align = meta.get("general.alignment") or 32
    if not isinstance(align, int) or align & (align - 1):
        raise TopkError(f"corrupt GGUF file {p}: bad general.alignment {align!r}")
    data_start = header_end + (-header_end % align)
    data_end = data_start
    for ttype, n_el, offset in tensors:
        try:
            block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        except (ValueError, KeyError):
            raise TopkError(f"corrupt GGUF file {p}: unknown tensor type {ttype}") from None
        data_end = max(data_end, data_start + offset + n_el * type_bytes // block)
    if data_end > size:
        raise TopkError(f"truncated GGUF file {p}: its tensors end at byte {data_end} but the file has {size}")
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise TopkError(f"GGUF file {p} has no general.architecture field")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise TopkError(f"unsupported GGUF architecture {arch!r} in {p} (supported: {', '.join(SUPPORTED_GGUF_ARCHS)})")
    info = GGUFInfo(path=p, version=version, architecture=arch, n_tensors=len(tensors), size=size, data_end=data_end)
    _INSPECTED[key] = info
    return info


def _memo_file(p: Path) -> Path:
    """Where the sha256 of `p` is remembered, keyed by its absolute path, size, mtime and inode."""
    st = p.stat()
    key = f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
    return cache_root() / ".sha256" / hashlib.sha256(key.encode()).hexdigest()[:32]


def gguf_sha256(path: str | os.PathLike) -> str:
    """The sha256 hex digest of a file, remembered per (path, size, mtime) so a 1 GB file is hashed once.

    Args:
        path: the GGUF file.
    """
    p = Path(path)
    memo = _memo_file(p)
    if memo.is_file():
        text = memo.read_text().strip()
        if len(text) == 64:
            return text
    h = hashlib.sha256()
    with open(p, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    with contextlib.suppress(OSError):  # a read-only cache only costs a re-hash next time
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}")
        tmp.write_text(digest)
        os.replace(tmp, memo)
    return digest


def gguf_fingerprint(path: str | os.PathLike) -> str:
    """The fingerprint a cache records for a GGUF model: the first 16 hex digits of its sha256.

    Args:
        path: the GGUF file.
    """
    inspect_gguf(path)
    return gguf_sha256(path)[:16]


def converted_source(model_dir: str | os.PathLike) -> dict | None:
    """The marker of a directory this module converted from a GGUF file (None for any other directory).

    Args:
        model_dir: a checkpoint directory.
    """
    marker = Path(model_dir) / MARKER
    if not marker.is_file():
        return None
    try:
        return json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return None


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """An exclusive advisory lock (POSIX flock); elsewhere the atomic rename alone guards the result."""
    try:
        import fcntl
    except ImportError:  # Windows: no flock; a racing converter only wastes work
        yield
        return
    with open(lock_path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def converted_dir(path: str | os.PathLike, progress: Progress | None = stderr_progress) -> Path:
    """The HF checkpoint directory of a GGUF file, converting it first if no complete one is cached.

    Args:
        path: the GGUF file.
        progress: called with one line per conversion stage (None: silent).
    Returns:
        `cache_root()/<sha256>`, holding config.json, model.safetensors (bf16), the tokenizer and MARKER.
    """
    src = Path(path)
    info = inspect_gguf(src)
    say = progress or (lambda _m: None)
    digest = gguf_sha256(src)
    root = cache_root()
    final = root / digest
    if converted_source(final) is not None:
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TopkError(f"cannot create the model cache {root}: {e.strerror} (set XDG_CACHE_HOME)") from None
    with _locked(root / f"{digest}.lock"):
        if converted_source(final) is not None:  # another process finished it while we waited
            return final
        # Under the lock nobody else converts this file: partial directories are leftovers of killed runs.
        for stale in root.glob(f".{digest}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = root / f".{digest}.partial-{os.getpid()}"
        say(
            f"converting {src.name} ({info.architecture}, {info.size / 2**20:.0f} MiB) to a bf16 checkpoint "
            f"once, into {final}"
        )
        t0 = time.perf_counter()
        try:
            _convert(src, tmp, say)
            (tmp / MARKER).write_text(
                json.dumps(
                    {
                        "source": str(src.resolve()),
                        "sha256": digest,
                        "architecture": info.architecture,
                        "bytes": info.size,
                    },
                    indent=1,
                )
            )
            if final.exists():  # an incomplete directory (no marker) left by hand or an old crash
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        say(f"converted {src.name} in {time.perf_counter() - t0:.0f} s")
    return final


def _convert(src: Path, out: Path, say: Progress) -> None:
    """Dequantize `src` with transformers and save a plain bf16 checkpoint + tokenizer into `out`.

    The GGUF-loaded model refuses `save_pretrained` (it carries a quantization config), so its weights
    move into a fresh model built from the same config; the shapes must match exactly, which also proves
    the state dict holds dequantized matrices rather than packed blocks.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    # transformers' own "de-quantizing" bar is the progress of the longest stage; show it on terminals.
    if sys.stderr.isatty():
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    try:
        say("reading the tokenizer")
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name, local_files_only=True)
        say("dequantizing the weights")
        loaded = AutoModelForCausalLM.from_pretrained(
            src.parent, gguf_file=src.name, dtype=torch.bfloat16, local_files_only=True
        )
    except Exception as e:  # transformers raises many types (ValueError, KeyError, RuntimeError, ...)
        msg = " ".join(str(e).split())
        if "accelerate" in msg.lower():
            raise TopkError("reading GGUF files needs the package accelerate: pip install accelerate") from None
        if "not supported" in msg.lower() or "architecture" in msg.lower():
            raise TopkError(f"transformers cannot read {src.name}: {msg[:300]}") from None
        raise TopkError(f"could not dequantize GGUF file {src}: {msg[:300] or type(e).__name__}") from None
    finally:
        hf_logging.disable_progress_bar()
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = loaded.state_dict()
    packed = [k for k, v in state.items() if not torch.is_floating_point(v)]
    if packed:
        raise TopkError(
            f"transformers kept {src.name}'s weights packed ({packed[0]}, ...); "
            f"cannot save a dequantized checkpoint with this transformers version"
        )
    try:
        missing, unexpected = fresh.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise TopkError(f"dequantized weights of {src.name} do not fit the model: {str(e).splitlines()[0]}") from None
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise TopkError(
            f"dequantized weights of {src.name} do not match the model: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}"
        )
    fresh.tie_weights()
    fresh.generation_config = loaded.generation_config
    del loaded, state
    say("saving")
    try:
        out.mkdir(parents=True)
        fresh.save_pretrained(out)
        tok.save_pretrained(out)
    except OSError as e:  # disk full, permissions: the caller removes the partial directory
        raise TopkError(f"could not write the converted model to {out.parent}: {e.strerror or e}") from None
