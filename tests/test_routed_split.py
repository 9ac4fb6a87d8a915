"""routed's split scan (kernels/routed_split.py) gives what one task per head gives, for any number of pieces."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_routed import _open, _queries, clustered_cache  # noqa: F401 - fixture

from topk_decode.index.routed import compiled as routed_compiled
from topk_decode.kernels import dots

CPU = torch.device("cpu")


@pytest.fixture
def device_routed(clustered_cache):
    """A device-routed strategy (routing on the CPU device) over the clustered cache; closed after the test."""
    strat = _open(
        clustered_cache,
        "routed",
        {"cluster_size": 32, "probe_fraction": 0.05, "kernel": "numba", "device_route": "true"},
    )
    yield strat
    strat.close()


def _layer(fn, strat, layer: int, q: torch.Tensor, order, take, k: int, threads: int, *scratch):
    hkv, Q, d = q.shape
    o, mz = np.full((hkv, Q, d), np.nan, np.float32), np.full((hkv, Q, 2), np.nan, np.float32)
    res = fn(strat._kernel_in[layer], q, order, take, k, strat.scale, threads, o, mz, *scratch)
    return res, o, mz


@pytest.mark.parametrize("pieces", [1, 3, 7, 16])
def test_split_scan_selects_and_attends_as_one_task_per_head(device_routed, pieces):
    strat, k = device_routed, 40
    routes = strat.device_routes(CPU, [k, k])
    scratch: dict = {}
    for layer, seed in ((0, 11), (1, 12), (0, 13)):
        q = _queries(seed=seed)
        routes.route(layer, q)
        order, take = routes.host_route(layer)
        ref, o_ref, mz_ref = _layer(routed_compiled.scan_layer, strat, layer, q, order, take, k, 2)
        got, o, mz = _layer(routed_compiled.split_layer, strat, layer, q, order, take, k, pieces, scratch)
        assert torch.equal(got.ids, ref.ids) and torch.equal(got.scores, ref.scores)  # same slots, same order
        assert got.read == ref.read and got.filled == ref.filled
        np.testing.assert_array_equal(mz, mz_ref)  # same weights, same sums
        np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-5)  # partial sums reordered


def _ranked(strat, k: int, layer: int, seed: int):
    """Queries of `seed` and the device's ranking of `layer` for them (routing on the CPU device)."""
    routes = strat.device_routes(CPU, [k, k])
    q = _queries(seed=seed)
    routes.route(layer, q)
    return (q, *routes.host_route(layer))


def test_split_scan_grows_its_buffers_and_handles_a_head_with_nothing_to_read(device_routed):
    strat, k = device_routed, 40
    q, order, take = _ranked(strat, k, 1, seed=3)
    scratch = {"split": routed_compiled.new_scratch(2, 4, 16, 8, 5)}  # too small: grown, then used
    take = take.clone()
    take[0] = 0  # head 0 reads no cluster
    res, o, mz = _layer(routed_compiled.split_layer, strat, 1, q, order, take, k, 5, scratch)
    assert scratch["split"].rows.shape[1] >= res.read
    assert bool((res.ids[0] == -1).all()) and not o[0].any() and not mz[0].any()
    ref, o_ref, mz_ref = _layer(routed_compiled.scan_layer, strat, 1, q, order, take, k, 2)
    assert torch.equal(res.ids, ref.ids)
    np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-5)


def test_device_routed_select_and_attend_uses_the_split_scan_and_matches_one_task_per_head(clustered_cache):
    strat = _open(
        clustered_cache,
        "routed",
        {"cluster_size": 32, "probe_fraction": 0.05, "kernel": "numba", "device_route": "true"},
    )
    routes = strat.device_routes(CPU, [40, 40])
    q = _queries(seed=21)
    routes.route(0, q)
    order, take = routes.host_route(0)
    o, mz = torch.empty(8, 16, dtype=torch.bfloat16), torch.empty(8, 2)
    sel = strat.select_and_attend(0, q, 40, None, o, mz, route=(order, take))
    assert "split" in strat._split_scratch  # the split call ran
    hkv, Q, d = q.shape
    o_ref, mz_ref = np.empty((hkv, Q, d), np.float32), np.empty((hkv, Q, 2), np.float32)
    ref = routed_compiled.scan_layer(strat._kernel_in[0], q, order, take, 40, strat.scale, 2, o_ref, mz_ref)
    assert torch.equal(sel.ids.sort(-1).values, ref.ids.sort(-1).values)
    torch.testing.assert_close(o.float(), torch.from_numpy(o_ref).view(hkv * Q, d), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(mz, torch.from_numpy(mz_ref).view(hkv * Q, 2), rtol=1e-5, atol=1e-5)
    strat.close()


def test_split_scan_writes_its_output_rounded_to_bf16_as_torch_rounds_it(device_routed):
    strat, k = device_routed, 40
    q, order, take = _ranked(strat, k, 0, seed=5)
    hkv, Q, d = q.shape
    o16 = np.zeros((hkv, Q, d), np.uint16)
    _, o, _ = _layer(routed_compiled.split_layer, strat, 0, q, order, take, k, 3, {}, o16)
    assert np.isfinite(o).all() and o.any()
    np.testing.assert_array_equal(o16, torch.from_numpy(o).bfloat16().view(torch.int16).numpy().view(np.uint16))


def test_bf16_rounding_matches_torch_on_ties_infinities_nan_and_subnormals():
    from topk_decode.kernels.routed_scan import round_bf16

    bits = np.array(
        [
            0x3F808000,
            0x3F818000,
            0x3F808001,
            0x7F7FFFFF,
            0xFF7FFFFF,
            0x7F800000,
            0xFF800000,
            0x7FC00000,
            0xFFC00001,
            0x00000001,
            0x80008000,
            0x00018000,
            0,
            0x80000000,
        ],
        np.uint32,
    )
    x = np.concatenate([bits.view(np.float32), np.random.default_rng(0).standard_normal(1000).astype(np.float32)])
    out = np.empty(len(x), np.uint16)
    round_bf16(x, out)
    want = torch.from_numpy(x).bfloat16().view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(out[~nan], want[~nan])
    assert np.isnan(torch.from_numpy(out[nan].view(np.int16)).view(torch.bfloat16).float().numpy()).all()


@pytest.fixture(scope="module")
def wide_cache(tmp_path_factory):
    """1 layer × 2 KV heads × 2000 bf16 keys of D = 64 (whole 32-element registers) around 30 centres."""
    from topk_decode.store.cache_dir import CacheWriter

    out = tmp_path_factory.mktemp("wide") / "cache"
    gen = torch.Generator().manual_seed(4)
    n, hkv, d = 2000, 2, 64
    centres = 4 * torch.randn(hkv, 30, d, generator=gen)
    which = torch.randint(0, 30, (hkv, n), generator=gen)
    keys = centres.gather(1, which[..., None].expand(hkv, n, d)) + 0.3 * torch.randn(hkv, n, d, generator=gen)
    w = CacheWriter(out)
    w.write_layer(0, keys.bfloat16(), torch.randn(hkv, n, d, generator=gen).bfloat16())
    w.write_tokens(list(range(n)))
    w.commit(
        {
            "model": {"path": "none", "fingerprint": "none"},
            "kv_dtype": "bfloat16",
            "n_tokens": n,
            "shape": {"n_layers": 1, "n_heads": 14, "n_kv_heads": hkv, "head_dim": d},
            "documents": [],
        }
    )
    return out


@pytest.mark.skipif(not dots.bf16_available(64), reason="no AVX512-BF16 here (or numba targets another CPU)")
@pytest.mark.parametrize("Q", [4, 7])
def test_split_scan_with_bf16_dot_products_selects_and_attends_as_the_fp32_scan(wide_cache, Q):
    strat = _open(
        wide_cache, "routed", {"cluster_size": 32, "probe_fraction": 0.1, "kernel": "numba", "device_route": "true"}
    )
    try:
        k = 50
        routes = strat.device_routes(CPU, [k])
        q = _queries(q=Q, d=64, seed=Q)  # bf16-exact, as the decoder's
        routes.route(0, q)
        order, take = routes.host_route(0)
        scratch: dict = {}
        got, o, mz = _layer(routed_compiled.split_layer, strat, 0, q, order, take, k, 3, scratch)
        assert scratch["qb"].dtype == np.uint16  # the bf16 path ran
        ref, o_ref, mz_ref = _layer(routed_compiled.scan_layer, strat, 0, q, order, take, k, 2)  # fp32 dots
        assert got.read == ref.read
        for h in range(2):
            for i in range(Q):
                a, b = got.scores[h, i].sort().values, ref.scores[h, i].sort().values
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
                assert set(got.ids[h, i].tolist()) == set(ref.ids[h, i].tolist())  # no near-tie at k here
        np.testing.assert_allclose(o, o_ref, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(mz, mz_ref, rtol=1e-4, atol=1e-4)
    finally:
        strat.close()
