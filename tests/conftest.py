"""Shared fixtures: tiny random-weight checkpoints of each supported family, built once per session."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from topk_decode.model.tiny import SIMPLE_CHAT_TEMPLATE, make_random_model, make_tokenizer

# Each family / attention layout the exactness tests cover: (family, config overrides).
MODEL_SPECS = {
    "llama_gqa": ("llama", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama_mha": ("llama", dict(num_attention_heads=4, num_key_value_heads=4)),
    "qwen2": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2)),  # q/k/v biases
    "mistral": ("mistral", dict(num_attention_heads=4, num_key_value_heads=1)),
}

DOC_TEXTS = {
    "alpha.txt": "The quick brown fox jumps over the lazy dog. Attention sinks keep the softmax stable. " * 12,
    "notes/beta.md": "# Notes\n\nPrefill runs once and writes the key value cache to disk. " * 10,
    "gamma.txt": "0123456789 alpha beta gamma delta epsilon zeta eta theta iota kappa lambda. " * 8,
}


def hf_greedy(model_dir: Path, ids: list[int], max_new_tokens: int, device: str = "cpu") -> list[int]:
    """The reference: HF `generate` (greedy, full KV) continuing `ids` with the fp32 checkpoint.

    Args:
        model_dir: checkpoint directory.
        ids: context + prompt token ids.
        max_new_tokens: tokens to generate.
        device: where the reference runs.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    x = torch.tensor([ids], device=device)
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, x.shape[1] :].tolist()


# The user's cache, read at import: the session fixture below points XDG_CACHE_HOME elsewhere.
USER_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
# The one place the tests keep files between runs (docs/USAGE.md "Use a real model"): the real-model tests' GGUF file and
# its bf16 conversion (tests/test_real_model.py), ~360 MB, content-addressed: reruns reuse them, nothing piles up.
TEST_MODELS = USER_CACHE / "topk-decode" / "test-models"


@pytest.fixture(scope="session", autouse=True)
def private_user_cache():
    """Everything the code under test keeps in the user's cache (GGUF conversions, the chat history) goes
    to a temporary folder that is removed when the session ends, not into ~/.cache/topk-decode."""
    with tempfile.TemporaryDirectory(prefix="topk-test-cache-") as d, pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", d)
        mp.delenv("TOPK_CACHE_HOME", raising=False)
        yield Path(d)


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--runslow") or os.environ.get("TOPK_RUN_SLOW") == "1"
    skip_slow = pytest.mark.skip(reason="slow: use --runslow or TOPK_RUN_SLOW=1")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    dry_run = os.environ.get("TOPK_REAL_DEVICE") == "cpu"  # test_gpu_real.py's code tried on a CPU (its docstring)
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            if not (dry_run and item.module.__name__.endswith("test_gpu_real")):
                item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer without a chat template."""
    d = tmp_path_factory.mktemp("tok")
    make_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """model_factory(name, chat=False, seed=0) → directory of a tiny random checkpoint (cached per args)."""
    from transformers import AutoTokenizer

    made: dict[tuple, Path] = {}

    def make(name: str = "llama_gqa", chat: bool = False, seed: int = 0) -> Path:
        key = (name, chat, seed)
        if key not in made:
            family, overrides = MODEL_SPECS[name]
            d = tmp_path_factory.mktemp(f"model-{name}-{'chat' if chat else 'raw'}-{seed}")
            tok = make_tokenizer(d, chat_template=SIMPLE_CHAT_TEMPLATE if chat else None)
            tok = AutoTokenizer.from_pretrained(d)
            make_random_model(d, family, seed=seed, tokenizer=tok, **overrides)
            made[key] = d
        return made[key]

    return make


@pytest.fixture(scope="session")
def docs_dir(tmp_path_factory) -> Path:
    """A small documents folder: two .txt, one .md in a subfolder, and a file to skip."""
    d = tmp_path_factory.mktemp("docs")
    for name, text in DOC_TEXTS.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
    (d / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    return d


@pytest.fixture(scope="session")
def built_cache(tmp_path_factory, model_factory, docs_dir) -> tuple[Path, Path]:
    """(cache_dir, model_dir): the docs prefilled with the tiny Llama GQA model in fp32 on the CPU."""
    from topk_decode.prefill.build import build_cache

    model_dir = model_factory("llama_gqa")
    out = tmp_path_factory.mktemp("caches") / "cache"
    build_cache(docs_dir, out, model_dir, chunk_size=97, device="cpu")
    return out, model_dir


@pytest.fixture(scope="session")
def short_model(tmp_path_factory) -> Path:
    """A tiny Llama that knows only 64 positions (context-length refusals, past-maximum-positions warnings)."""
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("short-model")
    make_tokenizer(d)
    make_random_model(d, "llama", seed=0, tokenizer=AutoTokenizer.from_pretrained(d), max_position_embeddings=64)
    return d


def serve_in_thread(server):
    """Serve `server`'s app with uvicorn in a thread on a free port of 127.0.0.1: yields (base_url, server)
    once it accepts requests, and stops it afterwards (the body of a module fixture)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    import uvicorn

    from topk_decode.serve.app import create_app

    uv = uvicorn.Server(uvicorn.Config(create_app(server), log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", server
    uv.should_exit = True
    thread.join(15)
