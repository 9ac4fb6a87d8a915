"""routed's residual codes of one dimension per sub-vector, encoded (index/routed/pq.py `train_codes`).

faiss' `ProductQuantizer.compute_codes` finds each sub-vector's nearest of its 16 codewords through one distance
call per sub-vector: at one dimension per sub-vector that call is most of the work, and encoding was most of a
build (docs/history/benchmarks-2026-11.md "the residual codes' build"). Here every row's sub-vectors are compared
with their codewords in one compiled loop, with faiss' arithmetic ((x − c)² per codeword, the first of equal
minima): the same codes (tests/test_routed_pq.py).
"""

from __future__ import annotations

from topk_decode.kernels.jit import pjit_ieee, prange


@pjit_ieee
def nearest_codes_1d(res, books, out):
    """Codes of one-dimension sub-vectors: res (N, m) float32 residuals, books (m, 16) float32 codewords per
    sub-vector → out (N, ⌈m/2⌉) uint8, sub-vector 2j in the low nibble of byte j and 2j + 1 in the high one."""
    n, m = res.shape
    for i in prange(n):
        for j in range(m):
            x = res[i, j]
            d = x - books[j, 0]
            best_d, best = d * d, 0
            for c in range(1, books.shape[1]):
                d = x - books[j, c]
                if d * d < best_d:
                    best_d, best = d * d, c
            if j % 2 == 0:
                out[i, j // 2] = best
            else:
                out[i, j // 2] |= best << 4
