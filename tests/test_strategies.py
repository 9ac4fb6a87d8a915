"""Selection strategies ivf, hnsw, quest, tokenselect and per-layer k schedules."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from conftest import hf_greedy

from topk_decode import KVStore
from topk_decode.errors import TopkError
from topk_decode.index import STRATEGIES, artifact_dir, get_strategy
from topk_decode.index.quest import page_bounds, page_scores
from topk_decode.index.schedule import k_schedule
from topk_decode.index.tokenselect import scan_scores, soft_vote
from topk_decode.store.cache_dir import CacheWriter, open_cache

NEW = ["ivf", "hnsw", "quest", "tokenselect"]


@pytest.fixture(scope="module")
def own_cache(tmp_path_factory, built_cache):
    """A private copy of the shared tiny cache (our artifacts must not leak into other tests' cache)."""
    cache, model_dir = built_cache
    dst = tmp_path_factory.mktemp("strategies") / "cache"
    shutil.copytree(cache, dst)
    return dst, model_dir


@pytest.fixture(scope="module")
def synthetic_cache(tmp_path_factory):
    """A model-free cache of 2 layers × 2 KV heads × 2000 random keys (D=16) with a common offset."""
    out = tmp_path_factory.mktemp("synthetic") / "cache"
    gen = torch.Generator().manual_seed(0)
    n, hkv, d, layers = 2000, 2, 16, 2
    w = CacheWriter(out)
    for layer in range(layers):
        keys = torch.randn(hkv, n, d, generator=gen) + 2.0  # an offset shared by all keys, as in real K
        w.write_layer(layer, keys, torch.randn(hkv, n, d, generator=gen))
    w.write_tokens(list(range(n)))
    w.commit(
        {
            "model": {"path": "none", "fingerprint": "none"},
            "kv_dtype": "float32",
            "n_tokens": n,
            "shape": {"n_layers": layers, "n_heads": 4, "n_kv_heads": hkv, "head_dim": d},
            "documents": [],
        }
    )
    return out


def _open(cache, name, options=None, lo=3, hi=None):
    ckv = open_cache(cache)
    strat = get_strategy(name)(ckv, lo, hi if hi is not None else ckv.n_tokens - 5, options or {})
    strat.prepare()
    return strat


def _queries(hkv=2, q=4, d=16, seed=1):
    return torch.randn(hkv, q, d, generator=torch.Generator().manual_seed(seed))


# ---- quest ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("adversarial", [False, True])
def test_quest_page_score_bounds_every_qk_in_its_page(adversarial):
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 70, 8, generator=gen)  # 70 = 4 full pages of 16 + a partial one
    q = torch.randn(2, 5, 8, generator=gen)
    if adversarial:
        # Mixed signs within a dimension and queries whose signs flip per dimension: the bound must
        # pick max for positive q_d and min for negative q_d.
        keys[:, ::2] *= -3.0
        q = torch.sign(torch.randn(2, 5, 8, generator=gen)) * 10.0
    mins, maxs = page_bounds(keys, 16)
    bound = page_scores(q, mins, maxs)  # (2, 5, 5)
    exact = torch.bmm(q, keys.transpose(1, 2))  # (2, 5, 70)
    for p in range(5):
        page_max = exact[:, :, p * 16 : (p + 1) * 16].amax(dim=-1)
        assert torch.all(bound[:, :, p] >= page_max - 1e-4)


def test_quest_pages_never_leave_the_searchable_range(synthetic_cache):
    strat = _open(synthetic_cache, "quest", {"dense_layers": 0}, lo=5, hi=1990)  # neither on a page edge
    for k in (16, 64, 160):
        sel = strat.select(1, _queries(), k)
        valid = sel.ids[sel.ids >= 0]
        assert valid.min() >= 5 and valid.max() < 1990
        assert bool((sel.ids == 1989).any(dim=-1).all())  # the last (partial) page is always attended


def test_quest_dense_layers_attend_everything(synthetic_cache):
    strat = _open(synthetic_cache, "quest", {"dense_layers": 1})
    assert strat.select(0, _queries(), 32).ids.shape[-1] == strat.n_searchable
    assert strat.select(1, _queries(), 32).ids.shape[-1] == 32


# ---- tokenselect ----------------------------------------------------------------------------------
def test_soft_vote_matches_hand_computation():
    scores = torch.tensor(
        [[[0.0, 0.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]], [[0.0, 4.0, 0.0, 0.0], [0.0, 0.0, 0.0, 8.0]]]
    )  # (Hkv=2, Q=2, M=4)
    e2, e4, e8 = np.exp(1.0), np.exp(2.0), np.exp(4.0)  # scale 0.5 halves the scores
    heads = [
        [0.25] * 4,
        [e2 / (e2 + 3), 1 / (e2 + 3), 1 / (e2 + 3), 1 / (e2 + 3)],
        [1 / (e4 + 3), e4 / (e4 + 3), 1 / (e4 + 3), 1 / (e4 + 3)],
        [1 / (e8 + 3), 1 / (e8 + 3), 1 / (e8 + 3), e8 / (e8 + 3)],
    ]
    expected = torch.tensor(np.sum(heads, axis=0), dtype=torch.float32)
    torch.testing.assert_close(soft_vote(scores, 0.5), expected)


def test_blocked_scan_equals_one_matmul_over_the_range():
    gen = torch.Generator().manual_seed(4)
    keys, q = torch.randn(2, 1000, 8, generator=gen).bfloat16(), torch.randn(2, 3, 8, generator=gen)
    ref = torch.bmm(q, keys[:, 7:993].float().transpose(1, 2))
    torch.testing.assert_close(scan_scores(q, keys, 7, 993, block=100), ref)


def test_tokenselect_shares_ids_across_heads_with_exact_scores(synthetic_cache):
    strat = _open(synthetic_cache, "tokenselect")
    q = _queries()
    sel = strat.select(0, q, 32, strat.new_state())
    assert torch.equal(sel.ids, sel.ids[:1, :1].expand_as(sel.ids))
    keys = strat.ckv.keys[0]
    ref = torch.einsum("hqd,hqkd->hqk", q, keys[torch.arange(2)[:, None, None], sel.ids])
    torch.testing.assert_close(sel.scores, ref)


def test_tokenselect_reuses_selection_when_queries_repeat(synthetic_cache):
    strat = _open(synthetic_cache, "tokenselect", {"threshold": 0.9})
    state = strat.new_state()
    q = _queries()
    first = strat.select(0, q, 32, state)
    again = strat.select(0, q * 1.01 + 1e-3, 32, state)  # nearly the same query: cache hit
    other = strat.select(0, _queries(seed=9), 32, state)  # an unrelated query: searched again
    assert (strat.stats.searches, strat.stats.reused) == (2, 1)
    assert first.searched and not again.searched and other.searched
    assert torch.equal(first.ids, again.ids)
    assert strat.stats.extra["hit_rate"] == pytest.approx(1 / 3)


# ---- ivf / hnsw ----------------------------------------------------------------------------------
@pytest.mark.parametrize("center", [False, True])
def test_ivf_with_nprobe_equal_nlist_matches_flat(synthetic_cache, center):
    ivf = _open(synthetic_cache, "ivf", {"nlist": 16, "nprobe": 16, "center": center, "threads": 2})
    flat = _open(synthetic_cache, "flat", {"threads": 1})
    q = _queries()
    for layer in range(2):
        a, b = ivf.select(layer, q, 20), flat.select(layer, q, 20)
        assert torch.equal(a.ids, b.ids)
        torch.testing.assert_close(a.scores, b.scores, rtol=1e-5, atol=1e-5)


def test_hnsw_with_large_ef_search_has_recall_near_one(synthetic_cache):
    hnsw = _open(synthetic_cache, "hnsw", {"efSearch": 512})
    flat = _open(synthetic_cache, "flat", {"threads": 1})
    q = _queries(q=8)
    a, b = hnsw.select(1, q, 20), flat.select(1, q, 20)
    hits = sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a.ids.reshape(-1, 20), b.ids.reshape(-1, 20)))
    assert hits / b.ids.numel() >= 0.98


@pytest.mark.parametrize("name", ["ivf", "hnsw"])
def test_ann_never_returns_ids_outside_the_searchable_range(synthetic_cache, name):
    strat = _open(synthetic_cache, name, {"ivf": {"nprobe": 2}, "hnsw": {"efSearch": 16}}[name], lo=700, hi=900)
    sel = strat.select(0, _queries(), 50)
    valid = sel.ids[sel.ids >= 0]
    assert valid.numel() > 0 and valid.min() >= 700 and valid.max() < 900


def test_artifacts_are_reused_on_second_open_and_rebuilt_when_options_change(synthetic_cache):
    _open(synthetic_cache, "ivf", {"nlist": 8})
    done = artifact_dir(synthetic_cache, "ivf") / "done.json"
    first = done.stat().st_mtime_ns
    _open(synthetic_cache, "ivf", {"nprobe": 4})  # search option only: no rebuild
    _open(synthetic_cache, "ivf", {"nlist": 8})  # same build option: no rebuild
    assert done.stat().st_mtime_ns == first
    strat = _open(synthetic_cache, "ivf", {"nlist": 12})  # a different nlist: rebuilt
    assert done.stat().st_mtime_ns != first and strat.built["nlist"] == 12
    q = _open(synthetic_cache, "quest", {"page_size": 16})
    qdone = artifact_dir(synthetic_cache, "quest") / "done.json"
    mtime = qdone.stat().st_mtime_ns
    _open(synthetic_cache, "quest")
    assert qdone.stat().st_mtime_ns == mtime and q.page_size == 16
    assert _open(synthetic_cache, "quest", {"page_size": 8}).page_size == 8


def test_unwritable_cache_raises_a_topk_error(tmp_path, synthetic_cache, monkeypatch):
    import topk_decode.index.ann as ann

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(ann.Path, "mkdir", refuse)
    with pytest.raises(TopkError, match="cannot write the hnsw index"):
        _open(synthetic_cache, "hnsw", {"M": 7})


def test_bad_options_raise_topk_errors(synthetic_cache):
    with pytest.raises(TopkError, match="nlist"):
        _open(synthetic_cache, "ivf", {"nlist": "many"})
    with pytest.raises(TopkError, match="schedule"):
        k_schedule("cubic", 8, 4)


# ---- every strategy, end to end ------------------------------------------------------------------
@pytest.mark.parametrize("name", NEW)
def test_strategy_reproduces_hf_generate_when_budget_covers_context(own_cache, name):
    cache, model_dir = own_cache
    assert name in STRATEGIES
    store = KVStore.open(cache, k=100_000, strategy=name, device="cpu")
    prompt = [5, 17, 42, 99]
    ours = store.generate_ids(prompt, max_new_tokens=10)
    assert ours == hf_greedy(model_dir, store.context_ids + prompt, 10)


@pytest.mark.parametrize("name,options", [("ivf", {"nlist": 4, "nprobe": 4}), ("hnsw", {"efSearch": 1000})])
def test_exhaustive_ann_decodes_like_flat_with_small_k(own_cache, name, options):
    cache, _ = own_cache
    prompt = [5, 17, 42, 99]
    flat = KVStore.open(cache, k=24, strategy="flat", device="cpu").generate_ids(prompt, 8)
    ann = KVStore.open(cache, k=24, strategy=name, strategy_options=options, device="cpu").generate_ids(prompt, 8)
    assert ann == flat


def test_every_strategy_returns_ids_inside_the_range_during_decoding(own_cache):
    cache, _ = own_cache
    for name in NEW:
        store = KVStore.open(
            cache,
            k=32,
            strategy=name,
            device="cpu",
            n_sink=4,
            n_tail=64,
            strategy_options={"dense_layers": 0} if name == "quest" else {},
        )
        lo, hi = store.decoder.strategy.lo, store.decoder.strategy.hi
        seen = []
        conv = store.decoder.new_conversation()
        conv.observer = lambda layer, q, sel, c: seen.append(sel.ids[sel.ids >= 0])
        store.decoder.generate(conv, [5, 17, 42], 4)
        ids = torch.cat(seen)
        assert ids.numel() > 0 and ids.min() >= lo and ids.max() < hi, name


# ---- per-layer k ---------------------------------------------------------------------------------
@pytest.mark.parametrize("k,layers", [(256, 32), (10, 3), (1, 4), (3, 7)])
def test_linear_schedule_sums_to_the_uniform_total_and_increases(k, layers):
    lin = k_schedule("linear", k, layers)
    assert sum(lin) == sum(k_schedule("uniform", k, layers)) == k * layers
    assert all(a <= b for a, b in zip(lin, lin[1:])) and min(lin) >= 1


def test_store_uses_the_linear_schedule_per_layer(own_cache):
    cache, _ = own_cache
    store = KVStore.open(cache, k=20, k_schedule="linear", device="cpu")
    n_layers = store.ckv.n_layers
    assert [store.config.k_for_layer(l) for l in range(n_layers)] == k_schedule("linear", 20, n_layers)
