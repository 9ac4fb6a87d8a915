"""Huge-page copies (store/huge_pages.py) hold the same data, and routed reads them with the same results."""

from __future__ import annotations

import gc

import pytest
import torch
from test_routed import _open, _queries, clustered_cache  # noqa: F401 - fixture

from topk_decode.store import huge_pages


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int64, torch.int32, torch.float32])
def test_huge_copy_is_an_equal_contiguous_copy_that_outlives_its_source(dtype):
    src = (torch.randn(300, 7) * 100).to(dtype).t()  # non-contiguous source
    want = src.clone()
    out = huge_pages.huge_copy(src)
    del src
    gc.collect()
    assert out.dtype == dtype and out.shape == (7, 300) and out.is_contiguous()
    assert torch.equal(out, want)
    out[0, 0] = 1  # writable
    assert huge_pages.huge_copy(torch.empty(0, 4)).shape == (0, 4)


@pytest.mark.parametrize("stored", [True, False])  # the layout's own copies, or (the default) the cache's arrays
def test_routed_reads_its_huge_page_copies_with_the_same_selection_and_output(clustered_cache, stored):
    base = {"cluster_size": 32, "probe_fraction": 0.1, "kernel": "numba", "store_keys": stored, "store_values": stored}
    huge, plain = (_open(clustered_cache, "routed", dict(base, hugepages=h)) for h in (True, False))

    def read(strat):  # what the compiled path reads, per layer: keys, values, cluster offsets
        kv = [
            (lay.keys, lay.values) if stored else (strat.ckv.keys[i], strat.ckv.values[i])
            for i, lay in enumerate(strat.layouts)
        ]
        return [t for (k, v), lay in zip(kv, strat.layouts) for t in (k, v, lay.offsets)]

    try:
        assert plain.huge_bytes == 0
        if huge_pages.supported():  # a small layout always fits: all of it moved
            assert huge.huge_bytes == sum(t.numel() * t.element_size() for t in read(plain))
        for a, b in zip(read(huge), read(plain)):
            assert torch.equal(a, b)
        for layer, seed in ((0, 21), (1, 22)):
            q = _queries(seed=seed)
            outs = []
            for strat in (huge, plain):
                o, mz = torch.empty(8, 16, dtype=torch.bfloat16), torch.empty(8, 2)
                sel = strat.select_and_attend(layer, q, 24, None, o, mz)
                outs.append((sel.ids, sel.scores, o, mz))
            for a, b in zip(*outs):
                assert torch.equal(a, b)
    finally:
        huge.close()
        plain.close()
