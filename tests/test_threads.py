"""One KVStore shared by many threads gives every caller exactly its serial answer."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from topk_decode.api import KVStore

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [  # examples/QUESTIONS.md: the demo model answers these from examples/docs
    "What is the special magic number for amber-fox?",
    "What is the special magic number for silver-owl?",
    "What is the special magic number for quiet-lynx?",
    "Which number does variable brave-otter equal?",
]
N_THREADS, PER_THREAD = 4, 4


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory) -> Path:
    """examples/docs prefilled with the bundled demo model (a few seconds on the CPU)."""
    from topk_decode.demo import default_model_dir
    from topk_decode.prefill.build import build_cache

    out = tmp_path_factory.mktemp("threads") / "cache"
    build_cache(ROOT / "examples" / "docs", out, default_model_dir()[0], device="cpu")
    return out


def _question_ids(store: KVStore, question: str) -> list[int]:
    text = store.prompt_format.question_text(question, first_turn=True)
    return store.tokenizer(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize(
    "strategy,options",
    [
        ("flat", {"backend": "faiss"}),
        ("flat", {"backend": "torch"}),
        ("ivf", {"nprobe": 4}),
    ],
)
def test_threads_sharing_a_store_get_the_serial_answers(demo_cache, strategy, options):
    with KVStore.open(demo_cache, k=32, strategy=strategy, strategy_options=options, device="cpu") as store:
        ids = [_question_ids(store, q) for q in QUESTIONS]
        serial_text = [store.ask(q, max_new_tokens=16) for q in QUESTIONS]
        serial_ids = [store.generate_ids(i, max_new_tokens=16) for i in ids]
        assert "482" in serial_text[0]  # the serial path itself is right (examples/QUESTIONS.md)

        start = threading.Barrier(N_THREADS)

        def worker(t: int) -> list[tuple[int, str, object]]:
            start.wait()  # all threads decode at the same time
            got = []
            for j in range(PER_THREAD):
                i = (t + j) % len(QUESTIONS)
                if j % 2:
                    got.append((i, "ids", store.generate_ids(ids[i], max_new_tokens=16)))
                else:
                    got.append((i, "text", store.ask(QUESTIONS[i], max_new_tokens=16)))
            return got

        with ThreadPoolExecutor(N_THREADS) as pool:
            results = [r for rs in pool.map(worker, range(N_THREADS)) for r in rs]
    assert len(results) == N_THREADS * PER_THREAD
    wrong = [
        (QUESTIONS[i], kind, got)
        for i, kind, got in results
        if got != (serial_ids[i] if kind == "ids" else serial_text[i])
    ]
    assert not wrong, f"{len(wrong)} of {len(results)} threaded answers differ from the serial ones: {wrong[:3]}"


def test_chat_sessions_in_threads_keep_their_own_conversation(demo_cache):
    with KVStore.open(demo_cache, k=32, device="cpu") as store:

        def two_turns(i: int) -> list[str]:
            s = store.session()
            return [s.ask(QUESTIONS[i], max_new_tokens=16), s.ask(QUESTIONS[(i + 1) % 4], max_new_tokens=16)]

        serial = [two_turns(i) for i in range(3)]
        with ThreadPoolExecutor(3) as pool:
            threaded = list(pool.map(two_turns, range(3)))
    assert threaded == serial


@pytest.mark.parametrize("strategy,options", [("flat", {"backend": "faiss", "threads": 2}), ("ivf", {"threads": 2})])
def test_opening_and_decoding_leave_process_thread_settings_alone(built_cache, strategy, options):
    import faiss
    import torch

    cache, model_dir = built_cache
    before = (torch.get_num_threads(), faiss.omp_get_max_threads())
    earlier = set(threading.enumerate())  # pools of other tests' stores may still be winding down
    with KVStore.open(cache, k=8, strategy=strategy, strategy_options=options, device="cpu") as store:
        assert (torch.get_num_threads(), faiss.omp_get_max_threads()) == before
        store.generate_ids([5, 6, 7], max_new_tokens=3)
        assert (torch.get_num_threads(), faiss.omp_get_max_threads()) == before
        workers = [t for t in threading.enumerate() if t.name.startswith("topk-heads") and t not in earlier]
        assert workers, "the per-head searches ran on the store's own pool"
    assert not any(t.is_alive() for t in workers), "close() stops the store's threads"
    from topk_decode.errors import TopkError

    with pytest.raises(TopkError, match="closed"):
        store.generate_ids([5], max_new_tokens=1)


def test_threads_sharing_the_one_token_segments_get_the_serial_answers(built_cache):
    """The fixed-buffer segments of the CUDA-graph path (run eagerly on the CPU) are shared by every
    conversation of a decoder: threads must still get their serial tokens."""
    from topk_decode.config import DecodeConfig
    from topk_decode.decode.engine import TopKDecoder
    from topk_decode.model.loading import load_model
    from topk_decode.store.cache_dir import open_cache

    cache, model_dir = built_cache
    dec = TopKDecoder(
        load_model(model_dir, "cpu"),
        open_cache(cache),
        DecodeConfig(k=8, strategy_options={"backend": "torch"}),
        graphs=True,
    )
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14], [20]]
    serial = [dec.generate(dec.new_conversation(), p, 8) for p in prompts]
    start = threading.Barrier(4)

    def run(i: int) -> list[list[int]]:
        start.wait()
        return [dec.generate(dec.new_conversation(), prompts[(i + j) % 4], 8) for j in range(3)]

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(run, range(4)))
    assert got == [[serial[(i + j) % 4] for j in range(3)] for i in range(4)]
    dec.close()


def test_the_small_op_thread_limit_applies_to_the_calling_thread_only():
    import torch

    from topk_decode.index import threads

    if threads._OMP is None or torch.get_num_threads() < 2:
        pytest.skip("needs torch's OpenMP runtime and ≥ 2 threads")
    full = torch.get_num_threads()
    seen = {}
    with threads.omp_threads(1):
        seen["here"] = torch.get_num_threads()
        other = threading.Thread(target=lambda: seen.setdefault("other", torch.get_num_threads()))
        other.start()
        other.join()
    assert seen == {"here": 1, "other": full} and torch.get_num_threads() == full


def test_head_pool_map_that_fails_returns_only_after_its_running_tasks_end():
    # An interrupted or failed search must not leave a task writing into buffers the next step reuses.
    import time

    from topk_decode.index.threads import HeadPool

    pool = HeadPool(2)
    started, done = threading.Event(), []

    def task(i: int) -> int:
        if i == 1:
            started.set()
            time.sleep(0.5)
            done.append(i)
            return i
        started.wait()
        raise KeyboardInterrupt  # as a Ctrl-C landing in the caller while head 1 still runs

    try:
        with pytest.raises(KeyboardInterrupt):
            pool.map(task, [0, 1])
        assert done == [1]
        assert pool.map(lambda i: i * 2, range(4)) == [0, 2, 4, 6]
    finally:
        pool.close()
