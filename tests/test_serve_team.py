"""`topk serve` with two caches of the demo model behind one loaded model, and concurrent requests decoded
together, against live servers on 127.0.0.1 with the real `openai` client.

`TOPK_TEST_SERVE_DEVICE=cuda` decodes on the GPU (as tests/test_serve.py). Cache `docs` holds examples/docs (four documents); cache `travel` only 04_travel_log.txt, where the
quiet-lynx fact is. Both were prefilled with the shipped demo model, so the server loads it once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from tests.test_serve import DEVICE, TIMEOUT, get, post, serve_in_thread  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = {  # examples/QUESTIONS.md
    "amber-fox": ("What is the special magic number for amber-fox?", "482"),
    "silver-owl": ("What is the special magic number for silver-owl?", "731"),
    "quiet-lynx": ("What is the special magic number for quiet-lynx?", "219"),
    "brave-otter": ("Which number does variable brave-otter equal?", "365"),
}


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> dict[str, Path]:
    """{"docs": examples/docs, "travel": 04_travel_log.txt alone}, each prefilled with the demo model on the CPU."""
    from topk_decode.demo import default_model_dir
    from topk_decode.prefill.build import build_cache

    model_dir, trained = default_model_dir()
    if not trained:
        pytest.skip("the trained demo model is not shipped in this checkout")
    base = tmp_path_factory.mktemp("team")
    travel_docs = base / "travel-docs"
    travel_docs.mkdir()
    (travel_docs / "04_travel_log.txt").write_text((ROOT / "examples/docs/04_travel_log.txt").read_text())
    out = {"docs": base / "docs", "travel": base / "travel"}
    build_cache(ROOT / "examples" / "docs", out["docs"], model_dir, device="cpu")
    build_cache(travel_docs, out["travel"], model_dir, device="cpu")
    return out


@pytest.fixture(scope="module")
def stores(caches):
    from topk_decode.api import KVStore

    docs = KVStore.open(caches["docs"], device=DEVICE, dtype="fp32")
    travel = KVStore.open(caches["travel"], device=DEVICE, dtype="fp32", share_model=docs)
    yield {"docs": docs, "travel": travel}
    travel.close()
    docs.close()


@pytest.fixture(scope="module")
def live(stores):
    from topk_decode.serve.app import Server

    yield from serve_in_thread(Server(stores, max_tokens_limit=1024, default_max_tokens=64, max_batch=4))


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live[0] + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


def ask(client, model: str, key: str, **kw):
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTIONS[key][0]}], max_tokens=24, **kw
    )


def text_of(r) -> str:
    if isinstance(r, openai.Stream):
        return "".join(c.choices[0].delta.content or "" for c in r if c.choices)
    return r.choices[0].message.content


def test_two_caches_are_two_models_over_one_loaded_model(client, live, stores):
    listed = client.models.list().data
    assert [m.id for m in listed] == ["docs", "travel"]
    extra = {m.id: m.model_extra for m in listed}
    assert extra["docs"]["documents"] == 4 and extra["travel"]["documents"] == 1
    assert extra["docs"]["context_tokens"] == stores["docs"].ckv.n_tokens
    assert extra["travel"]["context_tokens"] == stores["travel"].ckv.n_tokens
    assert stores["travel"].model is stores["docs"].model  # the weights once
    health = get(live[0], "/health")
    assert [m["id"] for m in health["models"]] == ["docs", "travel"] and "model" not in health


def test_each_request_is_answered_from_the_cache_its_model_names(client, stores):
    r = ask(client, "docs", "amber-fox")
    assert r.model == "docs" and "482" in r.choices[0].message.content
    assert r.usage.prompt_tokens_details.cached_tokens == stores["docs"].ckv.n_tokens
    r = ask(client, "travel", "quiet-lynx")
    assert r.model == "travel" and "219" in r.choices[0].message.content
    assert r.usage.prompt_tokens_details.cached_tokens == stores["travel"].ckv.n_tokens
    assert [s["document"] for s in r.model_extra["sources"]] == ["04_travel_log.txt"]
    assert r.choices[0].message.content == stores["travel"].ask(QUESTIONS["quiet-lynx"][0], max_new_tokens=24)


def test_an_unknown_model_is_a_404_listing_the_served_ones(client, live):
    with pytest.raises(openai.NotFoundError) as e:
        ask(client, "gpt-4o", "amber-fox")
    err = e.value.body
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "'docs'" in err["message"] and "'travel'" in err["message"]
    # without `model`, a server of two caches cannot guess: a 400 naming them
    status, answer = post(
        live[0], "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    )
    assert status == 400 and answer["error"]["param"] == "model" and "'travel'" in answer["error"]["message"]


def test_metrics_and_log_lines_carry_the_model(client, live, caplog):
    import logging

    from tests.test_serve import scrape

    caplog.set_level(logging.INFO, logger="topk_decode.serve")
    before = scrape(live[0])
    r = ask(client, "travel", "quiet-lynx")
    after = scrape(live[0])

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("topk_completion_tokens_total", model="travel") == r.usage.completion_tokens
    assert delta("topk_completion_tokens_total", model="docs") == 0
    assert delta("topk_requests_total", route="/v1/chat/completions", status="200", model="travel") == 1
    deadline = time.monotonic() + 10
    while not any(m.startswith(r.id) for m in caplog.messages):
        assert time.monotonic() < deadline, caplog.messages
        time.sleep(0.05)
    assert " model=travel " in next(m for m in caplog.messages if m.startswith(r.id))


def test_concurrent_clients_are_decoded_together_and_get_their_serial_answers(client, live):
    """8 requests over both caches, 4 at a time (the server's max_batch), half streamed: each answer equals the
    one the same request gets alone, and the steps were shared (bounded: 8 requests, 10 minutes)."""
    jobs = [
        ("docs", "amber-fox"),
        ("docs", "silver-owl"),
        ("travel", "quiet-lynx"),
        ("docs", "brave-otter"),
        ("docs", "quiet-lynx"),
        ("travel", "quiet-lynx"),
        ("docs", "amber-fox"),
        ("travel", "amber-fox"),
    ]
    serial = [text_of(ask(client, m, k)) for m, k in jobs]
    health0 = get(live[0], "/health")
    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        futures = [
            pool.submit(lambda m, k, s: text_of(ask(client, m, k, stream=s)), m, k, i % 2 == 1)
            for i, (m, k) in enumerate(jobs)
        ]
        got = [f.result(timeout=TIMEOUT * 4) for f in futures]
    assert time.monotonic() - t0 < 600
    assert got == serial
    for (m, k), text in zip(jobs, got):
        if m == "docs" or k == "quiet-lynx":
            assert QUESTIONS[k][1] in text, (m, k, text)
    health = get(live[0], "/health")
    steps = health["batched_steps"] - health0["batched_steps"]
    stepped = health["batched_requests"] - health0["batched_requests"]
    assert stepped > steps > 0  # some steps held several requests
    assert health["running"] == 0 and health["queue"] == 0


def test_one_cache_served_alone_takes_requests_without_model(stores):
    from topk_decode.serve.app import Server

    for base, _ in serve_in_thread(Server({"travel": stores["travel"]}, default_max_tokens=24)):
        status, answer = post(
            base,
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": QUESTIONS["quiet-lynx"][0]}]}),
        )
        assert status == 200 and answer["model"] == "travel" and "219" in answer["choices"][0]["message"]["content"]


def test_model_ids_are_folder_names_told_apart_by_their_parents(tmp_path):
    from topk_decode.cli.serve_cmd import model_ids
    from topk_decode.errors import TopkError

    a, b, c = tmp_path / "team-a" / "cache", tmp_path / "team-b" / "cache", tmp_path / "manuals"
    assert model_ids([c], []) == ["manuals"]
    assert model_ids([a, b, c], []) == ["team-a/cache", "team-b/cache", "manuals"]
    assert model_ids([a, c], ["x", "y"]) == ["x", "y"]
    with pytest.raises(TopkError, match="given twice"):
        model_ids([a, a], [])
    with pytest.raises(TopkError, match="once per cache"):
        model_ids([a, c], ["x"])


def test_topk_serve_command_serves_two_caches_over_one_loaded_model(caches):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "topk_decode",
            "serve",
            str(caches["docs"]),
            str(caches["travel"]),
            "--port",
            "0",
            "--device",
            "cpu",
            "--max-tokens",
            "24",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # printed once the models are loaded and the port bound
        assert line.startswith(f"serving {caches['docs']} as model 'docs' ("), line
        assert f"{caches['travel']} as model 'travel' (" in line and "2 caches over 1 loaded model" in line
        base = line.split(" on ")[1].split("/v1")[0]
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
        deadline = time.monotonic() + 60
        while True:
            try:
                listed = [m.id for m in client.models.list().data]
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
                time.sleep(0.2)
        assert listed == ["docs", "travel"]
        assert "219" in ask(client, "travel", "quiet-lynx").choices[0].message.content
        with pytest.raises(openai.NotFoundError):
            ask(client, "nope", "quiet-lynx")
    finally:
        proc.send_signal(subprocess.signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_topk_serve_with_a_cache_given_twice_is_one_error_line(caches):
    from typer.testing import CliRunner

    from topk_decode.cli.app import app

    result = CliRunner().invoke(app, ["serve", str(caches["docs"]), str(caches["docs"]), "--device", "cpu"])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: the cache {caches['docs'].resolve()} is given twice"


def test_only_caches_whose_rows_are_independent_are_batched(caches, stores):
    """flat's batched step shares its scan; routed's was slower than its serial steps on the GPU host, so a routed
    cache keeps its own steps even when it shares the model with a batched flat cache."""
    from topk_decode.api import KVStore
    from topk_decode.serve.worker import DecodeWorker

    routed = KVStore.open(caches["travel"], strategy="routed", device=DEVICE, dtype="fp32", share_model=stores["docs"])
    served = stores["docs"].decoder.batcher  # the live server's, put back after
    try:
        assert stores["docs"].decoder.strategy.rows_independent and not routed.decoder.strategy.rows_independent
        worker = DecodeWorker({"docs": stores["docs"], "routed": routed}, max_batch=4)
        try:
            assert len(worker.batchers) == 1
            assert stores["docs"].decoder.batcher is worker.batchers[0] and routed.decoder.batcher is None
        finally:
            worker.close()
    finally:
        stores["docs"].decoder.batcher = served
        routed.close()
