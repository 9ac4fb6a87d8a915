"""routed: clustered layout, routing under a keys-read budget, exactness when the budget covers the context."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import hf_greedy

from topk_decode import KVStore
from topk_decode.errors import TopkError
from topk_decode.index import artifact_dir, get_strategy
from topk_decode.index.artifacts import recorded_options
from topk_decode.index.base import exact_scores
from topk_decode.index.routed.cluster import KMeansConfig, build_layer
from topk_decode.store.cache_dir import CacheWriter, open_cache


@pytest.fixture(scope="module")
def own_cache(tmp_path_factory, built_cache):
    """A private copy of the shared tiny cache (our artifacts must not leak into other tests' cache)."""
    cache, model_dir = built_cache
    dst = tmp_path_factory.mktemp("routed") / "cache"
    shutil.copytree(cache, dst)
    return dst, model_dir


@pytest.fixture(scope="module")
def clustered_cache(tmp_path_factory):
    """2 layers × 2 KV heads × 3000 bf16 keys (D=16) drawn around 40 well-separated centres."""
    out = tmp_path_factory.mktemp("clustered") / "cache"
    gen = torch.Generator().manual_seed(0)
    n, hkv, d, layers = 3000, 2, 16, 2
    w = CacheWriter(out)
    for layer in range(layers):
        centres = 4 * torch.randn(hkv, 40, d, generator=gen)
        which = torch.randint(0, 40, (hkv, n), generator=gen)
        keys = centres.gather(1, which[..., None].expand(hkv, n, d)) + 0.3 * torch.randn(hkv, n, d, generator=gen)
        w.write_layer(layer, keys.bfloat16(), torch.randn(hkv, n, d, generator=gen).bfloat16())
    w.write_tokens(list(range(n)))
    w.commit(
        {
            "model": {"path": "none", "fingerprint": "none"},
            "kv_dtype": "bfloat16",
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
    return torch.randn(hkv, q, d, generator=torch.Generator().manual_seed(seed)).bfloat16().float()


def test_layout_is_a_cluster_contiguous_permutation_of_every_head():
    keys = torch.randn(2, 500, 8)
    values = torch.randn(2, 500, 8)
    lay = build_layer(keys, values, KMeansConfig(cluster_size=20, iters=3), torch.device("cpu"))
    for h in range(2):
        assert sorted(lay.pos[h].tolist()) == list(range(500))
        assert torch.equal(lay.keys[h], keys[h][lay.pos[h]])
        assert torch.equal(lay.values[h], values[h][lay.pos[h]])
        assert lay.offsets[h, 0] == 0 and lay.offsets[h, -1] == 500
        for c in range(lay.offsets.shape[1] - 1):  # centroid = mean of the cluster's raw keys
            s, e = lay.offsets[h, c], lay.offsets[h, c + 1]
            if e > s:
                assert torch.allclose(lay.centroids[h, c], keys[h][lay.pos[h, s:e]].mean(0), atol=1e-5)


@pytest.mark.parametrize("segment", [100, 96, 7])  # segments of whole clusters; 7 is rounded up to 20
def test_segmented_layout_clusters_each_segment_alone_into_ceil_n_over_s_clusters(segment):
    gen = torch.Generator().manual_seed(2)
    keys, values = torch.randn(2, 530, 8, generator=gen), torch.randn(2, 530, 8, generator=gen)
    S = 20
    lay = build_layer(keys, values, KMeansConfig(cluster_size=S, iters=3, segment=segment), torch.device("cpu"))
    seg = -(-segment // S) * S
    assert lay.offsets.shape == (2, -(-530 // S) + 1)
    for h in range(2):
        assert sorted(lay.pos[h].tolist()) == list(range(530))
        assert torch.equal(lay.keys[h], keys[h][lay.pos[h]])
        for c in range(lay.offsets.shape[1] - 1):  # every cluster's positions lie in one segment
            members = lay.pos[h, lay.offsets[h, c] : lay.offsets[h, c + 1]]
            if len(members):
                assert (members // seg).unique().numel() == 1
                assert c // (seg // S) == int(members[0]) // seg  # clusters numbered segment by segment


def test_segment_at_least_the_context_gives_the_whole_context_layout():
    keys = torch.randn(2, 300, 8, generator=torch.Generator().manual_seed(4))
    whole = build_layer(keys, None, KMeansConfig(cluster_size=20, iters=3, segment=10**9), torch.device("cpu"))
    exact = build_layer(keys, None, KMeansConfig(cluster_size=20, iters=3, segment=300), torch.device("cpu"))
    assert torch.equal(whole.pos, exact.pos) and torch.equal(whole.offsets, exact.offsets)


def test_routed_with_segments_probing_every_cluster_equals_flat(clustered_cache, tmp_path):
    cache = shutil.copytree(clustered_cache, tmp_path / "cache")  # the shared cache keeps its layout
    routed = _open(cache, "routed", {"cluster_size": 32, "segment": 1000, "probe_fraction": 1})
    assert recorded_options(cache, "routed")["segment"] == 1000
    flat = _open(cache, "flat")
    q = _queries(seed=6)
    a, b = routed.select(1, q, 40), flat.select(1, q, 40)
    assert torch.equal(a.ids.sort(-1).values, b.ids.sort(-1).values)


@pytest.mark.parametrize("lo,hi", [(3, 2990), (0, 3000)])  # padding masked as a sink row / by its own mask
def test_routed_reads_the_probe_fraction_and_returns_exact_scores_inside_the_range(clustered_cache, lo, hi):
    strat = _open(clustered_cache, "routed", {"cluster_size": 32, "probe_fraction": 0.1}, lo=lo, hi=hi)
    q = _queries()
    sel = strat.select(0, q, 16)
    assert sel.ids.shape == (2, 4, 16)
    assert sel.ids.min() >= lo and sel.ids.max() < hi
    assert torch.allclose(sel.scores, exact_scores(strat.ckv.keys[0], q, sel.ids), atol=1e-4)
    for h in range(2):  # no position twice in one query's answer (padding never wins)
        assert all(len(set(sel.ids[h, i].tolist())) == 16 for i in range(4))
    read = strat.keys_read_fraction()
    assert 0.1 <= read < 0.1 + 2 * 32 * 4 / (hi - lo)  # the budget plus at most the last cluster's overshoot


@pytest.mark.parametrize("spread", [False, True])
def test_routed_finds_most_of_the_exact_top_k_on_clustered_keys(clustered_cache, spread):
    # 4 queries per KV head, each of whose top-32 sits in one or two of the 40 groups of ~75 keys: 20 % covers them
    routed = _open(clustered_cache, "routed", {"cluster_size": 32, "probe_fraction": 0.2, "spread": spread})
    flat = _open(clustered_cache, "flat")
    q = _queries(seed=3)
    a, b = routed.select(1, q, 32).ids, flat.select(1, q, 32).ids
    recall = sum(len(set(a[h, i].tolist()) & set(b[h, i].tolist())) for h in range(2) for i in range(4)) / (8 * 32)
    assert recall >= 0.95


def test_routed_probing_every_cluster_equals_flat(clustered_cache):
    routed = _open(clustered_cache, "routed", {"cluster_size": 32, "probe_fraction": 1})
    flat = _open(clustered_cache, "flat")
    q = _queries(seed=5)
    a, b = routed.select(0, q, 50), flat.select(0, q, 50)
    assert torch.equal(a.ids.sort(-1).values, b.ids.sort(-1).values)
    assert torch.allclose(a.scores.sort(-1).values, b.scores.sort(-1).values, atol=1e-4)


def test_flat_backends_select_the_same_keys_as_the_default_torch_backend(clustered_cache):
    pytest.importorskip("faiss")
    default = _open(clustered_cache, "flat")
    assert default.backend == "torch"
    others = [_open(clustered_cache, "flat", {"backend": b, "threads": 1}) for b in ("numba", "faiss")]
    q = _queries(seed=7)
    want = default.select(0, q, 20).ids.sort(-1).values
    for strat in others:
        assert torch.equal(strat.select(0, q, 20).ids.sort(-1).values, want)


def test_artifacts_are_reused_and_rebuilt_when_the_cluster_size_changes(clustered_cache):
    _open(clustered_cache, "routed", {"cluster_size": 32})
    done = artifact_dir(clustered_cache, "routed") / "done.json"
    assert recorded_options(clustered_cache, "routed")["cluster_size"] == 32
    stamp = done.stat().st_mtime_ns
    _open(clustered_cache, "routed")  # default options: reuse what was built
    assert done.stat().st_mtime_ns == stamp
    _open(clustered_cache, "routed", {"cluster_size": 50})
    assert recorded_options(clustered_cache, "routed")["cluster_size"] == 50


@pytest.mark.parametrize(
    "options", [{"probe_fraction": 0}, {"probe_fraction": "all"}, {"cluster_size": -1}, {"nprobe": 3}]
)
def test_bad_routed_options_raise_topk_errors(clustered_cache, options):
    with pytest.raises(TopkError):
        _open(clustered_cache, "routed", options)


def test_routed_reproduces_hf_generate_when_budget_covers_context(own_cache):
    cache, model_dir = own_cache
    store = KVStore.open(cache, k=100_000, strategy="routed", device="cpu")
    prompt = [5, 17, 42, 99]
    assert store.generate_ids(prompt, max_new_tokens=10) == hf_greedy(model_dir, store.context_ids + prompt, 10)


def test_routed_probing_every_cluster_decodes_like_flat_with_small_k(own_cache):
    cache, _ = own_cache
    prompt = [5, 17, 42, 99]
    flat = KVStore.open(cache, k=24, strategy="flat", device="cpu").generate_ids(prompt, 8)
    routed = KVStore.open(
        cache, k=24, strategy="routed", strategy_options={"probe_fraction": 1, "cluster_size": 16}, device="cpu"
    ).generate_ids(prompt, 8)
    assert routed == flat


def test_routed_returns_ids_inside_the_range_during_decoding(own_cache):
    cache, _ = own_cache
    store = KVStore.open(
        cache,
        k=8,
        strategy="routed",
        device="cpu",
        n_sink=4,
        n_tail=64,
        strategy_options={"probe_fraction": 0.05, "cluster_size": 16},
    )
    lo, hi = store.decoder.strategy.lo, store.decoder.strategy.hi
    seen = []
    conv = store.decoder.new_conversation()
    conv.observer = lambda layer, q, sel, c: seen.append(sel.ids[sel.ids >= 0])
    store.decoder.generate(conv, [5, 17, 42], 4)
    ids = torch.cat(seen)
    assert ids.numel() > 0 and ids.min() >= lo and ids.max() < hi


def test_bench_runs_routed_and_reports_the_share_of_keys_read(tmp_path):
    from topk_decode.bench.run import run_bench, smoke_config

    cfg = smoke_config(str(tmp_path))
    cfg.systems, cfg.offload_prefill, cfg.contexts = ["topk"], False, [1024]
    cfg.strategy, cfg.strategy_options, cfg.k = "flat,routed", {"probe_fraction": 0.2, "cluster_size": 16}, 16
    data = run_bench(cfg, log=lambda line: None)
    rows = {r["strategy"]: r for r in data["rows"] if r["system"] == "topk"}
    assert rows["flat"]["status"] == "ok" and rows["flat"]["keys_read_pct"] == 100
    row = rows["routed"]
    assert row["status"] == "ok" and row["tokens_per_s"] > 0
    assert 20 <= row["keys_read_pct"] < 30  # 20 % plus at most one cluster of 16 per head and step


def test_bench_runs_what_auto_runs_on_a_gpu(tmp_path):
    """routed with rank=keys and value codes (auto's choice beyond 8K on a GPU) through the bench: its decoder opens
    under inference mode, where the codes are trained on several threads."""
    from topk_decode.bench.run import run_bench, smoke_config

    cfg = smoke_config(str(tmp_path))
    cfg.systems, cfg.offload_prefill, cfg.contexts, cfg.k = ["topk"], False, [1024], 16
    cfg.strategy, cfg.strategy_options = "routed", {"rank": "keys", "pq_values": 32, "cluster_size": 16}
    row = next(r for r in run_bench(cfg, log=lambda line: None)["rows"] if r["system"] == "topk")
    assert row["status"] == "ok" and row["tokens_per_s"] > 0 and row["ran_options"]["pq_values"] > 0


def test_prefill_builds_the_layout_and_open_reuses_it(tmp_path, clustered_cache):
    from topk_decode.index import prepare_artifacts

    cache = tmp_path / "cache"
    shutil.copytree(clustered_cache, cache)
    shutil.rmtree(artifact_dir(cache, "routed"), ignore_errors=True)
    prepare_artifacts(open_cache(cache), ["routed"], {"cluster_size": 24})
    done = artifact_dir(cache, "routed") / "done.json"
    stamp = done.stat().st_mtime_ns
    strat = _open(cache, "routed")
    assert done.stat().st_mtime_ns == stamp and strat.layouts[0].offsets.shape[1] == -(-3000 // 24) + 1


def test_artifacts_build_in_a_cache_given_by_a_relative_path(clustered_cache, tmp_path, monkeypatch):
    shutil.copytree(clustered_cache, tmp_path / "cache")
    monkeypatch.chdir(tmp_path)
    strat = _open("cache", "routed", {"cluster_size": 32})  # as `topk chat cache --strategy routed`
    assert (tmp_path / "cache" / "index" / "routed" / "done.json").is_file()
    assert strat.select(0, _queries(), 8).ids.shape == (2, 4, 8)


def test_ranking_clusters_keeps_the_searchable_statistics_only_and_per_key_ranking_keeps_the_layouts_tables(
    clustered_cache,
):
    """The layout's own fp32 centroids and mean values are read only by the residual codes' paths: dropped where
    clusters are ranked without them (7 GiB at 1M tokens of the Qwen2.5-7B shape), kept for rank=keys."""
    q = _queries()
    by_clusters = _open(clustered_cache, "routed", {"probe_fraction": 0.1})
    assert all(lay.centroids is None and lay.value_means is None for lay in by_clusters.layouts)
    assert by_clusters.select(0, q, 8).rest is not None  # the estimate reads the searchable means
    by_keys = _open(clustered_cache, "routed", {"probe_fraction": 0.1, "rank": "keys", "pq_m": 8})
    assert all(lay.centroids is not None for lay in by_keys.layouts)
    assert by_keys.select(0, q, 8).rest is not None
    by_clusters.close()
    by_keys.close()
