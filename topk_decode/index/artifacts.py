"""Strategy artifacts in a cache: `index/NAME/`, completed by a checksummed `done.json` written last.

Every strategy that keeps files (ivf, hnsw, quest, duo, ...) uses these helpers:

    d = start_artifacts(ckv.path, name)            # create the directory, drop a stale done.json
    ... write files into d ...
    write_done(d, files, {"options": opts}, ckv.cache_id)
    ...
    built = ensure_artifacts(ckv, name, wanted, build)   # at open: lock, build unless it matches, verify

`done.json` = {"version": 1, "cache_id": blake2b of the cache's manifest.json the artifacts were built
from, "meta": {...strategy's own record, e.g. build options...}, "files": {file name: {"bytes",
"blake2b"}}}. It is written atomically (temporary file + rename) after every file it lists, so a
directory without it is an unfinished build. A done.json without "files" (written by format-1
versions) counts as not built: the artifacts are rebuilt.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from topk_decode.errors import TopkError
from topk_decode.store.format import blake2_file

DONE = "done.json"
DONE_VERSION = 1
# Artifacts are hashed on load up to this total size (sizes are always checked); `topk info --verify`
# hashes all. Same rule as the cache's own files (store/cache_dir.py).
VERIFY_LIMIT_BYTES = 2 << 30


def artifact_dir(cache: str | os.PathLike, name: str) -> Path:
    """Where strategy `name` keeps its files inside a cache directory."""
    return Path(cache) / "index" / name


@contextmanager
def build_lock(cache: str | os.PathLike, name: str) -> Iterator[None]:
    """Hold an exclusive flock on strategy `name`'s directory: two processes opening a cache whose
    artifacts are missing build them once, the second waits and then finds them done.

    Not re-entrant (flock is per open file): take it once, around "check, build if needed, load".
    Where the directory cannot be created (a read-only cache) it yields without a lock: nothing can
    be built there, and the build's own error says so.
    """
    d = artifact_dir(cache, name)
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass  # no flock on this filesystem: builds may then race, done.json still checks them
        yield
    finally:
        os.close(fd)


@contextmanager
def writing(d: Path, name: str) -> Iterator[None]:
    """Around a build of strategy `name`'s artifacts in `d`: when it fails (a full disk, Ctrl-C, a crash)
    the files written so far are removed, so a failed build gives its space back (the directory stays,
    empty, without done.json: not built). An OS error becomes one TopkError line."""
    try:
        yield
    except BaseException as e:
        remove_contents(d)
        if isinstance(e, OSError):
            raise TopkError(
                f"cannot write the {name} artifacts into {d} ({e.strerror or e}); the partial files "
                f"were removed; free some space or build them where the cache is writable: "
                f"topk prefill ... --strategy {name}"
            ) from None
        raise


def remove_contents(d: Path) -> None:
    """Delete everything inside `d`, keeping `d` itself (build_lock's flock is held on it)."""
    import shutil

    try:
        entries = list(os.scandir(d))
    except OSError:
        return
    for e in entries:
        try:
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path, ignore_errors=True)
            else:
                os.unlink(e.path)
        except OSError:
            pass  # best effort: what stays has no done.json, so it never counts as built


def write_file(path: Path, data) -> None:
    """Write a bytes-like object to an artifact file (file.write, unlike numpy's tofile, keeps a full
    disk's errno)."""
    with open(path, "wb") as f:
        f.write(data)


def start_artifacts(cache: str | os.PathLike, name: str) -> Path:
    """Create (or reuse) strategy `name`'s directory, removing a stale `done.json` before files are rewritten.

    Args:
        cache: the cache directory.
        name: strategy name.
    Returns:
        the artifact directory.
    """
    d = artifact_dir(cache, name)
    try:
        d.mkdir(parents=True, exist_ok=True)
        (d / DONE).unlink(missing_ok=True)
    except OSError as e:
        raise TopkError(
            f"cannot write the {name} index into {d} ({e.strerror}); build it where the cache "
            f"is writable: topk prefill ... --strategy {name}"
        ) from None
    return d


def write_done(d: Path, files: list[Path], meta: dict, cache_id: str = "") -> None:
    """Mark the artifacts in `d` complete: record each file's size and blake2b, atomically, last.

    Args:
        d: the artifact directory.
        files: the artifact files (inside `d`), all already written.
        meta: the strategy's own record (e.g. {"options": build options}).
        cache_id: `ContextKV.cache_id` of the cache they were built from.
    """
    table = {}
    for p in files:
        p = Path(p)
        try:
            rel = p.relative_to(d).as_posix()  # a path under d, as given (relative caches too)
        except ValueError:
            rel = p.as_posix()  # a name already relative to d
        table[rel] = {"bytes": (d / rel).stat().st_size, "blake2b": blake2_file(d / rel)}
    tmp = d / (DONE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"version": DONE_VERSION, "cache_id": cache_id, "meta": meta, "files": table}, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, d / DONE)


def read_done(d: Path) -> dict | None:
    """The parsed `done.json` of `d` when it has this version's structure, else None (not built)."""
    try:
        done = json.loads((d / DONE).read_text())
    except (OSError, ValueError):
        return None
    ok = (
        isinstance(done, dict)
        and done.get("version") == DONE_VERSION
        and isinstance(done.get("meta"), dict)
        and isinstance(done.get("files"), dict)
        and all(
            isinstance(f, dict) and isinstance(f.get("bytes"), int) and isinstance(f.get("blake2b"), str)
            for f in done["files"].values()
        )
    )
    return done if ok else None


def verify_done(d: Path, full: bool | None = None) -> dict:
    """Check every artifact file `done.json` lists: size always, blake2b when `full`.

    Args:
        d: the artifact directory.
        full: hash every file (True), sizes only (False), or hash up to 2 GiB in total (None).
    Returns:
        the recorded meta.
    Raises:
        TopkError("corrupted cache: ...") naming the first file that does not match.
    """
    done = read_done(d)
    if done is None:
        raise TopkError(f"corrupted cache: {d / DONE} is missing or unreadable (delete {d} to rebuild)")
    files = done["files"]
    if full is None:
        full = sum(f["bytes"] for f in files.values()) <= VERIFY_LIMIT_BYTES
    for rel, rec in files.items():
        p = d / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts or not p.is_file():
            raise TopkError(f"corrupted cache: missing file {p} (delete {d} to rebuild)")
        if p.stat().st_size != rec["bytes"]:
            raise TopkError(
                f"corrupted cache: {p} has {p.stat().st_size} bytes, expected {rec['bytes']} "
                f"(truncated?; delete {d} to rebuild)"
            )
        if full and blake2_file(p) != rec["blake2b"]:
            raise TopkError(f"corrupted cache: checksum mismatch in {p} (delete {d} to rebuild)")
    return done["meta"]


def artifacts_complete(cache: str | os.PathLike, name: str) -> bool:
    """True when strategy `name` finished writing its artifacts in this cache (a valid done.json)."""
    return read_done(artifact_dir(cache, name)) is not None


def recorded_options(cache: str | os.PathLike, name: str) -> dict | None:
    """The build options recorded in `done.json` of strategy `name`, or None when not (fully) built."""
    done = read_done(artifact_dir(cache, name))
    return None if done is None else dict(done["meta"].get("options", {}))


def artifacts_match(cache: str | os.PathLike, name: str, wanted: dict, cache_id: str = "") -> bool:
    """True when the artifacts exist, were built from this cache, with every option asked for explicitly.

    Args:
        cache: the cache directory.
        name: strategy name.
        wanted: build options the user passed (options left at their default are not compared, so a
            cache built at prefill with e.g. nlist=4096 opens without repeating it).
        cache_id: the opened cache's id; artifacts recorded for another cache (one replaced by a
            prefill meanwhile) do not match. "" skips the comparison.
    """
    done = read_done(artifact_dir(cache, name))
    if done is None or (cache_id and done.get("cache_id") != cache_id):
        return False
    rec = done["meta"].get("options", {})
    return all(rec.get(key) == value for key, value in wanted.items())


def ensure_artifacts(ckv, name: str, wanted: dict, build: Callable[[], None]) -> dict:
    """Open-time check of strategy `name`'s artifacts; returns the build options recorded in done.json.

    Under the build lock (one process builds, the others wait), `build()` runs unless the artifacts
    exist, were built from this cache and with every option in `wanted`; then every file is verified
    (sizes always, checksums up to 2 GiB: a truncated or overwritten file is "corrupted cache", not a
    crash in the strategy's reader).

    Args:
        ckv: the opened cache (its `path` and `cache_id`).
        name: strategy name.
        wanted: build options the user passed explicitly (`artifacts_match`).
        build: writes the artifacts (the strategy's `build_artifacts` with its options).
    """
    with build_lock(ckv.path, name):
        if not artifacts_match(ckv.path, name, wanted, ckv.cache_id):
            build()
        verify_done(artifact_dir(ckv.path, name))
        return recorded_options(ckv.path, name)


__all__ = [
    "DONE",
    "ensure_artifacts",
    "artifact_dir",
    "build_lock",
    "writing",
    "remove_contents",
    "write_file",
    "start_artifacts",
    "write_done",
    "read_done",
    "verify_done",
    "artifacts_complete",
    "recorded_options",
    "artifacts_match",
]
