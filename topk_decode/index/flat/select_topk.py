"""select_topk: an exact row-wise top-k that runs `topk` only on the survivors of a sampled threshold.

`torch.topk` over a whole context's scores per row is a large part of the flat torch backend's
search on a few-core CPU (docs/BENCHMARKS.md, "Search floor"), almost all of it spent on keys that
cannot make the top k. `topk_by_threshold` estimates a per-row
threshold t from a strided sample, keeps every element >= t (one vectorised compare and a `nonzero`)
and runs `topk` on those ~2k survivors only. A row with at least k survivors has its whole top k
among them, so the result is exact; rows whose threshold came out too high (fewer than k survivors)
or useless (far too many) are answered by plain `topk`: correctness never depends on the sample.
"""

from __future__ import annotations

import torch

# Plain topk below this many elements per result, or for k < _MIN_K: there the compare + nonzero
# passes cost as much as torch's own selection (docs/BENCHMARKS.md, "Search floor on the 16-core host").
_DIRECT_FACTOR = 8
_MIN_K = 96
# The threshold is the _SAMPLE_RANK-th largest of a strided sample that aims at ~_SURVIVORS_PER_K·k
# survivors. A row falls back only if its sample holds >= 64 of the row's top k where 32 are expected
# (a Poisson tail of ~1e-7 for a random order), and a fallback costs one row's plain topk.
_SURVIVORS_PER_K = 2
_SAMPLE_RANK = 64
# More survivors than this (ties, a row of -inf, an adversarial order): plain topk for that row,
# the padded survivor matrix would cost more than it saves.
_MAX_SURVIVORS_PER_K = 8
# Integers of the same width: for t >= +0, x >= t  <=>  bits(x) >= bits(t) as signed integers
# (sign-magnitude floats, negatives have the sign bit), and integer compares vectorise where
# bf16 / fp16 ones do not (faster: docs/BENCHMARKS.md, "Search floor on the 16-core host").
_BITS = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}

FALLBACK_KEY = "topk_fallback_rows"


def sample_plan(k: int) -> tuple[int, int]:
    """(stride, rank) of the threshold sample for a top-k: t is the rank-th largest of row[::stride]."""
    rank = min(_SAMPLE_RANK, k)
    return max(1, _SURVIVORS_PER_K * k // rank), rank


def _mask_buffer(buffers: dict | None, size: int, device: torch.device) -> torch.Tensor:
    """A flat bool buffer of `size` elements rounded up to whole int64 words, its tail False."""
    key = ("topk_mask", size, device)
    buf = buffers.get(key) if buffers is not None else None
    if buf is None:
        buf = torch.zeros(-(-size // 8) * 8, dtype=torch.bool, device=device)
        if buffers is not None:
            buffers[key] = buf
    return buf


def _flat_nonzero(buf: torch.Tensor) -> torch.Tensor:
    """Ascending positions of the True entries of a word-padded bool buffer.

    Two levels: `nonzero` over the int64 words (8 flags each) and then over the ~15% of words that
    hold a survivor: cheaper than one `nonzero` over all the flags (docs/BENCHMARKS.md, "Search floor
    on the 16-core host").
    """
    words64 = buf.view(torch.int64)
    words = words64.nonzero().view(-1)  # (Wd,) words with a flag
    bits = words64.index_select(0, words).view(torch.bool).nonzero().view(-1)  # (P,) into (Wd·8)
    return words.index_select(0, bits >> 3).mul_(8).add_(bits & 7)  # (P,) into buf


def topk_by_threshold(
    x: torch.Tensor, k: int, sorted: bool = True, counters: dict | None = None, buffers: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise top-k of x along its last dimension: exact, and faster than `x.topk(k)` for k << N.

    The values equal `x.topk(k, dim=-1, sorted=sorted).values` (as a multiset per row; in the same
    order when sorted); the indices may differ from torch's only among equal values. x must not
    contain NaN (scores of finite keys do not).

    Args:
        x: (..., N) float scores (bf16, fp16, fp32 or fp64).
        k: results per row, 1 <= k <= N.
        sorted: return each row's values largest first (as torch.topk); False saves a sort of k.
        counters: optional dict; `counters["topk_fallback_rows"]` counts rows answered by plain topk
            because their sampled threshold let fewer than k (or far too many) elements through.
        buffers: optional dict in which the (..., N) bool mask is kept between calls (4 MiB at 32 x 131072).
    Returns:
        (values, indices), each (..., k): values in x's dtype, int64 positions along the last dimension.
    """
    *lead, n = x.shape
    dev = x.device
    if n <= _DIRECT_FACTOR * k or k < _MIN_K:
        return tuple(x.topk(k, dim=-1, sorted=sorted))
    rows = x.reshape(-1, n)  # (R, N)
    R = rows.shape[0]
    stride, rank = sample_plan(k)
    t = rows[:, ::stride].topk(rank, dim=-1, sorted=False).values.amin(-1, keepdim=True)  # (R, 1)

    buf = _mask_buffer(buffers, R * n, dev)
    mask = buf[: R * n].view(R, n)  # (R, N) survivors
    bits = _BITS.get(x.dtype)
    # The sign bit, not t >= 0: at t = -0 every bit pattern would compare >= it.
    if bits is not None and bool((t.view(bits) >= 0).all()):
        torch.ge(rows.view(bits), t.view(bits), out=mask)  # misses -0 at t = +0: a tie, harmless
    else:
        torch.ge(rows, t, out=mask)
    flat = _flat_nonzero(buf)  # (P,) ascending r·N + col
    start = torch.searchsorted(flat, torch.arange(R + 1, device=dev) * n)  # (R+1,) row r: flat[start[r]:start[r+1]]
    count = start[1:] - start[:-1]  # (R,)
    # Exact: every element > t survives and every survivor is >= t, so with >= k survivors the row's
    # k-th largest value is >= t and every element left out is <= it.
    good = (count >= k) & (count <= _MAX_SURVIVORS_PER_K * k)
    n_bad = R - int(good.sum())
    if counters is not None:
        counters[FALLBACK_KEY] = counters.get(FALLBACK_KEY, 0) + n_bad
    if n_bad == R:
        return tuple(x.topk(k, dim=-1, sorted=sorted))

    count = torch.where(good, count, 0)
    width = int(count.max())
    pos = torch.arange(width, device=dev)  # (W,)
    valid = pos < count[:, None]  # (R, W)
    at = (start[:-1, None] + pos).clamp_(max=flat.numel() - 1)  # (R, W) into flat
    cols = flat.index_select(0, at.view(-1))  # (R·W,) r·N + col
    vals = rows.reshape(-1).index_select(0, cols).view(R, width)  # (R, W) survivors
    # Padding never wins: a good row has >= k survivors, all >= t > -inf (t = -inf lets all N through).
    vals.masked_fill_(~valid, float("-inf"))
    top = vals.topk(k, dim=-1, sorted=sorted)
    values = top.values  # (R, k)
    indices = cols.view(R, width).gather(-1, top.indices) - (torch.arange(R, device=dev) * n)[:, None]  # (R, k)
    if n_bad:
        bad = (~good).nonzero().view(-1)
        plain = rows.index_select(0, bad).topk(k, dim=-1, sorted=sorted)
        values[bad], indices[bad] = plain.values, plain.indices
    return values.view(*lead, k), indices.view(*lead, k)
