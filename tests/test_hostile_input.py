"""Rough edges a new (or hostile) user hits, kept as regression tests (issue 54's table): fast, CPU only,
on the tiny fixtures of conftest.py. One test (or a few) per row:

1. `max_new_tokens` ≤ 0 in the Python API is one TopkError, not a silent ''.
2. `--help` shows boolean options as flags, not `--overwrite <bool>`.
3. a piped `topk chat` writes its prompts to stderr: stdout carries only the answers.
4. `topk info` says where the model weights go at decode time (the GPU, or RAM on a CPU-only machine).
5. `topk info` on a folder with some other program's `manifest.json` says it is not a topk cache.
7. `--append` to a read-only cache says the cache is read-only and how to fix it, not "choose an --out".

(Row 6, the disk-space pre-check's rounding, is made in prefill/build.py: not covered here.)
"""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
from typer.testing import CliRunner

from topk_decode.cli.app import app
from topk_decode.errors import TopkError

COMMANDS = ["prefill", "chat", "info", "eval", "calibrate-duo", "bench", "serve"]


def topk(*args: object, input: str | bytes | None = None):
    """Run `topk ARGS` in-process (stdout and stderr kept apart); never a traceback."""
    result = CliRunner().invoke(app, [str(a) for a in args], input=input)
    assert "Traceback" not in result.output, result.output
    return result


def one_error(result) -> str:
    """The run failed with exit 2 and exactly one `error:` line on stderr: that line."""
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and len(lines) == 1, result.stderr
    return errors[0]


@pytest.fixture(scope="module")
def store(built_cache):
    from topk_decode.api import KVStore

    with KVStore.open(built_cache[0], k=8, device="cpu") as s:
        yield s


# ---- 1: max_new_tokens ≤ 0 in the Python API ----------------------------------------------------------
@pytest.mark.parametrize("n", [0, -5])
@pytest.mark.parametrize("call", ["KVStore.ask", "KVStore.ask-stream", "session.ask", "complete", "reply"])
def test_max_new_tokens_not_positive_is_one_clear_error(store, call, n):
    calls = {
        "KVStore.ask": lambda: store.ask("What does the fox do?", max_new_tokens=n),
        "KVStore.ask-stream": lambda: store.ask("What does the fox do?", max_new_tokens=n, stream=True),
        "session.ask": lambda: store.session().ask("What does the fox do?", max_new_tokens=n),
        "complete": lambda: store.session().complete("The quick brown", max_new_tokens=n),
        "reply": lambda: store.session().reply([{"role": "user", "content": "Why?"}], max_new_tokens=n),
    }
    with pytest.raises(TopkError, match=rf"^max_new_tokens must be a positive integer, got {n}$"):
        calls[call]()  # raised at the call, before any generator is handed back


def test_max_new_tokens_refuses_a_bool_and_a_float_and_still_takes_a_positive_int(store):
    for bad in (True, 2.5):
        with pytest.raises(TopkError, match="max_new_tokens must be a positive integer"):
            store.ask("Why?", max_new_tokens=bad)
    assert isinstance(store.ask("Why?", max_new_tokens=1), str)


# ---- 2: boolean options are shown as flags ------------------------------------------------------------
@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_shows_boolean_options_as_flags_not_bool_values(command):
    result = topk(*([command] if command else []), "--help")
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.stdout and "--help" in result.stdout


def test_prefill_help_lists_overwrite_as_a_flag_that_takes_no_value(tmp_path):
    result = topk("prefill", "--help")
    line = next(line for line in result.stdout.splitlines() if "--overwrite" in line)
    assert "<" not in line, line  # no value column
    # and what the help shows is how it is used: `--overwrite` alone parses, `--overwrite true` does not
    assert "Got unexpected extra argument" in one_error(
        topk("prefill", tmp_path, "--out", tmp_path / "c", "--overwrite", "true")
    )


# ---- 3: a piped chat's stdout holds only the answers --------------------------------------------------
def test_piped_chat_writes_prompts_to_stderr_and_only_answers_to_stdout(built_cache):
    cache = built_cache[0]
    result = topk("chat", cache, "--max-new-tokens", 4, input="What does the fox do?\nAnd then?\n")
    assert result.exit_code == 0, result.output
    out, err = result.stdout, result.stderr
    assert "you>" not in out and "topk>" not in out and "Type /help" not in out, out
    assert err.count("you> ") == 3 and err.count("topk> ") == 2, err  # 2 questions, then end of input
    assert "error" not in err
    answers = out.splitlines()
    assert len(answers) == 2, out
    alone = topk("chat", cache, "--max-new-tokens", 4, "--prompt", "What does the fox do?")
    assert answers[0] == alone.stdout.rstrip("\n")  # the very answer `--prompt` prints


# ---- 4: where the weights go at decode time -----------------------------------------------------------
@pytest.mark.parametrize("gpu", [False, True], ids=["no-gpu-here", "a-gpu-present"])
def test_info_says_where_the_model_weights_go_at_decode_time(built_cache, monkeypatch, gpu):
    import topk_decode.cli.info_cmd as info_cmd

    monkeypatch.setattr(info_cmd, "gpu_present", lambda: gpu)
    result = topk("info", built_cache[0])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.stdout.splitlines() if "model weights" in line)
    if gpu:
        assert "(on the GPU at decode time)" in line, line
    else:
        assert "on the GPU" not in line and "in RAM" in line and "runs on the CPU" in line, line


def test_gpu_present_follows_torch_once_torch_is_loaded():
    import torch

    from topk_decode.cli.common import gpu_present

    assert gpu_present() == torch.cuda.is_available()


# ---- 5: some other program's manifest.json ------------------------------------------------------------
@pytest.mark.parametrize(
    "manifest",
    [{"name": "my-web-app", "version": "1.0.0", "icons": []}, {"format_version": 2, "files": {}}],
    ids=["web-app", "no-marker"],
)
def test_info_on_a_folder_with_another_manifest_says_it_is_not_a_topk_cache(tmp_path, manifest):
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    line = one_error(topk("info", tmp_path))
    assert "is not a topk cache" in line and "format marker" in line, line
    assert "cache format" not in line and "None" not in line and "prefill it again" not in line, line
    from topk_decode.store.cache_dir import open_cache

    with pytest.raises(TopkError, match="is not a topk cache"):
        open_cache(tmp_path)


def test_a_topk_cache_of_an_unknown_version_still_says_prefill_it_again(tmp_path, built_cache):
    cache = tmp_path / "cache"
    shutil.copytree(built_cache[0], cache)
    m = json.loads((cache / "manifest.json").read_text())
    m["format_version"] = 99
    (cache / "manifest.json").write_text(json.dumps(m))
    line = one_error(topk("info", cache))
    assert "has cache format 99" in line and "prefill it again" in line, line


# ---- 7: --append to a read-only cache -----------------------------------------------------------------
@pytest.mark.parametrize(
    "code,fix",
    [(errno.EROFS, "remount it read-write"), (errno.EACCES, "write permission")],
    ids=["read-only-mount", "no-permission"],
)
def test_append_to_a_read_only_cache_says_so_and_how_to_fix_it(tmp_path, built_cache, monkeypatch, code, fix):
    ro = tmp_path / "ro"
    ro.mkdir()
    cache = ro / "cache"
    shutil.copytree(built_cache[0], cache)
    before = {p: p.read_bytes() for p in cache.rglob("*") if p.is_file()}
    new = tmp_path / "new"
    new.mkdir()
    (new / "delta.txt").write_text("A new document about the lazy dog. " * 5)
    # root ignores permission bits: refuse every write under `ro` as a read-only mount (or chmod a-w) would
    real_open, real_mkdir = os.open, os.mkdir
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT

    def refused(path) -> bool:
        return str(path).startswith(str(ro) + os.sep)

    def fake_open(path, flags, *args, **kwargs):
        if refused(path) and flags & writes and kwargs.get("dir_fd") is None:
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *args, **kwargs)

    def fake_mkdir(path, *args, **kwargs):
        if refused(path):
            raise OSError(code, os.strerror(code), str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)
    line = one_error(topk("prefill", new, "--append", cache, "--device", "cpu"))
    monkeypatch.undo()
    assert f"the cache at {cache} is read-only" in line and fix in line, line
    assert "--out" not in line, line
    assert {p: p.read_bytes() for p in cache.rglob("*") if p.is_file()} == before


def test_a_new_out_under_a_read_only_directory_still_names_out(tmp_path):
    from topk_decode.store.locking import unwritable

    msg = str(unwritable(tmp_path / "new-cache", OSError(errno.EROFS, "Read-only file system")))
    assert "choose an --out in a writable directory" in msg
