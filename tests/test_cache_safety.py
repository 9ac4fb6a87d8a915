"""A cache directory under a hostile or careless user: --overwrite, concurrent writers and readers, a
damaged manifest or strategy artifact, a full or read-only disk (SIGTERM, kill -9, --resume: test_resume.py)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from test_cli import assert_one_line_error, snapshot, topk

from topk_decode.errors import TopkError
from topk_decode.store.cache_dir import CacheWriter, open_cache
from topk_decode.store.format import MANIFEST, partial_path
from topk_decode.store.manifest import CHECKSUM_FIELD, manifest_checksum

REPO = Path(__file__).resolve().parents[1]


def _python_m(*args: object, env: dict | None = None, **kwargs) -> subprocess.Popen:
    """`python -m topk_decode ARGS` in a subprocess, on this worktree's code."""
    full_env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    full_env.pop("TOPK_DEBUG", None)
    return subprocess.Popen(
        [sys.executable, "-m", "topk_decode", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        cwd=REPO,
        **kwargs,
    )


def _small_cache(out: Path, tag: str, n: int = 300, overwrite: bool = False, seed: int = 0) -> Path:
    """A model-free cache of 2 layers × 2 KV heads × n tokens (D = 8); `tag` names its one document."""
    gen = torch.Generator().manual_seed(seed)
    w = CacheWriter(out, overwrite=overwrite)
    for layer in range(2):
        w.write_layer(layer, torch.randn(2, n, 8, generator=gen), torch.randn(2, n, 8, generator=gen))
    w.write_tokens([3 + i % 50 for i in range(n)])
    return w.commit(
        {
            "model": {"path": "none", "fingerprint": "none"},
            "kv_dtype": "float32",
            "n_tokens": n,
            "shape": {"n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8},
            "documents": [{"name": tag, "start": 0, "end": n}],
        }
    )


def _rewrite_manifest(cache: Path, edit, fix_checksum: bool) -> None:
    m = json.loads((cache / MANIFEST).read_text())
    edit(m)
    if fix_checksum:
        m[CHECKSUM_FIELD] = manifest_checksum(m)
    (cache / MANIFEST).write_text(json.dumps(m))


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory) -> Path:
    """A tiny random Llama with 5 layers (room to be killed mid-way and resumed)."""
    from transformers import AutoTokenizer

    from topk_decode.model.tiny import make_random_model, make_tokenizer

    d = tmp_path_factory.mktemp("deep-model")
    make_tokenizer(d)
    make_random_model(d, "llama", seed=3, tokenizer=AutoTokenizer.from_pretrained(d), num_hidden_layers=5)
    return d


# ---- 2: --overwrite replaces only a topk cache ------------------------------------------------------
def test_overwrite_refuses_a_user_directory_that_merely_has_a_manifest_json(tmp_path, docs_dir, deep_model):
    p = tmp_path / "p"
    (p / "src").mkdir(parents=True)
    (p / "manifest.json").write_text('{"name":"app"}\n')
    (p / "src" / "main.py").write_text("code\n")
    before = snapshot(p)
    result = topk("prefill", docs_dir, "--out", p, "--overwrite", "--model", deep_model, "--device", "cpu")
    assert_one_line_error(result, "is not a topk cache", "refusing to replace it")
    assert snapshot(p) == before


def test_overwrite_refuses_a_cache_that_holds_a_file_of_the_user(tmp_path, docs_dir, deep_model):
    cache = _small_cache(tmp_path / "cache", "old")
    (cache / "kv" / "my-notes.txt").write_text("mine\n")
    before = snapshot(cache)
    result = topk("prefill", docs_dir, "--out", cache, "--overwrite", "--model", deep_model, "--device", "cpu")
    assert_one_line_error(result, "my-notes.txt", "refusing to replace it")
    assert snapshot(cache) == before


def test_overwrite_replaces_a_real_cache(tmp_path):
    cache = _small_cache(tmp_path / "cache", "old")
    _small_cache(cache, "new", overwrite=True, seed=1)
    assert open_cache(cache, verify=True).manifest["documents"][0]["name"] == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]  # no lock, partial or old copy left


# ---- 4: concurrent writers and readers --------------------------------------------------------------
def test_a_second_writer_of_the_same_out_fails_and_the_first_commits(tmp_path):
    out = tmp_path / "cache"
    first = CacheWriter(out)
    with pytest.raises(TopkError, match=r"another prefill \(pid \d+\) is writing"):
        CacheWriter(out)
    first.write_layer(0, torch.zeros(1, 4, 2), torch.zeros(1, 4, 2))
    first.write_tokens([1, 2, 3, 4])
    first.commit(
        {"model": {}, "kv_dtype": "float32", "n_tokens": 4, "shape": {"n_layers": 1, "n_kv_heads": 1, "head_dim": 2}}
    )
    assert open_cache(out, verify=True).n_tokens == 4
    _small_cache(out, "again", overwrite=True)  # the lock was released by the commit


def test_a_prefill_while_another_process_writes_the_same_out_fails_clearly(tmp_path, docs_dir, deep_model):
    out = tmp_path / "cache"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from topk_decode.store.cache_dir import "
            f"CacheWriter; w = CacheWriter({str(out)!r}); print('locked', flush=True); "
            "time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        result = topk("prefill", docs_dir, "--out", out, "--model", deep_model, "--device", "cpu")
        assert_one_line_error(result, f"another prefill (pid {holder.pid}) is writing")
        assert "left over" not in result.stderr  # a live writer's partial is not "left over"
        assert partial_path(out).is_dir() and not out.exists()  # the other writer's work is untouched
    finally:
        holder.kill()  # kill -9: the kernel releases its lock
        holder.wait()
    result = topk("prefill", docs_dir, "--out", out, "--model", deep_model, "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert open_cache(out, verify=True).n_tokens > 0


def test_a_reader_opening_during_a_commit_sees_the_old_cache_or_the_new_never_a_mix(tmp_path, monkeypatch):
    from topk_decode.store import cache_dir

    cache = _small_cache(tmp_path / "cache", "old", seed=0)
    old_keys = torch.from_numpy(__import__("numpy").fromfile(cache / "kv" / "keys.001.bin", dtype="float32"))
    real_verify = cache_dir.verify_files
    committer: list[threading.Thread] = []

    def verify_then_let_a_commit_land(d, manifest, full=None):
        # Between reading the manifest and mapping the files, another prefill commits over the cache.
        t = threading.Thread(target=_small_cache, args=(cache, "new"), kwargs={"overwrite": True, "seed": 1})
        t.start()
        committer.append(t)
        deadline = time.monotonic() + 20
        while json.loads((cache / MANIFEST).read_text())["documents"][0]["name"] != "new":
            assert time.monotonic() < deadline, "the commit did not happen"
            time.sleep(0.01)
        return real_verify(d, manifest, full)

    monkeypatch.setattr(cache_dir, "verify_files", verify_then_let_a_commit_land)
    ckv = open_cache(cache, verify=False)
    committer[0].join(timeout=20)
    assert ckv.manifest["documents"][0]["name"] == "old"
    assert torch.equal(ckv.keys[1].reshape(-1), old_keys)  # the old files, not the new ones
    monkeypatch.setattr(cache_dir, "verify_files", real_verify)
    assert open_cache(cache, verify=True).manifest["documents"][0]["name"] == "new"


def test_readers_racing_many_commits_always_see_one_whole_cache(tmp_path):
    """Stress: a writer thread commits 25 caches (every key of cache i equals i) while a reader opens
    in a loop; each open must pair cache i's manifest with cache i's files."""
    cache = tmp_path / "cache"

    def commit(i: int, overwrite: bool) -> None:
        w = CacheWriter(cache, overwrite=overwrite)
        for layer in range(2):
            w.write_layer(layer, torch.full((2, 64, 8), float(i)), torch.full((2, 64, 8), float(i)))
        w.write_tokens([i] * 64)
        w.commit(
            {
                "model": {},
                "kv_dtype": "float32",
                "n_tokens": 64,
                "shape": {"n_layers": 2, "n_kv_heads": 2, "head_dim": 8},
                "documents": [{"name": str(i), "start": 0, "end": 64}],
            }
        )

    commit(0, overwrite=False)
    done = threading.Event()

    def writer() -> None:
        try:
            for i in range(1, 26):
                commit(i, overwrite=True)
        finally:
            done.set()

    t = threading.Thread(target=writer)
    t.start()
    opened = 0
    while not done.is_set() or opened == 0:
        ckv = open_cache(cache, verify=False)
        i = int(ckv.manifest["documents"][0]["name"])
        assert ckv.tokens == [i] * 64
        assert float(ckv.keys[1][1, 63, 7]) == i and float(ckv.values[0][0, 0, 0]) == i
        opened += 1
    t.join()
    assert opened > 0 and int(open_cache(cache).manifest["documents"][0]["name"]) == 25


# ---- 5: the manifest and every artifact are verified -----------------------------------------------
@pytest.mark.parametrize("fix_checksum", [False, True], ids=["edited", "edited-with-new-checksum"])
def test_an_emptied_files_table_is_refused(tmp_path, fix_checksum):
    cache = _small_cache(tmp_path / "cache", "x")
    _rewrite_manifest(cache, lambda m: m.update(files={}), fix_checksum)
    why = "is not listed in 'files'" if fix_checksum else "checksum does not match"
    with pytest.raises(TopkError, match=why):
        open_cache(cache, verify=False)
    assert_one_line_error(topk("info", cache, "--verify"), "corrupted cache manifest", why)


@pytest.mark.parametrize(
    "edit,fragment",
    [
        (lambda m: m["shape"].update(head_dim="8"), "shape.head_dim must be a positive integer"),
        (lambda m: m["shape"].update(n_kv_heads=3), "the shapes give"),
        (lambda m: m.update(n_tokens=299), "the shapes give"),
        (lambda m: m.update(kv_dtype="int4"), "unknown kv_dtype"),
        (lambda m: m.update(shape=[2, 2, 8]), "'shape' and 'model' must be objects"),
    ],
    ids=["string-dim", "heads", "tokens", "dtype", "shape-list"],
)
def test_wrong_shapes_in_the_manifest_are_a_clear_error(tmp_path, edit, fragment):
    cache = _small_cache(tmp_path / "cache", "x")
    _rewrite_manifest(cache, edit, fix_checksum=True)
    result = topk("info", cache)
    assert result.exit_code == 2  # a user error, not "internal error" (1)
    assert_one_line_error(result, "corrupted cache manifest", fragment)


def _damage(path: Path, how: str) -> None:
    if how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
    else:  # same size, other bytes
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "overwritten"])
@pytest.mark.parametrize(
    "name,victim", [("ivf", "l001.h00.faiss"), ("hnsw", "l000.h01.faiss"), ("quest", "max.001.bin")]
)
def test_a_damaged_strategy_artifact_is_a_corrupted_cache_error(tmp_path, name, victim, how):
    from topk_decode.index import artifact_dir, get_strategy

    cache = _small_cache(tmp_path / "cache", "x")
    ckv = open_cache(cache)
    opts = {"nlist": 4} if name == "ivf" else {}
    get_strategy(name)(ckv, 2, ckv.n_tokens - 2, opts).prepare()  # builds and records checksums
    _damage(artifact_dir(cache, name) / victim, how)
    with pytest.raises(TopkError, match=f"corrupted cache: .*{victim}"):
        get_strategy(name)(open_cache(cache), 2, ckv.n_tokens - 2, opts).prepare()
    result = topk("info", cache, "--verify")
    assert_one_line_error(result, "corrupted cache", victim)


def test_a_damaged_duo_pattern_is_a_corrupted_cache_error(tmp_path):
    from topk_decode.index import artifact_dir, prepare_artifacts
    from topk_decode.index.duo import PATTERN_FILE

    cache = _small_cache(tmp_path / "cache", "x")
    pattern = tmp_path / "heads.tsv"
    pattern.write_text("1.0\t0.0\n0.0\t1.0\n")
    prepare_artifacts(open_cache(cache), ["duo"], {"pattern": str(pattern)})
    _damage(artifact_dir(cache, "duo") / PATTERN_FILE, "overwritten")
    from topk_decode.index import get_strategy

    with pytest.raises(TopkError, match=f"corrupted cache: checksum mismatch .*{PATTERN_FILE}"):
        get_strategy("duo")(open_cache(cache), 2, 290, {}).prepare()


@pytest.mark.parametrize("name", ["ivf", "quest"])
def test_two_openers_of_missing_artifacts_build_them_once(tmp_path, monkeypatch, name):
    from topk_decode.index import get_strategy

    cache = _small_cache(tmp_path / "cache", "x")
    cls = get_strategy(name)
    real = cls.build_artifacts.__func__
    builds: list[int] = []

    def slow_build(klass, *args, **kwargs):
        builds.append(1)
        time.sleep(0.5)  # the other opener arrives meanwhile
        real(klass, *args, **kwargs)

    monkeypatch.setattr(cls, "build_artifacts", classmethod(slow_build))
    errors: list[BaseException] = []

    def open_one() -> None:
        try:
            cls(open_cache(cache), 2, 290, {"nlist": 4} if name == "ivf" else {}).prepare()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=open_one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and builds == [1]


def test_info_says_what_it_checked(tmp_path):
    from topk_decode.index import get_strategy

    cache = _small_cache(tmp_path / "cache", "x")
    get_strategy("quest")(open_cache(cache), 2, 290, {}).prepare()
    facts = json.loads(topk("info", cache, "--json").stdout)
    assert facts["checked"] == "sizes" and facts["files_hashed"] == 0
    facts = json.loads(topk("info", cache, "--json", "--verify").stdout)
    # 2 layers × keys/values + tokens, and quest's min/max bounds of 2 layers
    assert facts["checked"] == "checksums" and facts["files_hashed"] == 5 + 4
    assert "quest" in facts["strategies"]
    assert "hashes every file" in topk("info", cache).stdout


def test_a_version_1_cache_still_opens(tmp_path):
    cache = _small_cache(tmp_path / "cache", "x")
    _rewrite_manifest(
        cache, lambda m: (m.pop("format"), m.pop(CHECKSUM_FIELD), m.update(format_version=1)), fix_checksum=False
    )
    assert open_cache(cache, verify=True).n_tokens == 300
    _small_cache(cache, "replaced", overwrite=True)  # and --overwrite recognises it as ours


# ---- 6: disk full, read-only parent --------------------------------------------------------------------
def test_disk_full_is_one_line_and_leaves_nothing(tmp_path, docs_dir, deep_model, monkeypatch):
    real = CacheWriter.write_layer

    def fill_up(self, layer, keys, values):
        if layer == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, layer, keys, values)

    monkeypatch.setattr(CacheWriter, "write_layer", fill_up)
    out = tmp_path / "caches" / "cache"
    result = topk("prefill", docs_dir, "--out", out, "--model", deep_model, "--device", "cpu", "--checkpoint-every", 0)
    assert_one_line_error(result, "no space left on the device", "partial cache was removed")
    assert list(out.parent.iterdir()) == []


def test_out_under_a_read_only_parent_is_one_line(tmp_path, docs_dir, deep_model, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
    else:  # root ignores permission bits: make the OS calls under `ro` fail as a read-only mount would
        real_open, real_mkdir = os.open, os.mkdir

        def refuse(real):
            def call(path, *args, **kwargs):
                if str(path).startswith(str(ro) + os.sep) and kwargs.get("dir_fd") is None:
                    raise OSError(errno.EROFS, "Read-only file system", str(path))
                return real(path, *args, **kwargs)

            return call

        monkeypatch.setattr(os, "open", refuse(real_open))
        monkeypatch.setattr(os, "mkdir", refuse(real_mkdir))
    try:
        result = topk("prefill", docs_dir, "--out", ro / "sub" / "cache", "--model", deep_model, "--device", "cpu")
        assert_one_line_error(result, "cannot write the cache at", "writable directory")
    finally:
        ro.chmod(0o755)


@pytest.fixture
def tiny_mount(tmp_path):
    """mount(options) → a fresh tmpfs mounted with those options (skips where mounting is not allowed)."""
    mounted: list[Path] = []

    def mount(options: str) -> Path:
        d = tmp_path / f"mnt{len(mounted)}"
        d.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(d)], capture_output=True)
        if proc.returncode != 0:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", str(d)], capture_output=True)


def test_a_really_full_disk_is_one_line_and_leaves_nothing(tiny_mount, docs_dir, deep_model):
    disk = tiny_mount("size=160k")  # room for a few layers of the tiny model's KV
    result = topk(
        "prefill", docs_dir, "--out", disk / "cache", "--model", deep_model, "--device", "cpu", "--checkpoint-every", 0
    )
    assert_one_line_error(result, "no space left on the device", "partial cache was removed")
    assert list(disk.iterdir()) == []


def test_strategy_artifacts_on_a_full_disk_are_one_line(tiny_mount, tmp_path):
    from topk_decode.index import get_strategy

    disk = tiny_mount("size=100k")  # the cache fits, its IVF indices do not
    cache = shutil.copytree(_small_cache(tmp_path / "cache", "x"), disk / "cache")
    with pytest.raises(TopkError, match="cannot write the ivf artifacts .*No space left on device"):
        get_strategy("ivf")(open_cache(cache), 2, 290, {"nlist": 4}).prepare()
    assert list((cache / "index" / "ivf").iterdir()) == []  # no done.json, and the space is given back


def test_out_on_a_really_read_only_mount_is_one_line(tiny_mount, docs_dir, deep_model):
    ro = tiny_mount("ro,size=64k")
    result = topk("prefill", docs_dir, "--out", ro / "sub" / "cache", "--model", deep_model, "--device", "cpu")
    assert_one_line_error(result, "cannot write the cache at", "Read-only file system")
