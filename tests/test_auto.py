"""`auto`, the default strategy: which strategy it picks, that it is the default everywhere, and that
`topk prefill` builds what it will need."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from topk_decode import KVStore
from topk_decode.cli.app import app
from topk_decode.config import DecodeConfig
from topk_decode.index import auto
from topk_decode.index.artifacts import artifact_dir


def test_choose_is_exact_up_to_the_threshold_and_routed_beyond():
    assert auto.choose(1).strategy == "flat"
    assert auto.choose(auto.EXACT_MAX_TOKENS).strategy == "flat"
    assert auto.choose(auto.EXACT_MAX_TOKENS + 1).strategy == "routed"
    assert "≤" in auto.choose(100).reason and ">" in auto.choose(10**6).reason
    assert auto.resolve("quest", 10**6) == auto.AutoChoice("quest", "chosen by the user")


def test_auto_is_the_default_strategy():
    import inspect

    assert DecodeConfig().strategy == auto.AUTO
    assert inspect.signature(KVStore.open).parameters["strategy"].default == auto.AUTO
    from topk_decode.cli.chat_cmd import chat_command
    from topk_decode.cli.serve_cmd import serve_command

    for cmd in (chat_command, serve_command):
        assert inspect.signature(cmd).parameters["strategy"].default == auto.AUTO


def test_open_without_a_strategy_runs_flat_on_a_short_context_and_says_why(built_cache):
    cache, model_dir = built_cache
    with KVStore.open(cache, k=8, device="cpu") as store:
        assert store.config.strategy == "flat"
        assert store.strategy_reason.startswith("auto:") and "exact" in store.strategy_reason
        assert store.info()["strategy"] == "flat"


def test_open_without_a_strategy_runs_routed_past_the_threshold(built_cache, tmp_path, monkeypatch):
    import shutil

    cache = tmp_path / "cache"  # routed builds its artifacts into the cache: not the shared one
    shutil.copytree(built_cache[0], cache)
    monkeypatch.setattr(auto, "EXACT_MAX_TOKENS", 16)
    with KVStore.open(cache, k=8, device="cpu") as store:
        assert store.config.strategy == "routed"
        assert "routed" in store.strategy_reason
    with KVStore.open(cache, k=8, strategy="flat", device="cpu") as store:  # flat stays one flag away
        assert store.config.strategy == "flat" and store.strategy_reason == "chosen by the user"


@pytest.mark.parametrize("threshold, built", [(16, True), (None, False)])
def test_prefill_builds_what_auto_will_run(tmp_path, model_factory, docs_dir, monkeypatch, threshold, built):
    import json

    model_dir = model_factory("llama_gqa")
    if threshold is not None:
        monkeypatch.setattr(auto, "EXACT_MAX_TOKENS", threshold)
    out = tmp_path / "cache"
    r = CliRunner().invoke(
        app, ["prefill", str(docs_dir), "--out", str(out), "--model", str(model_dir), "--device", "cpu"]
    )
    assert r.exit_code == 0, r.output
    assert artifact_dir(out, "routed").is_dir() == built
    info = CliRunner().invoke(app, ["info", str(out), "--json"])
    facts = json.loads(info.stdout)
    assert facts["auto"]["strategy"] == ("routed" if built else "flat")
    assert ("routed" in facts["strategies"]) == built  # ready: the first question waits for no build
    text = CliRunner().invoke(app, ["info", str(out)]).stdout
    assert f"auto runs {'routed' if built else 'flat'}" in text


@pytest.mark.parametrize("strategy", ["auto", "flat"])
def test_chat_accepts_auto_and_flat(built_cache, strategy):
    cache, _ = built_cache
    r = CliRunner().invoke(
        app,
        [
            "chat",
            str(cache),
            "--strategy",
            strategy,
            "--k",
            "8",
            "--device",
            "cpu",
            "--prompt",
            "hello",
            "--max-new-tokens",
            "2",
        ],
    )
    assert r.exit_code == 0, r.output


def test_unknown_strategy_names_auto_among_the_choices(built_cache):
    cache, _ = built_cache
    r = CliRunner().invoke(app, ["chat", str(cache), "--strategy", "bogus", "--prompt", "x"])
    assert r.exit_code != 0 and "auto" in r.stderr and "bogus" in r.stderr
