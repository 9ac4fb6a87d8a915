"""routed's estimate of the left-out attention: the merge, the searchable-only statistics, exactness."""

from __future__ import annotations

import shutil

import pytest
import torch

from topk_decode import KVStore
from topk_decode.decode.context import ContextAttention, merge_rest
from topk_decode.index import get_strategy
from topk_decode.index.artifacts import recorded_options
from topk_decode.index.base import RestPart
from topk_decode.index.routed.estimate import searchable_stats
from topk_decode.index.routed.layout import load_layouts
from topk_decode.store.cache_dir import CacheWriter, open_cache


@pytest.fixture(scope="module")
def grouped_cache(tmp_path_factory):
    """1 layer × 2 KV heads × 3000 fp32 keys (D=16) around 40 centres; each centre has its own value."""
    out = tmp_path_factory.mktemp("grouped") / "cache"
    gen = torch.Generator().manual_seed(0)
    n, hkv, d = 3000, 2, 16
    which = torch.randint(0, 40, (hkv, n), generator=gen)
    idx = which[..., None].expand(hkv, n, d)
    keys = (1.5 * torch.randn(hkv, 40, d, generator=gen)).gather(1, idx) + 0.5 * torch.randn(hkv, n, d, generator=gen)
    values = torch.randn(hkv, 40, d, generator=gen).gather(1, idx) + 0.3 * torch.randn(hkv, n, d, generator=gen)
    w = CacheWriter(out)
    w.write_layer(0, keys, values)
    w.write_tokens(list(range(n)))
    w.commit(
        {
            "model": {"path": "none", "fingerprint": "none"},
            "kv_dtype": "float32",
            "n_tokens": n,
            "shape": {"n_layers": 1, "n_heads": 8, "n_kv_heads": hkv, "head_dim": d},
            "documents": [],
        }
    )
    return out


def _routed(cache, lo, hi, **options):
    strat = get_strategy("routed")(open_cache(cache), lo, hi, dict(cluster_size=32, **options))
    strat.prepare()
    return strat


def context_output(strat, sel, q_shape):
    """The context part's normalised output (Hkv, Q, D) and lse (Hkv, Q), as the decoder computes them."""
    hkv, Q, d = q_shape
    ca = ContextAttention([strat.ckv.values[0]], strat.scale)
    o, mz = torch.empty(hkv * Q, d), torch.empty(hkv * Q, 2)
    ca.attend(0, sel, o, mz)
    return (o / mz[:, 1:]).view(hkv, Q, d), (mz[:, 0] + mz[:, 1].log()).view(hkv, Q)


def test_merging_a_rest_part_equals_one_softmax_over_the_union():
    gen = torch.Generator().manual_seed(0)
    R, n_sel, n_rest, d = 6, 5, 7, 4
    a_sel, a_rest = 3 * torch.randn(R, n_sel, generator=gen), 3 * torch.randn(R, n_rest, generator=gen)
    v_sel, v_rest = torch.randn(R, n_sel, d, generator=gen), torch.randn(R, n_rest, d, generator=gen)
    m = a_sel.amax(-1, keepdim=True)
    w = (a_sel - m).exp()
    o = (w[..., None] * v_sel).sum(1)  # the context part of the selected tokens
    mz = torch.cat([m, w.sum(-1, keepdim=True)], 1)
    p_rest = a_rest.softmax(-1)
    rest = RestPart(out=(p_rest[..., None] * v_rest).sum(1).view(2, 3, d), lse=a_rest.logsumexp(-1).view(2, 3))
    merge_rest(o, mz, rest)
    union = torch.cat([a_sel, a_rest], 1)
    want = (union.softmax(-1)[..., None] * torch.cat([v_sel, v_rest], 1)).sum(1)
    assert torch.allclose(o / mz[:, 1:], want, atol=1e-5)
    assert torch.allclose(mz[:, 0] + mz[:, 1].log(), union.logsumexp(-1), atol=1e-5)


def test_an_empty_rest_part_leaves_the_context_part_unchanged():
    o, mz = torch.randn(4, 3), torch.tensor([[0.5, 2.0]] * 4)
    before = (o.clone(), mz.clone())
    merge_rest(o, mz, RestPart(out=torch.zeros(2, 2, 3), lse=torch.full((2, 2), float("-inf"))))
    assert torch.equal(o, before[0]) and torch.equal(mz, before[1])


def test_cluster_statistics_leave_out_the_sinks_and_the_tail(grouped_cache):
    lo, hi = 10, 2900
    strat = _routed(grouped_cache, lo, hi)
    ckv = strat.ckv
    # the layout as stored (the strategy keeps only what it reads: ranking clusters drops the layout's own tables)
    lay = load_layouts(ckv, "routed", recorded_options(ckv.path, "routed"))[0]
    stats = searchable_stats(lay, strat._outside[0], ckv.keys[0], ckv.values[0])
    for h in range(2):
        for c in range(lay.offsets.shape[1] - 1):
            pos = lay.pos[h, lay.offsets[h, c] : lay.offsets[h, c + 1]]
            pos = pos[(pos >= lo) & (pos < hi)]
            assert stats.log_n[h, 0, c].exp().round() == pos.numel()
            if pos.numel():
                assert torch.allclose(stats.centroids[h, c], ckv.keys[0][h, pos].mean(0), atol=1e-4)
                assert torch.allclose(stats.value_means[h, c], ckv.values[0][h, pos].mean(0), atol=1e-4)


def test_estimate_brings_the_context_part_closer_to_full_attention_on_grouped_keys(grouped_cache):
    lo, hi = 3, 2995
    q = 2 * torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1))
    ckv = open_cache(grouped_cache)
    s = 16**-0.5
    scores = torch.bmm(q, ckv.keys[0][:, lo:hi].transpose(1, 2)) * s
    dense = torch.bmm(scores.softmax(-1), ckv.values[0][:, lo:hi])

    def error(**options):
        strat = _routed(grouped_cache, lo, hi, probe_fraction=0.1, **options)
        out, lse = context_output(strat, strat.select(0, q, 16), q.shape)
        return ((out - dense).norm(dim=-1) / dense.norm(dim=-1)).mean(), (lse - scores.logsumexp(-1)).abs().mean()

    plain, unread, both = error(estimate=False), error(estimate=True), error(estimate=True, estimate_read=True)
    assert unread[0] < 0.5 * plain[0] and both[0] < plain[0]
    assert unread[1] < plain[1] and both[1] < unread[1]  # the selected tokens' lse is a lower bound


def test_estimate_is_empty_when_every_cluster_is_read(grouped_cache):
    strat = _routed(grouped_cache, 3, 2995, probe_fraction=1, estimate=True)
    flat = get_strategy("flat")(open_cache(grouped_cache), 3, 2995, {})
    flat.prepare()
    q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(2))
    sel, ref = strat.select(0, q, 20), flat.select(0, q, 20)
    assert torch.isneginf(sel.rest.lse).all()
    assert torch.equal(sel.ids.sort(-1).values, ref.ids.sort(-1).values)
    out, lse = context_output(strat, sel, q.shape)
    out_ref, lse_ref = context_output(strat, ref, q.shape)
    assert torch.allclose(out, out_ref, atol=1e-5) and torch.allclose(lse, lse_ref, atol=1e-5)


@pytest.fixture(scope="module")
def own_cache(tmp_path_factory, built_cache):
    """A private copy of the shared tiny cache (our artifacts must not leak into other tests' cache)."""
    cache, model_dir = built_cache
    dst = tmp_path_factory.mktemp("routed-estimate") / "cache"
    shutil.copytree(cache, dst)
    return dst, model_dir


def test_routed_with_the_estimate_reading_every_cluster_decodes_like_flat(own_cache):
    cache, _ = own_cache
    prompt = [5, 17, 42, 99]
    flat = KVStore.open(cache, k=24, strategy="flat", device="cpu").generate_ids(prompt, 8)
    routed = KVStore.open(
        cache,
        k=24,
        strategy="routed",
        device="cpu",
        strategy_options={"probe_fraction": 1, "cluster_size": 16, "estimate": True},
    ).generate_ids(prompt, 8)
    assert routed == flat


def test_routed_with_the_estimate_decodes_inside_the_range(own_cache):
    cache, _ = own_cache
    store = KVStore.open(
        cache,
        k=8,
        strategy="routed",
        device="cpu",
        n_sink=4,
        n_tail=64,
        strategy_options={"probe_fraction": 0.05, "cluster_size": 16, "estimate": True, "estimate_read": True},
    )
    rests = []
    conv = store.decoder.new_conversation()
    conv.observer = lambda layer, q, sel, c: rests.append(sel.rest)
    tokens = store.decoder.generate(conv, [5, 17, 42], 4)
    assert len(tokens) == 4 and rests and all(r is not None for r in rests)
    assert all(torch.isfinite(r.out).all() and not torch.isnan(r.lse).any() for r in rests)
    assert any(torch.isfinite(r.lse).any() for r in rests)


def test_the_estimate_is_on_by_default_and_off_attaches_nothing(grouped_cache):
    q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(4))
    on = _routed(grouped_cache, 3, 2995, probe_fraction=0.1).select(0, q, 16)
    off = _routed(grouped_cache, 3, 2995, probe_fraction=0.1, estimate=False).select(0, q, 16)
    assert on.rest is not None and torch.isfinite(on.rest.lse).all()
    assert off.rest is None and torch.equal(on.ids, off.ids)


def test_a_layout_without_value_means_is_rebuilt_with_its_recorded_cluster_size(tmp_path, grouped_cache):
    import json

    from topk_decode.index import artifact_dir
    from topk_decode.index.artifacts import recorded_options

    cache = tmp_path / "cache"
    shutil.copytree(grouped_cache, cache)
    shutil.rmtree(artifact_dir(cache, "routed"), ignore_errors=True)
    get_strategy("routed")(open_cache(cache), 3, 2995, {"cluster_size": 24, "estimate": False}).prepare()
    done = artifact_dir(cache, "routed") / "done.json"  # as a layout built before the value means
    data = json.loads(done.read_text())
    del data["meta"]["options"]["value_means"]
    done.write_text(json.dumps(data))
    strat = get_strategy("routed")(open_cache(cache), 3, 2995, {})  # defaults: estimate on
    strat.prepare()
    assert recorded_options(cache, "routed")["cluster_size"] == 24 and recorded_options(cache, "routed")["value_means"]
    assert strat.select(0, torch.randn(2, 4, 16), 16).rest is not None
