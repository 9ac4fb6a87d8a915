"""Honest limits and a fast start (issue 32): contexts past the model's positions refused before any model
compute, failed artifact builds that give their space back, a closed or failing stdout that is an error,
links and special files in the documents folder reported and skipped, and `--help`, `info` and the error
paths answered without importing torch.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from topk_decode.cli.app import app
from topk_decode.errors import TopkError
from topk_decode.prefill.documents import LINK_OUTSIDE, collect_documents, read_text_file, summarize_skipped
from topk_decode.store.cache_dir import CacheWriter, open_cache

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "faiss", "numba")


def topk(*args: object):
    """`topk ARGS` in-process (typer's CliRunner, stdout and stderr apart)."""
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output, result.output
    return result


def one_error(stderr: str, *fragments: str) -> str:
    """The only line of `stderr` that is not a warning or note is one `error:` line naming `fragments`."""
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith(("warning: ", "note: "))]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


def python_m(*args: object, **kwargs) -> subprocess.CompletedProcess:
    """`python -m topk_decode ARGS` in a subprocess, from this checkout."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TOPK_DEBUG", None)
    kwargs.setdefault("stdout", subprocess.PIPE)
    return subprocess.run(
        [sys.executable, "-m", "topk_decode", *map(str, args)],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        timeout=300,
        **kwargs,
    )


# ---- start-up: no torch for --help, info and the error paths ---------------------------------------
PROBE = (
    "import sys, atexit\n"
    f"atexit.register(lambda: sys.stderr.write('HEAVY=' + ','.join(m for m in {HEAVY!r} if m in sys.modules)))\n"
    "from topk_decode.cli.app import main\n"
    "main(sys.argv[1:])\n"
)


def heavy_imports(*args: object) -> tuple[subprocess.CompletedProcess, str]:
    """Run the CLI with ARGS; return the process and the heavy modules it imported ('' = none)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *map(str, args)], capture_output=True, text=True, env=env, timeout=120
    )
    tail = proc.stderr.rpartition("HEAVY=")
    assert tail[1], proc.stderr
    return proc, tail[2].strip()


def test_startup_commands_import_no_torch(built_cache, docs_dir, tmp_path):
    cache, _ = built_cache
    ok = [["--help"], ["info", cache], ["info", cache, "--json"], ["prefill", "--help"]]
    for args in ok:
        proc, heavy = heavy_imports(*args)
        assert proc.returncode == 0, proc.stderr
        assert heavy == "", f"{args}: imported {heavy}"


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["chat", "{tmp}/missing", "--prompt", "hi"], "cache not found"),
        (["chat", "{cache}", "--strategy", "nope", "--prompt", "hi"], "unknown strategy 'nope'"),
        (["chat", "{cache}", "--temperature", "-1", "--prompt", "hi"], "temperature must be"),
        (["chat", "{cache}", "--k", "0", "--prompt", "hi"], "k must be a positive integer"),
        (["info", "{tmp}/missing"], "cache not found"),
        (["prefill", "{tmp}/missing", "--out", "{tmp}/c"], "documents not found"),
        (["prefill", "{docs}", "--out", "{cache}"], "already exists"),
        (["prefill", "{docs}", "--out", "{tmp}/c", "--dtype", "fp8"], "unknown dtype 'fp8'"),
        (["prefill", "{docs}", "--out", "{tmp}/c", "--model", "{tmp}/nope"], "model directory not found"),
        (["prefill", "{docs}", "--out", "{tmp}/c", "--strategy", "nope"], "unknown strategy 'nope'"),
        (["serve", "{tmp}/missing"], "cache not found"),
        (["serve", "{cache}", "--strategy", "nope"], "unknown strategy 'nope'"),
        (["serve", "{cache}", "--host", "0.0.0.0"], "pass --api-key KEY"),
        (["serve", "{cache}", "--cors-origin", "https://app.example.com/"], "--cors-origin must be"),
        (["serve", "{cache}", "--api-key", "two words"], "--api-key (or TOPK_API_KEY) must be printable"),
    ],
)
def test_error_paths_import_no_torch(built_cache, docs_dir, tmp_path, args, fragment):
    cache, _ = built_cache
    args = [a.format(tmp=tmp_path, cache=cache, docs=docs_dir) for a in args]
    proc, heavy = heavy_imports(*args)
    assert proc.returncode == 2
    one_error(proc.stderr.rpartition("HEAVY=")[0], fragment)
    assert heavy == "", f"{args}: imported {heavy}"


def test_the_registry_knows_which_strategies_keep_files_and_read_int8_without_importing_them():
    from topk_decode.index import STRATEGIES, SelectionStrategy, keeps_artifacts, reads_int8

    base = SelectionStrategy.build_artifacts.__func__
    for name, cls in STRATEGIES.items():
        assert cls.name == name
        assert keeps_artifacts(name) == (cls.build_artifacts.__func__ is not base), name
        assert reads_int8(name) == ("int8" in cls.kv_dtypes), name


# ---- stdout closed or failing: an error, not an answer lost in silence ----------------------------
def test_info_with_stdout_closed_or_full_is_an_error_and_a_gone_reader_is_quiet(built_cache):
    cache, _ = built_cache
    closed = python_m("info", cache, stdout=None, preexec_fn=lambda: os.close(1))
    assert closed.returncode == 2
    one_error(closed.stderr, "cannot write the output to stdout", "stdout is closed")
    with open("/dev/full", "w") as full:
        proc = python_m("info", cache, stdout=full)
    assert proc.returncode == 2
    one_error(proc.stderr, "cannot write the output to stdout", "No space left on device")
    read, write = os.pipe()
    os.close(read)  # `| head -c1` that has already exited
    try:
        gone = python_m("info", cache, "--json", stdout=write)
    finally:
        os.close(write)
    assert gone.returncode == 141 and gone.stderr.strip() == "", gone.stderr  # quiet, like Unix tools


@pytest.mark.slow
def test_chat_prompt_with_stdout_closed_is_an_error(built_cache):
    cache, _ = built_cache
    closed = python_m(
        "chat",
        cache,
        "--prompt",
        "Why?",
        "--k",
        8,
        "--max-new-tokens",
        4,
        "--device",
        "cpu",
        stdout=None,
        preexec_fn=lambda: os.close(1),
    )
    assert closed.returncode == 2
    one_error(closed.stderr, "cannot write the output to stdout", "stdout is closed")


# ---- positions: refused before any model compute ---------------------------------------------------
def test_a_context_past_the_positions_is_refused_before_the_model_loads(short_model, docs_dir, tmp_path, monkeypatch):
    from topk_decode import KVStore
    from topk_decode.prefill import build

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded for a context that is refused")

    monkeypatch.setattr(build, "load_model", never)
    with pytest.raises(TopkError, match=r"the context has \d+ tokens but the model has 64 positions"):
        KVStore.build(docs_dir, tmp_path / "c", short_model, device="cpu")
    result = topk("prefill", docs_dir, "--out", tmp_path / "c", "--model", short_model, "--device", "cpu")
    assert result.exit_code == 2
    one_error(result.stderr, "but the model has 64 positions", "--allow-long-context")
    assert list(tmp_path.iterdir()) == []


def test_an_allowed_long_context_is_prefilled_with_one_warning(short_model, docs_dir, tmp_path):
    from topk_decode.errors import TopkWarning
    from topk_decode.prefill.build import build_cache

    with pytest.warns(TopkWarning, match=r"more than the model's maximum positions \(64\)"):
        path, _ = build_cache(docs_dir, tmp_path / "c", short_model, device="cpu", allow_long_context=True)
    assert open_cache(path).n_tokens > 64


# ---- documents: links and special files --------------------------------------------------------------
@pytest.fixture
def linked_docs(tmp_path) -> Path:
    """docs/ with a file, a link to a file outside, a link to a folder outside, a link inside, a broken link."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("Outside text.\n")
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "a.txt").write_text("Inside text.\n")
    (docs / "sub" / "b.md").write_text("More inside text.\n")
    (docs / "out.txt").symlink_to(outside / "secret.txt")
    (docs / "outdir").symlink_to(outside)
    (docs / "same.txt").symlink_to(docs / "a.txt")
    (docs / "broken.txt").symlink_to(tmp_path / "nowhere.txt")
    return docs


def test_links_leaving_the_folder_are_reported_and_skipped_unless_followed(linked_docs):
    found, skipped = collect_documents(linked_docs)
    assert [d.name for d in found] == ["a.txt", "same.txt", "sub/b.md"]
    assert f"out.txt ({LINK_OUTSIDE})" in skipped and f"outdir ({LINK_OUTSIDE})" in skipped
    assert "broken.txt (broken link)" in skipped
    found, skipped = collect_documents(linked_docs, follow_symlinks=True)
    assert [d.name for d in found] == ["a.txt", "out.txt", "outdir/secret.txt", "same.txt", "sub/b.md"]
    assert skipped == ["broken.txt (broken link)"]


def test_a_link_loop_is_followed_once(linked_docs):
    (linked_docs / "sub" / "up").symlink_to(linked_docs)
    found, skipped = collect_documents(linked_docs, follow_symlinks=True)
    assert "sub/up (link loop)" in skipped
    assert sorted(d.name for d in found) == ["a.txt", "out.txt", "outdir/secret.txt", "same.txt", "sub/b.md"]


def _in_thread(fn, timeout: float = 30.0):
    """fn() in a daemon thread: (finished, result or exception). A blocking open of a FIFO never finishes."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(_call(fn)), daemon=True)
    t.start()
    t.join(timeout)
    return (not t.is_alive()), (out[0] if out else None)


def _call(fn):
    try:
        return fn()
    except BaseException as e:  # noqa: BLE001 - handed to the test
        return e


def test_fifos_and_sockets_are_reported_and_never_opened(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("Inside text.\n")
    os.mkfifo(docs / "pipe.txt")  # opening it for reading would wait for a writer
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(docs / "sock.txt"))
        finished, result = _in_thread(lambda: collect_documents(docs))
    assert finished, "collect_documents blocked on the FIFO"
    found, skipped = result
    assert [d.name for d in found] == ["a.txt"]
    assert skipped == ["pipe.txt (a FIFO: not read)", "sock.txt (a socket: not read)"]
    finished, result = _in_thread(lambda: read_text_file(docs / "pipe.txt"))  # one put where a file was listed
    assert finished and isinstance(result, OSError) and "FIFO" in str(result)
    with pytest.raises(TopkError, match="pipe.txt is a FIFO, not a text file or a folder"):
        collect_documents(docs / "pipe.txt")


def test_skipped_files_are_summarised_one_line_per_reason():
    skipped = [f"img{i}.png (binary)" for i in range(5)] + [
        "p (a FIFO: not read)",
        "x (1) (empty)",
        ".git/ (version-control folder)",
        "build/ (matched by .gitignore)",
        "a.log (matched by .gitignore)",
    ]
    assert summarize_skipped(skipped) == [
        "5 files (binary): img0.png, img1.png, img2.png and 2 more",
        "1 file (a FIFO: not read): p",
        "1 file (empty): x (1)",
        "1 folder (version-control folder): .git/",
        "2 entries (matched by .gitignore): build/, a.log",
    ]


def test_prefill_reports_skipped_entries_once_per_reason(model_factory, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("The fox sleeps in the sun. " * 4)
    for i in range(5):
        (docs / f"img{i}.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    os.mkfifo(docs / "pipe.txt")
    (docs / "out.txt").symlink_to(tmp_path)
    result = topk("prefill", docs, "--out", tmp_path / "c", "--model", model_factory("llama_gqa"), "--device", "cpu")
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: skipped")]
    assert sorted(warnings) == sorted(
        [
            "warning: skipped 5 files (binary): img0.png, img1.png, img2.png and 2 more",
            "warning: skipped 1 file (a FIFO: not read): pipe.txt",
            f"warning: skipped 1 file ({LINK_OUTSIDE}): out.txt",
        ]
    )
    info = topk("info", tmp_path / "c")
    assert "skipped at prefill: 5 files (binary): img0.png, img1.png, img2.png and 2 more" in info.stdout


# ---- a failed artifact build gives its space back --------------------------------------------------
def _small_cache(out: Path, n: int = 300) -> Path:
    """A model-free cache of 2 layers × 2 KV heads × n tokens (D = 8)."""
    gen = torch.Generator().manual_seed(0)
    w = CacheWriter(out)
    for layer in range(2):
        w.write_layer(layer, torch.randn(2, n, 8, generator=gen), torch.randn(2, n, 8, generator=gen))
    w.write_tokens([3 + i % 50 for i in range(n)])
    return w.commit(
        {
            "model": {"path": "none", "fingerprint": "none"},
            "kv_dtype": "float32",
            "n_tokens": n,
            "shape": {"n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8},
            "documents": [{"name": "x", "start": 0, "end": n}],
        }
    )


@pytest.mark.parametrize(
    "error", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()], ids=["disk-full", "interrupted"]
)
@pytest.mark.parametrize("name,module", [("routed", "routed.layout"), ("quest", "quest")])
def test_a_failed_artifact_build_removes_its_partial_files(tmp_path, monkeypatch, name, module, error):
    import importlib

    from topk_decode.index import artifact_dir, prepare_artifacts

    mod = importlib.import_module(f"topk_decode.index.{module}")
    real, calls = mod.write_file, []

    def fail_on_the_third(path, data):
        calls.append(path)
        if len(calls) == 3:
            real(path, bytes(data)[:10])  # a file half-written when the disk filled up
            raise error
        real(path, data)

    monkeypatch.setattr(mod, "write_file", fail_on_the_third)
    cache = _small_cache(tmp_path / "cache")
    if isinstance(error, OSError):
        with pytest.raises(TopkError, match=f"cannot write the {name} artifacts .*partial files were removed"):
            prepare_artifacts(open_cache(cache), [name])
    else:
        with pytest.raises(KeyboardInterrupt):
            prepare_artifacts(open_cache(cache), [name])
    d = artifact_dir(cache, name)
    assert len(calls) == 3 and d.is_dir() and list(d.iterdir()) == []
    monkeypatch.setattr(mod, "write_file", real)
    prepare_artifacts(open_cache(cache), [name])  # and a later build succeeds
    assert (d / "done.json").is_file()
