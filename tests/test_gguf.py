"""GGUF files as `--model`: header checks, one-line errors, and the conversion cache (atomic, reused, locked).

Synthetic GGUF files written with the `gguf` package's GGUFWriter stand in for real ones here; the real
dequantization of a real model is pinned in test_real_model.py. The conversion itself is replaced by a
stub in the cache tests: they pin where the result goes and when it is (not) redone, not the weights.
"""

from __future__ import annotations

import builtins
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from topk_decode.cli.app import app
from topk_decode.errors import TopkError
from topk_decode.model import gguf as G
from topk_decode.model.loading import model_fingerprint, resolve_model_path


def write_gguf(path: Path, arch: str = "llama", n: int = 64) -> Path:
    """A small, well-formed GGUF file (two f32 tensors) for architecture `arch`."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch=arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.arange(n * 32, dtype=np.float32).reshape(n, 32))
    w.add_tensor("output_norm.weight", np.ones((32,), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def cache_home(tmp_path, monkeypatch) -> Path:
    """An empty XDG cache: conversions in these tests never touch the user's cache."""
    home = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    G._INSPECTED.clear()
    return home


@pytest.fixture
def stub_convert(monkeypatch):
    """Replace the (slow, transformers) dequantization with a stub writing a minimal checkpoint; count calls."""
    calls: list[Path] = []

    def convert(src: Path, out: Path, say) -> None:
        calls.append(src)
        time.sleep(0.2)  # long enough for a second converter to arrive while the first holds the lock
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (out / "model.safetensors").write_bytes(b"stub")

    monkeypatch.setattr(G, "_convert", convert)
    return calls


# ---- header checks -------------------------------------------------------------------------------------
def test_inspect_reads_architecture_version_and_tensor_extent(tmp_path):
    f = write_gguf(tmp_path / "m.gguf", "qwen2")
    info = G.inspect_gguf(f)
    assert (info.architecture, info.version, info.n_tensors) == ("qwen2", 3, 2)
    assert info.data_end <= info.size == f.stat().st_size
    assert info.data_end > info.size - 64 * 32 * 4  # the tensors really were located, not assumed


def test_wrong_magic_is_rejected(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(TopkError, match="not a GGUF file"):
        G.inspect_gguf(f)


def test_unknown_version_is_rejected(tmp_path):
    f = write_gguf(tmp_path / "m.gguf")
    data = bytearray(f.read_bytes())
    data[4:8] = (99).to_bytes(4, "little")
    f.write_bytes(bytes(data))
    with pytest.raises(TopkError, match="unsupported GGUF version 99"):
        G.inspect_gguf(f)


@pytest.mark.parametrize("cut", [100, 1000, 4], ids=["in-the-header", "in-the-tensor-data", "one-word"])
def test_truncated_file_is_rejected(tmp_path, cut):
    f = write_gguf(tmp_path / "m.gguf")
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - cut] if cut != 100 else data[:100])
    with pytest.raises(TopkError, match="truncated GGUF file"):
        G.inspect_gguf(f)


@pytest.mark.parametrize("arch", ["gemma", "phi3"])
def test_unsupported_architecture_is_rejected(tmp_path, arch):
    f = write_gguf(tmp_path / "m.gguf", arch)
    with pytest.raises(TopkError, match=f"unsupported GGUF architecture '{arch}'"):
        G.inspect_gguf(f)


def test_missing_packages_are_named(tmp_path, monkeypatch):
    f = write_gguf(tmp_path / "m.gguf")
    real_import = builtins.__import__

    def no_accelerate(name, *args, **kwargs):
        if name == "accelerate":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_accelerate)
    with pytest.raises(TopkError, match=r"pip install accelerate"):
        G.inspect_gguf(f)


def test_ollama_style_blob_without_suffix_is_recognised_by_its_magic(tmp_path):
    blob = write_gguf(tmp_path / "sha256-0123abcd")
    assert G.is_gguf_file(blob)
    assert not G.is_gguf_file(tmp_path)  # a directory is a checkpoint directory, not a GGUF file
    (tmp_path / "notes").write_text("hello")
    assert not G.is_gguf_file(tmp_path / "notes")


# ---- the conversion cache ------------------------------------------------------------------------------
def test_conversion_goes_to_xdg_cache_and_is_reused(tmp_path, cache_home, stub_convert):
    f = write_gguf(tmp_path / "m.gguf")
    first = G.converted_dir(f, progress=None)
    again = resolve_model_path(f)
    assert first == again == cache_home / "topk-decode" / "models" / G.gguf_sha256(f)
    assert len(stub_convert) == 1
    assert G.converted_source(first)["sha256"] == G.gguf_sha256(f)
    assert not list(first.parent.glob(".*.partial-*"))


def test_fingerprint_of_gguf_and_its_converted_dir_is_the_files_sha(tmp_path, cache_home, stub_convert):
    f = write_gguf(tmp_path / "m.gguf")
    d = G.converted_dir(f, progress=None)
    import hashlib

    sha = hashlib.sha256(f.read_bytes()).hexdigest()
    assert model_fingerprint(f) == model_fingerprint(d) == sha[:16]


def test_failed_conversion_leaves_nothing_that_looks_done(tmp_path, cache_home, monkeypatch):
    f = write_gguf(tmp_path / "m.gguf")

    def boom(src, out, say):
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        raise TopkError("dequantization failed")

    monkeypatch.setattr(G, "_convert", boom)
    with pytest.raises(TopkError, match="dequantization failed"):
        G.converted_dir(f, progress=None)
    root = cache_home / "topk-decode" / "models"
    assert [p.name for p in root.iterdir() if not p.name.endswith(".lock") and p.name != ".sha256"] == []


def test_two_concurrent_conversions_run_once(tmp_path, cache_home, stub_convert):
    f = write_gguf(tmp_path / "m.gguf")
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(G.converted_dir(f, progress=None))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1]
    assert len(stub_convert) == 1


def test_a_changed_file_is_converted_again(tmp_path, cache_home, stub_convert):
    f = write_gguf(tmp_path / "m.gguf", n=64)
    a = G.converted_dir(f, progress=None)
    time.sleep(0.01)
    write_gguf(f, n=65)  # same path, new content (and mtime): the remembered sha must not be reused
    b = G.converted_dir(f, progress=None)
    assert a != b and len(stub_convert) == 2


# ---- through the command line --------------------------------------------------------------------------
def _one_line_error(args: list[str]) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize(
    "damage, message",
    [
        ("magic", "not a GGUF file"),
        ("truncate", "truncated GGUF file"),
        ("gemma", "unsupported GGUF architecture 'gemma'"),
    ],
)
def test_prefill_with_a_bad_gguf_is_one_line_error(tmp_path, cache_home, docs_dir, damage, message):
    f = write_gguf(tmp_path / "m.gguf", "gemma" if damage == "gemma" else "llama")
    data = f.read_bytes()
    if damage == "magic":
        f.write_bytes(b"XXXX" + data[4:])
    elif damage == "truncate":
        f.write_bytes(data[:-500])
    line = _one_line_error(["prefill", docs_dir, "--out", tmp_path / "cache", "--model", f, "--device", "cpu"])
    assert message in line
    assert not (tmp_path / "cache").exists()


def test_chat_with_a_bad_gguf_model_is_one_line_error(tmp_path, cache_home, built_cache):
    cache, _ = built_cache
    f = write_gguf(tmp_path / "m.gguf", "gemma")
    line = _one_line_error(["chat", cache, "--model", f, "--prompt", "hi", "--device", "cpu"])
    assert "unsupported GGUF architecture" in line


def test_leftover_of_a_killed_conversion_is_cleaned_and_redone(tmp_path, cache_home, stub_convert):
    f = write_gguf(tmp_path / "m.gguf")
    root = cache_home / "topk-decode" / "models"
    digest = G.gguf_sha256(f)
    stale = root / f".{digest}.partial-999999"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    incomplete = root / digest  # a directory without the marker is not a finished conversion
    incomplete.mkdir()
    d = G.converted_dir(f, progress=None)
    assert d == incomplete and G.converted_source(d) is not None
    assert not stale.exists() and len(stub_convert) == 1


def test_missing_gguf_file_is_named_as_such(tmp_path, docs_dir):
    line = _one_line_error(["prefill", docs_dir, "--out", tmp_path / "cache", "--model", tmp_path / "nope.gguf"])
    assert "GGUF file not found" in line
