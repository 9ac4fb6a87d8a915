"""Thread counts follow the CPUs the process may use (affinity mask, cgroup quota) or TOPK_THREADS / --threads."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from topk_decode import cpus
from topk_decode.errors import TopkError


@pytest.fixture
def host(monkeypatch, tmp_path):
    """A fake host: 8 CPUs in the affinity mask, no TOPK_THREADS, and an empty cgroup tree in tmp_path.

    Returns a function writing `relative path → text` files under the tree (and /proc/self/cgroup as "proc").
    """
    monkeypatch.delenv(cpus.THREADS_ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    root, proc = tmp_path / "cgroup", tmp_path / "proc_cgroup"
    root.mkdir()
    monkeypatch.setattr(cpus, "CGROUP_ROOT", root)
    monkeypatch.setattr(cpus, "PROC_CGROUP", proc)

    def write(files: dict[str, str]) -> None:
        for rel, text in files.items():
            path = proc if rel == "proc" else root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)

    return write


def usable() -> int:
    return cpus.usable_cpus(cpus.CGROUP_ROOT, cpus.PROC_CGROUP)


def test_the_count_is_the_affinity_mask_not_the_host(host, monkeypatch):
    assert usable() == 8
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)  # taskset -c 3
    assert usable() == 1


@pytest.mark.parametrize(
    "files,want",
    [
        ({"cpu.max": "max 100000\n"}, 8),  # v2, no quota
        ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 CPUs: rounded up
        ({"cpu.max": "30000 100000\n"}, 1),  # under one CPU: at least 1
        ({"cpu.max": "2000000 100000\n"}, 8),  # a quota above the mask: the mask
        ({"proc": "0::/box/job\n", "box/cpu.max": "300000 100000\n", "box/job/cpu.max": "max 100000\n"}, 3),
        ({"proc": "0::/box/job\n", "box/job/cpu.max": "400000 100000\n"}, 4),  # the process's own cgroup
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, 8),  # v1, no quota
        ({"cpu/cpu.cfs_quota_us": "250000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),  # v1
        (
            {
                "proc": "4:cpu,cpuacct:/docker/abc\n",
                "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "200000\n",
                "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
            },
            2,
        ),
        ({"cpu.max": "garbage\n"}, 8),  # unreadable: ignored
    ],
)
def test_a_cgroup_cpu_quota_caps_the_count(host, files, want):
    host(files)
    assert usable() == want


def test_topk_threads_overrides_the_mask_and_the_quota(host, monkeypatch):
    host({"cpu.max": "100000 100000\n"})
    assert usable() == 1
    monkeypatch.setenv("TOPK_THREADS", "5")
    assert usable() == 5
    monkeypatch.setenv("TOPK_THREADS", " ")  # empty: as unset
    assert usable() == 1


@pytest.mark.parametrize("value", ["0", "-2", "abc", "1.5", "2 threads"])
def test_a_bad_topk_threads_is_a_one_line_error_naming_it(monkeypatch, value):
    monkeypatch.setenv("TOPK_THREADS", value)
    with pytest.raises(TopkError, match="TOPK_THREADS must be a positive integer") as err:
        cpus.usable_cpus()
    assert "\n" not in str(err.value) and repr(value) in str(err.value)


@pytest.mark.parametrize("command", ["chat", "serve", "bench", "eval"])
def test_the_cli_rejects_a_bad_topk_threads_or_threads_before_loading_anything(monkeypatch, tmp_path, command):
    from test_cli import assert_one_line_error, topk

    args = [tmp_path / "no-cache"] if command in ("chat", "serve") else []
    monkeypatch.setenv("TOPK_THREADS", "many")
    assert_one_line_error(topk(command, *args), "TOPK_THREADS must be a positive integer", "'many'")
    monkeypatch.setenv("TOPK_THREADS", "2")
    assert_one_line_error(topk(command, *args, "--threads", "0"), "--threads must be a positive integer")


def test_threads_option_sets_the_knob_and_numba_and_openmp_pools_before_they_load(monkeypatch):
    from topk_decode.cli.common import use_threads

    monkeypatch.setenv("TOPK_THREADS", "7")  # restored after the test, as use_threads sets it
    for var in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS"):
        # set, then delete: monkeypatch records an absent variable only this way, so the value use_threads
        # writes is removed afterwards (a leaked NUMBA_NUM_THREADS breaks numba's next compile in this process)
        monkeypatch.setenv(var, "1")
        monkeypatch.delenv(var)
    monkeypatch.delitem(sys.modules, "numba", raising=False)  # as in a fresh `topk` process
    assert use_threads(3) == 3
    assert os.environ["TOPK_THREADS"] == "3" and os.environ["NUMBA_NUM_THREADS"] == "3"
    assert "OMP_NUM_THREADS" not in os.environ  # torch is loaded here: its runtime read it already
    monkeypatch.setenv("NUMBA_NUM_THREADS", "2")  # the user's own setting is kept
    assert use_threads(None) == 3 and os.environ["NUMBA_NUM_THREADS"] == "2"


def test_a_store_opened_with_topk_threads_1_searches_on_one_thread(built_cache, monkeypatch):
    import torch

    from topk_decode.api import KVStore

    cache, _ = built_cache
    monkeypatch.setenv("TOPK_THREADS", "1")
    earlier = set(threading.enumerate())
    seen = []
    with KVStore.open(cache, k=8, strategy="flat", strategy_options={"backend": "faiss"}, device="cpu") as store:
        strat = store.decoder.strategy
        assert strat.threads == 1 and strat.pool.threads == 1
        select = strat.select

        def watched(*args, **kwargs):
            seen.append(torch.get_num_threads())  # the step's torch threads, inside the search
            return select(*args, **kwargs)

        monkeypatch.setattr(strat, "select", watched)
        store.generate_ids([5, 6, 7], max_new_tokens=3)
        new = [t for t in threading.enumerate() if t.name.startswith("topk-heads") and t not in earlier]
    assert seen and set(seen) == {1}
    assert not new, "one thread: the heads are searched in the caller's thread"


def test_the_numba_search_runs_on_as_many_threads_as_topk_threads(monkeypatch):
    torch = pytest.importorskip("torch")
    import numba

    from topk_decode.bench.synthetic import kv_in_memory
    from topk_decode.index.flat import FlatStrategy
    from topk_decode.kernels import flat_scan

    keys = torch.randn(2, 1500, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    ckv = kv_in_memory([keys], [keys], list(range(1500)), "llama")
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(1)).bfloat16().float()
    scan, seen = flat_scan.scan_par, []

    def watched(*args):
        seen.append(numba.get_num_threads())
        return scan(*args)

    monkeypatch.setattr(flat_scan, "scan_par", watched)
    for value, want in (("1", 1), (None, min(cpus.usable_cpus(), numba.config.NUMBA_NUM_THREADS))):
        if value is None:
            monkeypatch.delenv("TOPK_THREADS", raising=False)
        else:
            monkeypatch.setenv("TOPK_THREADS", value)
        strat = FlatStrategy(ckv, 0, 1500, {"backend": "numba"})
        strat.prepare()
        seen.clear()
        strat.select(0, q, 30)
        strat.close()
        assert seen and set(seen) == {want}, (value, seen)
