"""`topk bench --streams` (bench/streams.py) on the CPU: over the demo cache and over a random-weight shape, the rows
have their fields and sane values. No timing decides a test here: counts, orders and p50 ≤ p99 only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from topk_decode.bench.streams import percentile
from topk_decode.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4
LONG = 600  # tokens of the long prompt: ten pieces of 64


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory) -> Path:
    """examples/docs prefilled with the shipped demo model, on the CPU."""
    from topk_decode.demo import default_model_dir
    from topk_decode.prefill.build import build_cache

    model_dir, trained = default_model_dir()
    if not trained:
        pytest.skip("the trained demo model is not shipped in this checkout")
    out = tmp_path_factory.mktemp("streams") / "demo-cache"
    build_cache(ROOT / "examples" / "docs", out, model_dir, device="cpu")
    return out


@pytest.fixture(scope="module")
def demo_run(demo_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-streams")
    args = ["bench", "--streams", "1,2", "--cache", str(demo_cache), "--device", "cpu", "--k", "64"]
    args += ["--steps", str(STEPS), "--long-prompt", str(LONG), "--prompt-chunk-tokens", "64", "--out", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    return json.loads((out / "bench_streams_demo-cache.json").read_text()), res


def check_row(row: dict, streams: int) -> None:
    assert row["streams"] == streams and row["steps"] == STEPS
    assert row["tokens_generated"] == streams * STEPS
    assert len(row["per_stream"]) == streams and all(s["tokens"] == STEPS for s in row["per_stream"])
    assert row["tokens_per_s"] > 0 and row["wall_s"] >= 0
    assert 0 <= row["ttft_ms_p50"] <= row["ttft_ms_max"]
    assert 0 <= row["itl_ms_p50"] <= row["itl_ms_p99"]
    for s in row["per_stream"]:
        assert s["ttft_ms"] >= 0 and 0 <= s["itl_ms_p50"] <= s["itl_ms_p99"]
    assert row["batching"] == (streams + bool(row["long_prompt_tokens"]) > 1)  # flat: batched as the server does
    assert 1 <= row["mean_batch"] <= streams + 1


def test_streams_over_the_demo_cache_give_a_row_per_count_and_long_prompt(demo_run):
    data, _ = demo_run
    assert data["timing_only"] is False and data["strategy"] == "flat" and data["device"] == "cpu"
    rows = data["rows"]
    assert [(r["streams"], r["long_prompt_tokens"]) for r in rows] == [(1, 0), (1, LONG), (2, 0), (2, LONG)]
    for r in rows:
        check_row(r, r["streams"])
        assert r["prompt_chunk_tokens"] == 64 and r["timing_only"] is False
    quiet = [r for r in rows if not r["long_prompt_tokens"]]
    assert not any("long_prefill_s" in r for r in quiet)


def test_short_streams_get_their_first_tokens_while_the_long_prompt_goes_through(demo_run):
    """The order the scheduling promises (serve/turns.py): the short streams start during the long prompt's
    prefill and each has its first token before the long prompt has its own; their gaps during it are counted."""
    data, _ = demo_run
    for r in (r for r in data["rows"] if r["long_prompt_tokens"]):
        assert r["long_prefill_s"] > 0
        assert r["short_first_tokens_before_long"] is True
        assert 0 <= r["itl_during_long_count"] <= r["streams"] * (STEPS - 1)
        if r["itl_during_long_count"]:
            assert 0 <= r["itl_during_long_ms_p50"] <= r["itl_during_long_ms_p99"]
        assert r["turns_waited_out"] == 0


def test_with_pieces_as_long_as_the_prompt_the_short_streams_wait_for_all_of_it(demo_cache, tmp_path):
    """--prompt-chunk-tokens ≥ the long prompt is the server before issue 53: the long prompt in one step, and the
    short stream's first token only after the long prompt's."""
    args = ["bench", "--streams", "1", "--cache", str(demo_cache), "--device", "cpu", "--k", "64"]
    args += ["--steps", str(STEPS), "--long-prompt", str(LONG), "--prompt-chunk-tokens", str(LONG)]
    args += ["--out", str(tmp_path)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    rows = json.loads((tmp_path / "bench_streams_demo-cache.json").read_text())["rows"]
    (row,) = [r for r in rows if r["long_prompt_tokens"]]
    check_row(row, 1)
    assert row["short_first_tokens_before_long"] is False and row["itl_during_long_count"] == 0


def test_the_table_and_the_note_are_printed(demo_run):
    _, res = demo_run
    assert "topk bench --streams" in res.stdout and "TTFT p50 ms" in res.stdout and "firsts before long" in res.stdout
    assert "note: results: " in res.stderr and "timing only" not in res.stderr


def test_a_random_weight_shape_says_its_rows_are_timing_only(tmp_path):
    args = ["bench", "--streams", "2", "--model", "tiny", "--context", "512", "--device", "cpu", "--k", "32"]
    res = CliRunner().invoke(app, args + ["--steps", "3", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "bench_streams_tiny.json").read_text())
    assert data["timing_only"] is True and "timing only" in data["what"]
    (row,) = data["rows"]
    assert row["streams"] == 2 and row["tokens_generated"] == 6 and row["timing_only"] is True
    assert "rows are timing only" in res.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--streams", "0"], "--streams must list stream counts of at least 1"),
        (["--streams", "1,x"], "--streams must list stream counts such as 1,2,4,8, got '1,x'"),
        (["--streams", "1", "--context", "32K,64K"], "--streams runs over one --context length"),
        (["--streams", "1", "--cache", "/nonexistent/cache"], "--cache /nonexistent/cache: no such cache directory"),
        (["--streams", "1", "--long-prompt", "lots"], "cannot read 'lots' as a context length"),
        (["--streams", "1", "--prompt-chunk-tokens", "0"], "--prompt-chunk-tokens must be positive"),
        (["--long-prompt", "20K"], "--long-prompt goes with --streams"),
        (["--cache", "x"], "--cache goes with --streams"),
        (["--streams", "1", "--model", "tiny", "--kv-dtype", "int4"], "int4"),
    ],
)
def test_bad_stream_options_are_one_error_line(args, message):
    res = CliRunner().invoke(app, ["bench", *args, "--device", "cpu"])
    assert res.exit_code != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res.stderr


def test_a_long_prompt_past_the_window_is_one_error_line(demo_cache, tmp_path):
    args = ["bench", "--streams", "1", "--cache", str(demo_cache), "--device", "cpu", "--long-prompt", "100000"]
    res = CliRunner().invoke(app, args + ["--out", str(tmp_path)])
    assert res.exit_code != 0
    assert res.stderr.strip().splitlines()[-1].startswith("error: --long-prompt 100000 does not fit")


@pytest.mark.parametrize(
    "values, q, expected",
    [([], 50, None), ([3.0], 99, 3.0), ([1.0, 2.0, 3.0, 4.0], 50, 2.5), ([0.0, 10.0], 99, 9.9)],
)
def test_percentile_interpolates_between_ranks(values, q, expected):
    got = percentile(values, q)
    assert got == pytest.approx(expected) if expected is not None else got is None


def test_a_named_shape_streams_over_int8_kv_and_a_cache_refuses_a_kv_dtype(demo_cache, tmp_path):
    args = ["bench", "--streams", "1", "--model", "tiny", "--context", "512", "--device", "cpu", "--k", "32"]
    res = CliRunner().invoke(app, args + ["--steps", "2", "--kv-dtype", "int8", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "int8" in json.loads((tmp_path / "bench_streams_tiny.json").read_text())["what"]
    res = CliRunner().invoke(app, ["bench", "--streams", "1", "--cache", str(demo_cache), "--kv-dtype", "int8"])
    assert res.exit_code != 0 and res.stderr.strip() == (
        "error: --kv-dtype applies to a named shape's random KV; a cache keeps the KV dtype it was made with"
    )
