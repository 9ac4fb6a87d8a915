"""Long prefills on pre-emptible machines: SIGTERM, plain progress lines in logs, kill -9 then --resume."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_cache_safety import _python_m, deep_model  # noqa: F401 - deep_model is a fixture
from test_cli import assert_one_line_error, snapshot, topk

from topk_decode.store.cache_dir import open_cache
from topk_decode.store.format import MANIFEST, partial_path
from topk_decode.store.manifest import CHECKSUM_FIELD


# ---- 8: SIGTERM, plain progress lines, kill -9 then --resume ----------------------------------------
def test_progress_lines_when_stderr_is_not_a_terminal(tmp_path, docs_dir, deep_model):
    result = topk(
        "prefill",
        docs_dir,
        "--out",
        tmp_path / "cache",
        "--model",
        deep_model,
        "--device",
        "cpu",
        "--log-every",
        0,
        "--chunk-size",
        200,
    )
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("prefill: ")]
    assert len(lines) >= 5 and lines[-1].startswith("prefill: 100% (5/5 layers done")


def _cache_bytes(cache: Path) -> dict[str, bytes]:
    """Every file's bytes, the manifest's run-dependent fields (timings, date, its checksum) left out."""
    files = snapshot(cache)
    m = json.loads(files.pop(MANIFEST))
    for key in ("created", "prefill", CHECKSUM_FIELD):
        m.pop(key)
    files[MANIFEST] = json.dumps(m, sort_keys=True).encode()
    return files


def _wait(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


@pytest.mark.parametrize("kv", [[], ["--kv-dtype", "int8"]], ids=["model-dtype", "int8"])
def test_kill_9_mid_layer_then_resume_equals_an_uninterrupted_prefill(tmp_path, docs_dir, deep_model, kv):
    args = ["--model", deep_model, "--device", "cpu", "--chunk-size", 97, *kv]
    reference = tmp_path / "reference"
    assert topk("prefill", docs_dir, "--out", reference, *args).exit_code == 0
    out = tmp_path / "cache"
    # Dies (SIGKILL) half-way through writing layer 3's keys; a checkpoint follows every layer.
    rc, err = _wait(
        _python_m(
            "prefill",
            docs_dir,
            "--out",
            out,
            *args,
            "--checkpoint-every",
            0,
            env={"TOPK_TEST_DIE_WRITING": "kv/keys.003.bin"},
        )
    )
    assert rc == -signal.SIGKILL, err
    partial = partial_path(out)
    assert not out.exists() and not (partial / MANIFEST).exists()
    assert_one_line_error(topk("info", out), "cache not found", "--resume")
    assert (partial / "kv" / "keys.003.bin").stat().st_size < (partial / "kv" / "keys.002.bin").stat().st_size
    # Without --resume the kept work is neither lost nor silently reused.
    assert_one_line_error(topk("prefill", docs_dir, "--out", out, *args), "finished layer(s)", "--resume")
    result = topk("prefill", docs_dir, "--out", out, *args, "--resume")
    assert result.exit_code == 0, result.output
    assert "resuming at layer 3 of 5" in result.stderr
    assert open_cache(out, verify=True).manifest["prefill"]["resumed_at_layer"] == 3
    assert _cache_bytes(out) == _cache_bytes(reference)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "reference"]


def test_resume_with_other_inputs_starts_over(tmp_path, docs_dir, deep_model):
    out = tmp_path / "cache"
    rc, err = _wait(
        _python_m(
            "prefill",
            docs_dir,
            "--out",
            out,
            "--model",
            deep_model,
            "--device",
            "cpu",
            "--chunk-size",
            97,
            "--checkpoint-every",
            0,
            env={"TOPK_TEST_DIE_WRITING": "kv/values.002.bin"},
        )
    )
    assert rc == -signal.SIGKILL, err
    result = topk(
        "prefill", docs_dir, "--out", out, "--model", deep_model, "--device", "cpu", "--chunk-size", 64, "--resume"
    )
    assert result.exit_code == 0, result.output
    assert "nothing to resume" in result.stderr and "chunk_size" in result.stderr
    assert open_cache(out, verify=True).manifest["prefill"]["resumed_at_layer"] == 0


@pytest.mark.parametrize("checkpoint_every,kept", [(0, True), (3600, False)], ids=["checkpointed", "no-checkpoint"])
def test_sigterm_stops_cleanly_keeping_only_resumable_work(tmp_path, docs_dir, deep_model, checkpoint_every, kept):
    out = tmp_path / "cache"
    proc = _python_m(
        "prefill",
        docs_dir,
        "--out",
        out,
        "--model",
        deep_model,
        "--device",
        "cpu",
        "--chunk-size",
        97,
        "--checkpoint-every",
        checkpoint_every,
        env={"TOPK_TEST_WRITE_DELAY_S": "0.5"},
    )
    deadline = time.monotonic() + 120
    while not (partial_path(out) / "kv" / "values.001.bin").exists():  # layer 1 is being written
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else ""
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    rc, err = _wait(proc)
    assert rc == 143, err
    assert err.strip().splitlines()[-1] == "terminated" and "Traceback" not in err
    assert not out.exists()
    assert partial_path(out).exists() == kept
    assert ("--resume to continue" in err) == kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ([partial_path(out).name] if kept else [])
    if kept:
        result = topk(
            "prefill", docs_dir, "--out", out, "--model", deep_model, "--device", "cpu", "--chunk-size", 97, "--resume"
        )
        assert result.exit_code == 0 and "resuming at layer" in result.stderr, result.output
        open_cache(out, verify=True)
