"""Concurrency of cache writers and readers (docs/DESIGN.md "Cache format" says what is guaranteed).

- Writers: one prefill per `--out` at a time. A writer holds an exclusive `flock` on `.NAME.lock`
  beside the cache from before it creates its partial directory until after its commit; a second
  writer fails at once with a clear error. The kernel drops the lock when a process dies (kill -9
  included), so a stale lock never blocks anyone.
- Commit: the finished partial directory and the old cache are swapped with one atomic
  `renameat2(RENAME_EXCHANGE)` (two renames where the kernel lacks it), so the path always names a
  complete cache.
- Readers open the cache *directory* once and read everything relative to that descriptor (openat),
  holding a shared `flock` on it while they open: a commit during an open cannot mix the old manifest
  with the new files, and the writer deletes the old cache only once no reader is still opening it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import stat
from pathlib import Path

from topk_decode.errors import TopkError
from topk_decode.store.format import MANIFEST, lock_path

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def unwritable(path: Path, e: OSError) -> TopkError:
    """The one-line error for a cache location the OS refuses to write (read-only, no permission, full)."""
    why = e.strerror or str(e)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return TopkError(f"no space left on the device to write {path} ({why})")
    if (path / MANIFEST).is_file():
        # An existing cache (`--append`, or `--overwrite` of it): a new `--out` is no answer to "change this one".
        fix = (
            "remount it read-write"
            if e.errno == errno.EROFS
            else f"give yourself write permission on it and on {path.parent} (e.g. chmod u+w)"
        )
        return TopkError(
            f"the cache at {path} is read-only ({why}): {fix}, or work on a copy of it in a writable directory"
        )
    return TopkError(f"cannot write the cache at {path}: {why} (choose an --out in a writable directory)")


class WriterLock:
    """Exclusive, non-blocking lock of cache `out` for one writer (a flock on `.NAME.lock` beside it).

    Args:
        out: the cache directory (need not exist yet; its parent is created).
    """

    def __init__(self, out: Path) -> None:
        self.path = lock_path(out)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise unwritable(out, e) from None
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise unwritable(out, e) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise TopkError(
                    f"another prefill (pid {holder}) is writing {out}; wait for it to finish or choose another --out"
                ) from None
            # The holder before us unlinks the file before unlocking it: a lock taken on an unlinked
            # file protects nothing, so try again on the file now at the path.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.fd = fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)  # for the message above only

    def release(self) -> None:
        """Remove the lock file, then drop the lock (a writer waiting on the old file retries, see above)."""
        if self.fd >= 0:
            try:
                self.path.unlink()
            except OSError:
                pass
            os.close(self.fd)
            self.fd = -1


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux renameat2 RENAME_EXCHANGE); False when unsupported."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def lock_dir(path: Path, shared: bool) -> int | None:
    """Open a directory and flock it (shared for readers, exclusive for the writer removing it).

    Returns:
        the directory descriptor (close it to unlock), or None when `path` is not a directory.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
    except OSError:
        pass  # a filesystem without flock (some network mounts): the atomic swap still holds
    return fd


class PinnedDir:
    """A cache directory opened once: every read goes through its descriptor, never the path again.

    Args:
        path: the directory.
    Use as a context manager (the shared lock is held until it exits).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = lock_dir(path, shared=True)
        if self.fd is None:
            raise TopkError(f"cache not found: {path}")

    def __enter__(self) -> PinnedDir:
        return self

    def __exit__(self, *exc) -> bool:
        os.close(self.fd)
        return False

    def open(self, rel: str, mode: str = "rb"):
        """A file object for `rel` inside the pinned directory."""
        return open(rel, mode, opener=lambda p, flags: os.open(p, flags | os.O_CLOEXEC, dir_fd=self.fd))

    def size(self, rel: str) -> int | None:
        """Size of a regular file `rel`, or None when it is missing or not a file."""
        try:
            st = os.stat(rel, dir_fd=self.fd)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def emptied(self) -> bool:
        """True when the directory was removed (a commit deleted the old cache) since it was pinned."""
        return os.stat(self.fd).st_nlink == 0


__all__ = ["WriterLock", "PinnedDir", "exchange", "lock_dir", "unwritable"]
