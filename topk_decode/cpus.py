"""How many CPUs this process may use: the one count every thread pool and thread setting is sized from.

`os.cpu_count()` counts the host's CPUs, not the ones this process may run on: under `taskset` (an
affinity mask) or in a container with a CPU quota, pools sized from it oversubscribe the CPUs they get.
`TOPK_THREADS` (the CLI's `--threads`) overrides the count. No torch here: the CLI reads it before
importing torch or numba.
"""

from __future__ import annotations

import os
from pathlib import Path

from topk_decode.errors import TopkError

THREADS_ENV = "TOPK_THREADS"
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def threads_override() -> int | None:
    """TOPK_THREADS as a positive integer, None where unset or empty; TopkError for anything else."""
    text = os.environ.get(THREADS_ENV, "").strip()
    if not text:
        return None
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise TopkError(f"{THREADS_ENV} must be a positive integer (threads for searches and torch ops), got {text!r}")
    return n


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _quota_in(d: Path) -> int | None:
    """The CPUs a cgroup directory's quota allows, rounded up (v2 `cpu.max`, v1 `cpu.cfs_quota_us`), None: no quota."""
    v2 = _read(d / "cpu.max")  # "max 100000" (none) or "200000 100000"
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        pair = (quota, period or "100000")
    else:
        quota = _read(d / "cpu.cfs_quota_us")  # -1: none
        pair = (quota, _read(d / "cpu.cfs_period_us") or "100000") if quota is not None else None
    if pair is None or pair[0] == "max":
        return None
    try:
        q, p = int(pair[0]), int(pair[1])
    except ValueError:
        return None
    return max(1, -(-q // p)) if q > 0 and p > 0 else None


def _cgroup_dirs(root: Path, proc: Path) -> list[Path]:
    """The process's cgroup directories (v2, and v1's cpu controller) and their ancestors below `root`."""
    bases = [root, root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"]
    rels = {""}
    for line in (_read(proc) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and (parts[1] == "" or "cpu" in parts[1].split(",")):
            rels.add(parts[2].strip("/"))
    dirs = []
    for base in bases:
        for rel in rels:
            d = base / rel if rel else base
            # In a container the path names the host's hierarchy: only the levels that exist here count.
            while True:
                if d.is_dir() and d not in dirs:
                    dirs.append(d)
                if d == base:
                    break
                d = d.parent
    return dirs


def cgroup_cpus(root: Path = CGROUP_ROOT, proc: Path = PROC_CGROUP) -> int | None:
    """CPUs the process's cgroup CPU quota allows (the tightest level, rounded up, at least 1), None: no quota.

    Args:
        root: where the cgroup file systems are mounted; proc: the process's /proc/<pid>/cgroup.
    """
    quotas = [q for d in _cgroup_dirs(root, proc) if (q := _quota_in(d)) is not None]
    return min(quotas) if quotas else None


def usable_cpus(root: Path = CGROUP_ROOT, proc: Path = PROC_CGROUP) -> int:
    """Threads for this process's CPU work: TOPK_THREADS if set, else the CPUs in its affinity mask capped
    by its cgroup CPU quota (else os.cpu_count()), at least 1.

    Args:
        root, proc: as for `cgroup_cpus` (tests point them at fake files).
    """
    n = threads_override()
    if n is not None:
        return n
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        n = os.cpu_count() or 1
    quota = cgroup_cpus(root, proc)
    return max(1, min(n, quota) if quota is not None else n)
