"""`topk prefill NEW_DOCS --append CACHE` and `KVStore.append` (issue 29, item 4): the model runs over the new
documents only, and the cache committed equals a fresh prefill of old + new documents byte for byte (CPU, fp32,
the bundled demo model); names the cache holds are refused; a failed or killed append leaves the old cache
exactly as it was; strategy artifacts are rebuilt for the appended cache before it is swapped in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.test_documents import minimal_pdf
from topk_decode.cli.app import app
from topk_decode.demo import DEMO_MODEL_DIR
from topk_decode.errors import TopkError
from topk_decode.prefill.append import append_cache, recompute_from
from topk_decode.prefill.build import build_cache
from topk_decode.store.cache_dir import CacheWriter, open_cache
from topk_decode.store.format import partial_path

WORDS = "harbour tide ledger fox amber north field note travel log spring cod salt rope mast pier".split()


def text(seed: int, n: int = 120) -> str:
    return " ".join(WORDS[(seed * 7 + i * i) % len(WORDS)] for i in range(n)) + "\n"


def folder(root: Path, files: dict[str, str | bytes]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(content) if isinstance(content, bytes) else (root / name).write_text(content)
    return root


OLD = {"a1.txt": text(1), "a2.md": text(2)}
NEW = {"b1.py": "def tide():\n    return 'noon'\n" * 6, "b2.txt": text(3)}


def snapshot(cache: Path) -> dict[str, bytes]:
    """Every file of a cache directory with its bytes."""
    return {str(p.relative_to(cache)): p.read_bytes() for p in sorted(cache.rglob("*")) if p.is_file()}


def same_cache(a: Path, b: Path) -> None:
    """The caches hold the same context byte for byte: every KV file, the tokens, the last logits, the
    document table (the manifests differ only in timings and the record of the append)."""
    ma, mb = (json.loads((c / "manifest.json").read_text()) for c in (a, b))
    assert ma["files"] == mb["files"]  # sizes and blake2b of every file
    assert ma["documents"] == mb["documents"] and ma["n_tokens"] == mb["n_tokens"]
    for rel in ma["files"]:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


@pytest.mark.parametrize("chunk_size", [100, 4096])  # the cache ends mid-chunk; the whole cache is one chunk
def test_append_equals_a_fresh_prefill_of_old_and_new_byte_for_byte(tmp_path, chunk_size):
    pytest.importorskip("pypdf")
    new = dict(NEW, **{"b3.pdf": minimal_pdf(["The amber fox hides under the pier", "Tide at noon"])})
    cache = tmp_path / "cache"
    build_cache(folder(tmp_path / "old", OLD), cache, DEMO_MODEL_DIR, chunk_size=chunk_size, device="cpu")
    n_old = open_cache(cache).n_tokens
    path, stats, skipped = append_cache(folder(tmp_path / "new", new), cache, device="cpu")
    assert path == cache and skipped == []
    fresh = tmp_path / "fresh"
    build_cache(folder(tmp_path / "both", {**OLD, **new}), fresh, DEMO_MODEL_DIR, chunk_size=chunk_size, device="cpu")
    same_cache(cache, fresh)
    ckv = open_cache(cache)
    # only the new tokens and the cached ones since the last chunk boundary were computed
    assert stats.n_tokens == ckv.n_tokens - recompute_from(n_old, chunk_size)
    if chunk_size < n_old:
        assert stats.n_tokens < ckv.n_tokens - n_old + chunk_size
    assert [p["label"] for p in ckv.manifest["documents"][-1]["places"]] == ["p. 1", "p. 2"]
    record = ckv.manifest["prefill"]["appended"]
    assert [(r["documents"], r["computed_from"]) for r in record] == [(3, recompute_from(n_old, chunk_size))]


def test_two_appends_equal_one_prefill_and_the_store_answers_over_all(tmp_path):
    from topk_decode.api import KVStore

    cache = tmp_path / "cache"
    build_cache(folder(tmp_path / "old", OLD), cache, DEMO_MODEL_DIR, chunk_size=64, device="cpu")
    store = KVStore.open(cache, k=32, device="cpu", strategy="flat", compile=False)
    before = store.ask("Where does the fox hide?", max_new_tokens=6)
    grown = store.append(folder(tmp_path / "n1", {"b1.py": NEW["b1.py"]}), device="cpu")
    grown = grown.append(folder(tmp_path / "n2", {"c.txt": text(9)}), device="cpu")
    assert [d["name"] for d in grown.documents] == ["a1.txt", "a2.md", "b1.py", "c.txt"]
    assert store.ask("Where does the fox hide?", max_new_tokens=6) == before  # the old store: the old context
    fresh = tmp_path / "fresh"
    build_cache(
        folder(tmp_path / "all", {**OLD, "b1.py": NEW["b1.py"], "c.txt": text(9)}),
        fresh,
        DEMO_MODEL_DIR,
        chunk_size=64,
        device="cpu",
    )
    same_cache(cache, fresh)
    alone = KVStore.open(fresh, k=32, device="cpu", strategy="flat", compile=False)
    q = "What does tide return?"
    assert grown.ask(q, max_new_tokens=8) == alone.ask(q, max_new_tokens=8)


@pytest.fixture
def old_cache(tmp_path) -> Path:
    cache = tmp_path / "cache"
    build_cache(folder(tmp_path / "old", OLD), cache, DEMO_MODEL_DIR, chunk_size=64, device="cpu")
    return cache


def test_a_name_the_cache_holds_is_refused_and_the_cache_is_untouched(tmp_path, old_cache):
    before = snapshot(old_cache)
    with pytest.raises(TopkError, match=r"already holds a2\.md: .*--replace, is not supported yet"):
        append_cache(folder(tmp_path / "new", {"a2.md": "again\n", "z.txt": "z\n"}), old_cache, device="cpu")
    assert snapshot(old_cache) == before and not partial_path(old_cache).exists()


def test_a_lone_raw_document_has_no_header_to_append_after(tmp_path):
    cache = tmp_path / "cache"
    build_cache(folder(tmp_path / "one", {"a.txt": text(1)}), cache, DEMO_MODEL_DIR, device="cpu")
    with pytest.raises(TopkError, match="one raw-text document without a document header"):
        append_cache(folder(tmp_path / "new", NEW), cache, device="cpu")


def test_a_failure_midway_leaves_the_old_cache_exactly_as_it_was(tmp_path, old_cache, monkeypatch):
    before = snapshot(old_cache)
    real = CacheWriter.write_layer

    def failing(self, layer, keys, values):
        if layer == 2:
            raise OSError(5, "Input/output error")  # an I/O error on the third layer (not a full disk)
        real(self, layer, keys, values)

    monkeypatch.setattr(CacheWriter, "write_layer", failing)
    with pytest.raises(OSError):
        append_cache(folder(tmp_path / "new", NEW), old_cache, device="cpu")
    assert snapshot(old_cache) == before and not partial_path(old_cache).exists()
    monkeypatch.setattr(CacheWriter, "write_layer", real)
    append_cache(tmp_path / "new", old_cache, device="cpu")  # the writer lock was released: it can run again
    assert open_cache(old_cache).manifest["documents"][-1]["name"] == "b2.txt"


def test_a_failed_strategy_build_before_the_swap_leaves_the_old_cache(tmp_path, old_cache, monkeypatch):
    import topk_decode.index as index

    before = snapshot(old_cache)

    def boom(*args, **kwargs):
        raise KeyboardInterrupt()  # Ctrl-C while the artifacts are built

    monkeypatch.setattr(index, "prepare_artifacts", boom)
    with pytest.raises(KeyboardInterrupt):
        append_cache(folder(tmp_path / "new", NEW), old_cache, device="cpu", strategies={"quest": {}})
    assert snapshot(old_cache) == before and not partial_path(old_cache).exists()


def test_an_append_killed_midway_leaves_the_old_cache_and_the_next_one_runs(tmp_path, old_cache):
    before = snapshot(old_cache)
    new = folder(tmp_path / "new", NEW)
    env = dict(os.environ, TOPK_TEST_DIE_WRITING="kv/keys.002.bin")  # SIGKILL half-way through layer 2
    run = subprocess.run(
        [sys.executable, "-m", "topk_decode", "prefill", str(new), "--append", str(old_cache), "--device", "cpu"],
        env=env,
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    assert run.returncode == -9, run.stderr
    assert snapshot(old_cache) == before  # a kill -9 before the swap: the cache is the old one
    assert partial_path(old_cache).exists()  # what the killed append wrote, hidden and never opened
    append_cache(new, old_cache, device="cpu")  # the next append clears it and runs
    assert not partial_path(old_cache).exists()
    assert [d["name"] for d in open_cache(old_cache).manifest["documents"]] == ["a1.txt", "a2.md", "b1.py", "b2.txt"]


def test_strategy_artifacts_are_rebuilt_for_the_appended_cache_with_their_options(tmp_path, old_cache):
    from topk_decode.index import prepare_artifacts
    from topk_decode.index.artifacts import read_done

    prepare_artifacts(open_cache(old_cache), ["quest"], {"page_size": 8})
    append_cache(folder(tmp_path / "new", NEW), old_cache, device="cpu")
    ckv = open_cache(old_cache)
    done = read_done(old_cache / "index" / "quest")
    assert done["cache_id"] == ckv.cache_id  # built from the appended cache, before the swap
    assert done["meta"]["options"]["page_size"] == 8  # with the options it was built with


def topk(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output, result.output
    return result


def test_the_cli_appends_and_refuses_what_does_not_apply(tmp_path, old_cache):
    new = folder(tmp_path / "new", NEW)
    before = snapshot(old_cache)
    for args, message in [
        ([new], "error: name the cache: --out CACHE to create one, or --append CACHE to add the documents to one"),
        ([new, "--append", old_cache, "--out", tmp_path / "x"], "error: name the cache"),
        ([new, "--append", old_cache, "--overwrite"], "error: --overwrite does not apply to --append"),
        ([new, "--append", old_cache, "--gpus", "2"], "error: --gpus does not apply to --append (an append runs in"),
        ([new, "--append", old_cache, "--dtype", "bf16"], "error: " + str(old_cache) + " holds float32 keys"),
        ([new, "--append", tmp_path / "nope"], f"error: cache not found: {tmp_path / 'nope'}"),
    ]:
        result = topk("prefill", *args)
        assert result.exit_code != 0 and result.stderr.startswith(message), (args, result.stderr)
    assert snapshot(old_cache) == before
    result = topk("prefill", new, "--append", old_cache, "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert "appended 2 documents" in result.stdout and str(old_cache) in result.stdout
    result = topk("prefill", new, "--append", old_cache, "--device", "cpu")
    assert result.exit_code != 0 and "already holds b1.py, b2.txt" in result.stderr
