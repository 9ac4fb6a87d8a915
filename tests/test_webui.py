"""The chat page of `topk serve` (topk_decode/serve/webui/) and GET /v1/passage, against real `topk serve`
processes on the demo caches; the page is driven in headless Chromium through Playwright.

Cache `docs` holds examples/docs (four documents), cache `travel` only 04_travel_log.txt, both prefilled with the
shipped demo model, whose answers can be checked (amber-fox is 482: examples/QUESTIONS.md). The browser tests are
marked `browser` and skip, saying why, without Playwright or a Chromium (Debian's `chromium` package, or
`python -m playwright install chromium`); TOPK_TEST_CHROMIUM names a browser binary, and TOPK_REQUIRE_BROWSER=1
(.ci/run) makes a missing one a failure instead. Every page they open must ask nothing of any host but the server.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlencode, urlsplit

import pytest

pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[1]
WEBUI = ROOT / "topk_decode" / "serve" / "webui"
DEVICE = os.environ.get("TOPK_TEST_SERVE_DEVICE", "cpu")
TIMEOUT = 120  # seconds any one request or page wait may take on a slow shared CPU
KEY = "webui-key-0123456789"
QUESTIONS = {  # examples/QUESTIONS.md: question, answer's number, the document holding the fact
    "amber-fox": ("What is the special magic number for amber-fox?", "482", "01_kelorn_harbour.txt"),
    "silver-owl": ("What is the special magic number for silver-owl?", "731", "02_field_notes.txt"),
    "quiet-lynx": ("What is the special magic number for quiet-lynx?", "219", "04_travel_log.txt"),
}
EOS_BANNED = {"logit_bias": {"1": -100}, "max_tokens": 1000}  # the demo model's end of turn is token 1


# ---- servers ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> dict[str, Path]:
    """{"docs": examples/docs, "travel": 04_travel_log.txt alone}, prefilled with the demo model on the CPU."""
    from topk_decode.demo import default_model_dir
    from topk_decode.prefill.build import build_cache

    model_dir, trained = default_model_dir()
    if not trained:
        pytest.skip("the trained demo model is not shipped in this checkout")
    base = tmp_path_factory.mktemp("webui")
    travel_docs = base / "travel-docs"
    travel_docs.mkdir()
    shutil.copy(ROOT / "examples/docs/04_travel_log.txt", travel_docs)
    out = {"docs": base / "docs", "travel": base / "travel"}
    build_cache(ROOT / "examples" / "docs", out["docs"], model_dir, device="cpu")
    build_cache(travel_docs, out["travel"], model_dir, device="cpu")
    return out


def document_text(name: str) -> str:
    """A demo document as the context holds it: its `### Document:` header, then its text."""
    return f"\n\n### Document: {name}\n\n" + (ROOT / "examples" / "docs" / name).read_text()


class Served:
    """A `topk serve` process on a free port of 127.0.0.1: `base` (http://127.0.0.1:PORT), the printed lines,
    and its log (stderr) read back by `log()`."""

    def __init__(self, args: list[str], tmp: Path, env: dict | None = None) -> None:
        self.log_path = tmp / "serve.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "topk_decode", "serve", *args, "--port", "0", "--device", DEVICE],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=self.log_path.open("w"),
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.lines = [self.proc.stdout.readline()]  # printed once the models are loaded and the port bound
        assert self.lines[0].startswith("serving "), self.log()
        if "--no-webui" not in args:
            self.lines.append(self.proc.stdout.readline())
        self.base = self.lines[0].split(" on ")[1].split("/v1")[0]
        deadline = time.monotonic() + 60
        while True:
            try:
                request(self.base, "/health")
                break
            except OSError:
                assert time.monotonic() < deadline and self.proc.poll() is None, self.log()
                time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        self.proc.send_signal(subprocess.signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        assert "Traceback" not in self.log()


@pytest.fixture(scope="module")
def served(caches, tmp_path_factory):
    """`topk serve docs travel`: the chat page on, no key (loopback)."""
    s = Served([str(caches["docs"]), str(caches["travel"]), "--max-tokens", "64"], tmp_path_factory.mktemp("served"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def keyed(caches, tmp_path_factory):
    """`topk serve docs` with an API key (from TOPK_API_KEY, as a deployment passes it)."""
    s = Served([str(caches["docs"]), "--max-tokens", "64"], tmp_path_factory.mktemp("keyed"), {"TOPK_API_KEY": KEY})
    yield s
    s.stop()


def request(base: str, path: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict, bytes]:
    """GET (or POST `body` as JSON): (status, response headers with lower-case names, body bytes)."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def get_json(base: str, path: str, key: str | None = None) -> tuple[int, dict]:
    status, _, raw = request(base, path, key=key)
    return status, json.loads(raw)


def ask(base: str, model: str, question: str, key: str | None = None) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": question}]}
    status, _, raw = request(base, "/v1/chat/completions", body, key)
    assert status == 200, raw
    return json.loads(raw)


def passage_path(**params) -> str:
    return "/v1/passage?" + urlencode(params)


# ---- the page's files ------------------------------------------------------------------------------
def test_the_page_is_served_without_the_key_under_a_policy_that_allows_this_server_only(keyed):
    base = keyed.base
    assert keyed.lines[1].strip() == f"chat page: {base}/"
    status, headers, raw = request(base, "/")
    assert status == 200 and headers["content-type"] == "text/html; charset=utf-8"
    assert raw == (WEBUI / "index.html").read_bytes()
    policy = headers["content-security-policy"]
    for directive in ("default-src 'none'", "script-src 'self'", "connect-src 'self'", "frame-ancestors 'none'"):
        assert directive in policy
    assert headers["x-content-type-options"] == "nosniff"
    for path, media_type, name in [
        ("/ui/app.js", "text/javascript; charset=utf-8", "app.js"),
        ("/ui/app.css", "text/css; charset=utf-8", "app.css"),
    ]:
        status, headers, raw = request(base, path)
        assert status == 200 and headers["content-type"] == media_type and raw == (WEBUI / name).read_bytes()
    # what holds anything from the documents needs the key
    for path in ["/v1/models", passage_path(document="03_ledger.txt")]:
        assert request(base, path)[0] == 401
    assert request(base, "/ui/other.js")[0] == 401  # not a file of the page: the API's rules
    assert get_json(base, passage_path(document="03_ledger.txt"), KEY)[0] == 200


def test_the_page_refers_only_to_its_own_files():
    class Refs(HTMLParser):
        def __init__(self):
            super().__init__()
            self.refs = []

        def handle_starttag(self, tag, attrs):
            self.refs += [v for k, v in attrs if k in ("src", "href", "action") and v is not None]

    parser = Refs()
    parser.feed((WEBUI / "index.html").read_text())
    assert sorted(parser.refs) == ["#prompt", "/ui/app.css", "/ui/app.js", "data:,"]
    assert "url(" not in (WEBUI / "app.css").read_text() and "@import" not in (WEBUI / "app.css").read_text()
    script = (WEBUI / "app.js").read_text()
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script and "eval(" not in script
    assert sorted(set(re.findall(r"fetch\(([^,)]*)", script))) == ["path"]  # one fetch, of the server's paths


def test_the_page_files_ship_as_package_data():
    tomllib = pytest.importorskip("tomllib")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["topk_decode"]
    from fnmatch import fnmatch

    for f in WEBUI.iterdir():
        assert any(fnmatch(f"serve/webui/{f.name}", pattern) for pattern in data), f.name


def test_topk_serve_no_webui_serves_the_api_alone(caches, tmp_path):
    s = Served([str(caches["travel"]), "--no-webui"], tmp_path)
    try:
        assert len(s.lines) == 1 and "chat page" not in s.lines[0]
        for path in ["/", "/ui/app.js"]:
            status, _, raw = request(s.base, path)
            assert status == 404 and json.loads(raw)["error"]["code"] == "not_found"
        assert get_json(s.base, "/v1/models")[1]["data"][0]["id"] == "travel"
        assert get_json(s.base, passage_path(document="04_travel_log.txt"))[0] == 200
    finally:
        s.stop()


# ---- sources and passages --------------------------------------------------------------------------
@pytest.mark.parametrize("key", list(QUESTIONS))
def test_each_source_names_the_passage_that_holds_the_fact(served, key):
    question, number, document = QUESTIONS[key]
    r = ask(served.base, "docs", question)
    assert number in r["choices"][0]["message"]["content"]
    first = r["sources"][0]
    assert first["document"] == document
    for s in r["sources"]:
        start, end = s["span"]
        assert end - start == 48  # PASSAGE_TOKENS: every demo document is longer
    start, end = first["span"]
    status, p = get_json(served.base, passage_path(model="docs", document=document, start=start, end=end))
    assert status == 200 and p["object"] == "passage" and p["model"] == "docs" and p["document"] == document
    assert f"{key} is {number}." in p["text"]  # the window that drew the most holds the fact the answer copies
    assert p["before"] + p["text"] + p["after"] in document_text(document)


def test_a_passage_is_bounded_by_around_and_by_its_document(served):
    from transformers import AutoTokenizer

    from topk_decode.demo import default_model_dir

    name = "02_field_notes.txt"
    p = get_json(served.base, passage_path(model="docs", document=name, around=1024))[1]
    assert p["document_start"] and p["document_end"]  # a document of 901 tokens: all of it
    assert p["before"] + p["text"] + p["after"] == document_text(name)
    tok = AutoTokenizer.from_pretrained(default_model_dir()[0])
    p = get_json(served.base, passage_path(model="docs", document=name, start=1300, end=1310, around=20))[1]
    assert (p["start"], p["end"]) == (1300, 1310) and not p["document_start"] and not p["document_end"]
    assert len(tok(p["before"] + p["text"] + p["after"], add_special_tokens=False).input_ids) <= 10 + 2 * 20 + 2
    assert (p["before"] + p["text"] + p["after"]) in document_text(name)


@pytest.mark.parametrize(
    "params, status, param, fragment",
    [
        (dict(document="03_ledger.txt"), 400, "model", "model is required: one of 'docs', 'travel'"),
        (dict(model="nope", document="03_ledger.txt"), 404, "model", "the model 'nope' does not exist"),
        (dict(model="docs"), 400, "document", "document is required"),
        (dict(model="docs", document="nope.txt"), 404, "document", "'nope.txt' is not in this cache"),
        (dict(model="travel", document="03_ledger.txt"), 404, "document", "not in this cache"),
        (dict(model="docs", document="03_ledger.txt", start="x"), 400, "start", "non-negative integer, got 'x'"),
        (dict(model="docs", document="03_ledger.txt", start="-1"), 400, "start", "non-negative integer"),
        (dict(model="docs", document="03_ledger.txt", end="9" * 40), 400, "end", "non-negative integer"),
        (dict(model="docs", document="03_ledger.txt", start=0, end=5), 400, "start", "1778 <= start < end <= 2561"),
        (dict(model="docs", document="03_ledger.txt", start=2000, end=2000), 400, "start", "start < end"),
        (dict(model="docs", document="03_ledger.txt", start=2500, end=2600), 400, "start", "<= 2561"),
        (dict(model="docs", document="03_ledger.txt", around=1025), 400, "around", "around must be in 0..1024"),
        (dict(model="docs", document="03_ledger.txt", length=5), 400, "length", "unknown parameter 'length'"),
    ],
)
def test_bad_passage_requests_are_4xx_naming_the_parameter(served, params, status, param, fragment):
    got, body = get_json(served.base, passage_path(**params))
    assert got == status, body
    assert body["error"]["param"] == param and fragment in body["error"]["message"]
    assert "\n" not in body["error"]["message"]


def test_a_sources_span_lies_in_the_place_it_names_around_the_tokens_that_drew_most():
    import torch

    from topk_decode.serve.passages import PASSAGE_TOKENS, PassageTracker

    documents = [
        {"name": "a.txt", "start": 0, "end": 90},
        {
            "name": "b.pdf",
            "start": 90,
            "end": 400,
            "places": [{"label": "p. 1", "start": 90}, {"label": "p. 2", "start": 200}],
        },
    ]
    tracker = PassageTracker(documents, scale=1.0, group_size=1, n_layers=1, n_tokens=400)
    # one head, one query, retrieving tokens 190..219 (p. 1 up to 199, p. 2 from 200), p. 2's scored higher,
    # and token 10 of a.txt, far lower
    ids = torch.tensor([[list(range(190, 220)) + [10]]])
    scores = torch.tensor([[[1.0] * 10 + [3.0] * 20 + [0.0]]])
    tracker(0, None, SimpleNamespace(ids=ids, scores=scores), None)
    first = tracker.sources()[0]
    assert first["document"] == "b.pdf" and first["place"] == "p. 2"
    start, end = first["span"]
    assert end - start == PASSAGE_TOKENS and start == 200  # in p. 2, holding its retrieved tokens 200..219
    a = next(s for s in tracker.sources(0) if s["document"] == "a.txt")
    assert a["span"][0] <= 10 < a["span"][1] <= 90  # its one retrieved token, inside a.txt
    tracker.reset()
    assert tracker.sources() == [] and float(tracker.token_mass.sum()) == 0


def test_a_passage_request_past_the_span_limit_is_refused(monkeypatch):
    from topk_decode.serve import passages
    from topk_decode.serve.schemas import APIError

    class Store:
        documents = [{"name": "a.txt", "start": 0, "end": 100}]
        context_ids = list(range(100))

    monkeypatch.setattr(passages, "MAX_SPAN", 16)
    with pytest.raises(APIError) as e:
        passages.passage(Store(), None, "a.txt", 0, 17, 0)
    assert e.value.status == 400 and e.value.param == "end" and "at most 16 tokens" in e.value.message


# ---- the page in a browser -------------------------------------------------------------------------
def chromium_path() -> str | None:
    """TOPK_TEST_CHROMIUM, or a Chromium on PATH (Debian's `chromium`); None: Playwright's own, if installed."""
    if os.environ.get("TOPK_TEST_CHROMIUM"):
        return os.environ["TOPK_TEST_CHROMIUM"]
    return next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")) if p),
        None,
    )


def no_browser(reason: str):
    if os.environ.get("TOPK_REQUIRE_BROWSER") == "1":
        pytest.fail(f"TOPK_REQUIRE_BROWSER=1: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import Error, expect, sync_playwright
    except ImportError:
        no_browser("the browser tests need Playwright: pip install playwright (the dev extra)")
    expect.set_options(timeout=TIMEOUT * 1000)  # a slow shared CPU: every expectation waits as long as a request
    with sync_playwright() as p:
        path = chromium_path()
        try:
            b = p.chromium.launch(executable_path=path) if path else p.chromium.launch()
        except Error as e:
            no_browser(
                f"no Chromium to drive ({str(e).splitlines()[0]}): apt install chromium, or python -m playwright "
                f"install chromium, or set TOPK_TEST_CHROMIUM"
            )
        yield b
        b.close()


@pytest.fixture
def open_page(browser):
    """open_page(server, bypass_csp=False, goto=True) → a page of a fresh browser context (empty storage) on the
    server's chat page (goto=False: not opened yet). At the end every request the pages made must have gone to that server, and no page may have
    logged an error (a script error, a blocked resource, a Content-Security-Policy violation)."""
    contexts, seen, problems = [], [], []

    def open_(server: Served, bypass_csp: bool = False, goto: bool = True):
        context = browser.new_context(bypass_csp=bypass_csp, viewport={"width": 1100, "height": 720})
        context.set_default_timeout(TIMEOUT * 1000)
        contexts.append((context, server.base))
        context.on("request", lambda r: seen.append((server.base, r.url)))
        page = context.new_page()
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.on(
            "console",
            lambda m: (
                m.type == "error"
                and not m.text.startswith("Failed to load resource")
                and problems.append(f"console error: {m.text}")
            ),
        )
        if goto:
            page.goto(server.base + "/")
        return page

    def elsewhere() -> list[str]:
        return [url for base, url in seen if not url.startswith(base + "/")]

    open_.elsewhere = elsewhere
    yield open_
    for context, _ in contexts:
        context.close()
    assert not elsewhere(), f"the page asked other hosts: {elsewhere()}"
    assert not problems, problems


def answers(page):
    return page.locator("article.msg.assistant")


def ask_in_page(page, question: str):
    """Type a question and send it with Enter, as a person does; the answer's element."""
    n = answers(page).count()
    page.get_by_label("Question").fill(question)
    page.get_by_label("Question").press("Enter")
    answer = answers(page).nth(n)
    answer.wait_for()
    return answer


def finished(answer):
    """Wait until the answer is no longer streaming."""
    from playwright.sync_api import expect

    expect(answer).to_have_attribute("aria-busy", "false", timeout=TIMEOUT * 1000)
    return answer


@pytest.mark.browser
def test_a_question_streams_its_answer_and_names_its_sources(served, open_page):
    from playwright.sync_api import expect

    page = open_page(served)
    picker = page.get_by_label("Cache")
    expect(picker.locator("option")).to_have_text(["docs", "travel"])
    expect(page.locator("#model-info")).to_have_text("4 documents · 3,475 tokens · strategy flat")
    with page.expect_response("**/v1/chat/completions") as sent:
        answer = ask_in_page(page, QUESTIONS["amber-fox"][0])
    response = sent.value
    assert response.headers["content-type"].startswith("text/event-stream")
    body = json.loads(response.request.post_data)
    assert body["stream"] is True and body["model"] == "docs"
    assert body["messages"] == [{"role": "user", "content": QUESTIONS["amber-fox"][0]}]
    finished(answer)
    expect(answer.locator(".content")).to_have_text("The special magic number for amber-fox is 482.")
    sources = answer.get_by_role("listitem")
    expect(sources.first).to_contain_text("01_kelorn_harbour.txt")
    assert sources.count() >= 2 and all(re.search(r"\d+%$", t) for t in sources.all_inner_texts())


@pytest.mark.browser
def test_a_question_sent_before_the_caches_are_listed_waits_for_them(served, open_page):
    from playwright.sync_api import expect

    page = open_page(served, goto=False)
    held = []
    page.route(
        "**/v1/models", lambda route: held.append(route)
    )  # the list of caches held back until the question is sent
    page.goto(served.base + "/")
    question = QUESTIONS["amber-fox"][0]
    page.get_by_label("Question").fill(question)
    page.get_by_label("Question").press("Enter")
    while not held:
        page.wait_for_timeout(50)
    assert answers(page).count() == 0 and page.get_by_label("Question").input_value() == question
    held[0].continue_()
    answer = finished(answers(page).first)
    expect(answer.locator(".content")).to_have_text("The special magic number for amber-fox is 482.")
    expect(page.get_by_label("Question")).to_have_value("")


@pytest.mark.browser
def test_a_source_opens_the_passage_it_drew_on(served, open_page):
    from playwright.sync_api import expect

    page = open_page(served)
    answer = finished(ask_in_page(page, QUESTIONS["silver-owl"][0]))
    expect(answer.locator(".content")).to_contain_text("731")
    answer.get_by_role("button", name=re.compile("^02_field_notes.txt")).click()
    dialog = page.get_by_role("dialog", name="02_field_notes.txt")
    expect(dialog).to_be_visible()
    expect(dialog.locator("mark")).to_contain_text("silver-owl is 731.")
    shown = dialog.locator("#passage-text").inner_text().strip("…")
    assert shown in document_text("02_field_notes.txt")
    expect(dialog).to_contain_text("% of the answer's retrieved attention")
    page.keyboard.press("Escape")
    expect(dialog).to_be_hidden()


@pytest.mark.browser
def test_stop_ends_the_answer_and_the_server_stops_decoding_it(served, open_page):
    from playwright.sync_api import expect

    page = open_page(served)

    def endless(route):  # the end of turn banned: the demo model writes on for 1000 tokens
        body = json.loads(route.request.post_data)
        route.continue_(post_data=json.dumps({**body, **EOS_BANNED}))

    page.route("**/v1/chat/completions", endless)
    before = get_json(served.base, "/health")[1]["cancelled"]
    answer = ask_in_page(page, "the")
    stop = page.get_by_role("button", name="Stop")
    expect(stop).to_be_visible()
    expect(answer.locator(".content")).not_to_be_empty()
    stop.click()
    finished(answer)
    expect(answer.locator(".status")).to_have_text("Stopped.")
    expect(page.get_by_role("button", name="Send")).to_be_visible()
    expect(stop).to_be_hidden()
    kept = answer.locator(".content").inner_text()
    assert kept
    deadline = time.monotonic() + TIMEOUT
    while True:  # the server notices the closed stream and stops decoding it
        health = get_json(served.base, "/health")[1]
        if health["cancelled"] == before + 1 and health["running"] == 0:
            break
        assert time.monotonic() < deadline, health
        time.sleep(0.2)
    assert answer.locator(".content").inner_text() == kept


@pytest.mark.browser
def test_switching_caches_asks_the_other_cache(served, open_page):
    from playwright.sync_api import expect

    page = open_page(served)
    expect(page.get_by_label("Cache").locator("option")).to_have_count(2)
    page.get_by_label("Cache").select_option("travel")
    expect(page.locator("#model-info")).to_have_text("1 document · 887 tokens · strategy flat")
    with page.expect_request("**/v1/chat/completions") as sent:
        answer = ask_in_page(page, QUESTIONS["quiet-lynx"][0])
    assert json.loads(sent.value.post_data)["model"] == "travel"
    finished(answer)
    expect(answer.locator(".content")).to_contain_text("219")
    expect(answer.locator("h3")).to_have_text("Answer · travel")
    expect(answer.get_by_role("listitem")).to_have_count(1)
    with page.expect_request("**/v1/passage?*") as opened:
        answer.get_by_role("button", name=re.compile("^04_travel_log.txt")).click()
    assert "model=travel" in opened.value.url
    expect(page.locator("#passage-text mark")).to_contain_text("quiet-lynx is 219.")


@pytest.mark.browser
def test_conversations_are_kept_in_the_browser_and_carry_their_history(served, open_page):
    from playwright.sync_api import expect

    page = open_page(served)
    finished(ask_in_page(page, QUESTIONS["amber-fox"][0]))
    with page.expect_request("**/v1/chat/completions") as sent:
        second = ask_in_page(page, QUESTIONS["silver-owl"][0])
    messages = json.loads(sent.value.post_data)["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["content"] == "The special magic number for amber-fox is 482."
    finished(second)
    page.get_by_role("button", name="New chat").click()
    expect(answers(page)).to_have_count(0)
    finished(ask_in_page(page, QUESTIONS["quiet-lynx"][0]))
    page.reload()
    chats = page.get_by_role("navigation", name="Conversations").locator("li .open")
    expect(chats).to_have_count(2)
    expect(answers(page)).to_have_count(1)  # the page reopens on the last conversation
    expect(answers(page).first).to_contain_text("219")
    chats.filter(has_text="amber-fox").click()
    expect(answers(page)).to_have_count(2)
    expect(answers(page).nth(0).locator(".content")).to_contain_text("482")
    expect(answers(page).nth(1).locator(".content")).to_contain_text("731")
    expect(answers(page).nth(1).get_by_role("listitem").first).to_contain_text("02_field_notes.txt")
    page.get_by_role(
        "button", name=re.compile("^Delete conversation: What is the special magic number for quiet")
    ).click()
    expect(chats).to_have_count(1)


@pytest.mark.browser
def test_the_api_key_is_asked_once_and_a_wrong_one_is_told(keyed, open_page):
    from playwright.sync_api import expect

    page = open_page(keyed)
    dialog = page.get_by_role("dialog", name="API key")
    expect(dialog).to_be_visible()
    expect(dialog.get_by_role("alert")).to_be_hidden()  # no key given yet: nothing is wrong
    dialog.get_by_label("API key").fill("wrong-key")
    dialog.get_by_label("API key").press("Enter")
    expect(dialog.get_by_role("alert")).to_have_text("Incorrect API key provided")
    dialog.get_by_label("API key").fill(KEY)
    dialog.get_by_role("button", name="Use this key").click()
    expect(dialog).to_be_hidden()
    expect(page.get_by_label("Cache").locator("option")).to_have_text(["docs"])
    answer = finished(ask_in_page(page, QUESTIONS["amber-fox"][0]))
    expect(answer.locator(".content")).to_contain_text("482")
    answer.get_by_role("button", name=re.compile("^01_kelorn_harbour.txt")).click()
    expect(page.locator("#passage-text mark")).to_contain_text("amber-fox is 482.")
    page.reload()  # the key is kept: not asked again
    expect(page.get_by_label("Cache").locator("option")).to_have_text(["docs"])
    expect(dialog).to_be_hidden()
    expect(answers(page).first).to_contain_text("482")


@pytest.mark.browser
def test_an_error_is_the_apis_message_in_plain_words(served, open_page):
    from playwright.sync_api import expect

    long_question = "amber " * 65_536  # past the demo model's 65,536 positions
    status, _, raw = request(
        served.base, "/v1/chat/completions", {"model": "docs", "messages": [{"role": "user", "content": long_question}]}
    )
    assert status == 400
    message = json.loads(raw)["error"]["message"]
    page = open_page(served)
    answer = finished(ask_in_page(page, long_question))
    error = answer.get_by_role("alert")
    expect(error).to_have_text("The server could not take this request." + message)
    expect(error.locator("span")).to_have_text(message)


@pytest.mark.browser
def test_answers_render_markdown_and_never_html(served, open_page):
    """The page's renderer on an answer no demo model writes: the server's stream replaced by a crafted one."""
    from playwright.sync_api import expect

    text = (
        "## Result\n\nThe **number** is `482`, see [the docs](https://example.com/x) or [this](javascript:alert(1)).\n\n"
        "- one\n- two *em*\n\n1. first\n2. second\n\n```python\nprint('<b>hi</b>')\n```\n\n"
        "| a | b |\n|---|---|\n| 1 | 2 |\n\n"
        '<img src="/nothing" onerror="window.pwned = 1"> <script>window.pwned = 2</script> ![x](https://example.com/i.png)'
    )
    chunks = [text[i : i + 7] for i in range(0, len(text), 7)]
    events = [{"choices": [{"index": 0, "delta": {"content": c}, "finish_reason": None}]} for c in chunks]
    events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}], "sources": []})
    sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    page = open_page(served)
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=sse),
    )
    answer = finished(ask_in_page(page, "anything"))
    content = answer.locator(".content")
    expect(content.locator("h4")).to_have_text("Result")
    expect(content.locator("strong")).to_have_text("number")
    expect(content.locator("p code")).to_have_text("482")
    expect(content.locator("ul > li")).to_have_text(["one", "two em"])
    expect(content.locator("ol > li")).to_have_text(["first", "second"])
    expect(content.locator("pre code.language-python")).to_have_text("print('<b>hi</b>')")
    expect(content.locator("td")).to_have_text(["1", "2"])
    links = content.locator("a")
    expect(links).to_have_count(2)  # the javascript: link is text; the image is a link, never loaded
    assert links.nth(0).get_attribute("href") == "https://example.com/x"
    expect(links.nth(1)).to_have_text("image: x")
    expect(content).to_contain_text('<img src="/nothing" onerror="window.pwned = 1">')
    expect(content).to_contain_text("this (javascript:alert(1))")
    assert content.locator("img, script, b").count() == 0
    assert page.evaluate("window.pwned") is None
    expect(answer.locator(".status")).to_have_text("Cut off at the length limit (max_tokens).")


@pytest.mark.browser
def test_the_page_asks_no_other_host_even_without_its_policy(served, open_page):
    """The Content-Security-Policy bypassed: what the page would ask of other hosts (a font, a script, an image)
    would reach the network layer, where it is recorded and refused."""
    from playwright.sync_api import expect

    page = open_page(served, bypass_csp=True)
    origin = served.base
    page.context.route(
        re.compile(r"^(?!" + re.escape(origin) + r"/).*"), lambda route: route.abort()
    )  # other hosts are never reached
    answer = finished(ask_in_page(page, QUESTIONS["amber-fox"][0]))
    expect(answer.locator(".content")).to_contain_text("482")
    answer.get_by_role("button", name=re.compile("^01_kelorn_harbour.txt")).click()
    expect(page.locator("#passage-text mark")).to_contain_text("482")
    assert urlsplit(page.url).netloc == urlsplit(origin).netloc
    assert open_page.elsewhere() == []
