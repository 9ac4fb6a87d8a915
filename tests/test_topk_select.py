"""topk_by_threshold: the exact top-k the flat torch backend selects its candidates with."""

from __future__ import annotations

import pytest
import torch

from topk_decode.index.base import StrategyStats
from topk_decode.index.flat.select_topk import FALLBACK_KEY, sample_plan, topk_by_threshold
from topk_decode.index.flat.strategy import fp32_scan, half_scan

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _check_exact(x: torch.Tensor, k: int, sorted: bool = True, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_by_threshold(x, k) has torch.topk's values, and its indices point at them without repeats."""
    values, indices = topk_by_threshold(x, k, sorted=sorted, **kw)
    ref = x.topk(k, dim=-1).values
    assert values.shape == indices.shape == ref.shape and values.dtype == x.dtype
    got = values if sorted else values.sort(-1, descending=True).values
    assert torch.equal(got, ref)
    assert torch.equal(x.gather(-1, indices), values)
    assert torch.equal(indices.sort(-1).values.diff(dim=-1) > 0, torch.ones_like(indices[..., 1:], dtype=torch.bool))
    return values, indices


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sorted", [True, False])
def test_threshold_topk_values_equal_torch_topk_on_random_scores(dtype, sorted):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 4, 20000, generator=gen) * 3).to(dtype)
    counters: dict = {}
    _check_exact(x, 320, sorted=sorted, counters=counters)
    assert counters[FALLBACK_KEY] == 0  # the threshold path answered every row


def test_threshold_topk_reuses_its_mask_buffer_across_calls():
    gen = torch.Generator().manual_seed(1)
    buffers: dict = {}
    for _ in range(3):
        _check_exact(torch.randn(6, 10000, generator=gen).bfloat16(), 200, buffers=buffers)
    assert len(buffers) == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_threshold_topk_is_exact_on_sorted_rows(dtype):
    # A strided sample of an ascending (or descending) row sees the row's order, not a random draw.
    n = 30000
    up = torch.arange(n, dtype=torch.float32) / 7 - 1000
    x = torch.stack([up, up.flip(0), -up, up * 0.01]).to(dtype)
    _check_exact(x, 500)


@pytest.mark.parametrize("dtype", DTYPES)
def test_threshold_topk_is_exact_with_many_ties(dtype):
    gen = torch.Generator().manual_seed(2)
    few = torch.randint(0, 5, (4, 20000), generator=gen).to(dtype)  # 5 distinct values
    equal = torch.full((2, 20000), 1.5, dtype=dtype)  # one value: far too many survivors
    counters: dict = {}
    _check_exact(torch.cat([few, equal]), 400, counters=counters)
    assert counters[FALLBACK_KEY] >= 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_threshold_topk_is_exact_with_signed_zeros(dtype):
    # The sample sees +0 only, so t = +0 and the integer compare drops every -0 key: they tie with
    # the +0 keys it keeps, so the values must not change.
    k = 1500
    stride, _ = sample_plan(k)
    gen = torch.Generator().manual_seed(3)
    x = torch.zeros(3, 20000)
    x[:, 1::2] = -0.0
    x[:, ::stride] = 0.0
    x[:, 1:200:2] = torch.rand(3, 100, generator=gen) + 1
    counters: dict = {}
    values, _ = _check_exact(x.to(dtype), k, counters=counters)
    assert counters[FALLBACK_KEY] == 0
    assert torch.all(values[:, 100:] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_threshold_topk_is_exact_on_negative_scores(dtype):
    # Negative thresholds take the float compare (the integer one orders only non-negative floats).
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, 20000, generator=gen)
    x[:2] -= 50
    _check_exact(x.to(dtype), 300)


@pytest.mark.parametrize("dtype", DTYPES)
def test_threshold_topk_is_exact_with_large_minus_inf_prefix_and_suffix(dtype):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, 40000, generator=gen).to(dtype)
    x[0, :39000] = float("-inf")  # 1000 finite scores for k = 600
    x[1, 600:] = float("-inf")  # exactly k finite
    x[2, :10000], x[2, 30000:] = float("-inf"), float("-inf")
    x[3, 1:-1] = float("-inf")  # fewer than k finite: -inf fills the top k
    counters: dict = {}
    _check_exact(x, 600, counters=counters)
    assert counters[FALLBACK_KEY] >= 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_whose_sampled_threshold_is_too_high_fall_back_to_plain_topk(dtype):
    # Large scores exactly at the sampled positions: the sample's threshold lets only ~rank keys
    # through, fewer than k, and those rows (only those) must be answered by plain topk.
    n, k = 40000, 500
    stride, rank = sample_plan(k)
    assert rank < k
    gen = torch.Generator().manual_seed(6)
    x = torch.rand(4, n, generator=gen)
    x[1, ::stride] += 10
    x[3, ::stride] += 10
    counters: dict = {}
    _check_exact(x.to(dtype), k, counters=counters)
    assert counters[FALLBACK_KEY] == 2


def test_threshold_topk_on_small_rows_is_plain_topk():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 2, 1000, generator=gen).bfloat16()
    counters: dict = {}
    values, indices = topk_by_threshold(x, 200, counters=counters)
    ref = x.topk(200, dim=-1)
    assert torch.equal(values, ref.values) and torch.equal(indices, ref.indices)
    assert counters == {}  # the threshold path never ran


def test_threshold_topk_accepts_a_non_contiguous_input():
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(20000, 6, generator=gen).t()
    _check_exact(x, 300)


@pytest.mark.parametrize("max_threads", [1 << 10, 0])  # threshold path / plain topk path (many cores)
def test_half_scan_with_threshold_candidates_returns_the_exact_fp32_top_k(monkeypatch, max_threads):
    # Large enough that half_scan's candidates come from the threshold path; buffers reused across calls.
    from topk_decode.index.flat import strategy as flat

    monkeypatch.setattr(flat, "THRESHOLD_MAX_THREADS", max_threads)
    gen = torch.Generator().manual_seed(9)
    keys = torch.randn(2, 30000, 16, generator=gen).bfloat16()
    stats, buffers = StrategyStats(), {}
    for _ in range(2):
        q = torch.randn(2, 3, 16, generator=gen).bfloat16().float()
        sel = half_scan(keys, q, 256, 5, 29000, stats, buffers)
        scores, ids = fp32_scan(keys, q, 256, 5, 29000)
        assert torch.equal(sel.ids.sort(-1).values, ids.sort(-1).values)
        assert torch.allclose(sel.scores, scores, rtol=0, atol=1e-5)
    assert stats.extra.get(FALLBACK_KEY, 0) == 0 and stats.extra["fp32_rescans"] == 0
    assert (FALLBACK_KEY in stats.extra) == (max_threads > 0)
