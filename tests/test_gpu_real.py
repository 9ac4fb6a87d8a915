"""What users run, on a GPU, with a real model: the product's path gives dense's answers with finite logits.

A Qwen2.5-Coder-0.5B-Instruct cache above `auto`'s threshold (real text, facts at spread-out depths, held-out seed),
opened as users open it (`KVStore.open` with its defaults: compile, CUDA graphs, the device placement), and asked
through `ask()`'s path, the CLI's `topk chat --prompt` and `topk serve`. Dense is `flat` over every context token.
Each configuration the device placement can choose is opened in turn (key codes as built and coarsened, value codes
on every layer or a few, clusters ranked, device_read on and off, float8 tables, bf16 and int8 KV, compile and
graphs off). Qwen's group of 7 query heads per KV head is what the tiny test models (groups of 1, 2, 4) never had.

Needs a CUDA GPU and the model: TOPK_REAL_GGUF=path/to/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf (or an HF directory;
`python tools/fetch_real_models.py --dir models --only qwen0.5b` fetches it). Run on the GPU host:
    TOPK_REAL_GGUF=... python -m pytest -m gpu tests/test_gpu_real.py

A dry run of the tests' own code on a CPU (before a GPU session; nothing it prints is a figure):
    TOPK_REAL_GGUF=topk_decode/demo_model TOPK_REAL_DEVICE=cpu TOPK_REAL_LENGTH=3000 python -m pytest -m gpu \
        tests/test_gpu_real.py -k "cli or serve or one_token or 'auto]'"
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

# context tokens: above auto's EXACT_MAX_TOKENS (8,192), so auto runs routed rank=keys
LENGTH = int(os.environ.get("TOPK_REAL_LENGTH", 12_288))
DEVICE = os.environ.get("TOPK_REAL_DEVICE", "cuda")  # cpu: a dry run of the tests' code (above)
SEED = 100  # held out: the suite's seeds are below it
TASKS = ["real_needle", "real_multi_key", "real_vt", "real_qa"]
PER_TASK = 3  # 12 questions

# name → (cache, KVStore.open strategy, strategy options, other open arguments)
CONFIGS = {
    "auto": ("bf16", "auto", {}, {}),
    "auto-device_read-false": ("bf16", "auto", {"device_read": "false"}, {}),
    "auto-fp8-tables": ("bf16", "auto", {"device_tables": "fp8"}, {}),
    "auto-codes-16-values-1-layer": ("bf16", "auto", {"device_code_m": 16, "device_value_layers": 1}, {}),
    "auto-codes-32-values-6-layers": ("bf16", "auto", {"device_code_m": 32, "device_value_layers": 6}, {}),
    "auto-compile-false": ("bf16", "auto", {}, {"compile": False}),
    "auto-graphs-false": ("bf16", "auto", {}, {"graphs": False}),
    "auto-int8": ("int8", "auto", {}, {}),
    "auto-int8-device_read-false": ("int8", "auto", {"device_read": "false"}, {}),
    "routed-clusters": ("bf16", "routed", {}, {}),
    "routed-clusters-device_read-false": ("bf16", "routed", {"device_read": "false"}, {}),
    "routed-clusters-int8": ("int8", "routed", {}, {}),
}


def _model() -> Path:
    path = os.environ.get("TOPK_REAL_GGUF")
    if not path or not Path(path).exists():
        pytest.skip("set TOPK_REAL_GGUF to Qwen2.5-Coder-0.5B-Instruct's GGUF file (tools/fetch_real_models.py)")
    return Path(path)


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """(model dir, {kv: cache}, suite, dense answers): one context prefilled on the GPU in bf16 and int8 KV."""
    from topk_decode.eval.realtext import make_suite
    from topk_decode.model.loading import load_tokenizer, resolve_model_path
    from topk_decode.prefill.build import build_cache

    model_dir = resolve_model_path(_model())
    suite = make_suite(TASKS, LENGTH, SEED, load_tokenizer(model_dir), per_task=PER_TASK)
    # TOPK_REAL_WORK: a folder where the caches are kept and reused by the next run (the same suite, model and code)
    work = os.environ.get("TOPK_REAL_WORK")
    root = Path(work) / suite.sha if work else tmp_path_factory.mktemp("real")
    (root / "docs").mkdir(parents=True, exist_ok=True)
    (root / "docs" / "context.txt").write_text(suite.context)
    caches = {}
    for kv in ("bf16", "int8"):
        caches[kv] = root / f"cache-{kv}"
        if not (work and (caches[kv] / "manifest.json").is_file()):
            build_cache(
                root / "docs",
                caches[kv],
                model_dir,
                device=DEVICE,
                kv_dtype="int8" if kv == "int8" else None,
                overwrite=True,
            )
    dense = {kv: answers(open_store(caches[kv], "flat", {}, {}, dense=True), suite) for kv in caches}
    return model_dir, caches, suite, dense


def open_store(cache: Path, strategy: str, options: dict, kwargs: dict, dense: bool = False):
    from topk_decode import KVStore
    from topk_decode.decode import engine

    kwargs = dict(kwargs)
    graphs = kwargs.pop("graphs", None)
    if dense:
        from topk_decode.store.cache_dir import open_cache

        kwargs["k"] = open_cache(cache, verify=False).n_tokens  # flat over every context token: dense attention
    store = KVStore.open(cache, strategy=strategy, strategy_options=options, device=DEVICE, **kwargs)
    if graphs is False:  # the same segments, run eagerly on the GPU (no capture)
        real_segments = engine.StepSegments
        engine.StepSegments = lambda *a, **kw: real_segments(*a, **{**kw, "capture": False})  # noqa: E731
        store._restore_segments = (engine, real_segments)
    return store


def answers(store, suite) -> list[tuple[str, int]]:
    """(text, non-finite steps recomputed) per question, each on a fresh conversation as `ask()` asks it."""
    out = []
    try:
        for q in suite.questions:
            chat = store.session()
            text = chat.ask(q.question, max_new_tokens=q.max_new_tokens)
            # getattr: a tree from before the non-finite guard (deacbdf) has no count; the check against it is the answers
            out.append((text, getattr(chat.conv.stats, "recomputed", 0)))
    finally:
        restore = getattr(store, "_restore_segments", None)
        if restore is not None:
            restore[0].StepSegments = restore[1]
        store.close()
    return out


def first_number_end(text: str) -> int:
    """Where the first number of `text` ends (len(text) where it has none)."""
    import re

    m = re.search(r"\d+", text)
    return m.end() if m else len(text)


def check_against_dense(ours: list[str], dense: list[str]) -> list[str]:
    """The failures: every answer equals dense's, but one may diverge after dense's first number."""
    late = []
    bad = []
    for i, (a, b) in enumerate(zip(ours, dense)):
        if a == b:
            continue
        common = len(os.path.commonprefix([a, b]))
        if common >= first_number_end(b):
            late.append(i)
        else:
            bad.append(f"question {i}: {a!r} vs dense {b!r}")
    if len(late) > 1:
        bad += [f"question {i}: {ours[i]!r} vs dense {dense[i]!r} (diverges after the number)" for i in late[1:]]
    return bad


def test_dense_answers_the_suite(real):
    """The reference itself: finite, and the model answers most questions right (a broken conversion would not)."""
    _, _, suite, dense = real
    for kv, got in dense.items():
        assert all(r == 0 for _, r in got), f"{kv}: dense recomputed a non-finite step"
        right = sum(q.check(t) for q, (t, _) in zip(suite.questions, got))
        assert right >= len(got) // 2, f"{kv}: dense answered {right}/{len(got)}: {[t for t, _ in got]}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_store_open_ask_gives_dense_answers_with_finite_logits(real, name):
    _, caches, suite, dense = real
    kv, strategy, options, kwargs = CONFIGS[name]
    store = open_store(caches[kv], strategy, options, kwargs)
    placed = store.decoder.strategy
    got = answers(store, suite)
    assert [r for _, r in got] == [0] * len(got), f"non-finite logits recomputed: {[r for _, r in got]}"
    bad = check_against_dense([t for t, _ in got], [t for t, _ in dense[kv]])
    print(f"{name}: {len(got) - len(bad)}/{len(got)} answers as dense's")
    if strategy == "routed":  # clusters ranked: an approximation that keeps dense's answer less often (docs/EVAL.md)
        return  # here the point is finite logits; its agreement is the suite's figure, not a pass/fail
    assert not bad, f"{name} ({placed.name}): " + "; ".join(bad)


def test_cli_chat_prompt_gives_dense_answer(real):
    """`topk chat CACHE --prompt Q`, the CLI's defaults (auto), gives dense's answer text."""
    _, caches, suite, dense = real
    for i in (0, 3):
        q = suite.questions[i]
        cmd = [sys.executable, "-m", "topk_decode.cli.app", "chat", str(caches["bf16"]), "--prompt", q.question]
        cmd += ["--max-new-tokens", str(q.max_new_tokens), "--device", DEVICE]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        assert dense["bf16"][i][0].strip() in run.stdout, (run.stdout[-500:], dense["bf16"][i][0])


def test_serve_chat_completion_gives_dense_answer(real):
    """`topk serve`'s chat completion over an auto store gives dense's answer text."""
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from conftest import serve_in_thread

    from topk_decode.serve.app import Server

    _, caches, suite, dense = real
    store = open_store(caches["bf16"], "auto", {}, {})
    server = Server({"real": store}, max_tokens_limit=256, default_max_tokens=64, max_body_mb=1)
    gen = serve_in_thread(server)
    base, _ = next(gen)
    try:
        for i in (1, 4):
            q = suite.questions[i]
            body = {"model": "real", "messages": [{"role": "user", "content": q.question}]}
            body["max_tokens"] = q.max_new_tokens
            req = urllib.request.Request(
                base + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=300) as r:
                text = json.loads(r.read())["choices"][0]["message"]["content"]
            assert text == dense["bf16"][i][0]
    finally:
        next(gen, None)
        store.close()


def test_one_token_steps_of_auto_are_finite(real):
    """Every one-token step's logits of auto's captured step are finite (checked directly, not through the guard)."""
    _, caches, suite, _ = real
    store = open_store(caches["bf16"], "auto", {}, {})
    try:
        conv = store.decoder.new_conversation()
        ids = store.tokenizer.encode(suite.questions[0].question)
        logits = store.decoder.forward(ids, conv)
        for _ in range(12):
            token = int(logits.argmax())
            logits = store.decoder.forward([token], conv)
            assert torch.isfinite(logits).all()
        assert conv.stats.recomputed == 0
    finally:
        store.close()
