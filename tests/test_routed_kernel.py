"""routed's compiled search (index/routed_kernel.py) selects what the torch path selects."""

from __future__ import annotations

import pytest
import torch

import test_routed

from topk_decode.errors import TopkError
from topk_decode.index.base import exact_scores
from test_routed import _open, _queries, clustered_cache, own_cache  # noqa: F401 - fixtures

pytest.importorskip("numba")


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
    options = dict(options, estimate=False)          # the compiled path selects; it does not estimate the rest
    return (_open(cache, "routed", dict(options, kernel="numba"), lo=lo, hi=hi),
            _open(cache, "routed", dict(options, kernel="torch"), lo=lo, hi=hi))


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
        filled = a.ids >= 0                          # a narrow range can leave fewer than k keys read
        exact = exact_scores(compiled.ckv.keys[layer], q, a.ids.clamp(min=0))
        assert torch.allclose(a.scores[filled], exact[filled], atol=1e-4)
    assert compiled.keys_read_fraction() == plain.keys_read_fraction()


def test_compiled_path_handles_many_queries_per_head_as_a_prompt_chunk_does(clustered_cache):
    compiled, plain = _pair(clustered_cache, {"cluster_size": 32, "probe_fraction": 0.1})
    q = _queries(q=4 * 37, seed=4)                    # G = 4 query heads × 37 prompt tokens per KV head
    a, b = compiled.select(0, q, 16), plain.select(0, q, 16)
    assert torch.equal(a.ids.sort(-1).values, b.ids.sort(-1).values)


def test_probing_every_cluster_with_the_compiled_path_equals_flat(clustered_cache):
    compiled = _open(clustered_cache, "routed", {"cluster_size": 32, "probe_fraction": 1, "kernel": "numba",
                                                 "estimate": False})
    flat = _open(clustered_cache, "flat")
    q = _queries(seed=5)
    a, b = compiled.select(0, q, 50), flat.select(0, q, 50)
    assert torch.equal(a.ids.sort(-1).values, b.ids.sort(-1).values)
    assert a.no_empty_slots


def test_kernel_option_is_opt_in_and_refused_where_the_compiled_path_does_not_apply(clustered_cache, own_cache):
    assert not _open(clustered_cache, "routed", {}).kernel                         # the default is the torch path
    with pytest.raises(TopkError, match="kernel=numba is not available: it does not implement spread"):
        _open(clustered_cache, "routed", {"spread": True, "kernel": "numba"})
    with pytest.raises(TopkError, match="it does not implement the estimates"):
        _open(clustered_cache, "routed", {"kernel": "numba"})                  # estimate is on by default
    with pytest.raises(TopkError, match="kernel must be torch or numba"):
        _open(clustered_cache, "routed", {"kernel": "fast"})
    fp32_cache, _ = own_cache                                                      # the demo model's fp32 KV
    with pytest.raises(TopkError, match="it reads bf16 keys"):
        _open(fp32_cache, "routed", {"cluster_size": 16, "kernel": "numba", "estimate": False})
