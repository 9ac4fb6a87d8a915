"""The `topk` command line end to end on tiny checkpoints: prefill, chat, info, and every bad input.

Every failure must be one `error:` line on stderr with a non-zero exit code, never a traceback, and
must leave an existing cache byte-for-byte intact and still openable.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from topk_decode.cli.app import app
from topk_decode.cli.common import parse_options
from topk_decode.errors import TopkError
from topk_decode.store.cache_dir import open_cache
from topk_decode.store.format import MANIFEST

REPO = Path(__file__).resolve().parents[1]


def topk(*args: object, input: str | None = None):
    """Run `topk ARGS` in-process through typer's CliRunner (stdout and stderr kept apart)."""
    result = CliRunner().invoke(app, [str(a) for a in args], input=input)
    assert "Traceback" not in result.output, result.output
    return result


def assert_one_line_error(result, *fragments: str) -> str:
    """The run failed with exactly one `error:` line (only warnings/notes beside it) naming `fragments`."""
    assert result.exit_code != 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    assert all(line.startswith(("error: ", "warning: ", "note: ")) for line in lines), result.stderr
    for f in fragments:
        assert f in errors[0], errors[0]
    return errors[0]


def snapshot(cache: Path) -> dict[str, bytes]:
    """Every file of a cache directory, by relative path."""
    return {str(p.relative_to(cache)): p.read_bytes() for p in sorted(cache.rglob("*")) if p.is_file()}


def assert_intact(cache: Path, before: dict[str, bytes]) -> None:
    """The cache is unchanged and still opens with full checksum verification."""
    assert snapshot(cache) == before
    open_cache(cache, verify=True)


@pytest.fixture(scope="module")
def prefilled(tmp_path_factory, model_factory, docs_dir):
    """(cache, model_dir, result): the fixture docs prefilled through `topk prefill` on the CPU."""
    model_dir = model_factory("llama_gqa")
    cache = tmp_path_factory.mktemp("cli") / "cache"
    result = topk(
        "prefill",
        docs_dir,
        "--out",
        cache,
        "--model",
        model_dir,
        "--device",
        "cpu",
        "--chunk-size",
        61,
        "--strategy",
        "flat",
    )
    return cache, model_dir, result


@pytest.fixture
def cache_copy(prefilled, tmp_path) -> Path:
    """A private copy of the prefilled cache that a test may damage or try to overwrite."""
    dst = tmp_path / "copy"
    shutil.copytree(prefilled[0], dst)
    return dst


# ---- the happy path ------------------------------------------------------------------------------
def test_prefill_writes_a_cache_and_warns_about_the_skipped_png(prefilled):
    cache, _, result = prefilled
    assert result.exit_code == 0, result.output
    assert any(line.startswith("warning: ") and "image.png" in line for line in result.stderr.splitlines())
    manifest = json.loads((cache / MANIFEST).read_text())
    assert len(manifest["documents"]) == 3
    assert f"tokens: {manifest['n_tokens']:,}" in result.stdout
    assert "peak GPU memory: n/a on CPU" in result.stdout
    assert "size on disk:" in result.stdout


def test_chat_prompt_prints_an_answer_and_exits_zero(prefilled):
    cache, _, _ = prefilled
    result = topk(
        "chat", cache, "--prompt", "What does the fox do?", "--k", 8, "--max-new-tokens", 6, "--device", "cpu"
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()


def test_chat_accepts_strategy_options(prefilled):
    cache, _, _ = prefilled
    result = topk(
        "chat",
        cache,
        "--prompt",
        "Why?",
        "--k",
        8,
        "--max-new-tokens",
        3,
        "--opt",
        "backend=torch",
        "--opt",
        "threads=1",
    )
    assert result.exit_code == 0, result.output


def test_chat_no_compile_reaches_the_decoder_and_answers_the_same(prefilled):
    from topk_decode import KVStore

    cache, _, _ = prefilled
    args = ("chat", cache, "--prompt", "Why?", "--k", 8, "--max-new-tokens", 4, "--device", "cpu")
    plain, uncompiled = topk(*args), topk(*args, "--no-compile")
    assert plain.exit_code == 0 and uncompiled.exit_code == 0, uncompiled.output
    assert uncompiled.stdout == plain.stdout  # compilation only applies to CUDA one-token steps
    assert KVStore.open(cache, k=8, device="cpu", compile=False).decoder.config.compile is False


def test_info_shows_tokens_documents_and_strategies(prefilled):
    cache, _, _ = prefilled
    manifest = json.loads((cache / MANIFEST).read_text())
    result = topk("info", cache)
    assert result.exit_code == 0, result.output
    assert f"{manifest['n_tokens']:,}" in result.stdout
    for d in manifest["documents"]:
        assert d["name"] in result.stdout
    assert "flat" in result.stdout and "estimate" in result.stdout

    facts = json.loads(topk("info", cache, "--json", "--verify").stdout)
    assert facts["n_tokens"] == manifest["n_tokens"]
    assert [d["name"] for d in facts["documents"]] == [d["name"] for d in manifest["documents"]]
    assert facts["checked"] == "checksums"
    assert "flat" in facts["strategies"]
    assert facts["disk"]["kv_bytes"] == sum(f["bytes"] for r, f in manifest["files"].items() if r.startswith("kv/"))


def test_prefill_strategy_builds_artifacts_that_info_lists_and_chat_uses(docs_dir, prefilled, tmp_path):
    cache = tmp_path / "cache"
    result = topk("prefill", docs_dir, "--out", cache, "--model", prefilled[1], "--strategy", "flat,quest")
    assert result.exit_code == 0, result.output
    facts = json.loads(topk("info", cache, "--json").stdout)
    assert "quest" in facts["strategies"] and "quest" not in facts["strategies_not_built"]
    result = topk("chat", cache, "--strategy", "quest", "--k", 16, "--prompt", "Why?", "--max-new-tokens", 3)
    assert result.exit_code == 0, result.output


def test_interactive_chat_runs_in_chat_commands_from_stdin(prefilled):
    cache, _, _ = prefilled
    result = topk("chat", cache, "--max-new-tokens", 4, input="/k 8\nWhat is prefill?\n/stats\n/reset\n/quit\n")
    assert result.exit_code == 0, result.output
    assert "(k = 8)" in result.stdout
    assert "ms_per_step" in result.stdout and "k=8" in result.stdout
    assert "(new conversation)" in result.stdout
    assert "error" not in result.stderr and "warning" not in result.stderr  # piped: only prompts and status lines


def test_interactive_chat_ends_cleanly_at_end_of_input(prefilled):
    cache, _, _ = prefilled
    result = topk("chat", cache, input="/help\n")
    assert result.exit_code == 0, result.output
    assert "/reset" in result.stdout


def test_bad_in_chat_commands_print_an_error_and_keep_the_chat_going(prefilled):
    cache, _, _ = prefilled
    result = topk("chat", cache, input="/k 0\n/k abc\n/nope\n/k 5\n/quit\n")
    assert result.exit_code == 0, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 3, result.stderr
    assert "(k = 5)" in result.stdout


def test_parse_options_turns_numbers_into_numbers():
    assert parse_options(["nprobe=32", "ratio=0.5", "backend=torch", "flag=true"]) == {
        "nprobe": 32,
        "ratio": 0.5,
        "backend": "torch",
        "flag": True,
    }
    with pytest.raises(TopkError, match="key=value"):
        parse_options(["nprobe"])


# ---- bad input: one line, non-zero exit, existing cache untouched ---------------------------------
def _make_docs(root: Path, kind: str) -> Path:
    """Documents folders that cannot be prefilled."""
    d = root / f"docs-{kind}"
    d.mkdir()
    if kind == "unreadable":
        (d / "scan.png").write_bytes(b"\x89PNG\r\n\x1a\n")
        (d / "blank.txt").write_text("   \n")
    return d


@pytest.mark.parametrize(
    "kind,fragment", [("missing", "documents not found"), ("empty", "no files"), ("unreadable", "no readable text")]
)
def test_prefill_with_bad_docs_fails_and_leaves_the_old_cache(kind, fragment, cache_copy, prefilled, tmp_path):
    docs = tmp_path / "nowhere" if kind == "missing" else _make_docs(tmp_path, kind)
    before = snapshot(cache_copy)
    result = topk("prefill", docs, "--out", cache_copy, "--overwrite", "--model", prefilled[1])
    assert_one_line_error(result, fragment)
    assert_intact(cache_copy, before)


def test_prefill_with_a_missing_model_dir_fails(cache_copy, docs_dir, tmp_path):
    before = snapshot(cache_copy)
    result = topk("prefill", docs_dir, "--out", cache_copy, "--overwrite", "--model", tmp_path / "no-model")
    assert_one_line_error(result, "model directory not found")
    assert_intact(cache_copy, before)


def test_prefill_with_an_unsupported_model_type_fails(cache_copy, docs_dir, tmp_path):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    before = snapshot(cache_copy)
    result = topk("prefill", docs_dir, "--out", cache_copy, "--overwrite", "--model", gpt2)
    assert_one_line_error(result, "unsupported model type 'gpt2'")
    assert_intact(cache_copy, before)


def test_prefill_refuses_an_existing_cache_until_overwrite(cache_copy, docs_dir, prefilled):
    before = snapshot(cache_copy)
    result = topk("prefill", docs_dir, "--out", cache_copy, "--model", prefilled[1], "--device", "cpu")
    assert_one_line_error(result, "already exists", "--overwrite")
    assert_intact(cache_copy, before)
    result = topk("prefill", docs_dir, "--out", cache_copy, "--model", prefilled[1], "--device", "cpu", "--overwrite")
    assert result.exit_code == 0, result.output
    ckv = open_cache(cache_copy, verify=True)
    assert ckv.manifest["prefill"]["chunk_size"] == 4096  # the new cache, not the old (chunk 61)


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--strategy", "flat,nope"], "unknown strategy 'nope'"),
        (["--chunk-size", "0"], "--chunk-size must be a positive integer"),
        (["--dtype", "fp8"], "unknown dtype"),
        (["--device", "tpu"], "unknown device"),
        (["--opt", "nlist"], "key=value"),
    ],
)
def test_prefill_rejects_bad_options_before_any_work(args, fragment, docs_dir, prefilled, tmp_path):
    out = tmp_path / "new-cache"
    result = topk("prefill", docs_dir, "--out", out, "--model", prefilled[1], *args)
    assert_one_line_error(result, fragment)
    assert not out.exists()
    assert "wrote" not in result.stdout


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--k", "0"], "k must be a positive integer, got 0"),
        (["--k", "-3"], "k must be a positive integer, got -3"),
        (["--strategy", "nope"], "unknown strategy 'nope'"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--k", "abc"], "--k"),
        (["--prompt", "  "], "--prompt is empty"),
    ],
)
def test_chat_rejects_bad_options(args, fragment, cache_copy):
    before = snapshot(cache_copy)
    result = topk("chat", cache_copy, *args)
    assert_one_line_error(result, fragment)
    assert_intact(cache_copy, before)


def test_chat_refuses_a_model_with_another_fingerprint(cache_copy, model_factory):
    before = snapshot(cache_copy)
    other = model_factory("llama_gqa", seed=1)
    result = topk("chat", cache_copy, "--model", other, "--prompt", "hi")
    assert_one_line_error(result, "is not the model this cache was built with")
    assert_intact(cache_copy, before)


def test_chat_on_a_missing_cache_fails(tmp_path):
    assert_one_line_error(topk("chat", tmp_path / "nothing", "--prompt", "hi"), "cache not found")
    assert_one_line_error(topk("info", tmp_path), "is not a topk cache")


def test_truncated_cache_file_is_named(cache_copy):
    victim = cache_copy / "kv" / "keys.000.bin"
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    for cmd in (["chat", cache_copy, "--prompt", "hi"], ["info", cache_copy]):
        assert_one_line_error(topk(*cmd), "keys.000.bin", "truncated")


def test_corrupted_cache_file_fails_its_checksum(cache_copy):
    victim = cache_copy / "kv" / "values.001.bin"
    data = bytearray(victim.read_bytes())
    data[100:108] = bytes(b ^ 0xFF for b in data[100:108])
    victim.write_bytes(bytes(data))
    for cmd in (["chat", cache_copy, "--prompt", "hi"], ["info", cache_copy, "--verify"]):
        assert_one_line_error(topk(*cmd), "checksum mismatch", "values.001.bin")


# ---- positions past the model's maximum: refused at prefill (unless allowed), a warning at chat -----
def test_prefill_past_max_positions_is_refused_unless_allowed(short_model, docs_dir, tmp_path):
    result = topk("prefill", docs_dir, "--out", tmp_path / "c", "--model", short_model, "--device", "cpu")
    assert_one_line_error(result, "tokens but the model has 64 positions", "--allow-long-context")
    assert list(tmp_path.iterdir()) == []  # no cache, no partial directory, no lock left
    result = topk(
        "prefill", docs_dir, "--out", tmp_path / "c", "--model", short_model, "--device", "cpu", "--allow-long-context"
    )
    assert result.exit_code == 0, result.output
    assert any(line.startswith("warning: ") and "maximum positions (64)" in line for line in result.stderr.splitlines())


def test_chat_prompt_past_max_positions_warns_and_answers(short_model, tmp_path):
    (tmp_path / "note.txt").write_text("The fox sleeps.")
    cache = tmp_path / "c"
    assert topk("prefill", tmp_path / "note.txt", "--out", cache, "--model", short_model).exit_code == 0
    long_question = "Why does the quick brown fox jump over the lazy dog again and again? " * 3
    result = topk("chat", cache, "--prompt", long_question, "--max-new-tokens", 4)
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "maximum positions (64)" in warnings[0], result.stderr


# ---- interrupts and internal errors -----------------------------------------------------------------
@pytest.fixture
def interrupt_after_first_layer(monkeypatch):
    """Make the prefill raise KeyboardInterrupt right after the first layer's KV has been written."""
    from topk_decode.prefill import build

    real = build.prefill_layers

    def interrupted(model, ids, on_layer, *args, **kwargs):
        def first_layer_then_ctrl_c(layer, keys, values):
            on_layer(layer, keys, values)
            raise KeyboardInterrupt

        return real(model, ids, first_layer_then_ctrl_c, *args, **kwargs)

    monkeypatch.setattr(build, "prefill_layers", interrupted)


def _leftovers(parent: Path) -> list[Path]:
    return [p for p in parent.iterdir() if ".partial" in p.name or ".old" in p.name]


def test_interrupted_prefill_leaves_no_cache(interrupt_after_first_layer, docs_dir, prefilled, tmp_path):
    out = tmp_path / "cache"
    result = topk("prefill", docs_dir, "--out", out, "--model", prefilled[1], "--device", "cpu")
    assert result.exit_code == 130
    assert result.stderr.strip().splitlines()[-1] == "interrupted"
    assert not out.exists()
    assert all(not (p / MANIFEST).exists() for p in _leftovers(tmp_path))


def test_interrupted_overwrite_keeps_the_old_cache(interrupt_after_first_layer, cache_copy, docs_dir, prefilled):
    before = snapshot(cache_copy)
    result = topk("prefill", docs_dir, "--out", cache_copy, "--model", prefilled[1], "--overwrite")
    assert result.exit_code == 130
    assert_intact(cache_copy, before)
    assert all(not (p / MANIFEST).exists() for p in _leftovers(cache_copy.parent))


def test_internal_errors_are_one_line_unless_topk_debug(monkeypatch, prefilled):
    from topk_decode.cli import info_cmd

    def boom(*args, **kwargs):
        raise RuntimeError("something broke\nacross lines")

    monkeypatch.setattr(info_cmd, "cache_facts", boom)
    result = topk("info", prefilled[0])
    assert result.exit_code == 1
    assert_one_line_error(result, "internal error: RuntimeError: something broke across lines", "TOPK_DEBUG=1")
    monkeypatch.setenv("TOPK_DEBUG", "1")
    result = CliRunner().invoke(app, ["info", str(prefilled[0])])
    assert isinstance(result.exception, RuntimeError)


# ---- the real entry points ----------------------------------------------------------------------------
def _python_m(*args: object) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TOPK_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "topk_decode", *map(str, args)], capture_output=True, text=True, env=env, timeout=300
    )


def test_python_m_reports_a_truncated_cache_in_one_line_without_traceback(cache_copy):
    victim = cache_copy / "kv" / "keys.000.bin"
    with open(victim, "r+b") as f:
        f.truncate(10)
    proc = _python_m("chat", cache_copy, "--prompt", "hi")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: corrupted cache:") and "keys.000.bin" in proc.stderr


def test_python_m_info_json_and_help_without_torch(prefilled):
    proc = _python_m("info", prefilled[0], "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["n_tokens"] == open_cache(prefilled[0]).n_tokens
    # `topk --help` must stay fast: building the app must not import torch.
    code = "import sys; import topk_decode.cli.app; print('torch' in sys.modules)"
    probe = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert probe.stdout.strip() == "False", probe.stderr


def test_a_missing_dependency_is_named_not_an_internal_error(monkeypatch, prefilled):
    from topk_decode.cli import info_cmd

    def no_faiss(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'faiss'", name="faiss")

    monkeypatch.setattr(info_cmd, "cache_facts", no_faiss)
    result = topk("info", prefilled[0])
    assert result.exit_code == 2
    assert_one_line_error(result, "'faiss' is not installed")
