"""A cache grown by `topk prefill --append` while `topk serve` serves it (issue 53 item 4): new requests are answered
from the new version without a restart, a request in flight during the append finishes on the version it started
on, and a path that stops holding a usable cache leaves the served version serving.

The served cache holds examples/docs without 04_travel_log.txt, where the quiet-lynx fact is (219): before the
append the demo model answers 932, after it 219. Each test serves its own copy of that cache (live servers on
127.0.0.1, the real `openai` client), watched every WATCH_S seconds so that the tests need not wait long.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from tests.test_serve import DEVICE, TIMEOUT, get, serve_in_thread  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is the special magic number for quiet-lynx?"
OLD_ANSWER = "The special magic number for quiet-lynx is 932."  # without the travel log (checked below)
NEW_ANSWER = "The special magic number for quiet-lynx is 219."
TRAVEL = "04_travel_log.txt"
WATCH_S = 0.1
K = 64  # served with k=64 and strategy auto: a new version is opened alike


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """{"cache": examples/docs but the travel log, prefilled with the demo model on the CPU; "travel": a folder
    holding the travel log alone}."""
    from topk_decode.demo import default_model_dir
    from topk_decode.prefill.build import build_cache

    model_dir, trained = default_model_dir()
    if not trained:
        pytest.skip("the trained demo model is not shipped in this checkout")
    base = tmp_path_factory.mktemp("append-serve")
    docs, travel = base / "docs-in", base / "travel-in"
    for name in sorted(os.listdir(ROOT / "examples" / "docs")):
        target = travel if name == TRAVEL else docs
        target.mkdir(exist_ok=True)
        shutil.copy(ROOT / "examples" / "docs" / name, target / name)
    build_cache(docs, base / "cache", model_dir, device="cpu")
    return {"cache": base / "cache", "travel": travel}


@pytest.fixture
def served(made, tmp_path, request):
    """(base_url, Server, cache path): a fresh copy of the cache served as model 'docs', next to a second cache
    'other' over the same loaded model (another copy, never appended to); max_batch 8, or the test's parameter."""
    from topk_decode.api import KVStore
    from topk_decode.serve.app import Server

    path, other_path = tmp_path / "docs", tmp_path / "other"
    shutil.copytree(made["cache"], path)
    shutil.copytree(made["cache"], other_path)
    stores = {"docs": KVStore.open(path, k=K, device=DEVICE, dtype="fp32")}
    stores["other"] = KVStore.open(other_path, k=K, device=DEVICE, dtype="fp32", share_model=stores["docs"])
    server = Server(
        stores, max_tokens_limit=1024, default_max_tokens=64, watch_s=WATCH_S, max_batch=getattr(request, "param", 8)
    )
    del stores  # a version swapped out is the server's to close (and to free: nothing else may hold it)
    try:
        for base, _ in serve_in_thread(server):
            yield base, server, path
    finally:
        for store in server.stores.values():
            store.close()


@pytest.fixture
def logs():
    """The records of the server's logger (topk_decode.serve), INFO and up."""
    from topk_decode.serve.metrics import LOG

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    level = LOG.level
    LOG.addHandler(handler)
    LOG.setLevel(logging.INFO)
    yield records
    LOG.removeHandler(handler)
    LOG.setLevel(level)


def client_of(base: str):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


def ask(client, model: str = "docs", **kw):
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=24, **kw
    )


def card(base: str, model: str = "docs") -> dict:
    return next(m for m in get(base, "/v1/models")["data"] if m["id"] == model)


def wait_for(condition, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def append(made, path: Path) -> int:
    """`topk prefill TRAVEL --append PATH` in process; the appended cache's token count."""
    from topk_decode.prefill.append import append_cache

    append_cache(made["travel"], path, device="cpu")
    return json.loads((path / "manifest.json").read_text())["n_tokens"]


def swap(a: Path, b: Path) -> None:
    """Exchange two folders in one atomic rename (as a prefill swaps its cache in): `b` never goes missing."""
    from topk_decode.store.locking import exchange

    if not exchange(a, b):
        pytest.skip("no atomic exchange of folders here (renameat2)")


def sources(response) -> list[str]:
    return [s["document"] for s in (response.model_extra or {}).get("sources", [])]


def test_new_requests_are_answered_from_the_appended_cache_without_a_restart(made, served, logs):
    base, server, path = served
    client = client_of(base)
    old, other = server.stores["docs"], server.stores["other"]
    before = card(base)
    assert before["documents"] == 3 and before["context_tokens"] == old.ckv.n_tokens
    r = ask(client)
    assert r.choices[0].message.content == OLD_ANSWER and TRAVEL not in sources(r)

    n = append(made, path)
    wait_for(lambda: card(base)["context_tokens"] == n, "the appended cache to be served")

    after = card(base)
    assert after["documents"] == 4 and n > before["context_tokens"]
    health = {m["id"]: m for m in get(base, "/health")["models"]}
    assert health["docs"] == {"id": "docs", "context_tokens": n, "documents": 4}
    r = ask(client)
    assert r.choices[0].message.content == NEW_ANSWER and TRAVEL in sources(r)
    assert r.usage.prompt_tokens_details.cached_tokens == n
    # the other cache over the same model is untouched and still answers from its own documents
    assert server.stores["other"] is other and card(base, "other")["context_tokens"] == before["context_tokens"]
    assert ask(client, "other").choices[0].message.content == OLD_ANSWER
    # opened as the first version was (k, and auto as asked), over the loaded model, its steps batched with the others'
    new = server.stores["docs"]
    assert new.config.k == K and new.requested_strategy == "auto" and new.model is old.model
    assert new.decoder.lock is other.decoder.lock and new.decoder.batcher is other.decoder.batcher is not None
    assert len(server.worker.batchers) == 1
    wait_for(lambda d=old.decoder: d.closed, "the old version to be closed")  # no job used it: closed at once
    assert not new.decoder.closed and not other.decoder.closed
    gone = weakref.ref(old)
    del old
    wait_for(lambda: gone() is None, "the old version to be freed")  # its maps and index with it
    lines = [r.getMessage() for r in logs if r.getMessage().startswith("cache docs:")]
    assert lines == [f"cache docs: now {n:,} tokens, 4 documents (appended; strategy flat); new requests use it"]


@pytest.mark.parametrize("served", [1], indirect=True)  # max_batch 1: one request decodes, the next one waits
def test_requests_in_flight_during_an_append_finish_on_the_version_they_started_on(made, served, monkeypatch):
    base, server, path = served
    client, worker = client_of(base), server.worker
    old = server.stores["docs"]
    n_old = old.ckv.n_tokens
    # the old version's steps wait at a gate: requests on it stay in flight for as long as the test says
    gate, entered, forward = threading.Event(), threading.Event(), old.decoder.forward

    def gated(ids, conv):
        entered.set()
        assert gate.wait(TIMEOUT)
        return forward(ids, conv)

    monkeypatch.setattr(old.decoder, "forward", gated)

    def stream() -> tuple[str, list, object]:
        parts, last, usage = [], None, None
        for chunk in ask(client, stream=True, stream_options={"include_usage": True}):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                last = chunk if chunk.choices[0].finish_reason else last
            usage = chunk.usage or usage
        return "".join(parts), sources(last), usage

    def prepared(store) -> bool:  # a request prepared on `store` waits for the decoding thread
        with worker._count:
            return any(job.store is store for job in worker.pending)

    with ThreadPoolExecutor(3) as pool:
        decoding = pool.submit(stream)  # decoding on the old version, held at the gate
        assert entered.wait(TIMEOUT), "the request did not start"
        queued = pool.submit(stream)  # prepared on the old version, waiting for the decoding thread
        wait_for(lambda: prepared(old), "the second request to be prepared")
        n = append(made, path)
        wait_for(lambda: card(base)["context_tokens"] == n, "the appended cache to be served")
        new = server.stores["docs"]
        assert new is not old and not old.decoder.closed  # in use: kept open
        later = pool.submit(stream)  # sent after the append: prepared on the new version
        wait_for(lambda: prepared(new), "the third request to be prepared")
        assert not decoding.done() and not queued.done()
        gate.set()
        answers = [f.result(TIMEOUT) for f in (decoding, queued, later)]
    for text, cited, usage in answers[:2]:  # the same tokens as before the append
        assert text == OLD_ANSWER and TRAVEL not in cited and usage.prompt_tokens_details.cached_tokens == n_old
    text, cited, usage = answers[2]
    assert text == NEW_ANSWER and TRAVEL in cited and usage.prompt_tokens_details.cached_tokens == n
    wait_for(lambda: old.decoder.closed, "the old version to be closed once its last request ended")
    assert not new.decoder.closed


def test_a_path_that_stops_holding_a_cache_leaves_the_served_version_serving(made, served, logs):
    base, server, path = served
    client = client_of(base)
    old = server.stores["docs"]
    tokens = card(base)["context_tokens"]
    moved = path.with_name("docs-moved")  # a folder that is no cache takes the cache's place (at once, as a swap)
    moved.mkdir()
    (moved / "notes.txt").write_text("not a cache\n")
    swap(moved, path)

    def failures() -> list[logging.LogRecord]:
        return [r for r in logs if r.levelno == logging.WARNING and r.getMessage().startswith("cache docs:")]

    wait_for(lambda: failures(), "the failed check to be logged")
    assert ask(client).choices[0].message.content == OLD_ANSWER  # answered by the version served
    assert server.stores["docs"] is old and card(base)["context_tokens"] == tokens and not old.decoder.closed
    time.sleep(10 * WATCH_S)  # checked again meanwhile: logged once
    (line,) = failures()
    assert line.exc_info is None and "\n" not in line.getMessage()
    assert line.getMessage() == (
        f"cache docs: a new version cannot be served ({path} is not a topk cache (no manifest.json; an "
        f"interrupted prefill?)); still serving the one of {tokens:,} tokens"
    )

    # the cache put back is the version served (nothing to do); a later append is picked up as ever
    swap(moved, path)
    n = append(made, path)
    wait_for(lambda: card(base)["context_tokens"] == n, "the appended cache to be served")
    assert ask(client).choices[0].message.content == NEW_ANSWER
    assert len(failures()) == 1


def test_a_cache_of_another_model_at_the_path_is_refused_in_one_line(made, served, logs, model_factory):
    from topk_decode.prefill.build import build_cache

    base, server, path = served
    old = server.stores["docs"]
    other_model = path.with_name("other-model")
    build_cache(made["travel"], other_model, model_factory("llama_gqa"), device="cpu")
    swap(other_model, path)

    def failures() -> list[str]:
        return [r.getMessage() for r in logs if r.levelno == logging.WARNING and r.getMessage().startswith("cache")]

    wait_for(lambda: failures(), "the failed open to be logged")
    (line,) = failures()
    assert "was made with" in line and line.endswith(f"still serving the one of {old.ckv.n_tokens:,} tokens")
    assert ask(client_of(base)).choices[0].message.content == OLD_ANSWER and server.stores["docs"] is old


def test_reopen_options_ask_for_what_the_store_was_opened_with(made):
    from topk_decode.api import KVStore
    from topk_decode.serve.worker import reopen_options

    with KVStore.open(made["cache"], k=K, n_tail=16, device="cpu", dtype="fp32") as store:
        assert store.config.strategy == "flat"  # auto's choice at this length
        options = reopen_options(store)
        assert options["strategy"] == "auto" and options["k"] == K and options["n_tail"] == 16
        with KVStore.open(made["cache"], **options, share_model=store) as again:
            assert again.config == store.config


def test_topk_serve_picks_up_topk_prefill_append(made, tmp_path):
    path = tmp_path / "docs"
    shutil.copytree(made["cache"], path)
    command = [sys.executable, "-m", "topk_decode"]
    proc = subprocess.Popen(
        [*command, "serve", str(path), "--port", "0", "--device", "cpu", "--k", str(K), "--max-tokens", "24"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # printed once the model is loaded and the port bound
        assert line.startswith(f"serving {path} as model 'docs' ("), line
        base = line.split(" on ")[1].split("/v1")[0]
        wait_for(lambda: _up(base), "the server to listen")
        tokens = card(base)["context_tokens"]
        done = subprocess.run(
            [*command, "prefill", str(made["travel"]), "--append", str(path), "--device", "cpu"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert done.returncode == 0, done.stderr
        wait_for(lambda: card(base)["context_tokens"] > tokens, "the appended cache to be served")
        assert ask(client_of(base)).choices[0].message.content == NEW_ANSWER
    finally:
        proc.send_signal(subprocess.signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    n = json.loads((path / "manifest.json").read_text())["n_tokens"]
    assert f"cache docs: now {n:,} tokens, 4 documents (appended; strategy flat); new requests use it" in err


def _up(base: str) -> bool:
    try:
        get(base, "/health")
        return True
    except OSError:
        return False
