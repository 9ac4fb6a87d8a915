"""Concurrent conversations decoded together (decode/batch.py, engine.py `forward_batch`): each gets what it
gets alone, over one cache or several caches of one model.

`TOPK_TEST_SERVE_DEVICE=cuda` runs them on the GPU host, where a conversation's own one-token step replays
the CUDA graphs and a batched step runs the modules eagerly (fp32, so the tolerances hold).
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from topk_decode.errors import StepCancelled

K = 8  # well below the tiny cache's searchable tokens: flat really selects
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [20], [30, 31, 32, 33]]
DEVICE = os.environ.get("TOPK_TEST_SERVE_DEVICE", "cpu")


@pytest.fixture(scope="module")
def stores(tmp_path_factory, built_cache, docs_dir):
    """Two stores of the tiny Llama GQA model: the docs cache, and a cache of one of its files sharing the model."""
    from topk_decode.api import KVStore
    from topk_decode.prefill.build import build_cache

    cache, model_dir = built_cache
    one = tmp_path_factory.mktemp("one-doc")
    first = min(docs_dir.rglob("*.txt"))
    (one / first.name).write_text(first.read_text())
    other = tmp_path_factory.mktemp("caches") / "other"
    build_cache(one, other, model_dir, chunk_size=97, device="cpu")
    a = KVStore.open(cache, k=K, strategy="flat", device=DEVICE, dtype="fp32")
    b = KVStore.open(other, k=K, strategy="flat", device=DEVICE, dtype="fp32", share_model=a)
    yield a, b
    b.close()
    a.close()


def greedy_alone(store, prompt: list[int], n: int) -> list[int]:
    conv = store.decoder.new_conversation()
    return store.decoder.generate(conv, prompt, n)


def test_a_store_opened_with_share_model_decodes_with_the_same_model_and_lock(stores):
    a, b = stores
    assert b.model is a.model and b.tokenizer is a.tokenizer and b.decoder.lock is a.decoder.lock
    assert b.ckv.n_tokens < a.ckv.n_tokens


def test_share_model_refuses_a_cache_of_another_model(stores, tmp_path_factory, model_factory, docs_dir):
    from topk_decode.api import KVStore
    from topk_decode.errors import TopkError
    from topk_decode.prefill.build import build_cache

    out = tmp_path_factory.mktemp("caches") / "qwen"
    build_cache(docs_dir, out, model_factory("qwen2"), chunk_size=97, device="cpu")
    with pytest.raises(TopkError, match="not the model of"):
        KVStore.open(out, device=DEVICE, dtype="fp32", share_model=stores[0])


def test_flat_rows_are_independent_one_select_over_several_conversations_rows_equals_one_each(stores):
    strategy = stores[0].decoder.strategy
    shape = stores[0].decoder.shape
    assert strategy.rows_independent
    gen = torch.Generator().manual_seed(0)
    qs = [torch.randn(shape.n_kv_heads, shape.group_size, shape.head_dim, generator=gen) for _ in range(3)]
    together = strategy.select(1, torch.cat(qs, dim=1), K)
    G = shape.group_size
    for j, q in enumerate(qs):
        alone = strategy.select(1, q, K)
        assert torch.equal(together.ids[:, j * G : (j + 1) * G], alone.ids)
        torch.testing.assert_close(together.scores[:, j * G : (j + 1) * G], alone.scores)


def test_a_batched_step_gives_each_conversation_its_own_logits_over_its_own_cache(stores):
    from topk_decode.decode.engine import StepRequest, forward_batch

    a, b = stores
    pairs = [(a, PROMPTS[0]), (a, PROMPTS[1]), (b, PROMPTS[2]), (b, PROMPTS[3])]  # two caches, four lengths
    alone = [s.decoder.new_conversation() for s, _ in pairs]
    batched = [s.decoder.new_conversation() for s, _ in pairs]
    seen: dict[str, list] = {"alone": [], "batched": []}  # what an observer (sources) is shown, both ways
    alone[1].observer = lambda layer, q, sel, conv: seen["alone"].append((layer, q.clone(), sel.ids.clone()))
    batched[1].observer = lambda layer, q, sel, conv: seen["batched"].append((layer, q.clone(), sel.ids.clone()))
    toks = []
    for (s, p), c1, c2 in zip(pairs, alone, batched):
        l1, l2 = s.decoder.forward(p, c1), s.decoder.forward(p, c2)
        assert torch.equal(l1, l2)
        toks.append(int(torch.argmax(l1)))
    for _ in range(6):
        reqs = [StepRequest(s.decoder, c, [t]) for (s, _), c, t in zip(pairs, batched, toks)]
        forward_batch(reqs)
        nxt = []
        for (s, _), c1, c2, t, r in zip(pairs, alone, batched, toks, reqs):
            assert r.error is None
            want = s.decoder.forward([t], c1)
            torch.testing.assert_close(r.logits, want, rtol=1e-4, atol=1e-4)
            assert int(torch.argmax(r.logits)) == int(torch.argmax(want))
            assert c2.window.length == c1.window.length and c2.window.next_position == c1.window.next_position
            assert c2.stats.retrieved == c1.stats.retrieved
            nxt.append(int(torch.argmax(want)))
        toks = nxt
    assert len(seen["alone"]) == len(seen["batched"]) > 0
    for (l1, q1, ids1), (l2, q2, ids2) in zip(seen["alone"], seen["batched"]):
        assert l1 == l2 and q1.shape == q2.shape and torch.equal(ids1, ids2)
        torch.testing.assert_close(q1, q2, rtol=1e-4, atol=1e-4)


def test_a_cancelled_conversation_leaves_its_batch_and_stays_as_it_was(stores):
    from topk_decode.decode.engine import StepRequest, forward_batch

    a, _ = stores
    convs = [a.decoder.new_conversation() for _ in range(3)]
    for c, p in zip(convs, PROMPTS):
        a.decoder.forward(p, c)
    lengths = [c.window.length for c in convs]
    convs[1].should_stop = lambda: True
    reqs = [StepRequest(a.decoder, c, [40]) for c in convs]
    forward_batch(reqs)
    assert isinstance(reqs[1].error, StepCancelled) and reqs[1].logits is None
    assert convs[1].window.length == lengths[1]
    assert reqs[0].error is None and reqs[2].error is None
    assert [c.window.length for c in convs] == [lengths[0] + 1, lengths[1], lengths[2] + 1]


def test_threads_with_a_batcher_get_their_serial_greedy_answers_in_shared_steps(stores):
    from topk_decode.decode.batch import StepBatcher

    a, b = stores
    jobs = [(a, PROMPTS[0]), (b, PROMPTS[1]), (a, PROMPTS[2]), (b, PROMPTS[3])]
    serial = [greedy_alone(s, p, 12) for s, p in jobs]
    batcher = StepBatcher(max_batch=8)
    batcher.attach([a.decoder, b.decoder])
    try:
        got: list = [None] * len(jobs)

        def run(i: int) -> None:
            got[i] = greedy_alone(*jobs[i], 12)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert got == serial
        assert batcher.stepped > batcher.batches  # some steps held several conversations
        assert batcher.members == set()  # every answer left when it ended
    finally:
        a.decoder.batcher = b.decoder.batcher = None


def test_batcher_refuses_decoders_of_different_models(stores, built_cache):
    from topk_decode.api import KVStore
    from topk_decode.decode.batch import StepBatcher

    own = KVStore.open(built_cache[0], k=K, strategy="flat", device=DEVICE, dtype="fp32")  # its own model copy
    try:
        with pytest.raises(ValueError):
            StepBatcher(4).attach([stores[0].decoder, own.decoder])
    finally:
        own.close()
