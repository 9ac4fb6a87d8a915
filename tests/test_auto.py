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


def test_choose_is_exact_up_to_the_threshold_and_routed_rank_keys_beyond_on_a_gpu():
    assert auto.choose(1).strategy == "flat"
    assert auto.choose(auto.EXACT_MAX_TOKENS).strategy == "flat" and auto.choose(1).options == {}
    beyond = auto.choose(auto.EXACT_MAX_TOKENS + 1)
    assert (beyond.strategy, beyond.options) == ("routed", {"rank": "keys", "pq_values": 32})
    assert "≤" in auto.choose(100).reason and ">" in beyond.reason and "rank=keys" in beyond.reason
    # on a CPU rank=keys would run its torch path (flat's scan and more): the exact scan at every length
    cpu = auto.choose(10**6, gpu=False)
    assert (cpu.strategy, cpu.options) == ("flat", {}) and "CPU" in cpu.reason
    assert auto.resolve("quest", 10**6) == auto.AutoChoice("quest", "chosen by the user")
    assert auto.resolve(auto.AUTO, 10**6, gpu=False) == cpu


def test_auto_is_the_default_strategy():
    import inspect

    assert DecodeConfig().strategy == auto.AUTO
    assert inspect.signature(KVStore.open).parameters["strategy"].default is None  # None: DecodeConfig's
    from topk_decode.api import decode_config

    assert decode_config(strategy=None).strategy == auto.AUTO
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


def test_open_without_a_strategy_on_a_cpu_runs_flat_past_the_threshold(built_cache, monkeypatch):
    cache, _ = built_cache
    monkeypatch.setattr(auto, "EXACT_MAX_TOKENS", 16)
    with KVStore.open(cache, k=8, device="cpu") as store:
        assert store.config.strategy == "flat" and "CPU" in store.strategy_reason
    with KVStore.open(cache, k=8, strategy="routed", device="cpu") as store:  # routed stays one flag away
        assert store.config.strategy == "routed" and store.strategy_reason == "chosen by the user"


def test_auto_passes_its_options_and_the_users_win(built_cache, tmp_path, monkeypatch):
    """What a GPU decode resolves to (routed rank=keys), opened here on the CPU through `resolve`'s gpu flag:
    auto's options reach the strategy, and an option the user gives overrides auto's."""
    import shutil

    from topk_decode.decode import engine

    cache = tmp_path / "cache"  # routed builds its artifacts into the cache: not the shared one
    shutil.copytree(built_cache[0], cache)
    monkeypatch.setattr(auto, "EXACT_MAX_TOKENS", 16)
    on_cpu = auto.resolve
    monkeypatch.setattr(engine.auto, "resolve", lambda name, n, gpu=True: on_cpu(name, n, gpu=True))
    with KVStore.open(cache, k=8, device="cpu") as store:
        assert store.config.strategy == "routed" and "rank=keys" in store.strategy_reason
        assert store.config.strategy_options == {"rank": "keys", "pq_values": 32}
        o = store.decoder.strategy.options
        d = store.decoder.strategy.ckv.head_dim
        assert o.rank == "keys" and o.pq_m == min(128, d) and o.pq_values == d // 2  # key codes: a dimension each
        first = store.ask("What is in the documents?", max_new_tokens=3)
    with KVStore.open(cache, k=8, device="cpu", strategy_options={"rank": "clusters"}) as store:
        assert store.decoder.strategy.options.rank == "clusters"
    assert isinstance(first, str)


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
    assert facts["auto"]["options"] == (auto.FAST_OPTIONS if built else {}) and facts["auto_cpu"]["strategy"] == "flat"
    if built:  # with the key and value codes rank=keys ranks and estimates by: the first question waits for no build
        from topk_decode.index.artifacts import recorded_options

        recorded = recorded_options(out, "routed")
        assert recorded["pq_values"] > 0 and recorded["pq_m"] == 2 * recorded["pq_values"]  # D and D/2 sub-vectors
    assert ("routed" in facts["strategies"]) == built  # ready: the first question waits for no build
    text = CliRunner().invoke(app, ["info", str(out)]).stdout
    assert f"auto runs {'routed rank=keys' if built else 'flat'}" in text


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
