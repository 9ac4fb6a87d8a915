"""routed's compiled search (kernels/routed_scan.py) selects what the torch path selects."""

from __future__ import annotations

import pytest
import test_routed
import torch
from test_routed import _open, _queries, clustered_cache, own_cache  # noqa: F401 - fixtures

from topk_decode.decode.context import ContextAttention
from topk_decode.errors import TopkError
from topk_decode.index.base import exact_scores


@pytest.fixture(autouse=True)
def _close_what_each_test_opens(monkeypatch):
    """Every strategy a test opens is closed after it (the compiled path starts a thread pool)."""
    opened = []

    def tracked(*args, **kwargs):
        opened.append(test_routed._open(*args, **kwargs))
        return opened[-1]

    monkeypatch.setitem(globals(), "_open", tracked)
    yield
    for strat in opened:
        strat.close()


def _pair(cache, options, lo=3, hi=None):
    return (
        _open(cache, "routed", dict(options, kernel="numba"), lo=lo, hi=hi),
        _open(cache, "routed", dict(options, kernel="torch"), lo=lo, hi=hi),
    )


@pytest.mark.parametrize("lo,hi", [(3, 2990), (0, 3000), (700, 1500)])
@pytest.mark.parametrize("k,probe", [(8, 0.05), (50, 0.1), (200, 0.3)])
def test_compiled_and_torch_paths_select_the_same_ids_with_the_same_scores(clustered_cache, lo, hi, k, probe):
    compiled, plain = _pair(clustered_cache, {"cluster_size": 32, "probe_fraction": probe}, lo, hi)
    assert compiled.kernel and not plain.kernel
    for layer, seed in ((0, 11), (1, 12)):
        q = _queries(seed=seed)
        a, b = compiled.select(layer, q, k), plain.select(layer, q, k)
        assert a.ids.shape == (2, 4, k)
        assert torch.equal(a.ids.sort(-1).values, b.ids.sort(-1).values)
        torch.testing.assert_close(a.scores.sort(-1).values, b.scores.sort(-1).values, rtol=1e-5, atol=1e-5)
        filled = a.ids >= 0  # a narrow range can leave fewer than k keys read
        exact = exact_scores(compiled.ckv.keys[layer], q, a.ids.clamp(min=0))
        assert torch.allclose(a.scores[filled], exact[filled], atol=1e-4)
        # the estimate of the unread clusters (on by default) is the torch path's
        torch.testing.assert_close(a.rest.lse, b.rest.lse, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.rest.out, b.rest.out, rtol=1e-4, atol=1e-5)
    assert compiled.keys_read_fraction() == plain.keys_read_fraction()


@pytest.mark.parametrize("threads", [3, 8])  # 2 and 4 routing tasks per KV head
@pytest.mark.parametrize("probe", [0.05, 0.9])
def test_routing_split_over_several_tasks_per_head_selects_and_estimates_as_the_torch_path(
    clustered_cache, monkeypatch, threads, probe
):
    from topk_decode.index.routed import compiled as routed_compiled

    monkeypatch.setattr(routed_compiled, "_MIN_CLUSTERS_PER_TASK", 8)
    compiled, plain = _pair(clustered_cache, {"cluster_size": 32, "probe_fraction": probe})
    compiled.threads = threads
    for layer, seed in ((0, 31), (1, 32)):
        q = _queries(seed=seed)
        hkv, Q, d = q.shape
        o, mz = torch.empty(hkv * Q, d, dtype=torch.bfloat16), torch.empty(hkv * Q, 2)
        a, b = compiled.select_and_attend(layer, q, 20, None, o, mz), plain.select(layer, q, 20)
        assert torch.equal(a.ids.sort(-1).values, b.ids.sort(-1).values)
        torch.testing.assert_close(a.rest.lse, b.rest.lse, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.rest.out, b.rest.out, rtol=1e-4, atol=1e-5)


def test_compiled_path_handles_many_queries_per_head_as_a_prompt_chunk_does(clustered_cache):
    compiled, plain = _pair(clustered_cache, {"cluster_size": 32, "probe_fraction": 0.1})
    q = _queries(q=4 * 37, seed=4)  # G = 4 query heads × 37 prompt tokens per KV head
    a, b = compiled.select(0, q, 16), plain.select(0, q, 16)
    assert torch.equal(a.ids.sort(-1).values, b.ids.sort(-1).values)
    torch.testing.assert_close(a.rest.out, b.rest.out, rtol=1e-4, atol=1e-5)


def test_probing_every_cluster_with_the_compiled_path_equals_flat_and_estimates_nothing(clustered_cache):
    compiled = _open(clustered_cache, "routed", {"cluster_size": 32, "probe_fraction": 1, "kernel": "numba"})
    flat = _open(clustered_cache, "flat")
    q = _queries(seed=5)
    a, b = compiled.select(0, q, 50), flat.select(0, q, 50)
    assert torch.equal(a.ids.sort(-1).values, b.ids.sort(-1).values)
    assert a.no_empty_slots
    assert torch.isinf(a.rest.lse).all() and not a.rest.out.any()


def _normalised(o, mz, shape):
    """A context part's output o/z (Hkv, Q, D) and lse m + log z (Hkv, Q), in fp32."""
    hkv, Q, d = shape
    return (o.float() / mz[:, 1:]).view(hkv, Q, d), (mz[:, 0] + mz[:, 1].log()).view(hkv, Q)


# keys and values read next to each other in the layout / the values by position / both from the cache by position
# (store_keys=false, store_values=false: the KV held once)
@pytest.mark.parametrize("store_keys,store_values", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("lo,hi,k,estimate", [(3, 2990, 40, True), (3, 2990, 40, False), (700, 1500, 200, True)])
def test_fused_context_part_equals_select_then_the_decoders_context_part(
    clustered_cache, store_keys, store_values, lo, hi, k, estimate
):
    options = {
        "cluster_size": 32,
        "probe_fraction": 0.05,
        "estimate": estimate,
        "store_keys": store_keys,
        "store_values": store_values,
    }
    compiled, plain = _pair(clustered_cache, options, lo, hi)
    for layer, seed in ((0, 21), (1, 22)):
        q = _queries(seed=seed)
        hkv, Q, d = q.shape
        o, mz = torch.empty(hkv * Q, d, dtype=torch.bfloat16), torch.empty(hkv * Q, 2)
        fused = compiled.select_and_attend(layer, q, k, None, o, mz)
        sel = plain.select(layer, q, k)
        o_ref, mz_ref = torch.empty_like(o), torch.empty_like(mz)
        ContextAttention([plain.ckv.values[layer]] * 2, plain.scale).attend(layer, sel, o_ref, mz_ref)
        assert torch.equal(fused.ids.sort(-1).values, sel.ids.sort(-1).values)
        out, lse = _normalised(o, mz, q.shape)
        out_ref, lse_ref = _normalised(o_ref, mz_ref, q.shape)
        torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=1e-4)
        # the torch path rounds the weights to bf16 before the weighted sum, the kernel does not
        torch.testing.assert_close(out, out_ref, rtol=2e-2, atol=2e-2)
        if lo == 700:  # ~400 rows read, ~1/4 of them in the range, for k = 200: empty slots
            assert not fused.no_empty_slots


def test_fused_path_is_not_taken_where_the_exact_path_applies(clustered_cache):
    compiled = _open(clustered_cache, "routed", {"cluster_size": 32, "kernel": "numba"}, lo=3, hi=100)
    o = torch.empty(8, 16, dtype=torch.bfloat16)
    assert not compiled.attends(0, 97, o)  # k covers the range
    assert compiled.attends(0, 20, o) and not compiled.attends(0, 20, o.float())  # bf16 values only


def test_kernel_option_picks_the_compiled_path_wherever_it_applies(clustered_cache, own_cache):
    assert _open(clustered_cache, "routed", {}).kernel  # auto, bf16 keys: compiled
    assert not _open(clustered_cache, "routed", {"spread": True}).kernel  # auto falls back to torch
    assert not _open(clustered_cache, "routed", {"estimate_read": True}).kernel  # rank=clusters: the torch path's
    assert _open(clustered_cache, "routed", {"estimate_read": True, "rank": "keys", "pq_m": 8}).kernel  # the device's
    assert not _open(clustered_cache, "routed", {"estimate_read": True, "rank": "keys", "estimate": False}).kernel
    assert not _open(clustered_cache, "routed", {"kernel": "torch"}).kernel
    with pytest.raises(TopkError, match="kernel=numba is not available: it does not implement spread"):
        _open(clustered_cache, "routed", {"spread": True, "kernel": "numba"})
    with pytest.raises(TopkError, match="it implements estimate_read=true only with rank=keys and estimate=true"):
        _open(clustered_cache, "routed", {"estimate_read": True, "kernel": "numba"})
    with pytest.raises(TopkError, match="kernel must be auto, torch or numba"):
        _open(clustered_cache, "routed", {"kernel": "fast"})
    fp32_cache, _ = own_cache  # the tiny model's fp32 KV
    assert not _open(fp32_cache, "routed", {"cluster_size": 16}).kernel
    with pytest.raises(TopkError, match="it reads bf16 or int8 keys"):
        _open(fp32_cache, "routed", {"cluster_size": 16, "kernel": "numba"})


def test_decoder_runs_the_fused_path_and_matches_the_torch_path(tmp_path, model_factory, docs_dir):
    from topk_decode import KVStore
    from topk_decode.prefill.build import build_cache

    cache = tmp_path / "bf16"
    build_cache(docs_dir, cache, model_factory("llama_gqa"), chunk_size=97, device="cpu", dtype="bf16")
    opts = {"probe_fraction": 0.1, "cluster_size": 16}
    stores = {
        kind: KVStore.open(
            cache,
            k=8,
            device="cpu",
            dtype="bf16",
            strategy="routed",
            n_sink=4,
            n_tail=16,
            strategy_options=dict(opts, kernel=kind),
        )
        for kind in ("numba", "torch")
    }
    calls = []
    compiled = stores["numba"].decoder.strategy
    plain_select = compiled.select
    compiled.select = lambda *a, **kw: calls.append(1) or plain_select(*a, **kw)
    logits = {}
    for kind, store in stores.items():
        conv = store.decoder.new_conversation()
        logits[kind] = [store.decoder.forward([5, 17, 42, 99], conv), store.decoder.forward([7], conv)]
    assert not calls, "the decoder searched and attended in one pass (select_and_attend)"
    for a, b in zip(logits["numba"], logits["torch"]):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=5e-2)
    for store in stores.values():
        store.close()


def test_kth_largest_is_the_partition_value_with_ties_infinities_and_signed_zeros():
    import numpy as np

    from topk_decode.kernels.topk import kth_largest

    rng = np.random.default_rng(0)
    hist = np.empty(2048, np.int64)
    rows = [rng.standard_normal(m).astype(np.float32) * scale for m, scale in ((1, 1), (7, 1e-3), (300, 40), (2000, 3))]
    rows.append(np.array([0.0, -0.0, 0.0, -0.0, 1.0, -np.inf, -np.inf], np.float32))
    rows.append(np.round(rng.standard_normal(500) * 2).astype(np.float32))  # many ties
    rows.append(np.full(64, -np.inf, np.float32))
    rows.append(
        rng.permutation(
            np.nextafter(np.float32(1.0), np.float32(2.0)) + np.arange(3000, dtype=np.float32) * np.float32(2**-23)
        )
    )  # one bucket, keys apart in their lowest bits only
    for s in rows:
        for kk in sorted({1, min(2, len(s)), len(s) // 2 or 1, len(s)}):
            assert kth_largest(s, kk, hist) == np.sort(s)[len(s) - kk], (s[:8], kk)


def test_top_k_one_takes_every_score_above_the_cut_then_the_first_ties_in_row_order():
    import numpy as np

    from topk_decode.kernels.topk import top_k_one

    rng = np.random.default_rng(1)
    rows = [
        rng.standard_normal(3000).astype(np.float32),
        np.round(rng.standard_normal(800)).astype(np.float32),
        np.array([0.0, -0.0, 0.0, -0.0, 1.0, -np.inf, -np.inf, -0.0], np.float32),
        np.full(40, -np.inf, np.float32),
        rng.standard_normal(5).astype(np.float32),
        rng.permutation(np.float32(1.0) + (np.arange(3000) // 2).astype(np.float32) * np.float32(2**-23)),
    ]  # pairs
    rows[0][::7] = -np.inf
    for s in rows:
        rpos = np.arange(len(s), dtype=np.int64) * 3 + 1
        for K in (1, 4, 64, 1024):
            ids, sc, cols = np.empty(K, np.int64), np.empty(K, np.float32), np.empty(K, np.int64)
            filled = top_k_one(s, rpos, ids, sc, cols, np.empty(2048, np.int64))
            valid = s[s > -np.inf]
            kk = min(K, len(valid))
            assert filled == kk
            want = []
            if kk:
                cut = np.sort(valid)[len(valid) - kk]
                want = [r for r in range(len(s)) if s[r] > cut]
                want += [r for r in range(len(s)) if s[r] == cut][: kk - len(want)]
            assert cols[:kk].tolist() == want and (cols[kk:] == -1).all() and (ids[kk:] == -1).all()
            assert ids[:kk].tolist() == rpos[want].tolist() and np.array_equal(sc[:kk], s[want])
