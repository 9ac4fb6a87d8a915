"""The compiled scans' dot products (kernels/dots.py): padding, exactness flags, and both ways of scoring."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from topk_decode.index.base import bf16_bits as bits
from topk_decode.kernels import dots
from topk_decode.kernels.jit import jit


@jit
def _all_rows(keys, q, out):
    """out (N, Qp) = every row of keys · every query of q, through `dots.dot4`."""
    for t in range(keys.shape[0]):
        for i in range(0, q.shape[0], dots.GROUP):
            out[t, i], out[t, i + 1], out[t, i + 2], out[t, i + 3] = dots.dot4(keys, t, q, i)


def _padded(q: torch.Tensor, qb_dtype) -> tuple[np.ndarray, np.ndarray, bool]:
    qp = -(-q.shape[0] // dots.GROUP) * dots.GROUP
    qf, qb = np.full((qp, q.shape[1]), np.nan, np.float32), np.zeros((qp, q.shape[1]), qb_dtype)
    return qf, qb, dots.pad_queries(q.numpy(), qf, qb)


def test_pad_queries_pads_with_zero_rows_and_flags_bf16_exact_queries():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(7, 64, generator=gen).bfloat16().float()
    qf, qb, exact = _padded(q, np.uint16)
    assert exact and qf.shape == (8, 64)
    np.testing.assert_array_equal(qf[:7], q.numpy())
    assert not qf[7].any() and not qb[7].any()
    np.testing.assert_array_equal(qb[:7], bits(q.bfloat16()))  # the queries' own bf16 bits
    assert not _padded(q + 1e-3, np.uint16)[2]  # not bf16-exact: flagged
    qf, qb, exact = _padded(q, np.float32)  # no bf16 path: qb is left alone
    assert not exact and not qb.any()


@pytest.mark.parametrize(
    "dot",
    [
        "fp32",
        pytest.param(
            "bf16",
            marks=pytest.mark.skipif(
                not dots.bf16_available(96), reason="no AVX512-BF16 here (or numba targets another CPU)"
            ),
        ),
    ],
)
def test_dot4_scores_every_row_against_four_queries_at_a_time(dot):
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(300, 96, generator=gen).bfloat16()
    q = torch.randn(5, 96, generator=gen).bfloat16().float()
    qf, qb, exact = _padded(q, np.uint16 if dot == "bf16" else np.float32)
    out = np.empty((300, qf.shape[0]), np.float32)
    _all_rows(bits(keys), qb if dot == "bf16" else qf, out)
    want = (keys.double() @ q.double().T).numpy()
    np.testing.assert_allclose(out[:, :5], want, rtol=1e-5, atol=1e-5)
    assert not out[:, 5:].any()  # zero padding rows score 0
