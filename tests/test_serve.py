"""`topk serve` against a live server on 127.0.0.1, driven by the real `openai` client.

The demo cache (examples/docs prefilled with the shipped demo model) answers "What is the special
magic number for amber-fox?" with 482, so answers can be checked, not only shapes. One server (uvicorn
in a thread, a random free port) serves every test of the module; each request has a bounded timeout.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import select
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from conftest import serve_in_thread  # noqa: E402

from topk_decode.serve.app import Server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "demo-cache"
TIMEOUT = 120  # seconds any one request may take on a slow shared CPU
BODY_MB = 1  # the test server's body limit
FREED_S = 15  # a cancelled request frees the worker within this (a layer takes ~1 s on a 2-core CPU)
LONG_PROMPT = " the" * 20_000  # 20,000 demo tokens: minutes of prompt on a 2-core CPU
# `cuda` on the GPU host runs every test below over the CUDA decode path (fp32, so the answers are the CPU's)
DEVICE = os.environ.get("TOPK_TEST_SERVE_DEVICE", "cpu")
QUESTIONS = {  # examples/QUESTIONS.md
    "amber-fox": ("What is the special magic number for amber-fox?", "482"),
    "silver-owl": ("What is the special magic number for silver-owl?", "731"),
    "quiet-lynx": ("What is the special magic number for quiet-lynx?", "219"),
}


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory) -> Path:
    """examples/docs prefilled with the shipped demo model, on the CPU."""
    from topk_decode.demo import default_model_dir
    from topk_decode.prefill.build import build_cache

    model_dir, trained = default_model_dir()
    if not trained:
        pytest.skip("the trained demo model is not shipped in this checkout")
    out = tmp_path_factory.mktemp("serve") / MODEL
    build_cache(ROOT / "examples" / "docs", out, model_dir, device="cpu")
    return out


@pytest.fixture(scope="module")
def store(demo_cache):
    from topk_decode.api import KVStore

    return KVStore.open(demo_cache, device=DEVICE, dtype="fp32")


@pytest.fixture(scope="module")
def live(store):
    """(base_url, Server): the app served by uvicorn in a thread on a free port of 127.0.0.1."""
    server = Server({MODEL: store}, max_tokens_limit=1024, default_max_tokens=64, max_body_mb=BODY_MB)
    yield from serve_in_thread(server)


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live[0] + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


def ask(client, question: str, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}], **kw)


def post(base: str, path: str, body: bytes | str) -> tuple[int, dict]:
    """POST raw bytes; (status, parsed JSON body)."""
    data = body.encode() if isinstance(body, str) else body
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(base: str, path: str) -> dict:
    with urllib.request.urlopen(base + path, timeout=TIMEOUT) as r:
        return json.loads(r.read())


def sources_of(obj) -> list[dict]:
    """The extra `sources` field an OpenAI response object carries along."""
    return (obj.model_extra or {}).get("sources")


# ---- answers ---------------------------------------------------------------------------------------
def test_openai_client_gets_the_demo_answer_with_sources_and_usage(client, store):
    r = ask(client, QUESTIONS["amber-fox"][0])
    answer = r.choices[0].message.content
    assert answer == "The special magic number for amber-fox is 482."
    assert answer == store.ask(QUESTIONS["amber-fox"][0])  # the server answers as the API does
    assert r.choices[0].finish_reason == "stop"
    assert r.model == MODEL and r.object == "chat.completion"
    assert r.usage.prompt_tokens_details.cached_tokens == store.ckv.n_tokens
    assert r.usage.prompt_tokens > store.ckv.n_tokens and r.usage.completion_tokens > 5
    src = sources_of(r)
    assert {s["document"] for s in src} <= {d["name"] for d in store.documents}
    assert src[0]["document"] == "01_kelorn_harbour.txt"  # where the amber-fox fact is (examples/QUESTIONS.md)


def test_streamed_chunks_join_to_the_same_answer_and_the_last_carries_sources(client):
    question, number = QUESTIONS["quiet-lynx"]
    plain = ask(client, question).choices[0].message.content
    chunks = list(ask(client, question, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain and number in text
    assert chunks[0].choices[0].delta.role == "assistant"
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason == "stop"
    assert sources_of(last)[0]["document"] == "04_travel_log.txt"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 5


def test_raw_stream_is_openai_sse_ending_with_done(live):
    base = live[0]
    body = json.dumps(
        {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": QUESTIONS["amber-fox"][0]}]}
    )
    req = urllib.request.Request(base + "/v1/chat/completions", data=body.encode())
    with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    deltas = [json.loads(e[6:]) for e in events[:-1]]
    assert all(d["object"] == "chat.completion.chunk" for d in deltas)
    assert "482" in "".join(d["choices"][0]["delta"].get("content", "") for d in deltas)


def test_completions_continue_the_prompt_verbatim_after_the_documents(client):
    prompt = "\nQuestion: What is the special magic number for silver-owl?\nAnswer:"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20)
    assert r.choices[0].text.strip() == "The special magic number for silver-owl is 731."
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, stream=True)
    )
    assert streamed == r.choices[0].text


def test_stop_sequence_and_max_tokens_end_the_answer(client):
    r = ask(client, QUESTIONS["amber-fox"][0], stop=[" is "])
    assert r.choices[0].message.content == "The special magic number for amber-fox"
    assert r.choices[0].finish_reason == "stop"
    r = ask(client, QUESTIONS["amber-fox"][0], max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_seeded_sampling_repeats_and_a_system_prompt_is_accepted(client):
    kw = dict(temperature=1.5, top_p=0.95, seed=7, max_tokens=24)
    a = ask(client, QUESTIONS["silver-owl"][0], **kw).choices[0].message.content
    b = ask(client, QUESTIONS["silver-owl"][0], **kw).choices[0].message.content
    assert a == b and a
    r = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Answer with the number."},
            {"role": "user", "content": QUESTIONS["amber-fox"][0]},
        ],
    )
    assert r.choices[0].message.content  # the demo model has no chat template: a plain line before the question


def test_models_and_health(live):
    base, server = live
    models = get(base, "/v1/models")
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert (
        models["data"][0]["documents"] == 4 and models["data"][0]["context_tokens"] == server.stores[MODEL].ckv.n_tokens
    )
    health = get(base, "/health")
    assert health["status"] == "ok" and health["batching"].startswith("up to 8 answers at once")
    assert health["queue"] == 0 and health["documents"] == 4 and health["model"] == MODEL


def test_models_retrieve_gives_the_listed_model_and_an_unknown_id_is_a_404(live, client):
    listed = client.models.list().data
    got = client.models.retrieve(MODEL)
    assert got.id == MODEL and got.object == "model" and got.owned_by == "topk-decode"
    assert got.model_dump() == listed[0].model_dump()  # documents, context_tokens and strategy included
    assert got.model_extra["context_tokens"] == live[1].stores[MODEL].ckv.n_tokens
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    # the same JSON a generation request naming an unknown model gets, for ids holding a slash too
    for ident in ("nope", "org/nope"):
        status, _, raw = call(live[0], f"/v1/models/{ident}")
        assert status == 404, raw
        chat = post(live[0], "/v1/chat/completions", json.dumps({"model": ident, "messages": [{"role": "user"}]}))
        assert json.loads(raw) == chat[1] and chat[1]["error"]["code"] == "model_not_found"


# ---- many clients ------------------------------------------------------------------------------------
def test_concurrent_clients_get_the_answers_they_get_alone(client):
    serial = {k: ask(client, q).choices[0].message.content for k, (q, _) in QUESTIONS.items()}
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        futures = {
            k: pool.submit(ask, client, q, stream=(i % 2 == 1)) for i, (k, (q, _)) in enumerate(QUESTIONS.items())
        }
        got = {}
        for k, f in futures.items():
            r = f.result(timeout=TIMEOUT * 2)
            got[k] = (
                r.choices[0].message.content
                if not isinstance(r, openai.Stream)
                else "".join(c.choices[0].delta.content or "" for c in r if c.choices)
            )
    assert got == serial
    assert all(QUESTIONS[k][1] in got[k] for k in QUESTIONS)


def post_raw(base: str, body: dict) -> http.client.HTTPConnection:
    """A completion request sent over a connection of our own (the test then reads, or drops, it as a client would)."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn


@pytest.mark.parametrize("stream", [True, False])
def test_a_dropped_client_stops_its_generation_and_the_next_is_served(live, client, stream):
    base, server = live
    before = server.worker.cancelled
    # " the" makes the demo model write filler text without an end of turn: a long generation
    conn = post_raw(base, {"model": MODEL, "prompt": " the", "max_tokens": 1000, "stream": stream})
    if stream:
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: ")  # the answer has started
    else:
        deadline = time.monotonic() + TIMEOUT
        while not server.worker.running:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.monotonic() + TIMEOUT
    while server.worker.cancelled == before or server.worker.running:
        assert time.monotonic() < deadline, "the dropped stream was not stopped"
        time.sleep(0.1)
    assert server.worker.cancelled == before + 1
    assert "482" in ask(client, QUESTIONS["amber-fox"][0]).choices[0].message.content


def test_load_every_request_of_every_client_is_answered(client):
    n_clients, n_requests = 4, 3
    keys = list(QUESTIONS)

    def one_client(c: int) -> list[tuple[str, str]]:
        out = []
        for m in range(n_requests):
            k = keys[(c + m) % len(keys)]
            r = ask(client, QUESTIONS[k][0], stream=bool(m % 2))
            text = (
                "".join(x.choices[0].delta.content or "" for x in r if x.choices)
                if m % 2
                else r.choices[0].message.content
            )
            out.append((k, text))
        return out

    t0 = time.monotonic()
    with ThreadPoolExecutor(n_clients) as pool:
        results = [a for f in [pool.submit(one_client, c) for c in range(n_clients)] for a in f.result(timeout=600)]
    assert len(results) == n_clients * n_requests
    assert all(QUESTIONS[k][1] in text for k, text in results), results
    assert time.monotonic() - t0 < 600


# ---- bad requests: 4xx JSON, and the server stays up ---------------------------------------------------
@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        ({"model": "", "messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
        ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
        ({"model": MODEL, "messages": []}, 400, "messages"),
        ({"model": MODEL, "messages": "hi"}, 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, None),
        ({"model": MODEL, "messages": [{"role": "assistant", "content": "hi"}]}, 400, None),
        ({"model": MODEL, "messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, 400, "max_tokens"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 5}, 400, "temperature"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": [""]}, 400, "stop"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "seed": 1.5}, 400, "seed"),
        # malformed input that once reached the tokenizer or the JSON decoder's recursion: 400, never a 500
        (
            b'{"model": "demo-cache", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
            400,
            "messages[0].content",
        ),
        (
            b'{"model": "demo-cache", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
            400,
            "messages[0].content",
        ),
        (b'{"model": "demo-cache", "messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800"]}', 400, "stop"),
        pytest.param(
            b'{"model": "demo-cache", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            400,
            None,
            id="nested-100000-deep",
        ),
        (
            b'{"model": "demo-cache", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e400}',
            400,
            "max_tokens",
        ),
        (
            b'{"model": "demo-cache", "messages": [{"role": "user", "content": "hi"}], "temperature": -1e400}',
            400,
            "temperature",
        ),
        (b'{"model": "demo-cache", "messages": [{"role": "user", "content": "hi"}], "top_p": NaN}', 400, "top_p"),
        pytest.param(
            b'{"model": "demo-cache", "messages": [{"role": "user", "content": "hi"}], "seed": ' + b"9" * 5000 + b"}",
            400,
            None,
            id="seed-of-5000-digits",
        ),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**100}, 400, "max_tokens"),
        ({"model": MODEL, "messages": [{"role": 5, "content": "hi"}]}, 400, "messages[0]"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": [1]}, 400, "stop"),
        ({"model": MODEL, "prompt": "hi", "messages": {"role": "user"}}, 400, "messages"),
        (b'{"model": "demo-cache", "messages": [{"role": "user", "content": "\xff"}]}', 400, None),
    ],
)
def test_bad_chat_requests_get_openai_shaped_4xx_json(live, body, status, param):
    base = live[0]
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    got, answer = post(base, "/v1/chat/completions", raw)
    assert got == status, answer
    err = answer["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert get(base, "/health")["status"] == "ok"


def raw_request(base: str, head: str, body_parts=()) -> tuple[int, dict]:
    """Send `head` (request line and headers) then `body_parts`, stopping once the server answers: (status, JSON)."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
        sock.sendall(head.encode())
        for part in body_parts:
            if select.select([sock], [], [], 0)[0]:
                break  # answered early: the rest is never read
            sock.sendall(part)
        resp = http.client.HTTPResponse(sock)  # reads the answer by its length: the connection stays open
        resp.begin()
        return resp.status, json.loads(resp.read())


def test_a_body_past_the_limit_is_a_413_without_reading_it(live):
    base = live[0]
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    # declared too large: answered from the headers alone (no body is ever sent)
    status, answer = raw_request(base, head + f"Content-Length: {100 << 20}\r\n\r\n")
    assert status == 413 and answer["error"]["code"] == "request_too_large", answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    # no length declared (chunked): cut off once the received bytes pass the limit
    part = b"a" * (1 << 16)
    chunks = (b"%x\r\n%s\r\n" % (len(part), part) for _ in range(int(BODY_MB * 16) + 8))
    status, answer = raw_request(base, head + "Transfer-Encoding: chunked\r\n\r\n", chunks)
    assert status == 413 and answer["error"]["code"] == "request_too_large", answer
    assert get(base, "/health")["status"] == "ok"


@pytest.fixture
def server_logs(caplog):
    """caplog, also fed by uvicorn's error logger (where an app's traceback goes; it does not reach the root)."""
    import logging

    caplog.set_level(logging.INFO, logger="topk_decode.serve")
    uvicorn_errors = logging.getLogger("uvicorn.error")
    uvicorn_errors.addHandler(caplog.handler)
    yield caplog
    uvicorn_errors.removeHandler(caplog.handler)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_client_gone_while_sending_its_body_is_one_log_line_not_a_server_error(live, client, server_logs, path):
    base = live[0]
    before = scrape(base)
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
        sock.sendall(head.encode() + b'{"model": ')  # 10 of the 1,000 bytes promised, then gone
    deadline = time.monotonic() + 10  # the line is written once the server has seen the socket close
    while not [m for m in server_logs.messages if path in m]:
        assert time.monotonic() < deadline, server_logs.messages
        time.sleep(0.05)
    lines = [m for m in server_logs.messages if path in m]
    assert len(lines) == 1 and lines[0].startswith(f"- POST {path} 499 client disconnected while sending its request")
    assert not [r for r in server_logs.records if r.exc_info or r.levelno >= logging.ERROR], server_logs.text
    after = scrape(base)

    def count(metrics: dict, status: str | None = None) -> float:
        return sum(
            v
            for (name, labels), v in metrics.items()
            if name == "topk_requests_total"
            and (status is None or dict(labels)["status"] == status)
            and (status is not None or dict(labels)["status"].startswith("5"))
        )

    assert count(after) == count(before)  # no 5xx
    assert count(after, "499") == count(before, "499") + 1
    assert get(base, "/health")["status"] == "ok"
    assert "482" in ask(client, QUESTIONS["amber-fox"][0]).choices[0].message.content


def test_a_short_question_is_answered_while_a_long_prompt_is_still_going_through(live, client):
    """Issue 53: the long prompt goes through in pieces that take turns with the short request's prompt and steps
    (serve/turns.py), so the short answer is whole before the long prompt has its first token (order, not time:
    the short answer takes at most max_tokens turns, the long prompt ~310 pieces of 64 tokens)."""
    base, server = live
    turns = server.worker.turns(server.stores[MODEL])
    before = turns.turns
    conn = post_raw(base, {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 1, "stream": True})
    try:
        assert conn.getresponse().status == 200
        deadline = time.monotonic() + TIMEOUT
        while turns.turns == before:  # the long prompt's first piece has gone through
            assert time.monotonic() < deadline, "the long prompt never started"
            time.sleep(0.05)
        long = next(j for j in server.worker.current if len(j.ids) > 10_000)
        r = ask(client, QUESTIONS["amber-fox"][0], max_tokens=16)
        assert r.usage.completion_tokens >= 1 and r.choices[0].message.content
        assert long in server.worker.current and long.completion_tokens == 0  # still in its prompt
    finally:
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
    deadline = time.monotonic() + TIMEOUT
    while server.worker.running:
        assert time.monotonic() < deadline, "the long prompt of a client that left went on"
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_during_a_long_prompt_frees_the_worker_within_seconds(live, client, stream):
    base, server = live
    before = server.worker.cancelled
    # minutes of prompt on a 2-core CPU; a fast device may be in the answer (filler text, no end of turn) by then
    conn = post_raw(base, {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 1000, "stream": stream})
    deadline = time.monotonic() + TIMEOUT
    while not server.worker.running:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    time.sleep(0.5)  # inside the prompt's first chunk (CPU)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    left = time.monotonic()
    while server.worker.running:
        assert time.monotonic() - left < FREED_S, "the worker went on with the prompt of a client that left"
        time.sleep(0.05)
    assert server.worker.cancelled == before + 1
    assert "482" in ask(client, QUESTIONS["amber-fox"][0]).choices[0].message.content


def test_a_cancelled_prompt_step_leaves_the_conversation_as_it_was(store):
    from topk_decode.errors import StepCancelled

    question = QUESTIONS["amber-fox"][0]
    chat = store.session()
    polls = []
    chat.conv.should_stop = lambda: polls.append(1) or len(polls) >= 3  # stops at the third layer of the prompt
    with pytest.raises(StepCancelled):
        chat.ask(question, max_new_tokens=16)
    assert len(polls) == 3 and chat.conv.window.n_new == 0 and chat.turns == 0 and chat.conv.pending == []
    chat.conv.should_stop = None
    assert chat.ask(question, max_new_tokens=16) == store.ask(question, max_new_tokens=16)


def test_the_prompt_is_checked_against_the_room_before_it_is_queued(store):
    from topk_decode.serve.schemas import APIError, GenerationRequest
    from topk_decode.serve.worker import DecodeWorker

    worker = DecodeWorker({MODEL: store})
    try:
        assert worker.rooms[MODEL] == store.decoder.shape.max_positions - store.ckv.n_tokens  # the demo's binding limit
        worker.rooms[MODEL] = 100
        req = GenerationRequest(kind="completion", model=MODEL, prompt=" the" * 95, max_tokens=64)
        assert len(worker.prompt_ids(req)) == 95 and req.max_tokens == 5  # an unset max_tokens fits the room
        for n, given, param in [(95, True, "max_tokens"), (100, False, "prompt"), (100_000, False, "prompt")]:
            req = GenerationRequest(
                kind="completion", model=MODEL, prompt=" the" * n, max_tokens=10, max_tokens_given=given
            )
            with pytest.raises(APIError) as e:
                worker.prompt_ids(req)
            assert e.value.status == 400 and e.value.code == "context_length_exceeded" and e.value.param == param
        assert "more than 100" in e.value.message  # the huge one was refused without tokenizing it all
        assert worker.waiting == worker.running == 0
    finally:
        worker.close()


def test_tokenize_within_counts_slices_and_stops_early(store):
    from topk_decode.serve.worker import SLICE_CHARS, tokenize_within

    tok = store.tokenizer
    text = (ROOT / "examples" / "docs" / "01_kelorn_harbour.txt").read_text()
    text = text * (3 * SLICE_CHARS // len(text) + 1)
    full = tok(text, add_special_tokens=False).input_ids
    assert tokenize_within(tok, text, len(full)) == full
    assert tokenize_within(tok, text, len(full) // 2) is None


def test_openai_client_raises_its_own_errors_for_unknown_model_and_bad_values(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        ask(client, "hi", max_tokens=100_000)
    with pytest.raises(openai.BadRequestError):
        ask(client, "hi", temperature=-1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="", max_tokens=5)
    assert "482" in ask(client, QUESTIONS["amber-fox"][0]).choices[0].message.content


def test_unknown_routes_and_methods_are_json_errors(live):
    base = live[0]
    for method, path, status in [("GET", "/v1/nothing", 404), ("GET", "/v1/chat/completions", 405)]:
        req = urllib.request.Request(base + path, method=method)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=TIMEOUT)
        assert e.value.code == status and "error" in json.loads(e.value.read())


# ---- the command -----------------------------------------------------------------------------------
def test_topk_serve_on_a_taken_port_is_one_error_line(demo_cache):
    from typer.testing import CliRunner

    from topk_decode.cli.app import app

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(app, ["serve", str(demo_cache), "--port", str(port), "--device", "cpu"])
    assert result.exit_code == 2
    assert result.stderr.strip().startswith("error: cannot listen on 127.0.0.1:") and "\n" not in result.stderr.strip()


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_topk_serve_with_a_bad_body_limit_is_one_error_line(demo_cache, value):
    from typer.testing import CliRunner

    from topk_decode.cli.app import app

    result = CliRunner().invoke(app, ["serve", str(demo_cache), "--max-body-mb", value, "--device", "cpu"])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: --max-body-mb must be a positive number, got {float(value)}"


def test_topk_serve_command_stops_on_interrupt_ending_an_open_stream_with_an_error_and_done(demo_cache):
    # the key from the environment (TOPK_API_KEY), as a deployment would pass it
    proc = subprocess.Popen(
        [sys.executable, "-m", "topk_decode", "serve", str(demo_cache), "--port", "0", "--device", "cpu"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TOPK_API_KEY": KEY},
    )
    try:
        line = proc.stdout.readline()  # printed once the model is loaded and the port bound
        assert line.startswith(f"serving {demo_cache} as model '{MODEL}' (") and " on http://127.0.0.1:" in line, line
        base = line.split(" on ")[1].split("/v1")[0]
        deadline = time.monotonic() + 60
        while True:
            try:
                health = get(base, "/health")
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
                time.sleep(0.2)
        assert health["model"] == MODEL
        assert call(base, "/v1/models")[0] == 401
        # a streamed answer stuck in a long prompt when Ctrl-C comes
        body = json.dumps(
            {"model": MODEL, "stream": True, "max_tokens": 1, "messages": [{"role": "user", "content": LONG_PROMPT}]}
        )
        stream = urllib.request.urlopen(
            urllib.request.Request(
                base + "/v1/chat/completions", data=body.encode(), headers={"Authorization": f"Bearer {KEY}"}
            ),
            timeout=TIMEOUT,
        )
        assert stream.readline().startswith(b"data: ")  # the role chunk: the prompt is running
        proc.send_signal(subprocess.signal.SIGINT)
        sent = time.monotonic()
        events = [e for e in stream.read().decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["code"] == "server_shutdown"
        proc.wait(timeout=FREED_S)
        assert time.monotonic() - sent < FREED_S
        log = proc.stderr.read()
        assert "Traceback" not in log
        assert " - GET /v1/models 401 seconds=" in log  # one line per request, on stderr
        assert " POST /v1/chat/completions 200 model=demo-cache " in log
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_prompt_past_the_models_positions_is_a_400_context_length_exceeded(live, store):
    n = store.decoder.shape.max_positions
    status, answer = post(
        live[0],
        "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "amber " * n}]}),
    )
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"


def test_a_full_queue_answers_429_and_shutdown_answers_queued_requests_503(store):
    import asyncio

    from topk_decode.serve.schemas import APIError, GenerationRequest
    from topk_decode.serve.worker import DecodeWorker, Job

    loop = asyncio.new_event_loop()
    worker = DecodeWorker({MODEL: store}, max_queue=2, max_batch=1)
    request = GenerationRequest(kind="completion", model=MODEL, prompt=" the", max_tokens=5)
    try:
        with store.decoder.lock:  # the decoding thread blocks on the step lock: jobs pile up
            jobs = [Job(request, loop), Job(request, loop)]
            for job in jobs:
                worker.submit(job)
            with pytest.raises(APIError) as e:
                worker.submit(Job(request, loop))
            assert e.value.status == 429 and e.value.body()["error"]["code"] == "queue_full"
            deadline = time.monotonic() + 30
            while worker.waiting != 1:  # the first job is running (waiting for the lock)
                assert time.monotonic() < deadline
                time.sleep(0.01)
            jobs[0].cancel()
            worker.close()
        kind, value = loop.run_until_complete(asyncio.wait_for(jobs[1].queue.get(), 30))
        assert kind == "error" and value.status == 503
        with pytest.raises(APIError):
            worker.submit(Job(request, loop))
    finally:
        worker.close()
        loop.close()


# ---- access: API key, CORS ---------------------------------------------------------------------------
KEY = "test-key-0123456789"
ORIGIN = "https://app.example.com"


@pytest.fixture(scope="module")
def keyed(store):
    """(base_url, Server) of a second server over the same store, with an API key and one CORS origin."""
    server = Server({MODEL: store}, max_tokens_limit=1024, default_max_tokens=64, api_key=KEY, cors_origins=(ORIGIN,))
    yield from serve_in_thread(server)


def call(
    base: str, path: str, method: str = "GET", body: dict | None = None, headers: dict | None = None
) -> tuple[int, dict, bytes]:
    """Any request: (status, response headers, body bytes)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_a_key_is_required_everywhere_but_health(keyed):
    base = keyed[0]
    chat = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path, body in [
            ("POST", "/v1/chat/completions", chat),
            ("GET", "/v1/models", None),
            ("GET", "/metrics", None),
        ]:
            status, got_headers, raw = call(base, path, method, body, headers)
            assert status == 401, (path, headers)
            assert json.loads(raw) == {
                "error": {
                    "message": json.loads(raw)["error"]["message"],
                    "param": None,
                    "type": "invalid_request_error",
                    "code": "invalid_api_key",
                }
            }
            assert got_headers["www-authenticate"] == "Bearer"
    assert call(base, "/health")[0] == 200
    good = {"Authorization": f"Bearer {KEY}"}
    assert call(base, "/v1/models", headers=good)[0] == 200 and call(base, "/metrics", headers=good)[0] == 200
    assert call(base, "/v1/chat/completions", "POST", chat, headers=good)[0] == 200


def test_the_openai_client_needs_the_key(keyed):
    base = keyed[0]
    wrong = openai.OpenAI(base_url=base + "/v1", api_key="nope", timeout=TIMEOUT, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        ask(wrong, QUESTIONS["amber-fox"][0])
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    right = openai.OpenAI(base_url=base + "/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)
    assert ask(right, QUESTIONS["amber-fox"][0]).choices[0].message.content.endswith("482.")


def test_cors_preflight_is_answered_without_the_key_for_the_allowed_origin_only(keyed):
    base = keyed[0]
    ask_ = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    status, headers, _ = call(base, "/v1/chat/completions", "OPTIONS", headers=ask_)
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in headers["access-control-allow-methods"]
    assert "authorization" in headers["access-control-allow-headers"].lower()
    status, headers, _ = call(base, "/v1/chat/completions", "OPTIONS", headers={**ask_, "Origin": "https://evil.test"})
    assert status == 400 and "access-control-allow-origin" not in headers
    # the real request: the browser may read the answer (and a 401, so that it can say why)
    for auth, expected in (({"Authorization": f"Bearer {KEY}"}, 200), ({}, 401)):
        status, headers, _ = call(base, "/v1/models", headers={"Origin": ORIGIN, **auth})
        assert status == expected and headers["access-control-allow-origin"] == ORIGIN


def test_without_cors_origins_there_are_no_cors_headers(live):
    status, headers, _ = call(live[0], "/v1/models", headers={"Origin": ORIGIN})
    assert status == 200 and "access-control-allow-origin" not in headers


# ---- metrics and logs ----------------------------------------------------------------------------------
def scrape(base: str, headers: dict | None = None) -> dict:
    """GET /metrics parsed by prometheus_client's own parser: {(sample name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    status, got, raw = call(base, "/metrics", headers=headers)
    assert status == 200 and got["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(raw.decode())
        for s in family.samples
    }


def test_metrics_count_requests_tokens_time_to_first_token_search_and_keys(live, client):
    base = live[0]
    before = scrape(base)
    r = ask(client, QUESTIONS["amber-fox"][0])
    post(base, "/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}))  # a 400
    after = scrape(base)

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("topk_requests_total", route="/v1/chat/completions", status="200", model=MODEL) == 1
    assert delta("topk_requests_total", route="/v1/chat/completions", status="400", model="") == 1
    m = {"model": MODEL}
    assert delta("topk_completion_tokens_total", **m) == r.usage.completion_tokens
    assert delta("topk_prompt_tokens_total", **m) == r.usage.prompt_tokens  # the same quantity (docs/SERVE.md)
    assert delta("topk_cached_tokens_total", **m) == r.usage.prompt_tokens_details.cached_tokens
    assert delta("topk_time_to_first_token_seconds_count", **m) == 1
    assert delta("topk_time_to_first_token_seconds_sum", **m) > 0
    assert delta("topk_decode_tokens_per_second_count", **m) == 1 and delta("topk_decode_seconds_total", **m) > 0
    assert delta("topk_steps_total", **m) >= r.usage.completion_tokens
    assert delta("topk_search_ms_per_step_count", **m) == 1 and delta("topk_search_seconds_total", **m) > 0
    assert delta("topk_keys_read_total", **m) > 0
    assert ("topk_recomputed_steps_total", (("model", MODEL),)) in after  # non-finite steps: none here
    assert delta("topk_recomputed_steps_total", **m) == 0
    # the worker thread counts the job out of `running` just after its last event reached the client: under load a
    # scrape can come in between, so the gauges are waited for (they must settle, not lag forever)
    deadline = time.monotonic() + 10
    while (after[("topk_queue_depth", ())], after[("topk_running", ())]) != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
        after = scrape(base)
    assert after[("topk_queue_depth", ())] == 0 and after[("topk_running", ())] == 0


def test_usage_prompt_tokens_are_what_the_counter_counts_for_streams_and_completions(live, client, store):
    base, m = live[0], ("topk_prompt_tokens_total", (("model", MODEL),))
    before = scrape(base)
    chunks = list(ask(client, QUESTIONS["quiet-lynx"][0], stream=True, stream_options={"include_usage": True}))
    middle = scrape(base)
    done = client.completions.create(model=MODEL, prompt="The harbour of Kelorn", max_tokens=4)
    after = scrape(base)
    streamed = chunks[-1].usage
    assert middle[m] - before[m] == streamed.prompt_tokens
    assert after[m] - middle[m] == done.usage.prompt_tokens
    # the documents and the request's own tokens: a completion's prompt as its tokenizer counts it
    own = len(store.tokenizer("The harbour of Kelorn", add_special_tokens=False).input_ids)
    assert done.usage.prompt_tokens == store.ckv.n_tokens + own
    assert done.usage.prompt_tokens_details.cached_tokens == store.ckv.n_tokens


def test_one_log_line_per_request_with_id_model_tokens_seconds_and_status(live, client, caplog):
    caplog.set_level(logging.INFO, logger="topk_decode.serve")
    r = ask(client, QUESTIONS["silver-owl"][0])
    post(live[0], "/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}))
    get(live[0], "/health")  # probes are not logged
    deadline = time.monotonic() + 10  # the line is written once the response has gone
    while len([m for m in caplog.messages if "/v1/chat/completions" in m]) < 2:
        assert time.monotonic() < deadline, caplog.messages
        time.sleep(0.05)
    lines = [m for m in caplog.messages if "/v1/chat/completions" in m]
    ok = next(m for m in lines if m.startswith(r.id))
    u = r.usage
    assert (
        f"{r.id} POST /v1/chat/completions 200 model={MODEL} prompt_tokens={u.prompt_tokens} "
        f"cached_tokens={u.prompt_tokens_details.cached_tokens} completion_tokens={u.completion_tokens} finish=stop "
        "seconds="
    ) in ok
    assert float(ok.rpartition("seconds=")[2]) > 0
    assert any(m.startswith("- POST /v1/chat/completions 400 seconds=") for m in lines)
    assert not any("/health" in m for m in caplog.messages)


# ---- parameters: implemented, or refused by name -----------------------------------------------------
@pytest.mark.parametrize(
    "kind,extra,param",
    [
        ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
        (
            "chat",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
            "response_format",
        ),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ("chat", {"tool_choice": "auto"}, "tool_choice"),
        ("chat", {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ("chat", {"function_call": "auto"}, "function_call"),
        ("chat", {"n": 2}, "n"),
        ("chat", {"modalities": ["text", "audio"]}, "modalities"),
        ("chat", {"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"logprobs": 1}, "logprobs"),
        ("chat", {"presence_penalty": 2.5}, "presence_penalty"),
        ("chat", {"frequency_penalty": "high"}, "frequency_penalty"),
        ("chat", {"logit_bias": {"abc": 1}}, "logit_bias"),
        ("chat", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("chat", {"logit_bias": {"9999999": -100}}, "logit_bias"),  # past the vocabulary: found before decoding
        ("chat", {"logit_bias": [1, 2]}, "logit_bias"),
        ("completion", {"echo": True}, "echo"),
        ("completion", {"suffix": "end"}, "suffix"),
        ("completion", {"best_of": 3}, "best_of"),
        ("completion", {"n": 2}, "n"),
        ("completion", {"logprobs": 6}, "logprobs"),
    ],
)
def test_what_is_not_implemented_is_a_400_naming_the_parameter(live, kind, extra, param):
    body = (
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        if kind == "chat"
        else {"model": MODEL, "prompt": "hi"}
    )
    status, answer = post(
        live[0],
        "/v1/chat/completions" if kind == "chat" else "/v1/completions",
        json.dumps({**body, "max_tokens": 2, **extra}),
    )
    assert status == 400 and answer["error"]["param"] == param, answer
    assert param in answer["error"]["message"]


def test_what_asks_for_nothing_is_accepted(client):
    r = ask(
        client,
        QUESTIONS["amber-fox"][0],
        response_format={"type": "text"},
        tools=[],
        tool_choice="none",
        n=1,
        presence_penalty=0,
        frequency_penalty=0,
        logit_bias={},
        logprobs=False,
    )
    assert r.choices[0].message.content == "The special magic number for amber-fox is 482."  # greedy, unchanged
    assert r.choices[0].logprobs is None


def test_chat_logprobs_are_the_answers_tokens_with_sorted_alternatives(client):
    question = QUESTIONS["amber-fox"][0]
    r = ask(client, question, logprobs=True, top_logprobs=5)
    answer = r.choices[0].message.content
    assert answer == "The special magic number for amber-fox is 482."  # asking for logprobs changes nothing
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content).strip() == answer
    assert len(content) == r.usage.completion_tokens - 1  # all but the end-of-turn token
    for t in content:
        assert t.logprob <= 0 and bytes(t.bytes).decode() == t.token
        top = [a.logprob for a in t.top_logprobs]
        assert len(top) == 5 and top == sorted(top, reverse=True)
        assert sum(2.718281828459045**lp for lp in top) <= 1 + 1e-6
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)  # greedy
    streamed = [c for c in ask(client, question, logprobs=True, top_logprobs=5, stream=True) if c.choices]
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in tokens] == [(t.token, t.logprob) for t in content]
    assert ask(client, question, logprobs=True).choices[0].logprobs.content[0].top_logprobs == []


def test_completion_logprobs_are_parallel_lists_with_offsets(client):
    prompt = "\nQuestion: What is the special magic number for silver-owl?\nAnswer:"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, logprobs=3)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert len(lp.tokens) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")  # no end of text
    assert all(x <= 0 for x in lp.token_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and max(top.values()) == pytest.approx(logprob) and top[token] == pytest.approx(logprob)
    streamed = [
        c.choices[0]
        for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, logprobs=3, stream=True)
    ]
    offsets = [o for c in streamed if c.logprobs for o in c.logprobs.text_offset]
    assert offsets == lp.text_offset


def first_token_id(store, client, question: str) -> tuple[int, str]:
    """The greedy answer's first token (id, text)."""
    token = ask(client, question, logprobs=True, max_tokens=1).choices[0].logprobs.content[0].token
    ids = store.tokenizer(token, add_special_tokens=False).input_ids
    assert len(ids) == 1 and store.tokenizer.decode(ids) == token
    return ids[0], token


def test_a_banned_first_token_changes_the_greedy_answer_and_a_forced_one_starts_it(client, store):
    question = QUESTIONS["amber-fox"][0]
    tid, token = first_token_id(store, client, question)
    banned = ask(client, question, logit_bias={str(tid): -100}, logprobs=True, top_logprobs=1, max_tokens=8)
    first = banned.choices[0].logprobs.content[0]
    assert first.token != token
    assert first.top_logprobs[0].token == token  # logprobs are the model's own: the banned token is still its top
    forced_id = store.tokenizer(" 482", add_special_tokens=False).input_ids[0]
    forced = ask(client, question, logit_bias={str(forced_id): 100}, max_tokens=3)
    assert forced.choices[0].message.content.startswith(store.tokenizer.decode([forced_id]).strip())


def test_penalties_cut_repetition_of_the_greedy_answer(client):
    prompt = "\nThe special magic numbers are 482, 482, 482,"  # greedy repeats " 482," to the end

    def count_482(**kw) -> int:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, **kw)
        return r.choices[0].text.count("482")

    plain = count_482()
    assert count_482(presence_penalty=0, frequency_penalty=0) == plain  # zero penalties change nothing
    assert plain > count_482(frequency_penalty=1.0) > count_482(frequency_penalty=2.0, presence_penalty=2.0)
