"""flat's compiled scan (kernels/flat_scan.py, index/flat/compiled.py, `flat --opt backend=numba`) returns the exact top-k."""

from __future__ import annotations

import pytest
import torch

from topk_decode.bench.synthetic import kv_in_memory, synthetic_kv
from topk_decode.errors import TopkError
from topk_decode.index.base import bf16_bits, exact_scores
from topk_decode.index.flat import FlatStrategy
from topk_decode.index.flat import compiled as flat_numba
from topk_decode.kernels import dots, flat_sample, jit


@pytest.fixture(scope="module")
def threads():
    """Two worker threads, as the strategy would use on this machine."""
    return 2


_NO_BF16 = pytest.mark.skipif(not dots.bf16_available(64), reason="no AVX512-BF16 here (or numba targets another CPU)")
# Both ways of scoring: the keys widened to fp32 (any query), the hardware bf16 dot product (bf16 queries)
DOTS = ["fp32", pytest.param("bf16", marks=_NO_BF16)]


def _for(dot: str, q: torch.Tensor) -> torch.Tensor:
    """The queries the `dot` path is for: bf16-exact ones for "bf16" (as the decoder's), any for "fp32"."""
    return q.bfloat16().float() if dot == "bf16" else q


def _keys_and_queries(hkv: int, n: int, d: int, q: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    keys = (torch.randn(hkv, n, d, generator=gen) + 0.5).bfloat16()  # an offset shared by all keys, as in real K
    return keys, torch.randn(hkv, q, d, generator=gen)


def _brute_force(keys: torch.Tensor, q: torch.Tensor, k: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 scores of keys[:, lo:hi] and the top min(k, hi − lo) by (score desc, position asc)."""
    scores = torch.bmm(q, keys[:, lo:hi].float().transpose(1, 2))  # (Hkv, Q, M)
    order = scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    return scores, order + lo


def _assert_exact_topk(
    ids: torch.Tensor, sc: torch.Tensor, keys: torch.Tensor, q: torch.Tensor, k: int, lo: int, hi: int
) -> None:
    """ids/scores are the exact top-k of keys[:, lo:hi]: scores to 1e-5, id sets where the k-th score is clear."""
    m = min(k, max(0, hi - lo))
    all_scores, ref_ids = _brute_force(keys, q, k, lo, hi)
    assert ids.shape == sc.shape == (*q.shape[:2], k)
    assert (ids[..., m:] == -1).all()
    got, got_s = ids[..., :m], sc[..., :m]
    assert ((got >= lo) & (got < hi)).all()
    exact = exact_scores(keys, q, got)
    torch.testing.assert_close(got_s, exact, rtol=1e-5, atol=1e-5)
    ref_s = all_scores.sort(dim=-1, descending=True).values  # (Hkv, Q, M)
    torch.testing.assert_close(got_s.sort(-1, descending=True).values, ref_s[..., :m], rtol=1e-5, atol=1e-5)
    for h in range(q.shape[0]):
        for i in range(q.shape[1]):
            # a near-tie at the k-th score may pick either key under another summation order
            if m == hi - lo or ref_s[h, i, m - 1] - ref_s[h, i, m] > 1e-4 * ref_s[h, i, 0].abs():
                assert set(got[h, i].tolist()) == set(ref_ids[h, i].tolist())


@pytest.mark.parametrize(
    "d,Q,k,lo,hi,block",
    [
        (64, 4, 50, 3, 2990, 256),  # many blocks, a partial last one
        (128, 7, 300, 100, 2500, 128),  # k larger than a block: every block returns all its keys
        (128, 1, 20, 0, 3000, None),  # block size chosen by search
        (64, 32, 8, 1, 2999, 512),  # a prompt chunk's worth of queries
        (128, 5, 700, 700, 1500, 100),  # a narrow range in the middle
    ],
)
@pytest.mark.parametrize("dot", DOTS)
def test_search_returns_the_exact_topk_across_block_boundaries(threads, d, Q, k, lo, hi, block, dot):
    keys, q = _keys_and_queries(2, 3000, d, Q, seed=d + Q + k)
    q = _for(dot, q)
    ids, sc = flat_numba.search(keys, q, k, lo, hi, threads, block=block, dot=dot)
    _assert_exact_topk(ids, sc, keys, q, k, lo, hi)


@pytest.mark.parametrize("k,lo,hi", [(900, 100, 1000), (2000, 100, 1000), (1, 0, 1)])
def test_k_at_least_the_range_returns_every_key_then_empty_slots(threads, k, lo, hi):
    keys, q = _keys_and_queries(2, 1000, 64, 4, seed=3)
    ids, sc = flat_numba.search(keys, q, k, lo, hi, threads, block=64)
    _assert_exact_topk(ids, sc, keys, q, k, lo, hi)
    assert (sc[..., hi - lo :] == 0).all()


def test_empty_range_returns_only_empty_slots(threads):
    keys, q = _keys_and_queries(2, 100, 64, 4, seed=4)
    ids, sc = flat_numba.search(keys, q, 5, 50, 50, threads)
    assert (ids == -1).all() and (sc == 0).all() and ids.shape == (2, 4, 5)


@pytest.mark.parametrize("dot", DOTS)
def test_ties_at_the_kth_score_go_to_the_lowest_positions_whatever_the_threads_and_blocks(threads, dot):
    hkv, n, d = 2, 2000, 64
    keys = torch.ones(hkv, n, d, dtype=torch.bfloat16)  # every key scores the same...
    keys[:, 1500:1510] = 2.0  # ...but ten, which score higher for q = 1
    q = torch.ones(hkv, 3, d)
    want = set(range(1500, 1510)) | set(range(10, 40))  # lo = 10: the 30 lowest tied positions
    for p, block in ((threads, 16), (threads, 64), (threads, 1000), (1, 300), (threads, None)):
        ids, sc = flat_numba.search(keys, q, 40, 10, 1990, p, block=block, dot=dot)
        for h in range(hkv):
            for i in range(3):
                assert set(ids[h, i].tolist()) == want
        assert sorted(sc[0, 0].tolist()) == [64.0] * 30 + [128.0] * 10


def _sampled_block_is_used(keys: torch.Tensor, q: torch.Tensor, k: int, s: int, e: int) -> bool:
    """Whether `search` guesses each head's cut from a sample here (else every block starts from −inf)."""
    spec = flat_sample.head_cuts(bf16_bits(keys), q.contiguous().numpy(), s, e, k, 1)
    return bool((spec > float("-inf")).all())


@pytest.mark.parametrize(
    "Q,k,lo,hi,block",
    [
        (4, 256, 0, 12000, None),  # one block per head on one thread: the sample's cut is used
        (7, 300, 5, 11990, 6000),  # two blocks, a padded query group
        (4, 2048, 0, 12000, None),  # k large against the block: no sample, the running cut alone
    ],
)
@pytest.mark.parametrize("dot", DOTS)
def test_sampled_cut_keeps_the_exact_topk(Q, k, lo, hi, block, dot):
    keys, q = _keys_and_queries(2, 12000, 64, Q, seed=Q + k)
    q = _for(dot, q)
    assert _sampled_block_is_used(keys, q, k, lo, hi) == (k < 2000)
    ids, sc = flat_numba.search(keys, q, k, lo, hi, 1, block=block, dot=dot)
    _assert_exact_topk(ids, sc, keys, q, k, lo, hi)


def test_a_sample_that_guesses_too_high_falls_back_to_the_exact_topk():
    hkv, n, d, k = 1, 8192, 64, 256
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(hkv, n, d, generator=gen) * 0.1
    keys[:, ::8] += 1.0  # exactly the sampled rows (stride 8 at k = 256) score high: the sample's
    q = torch.ones(hkv, 2, d)  # 64th best lets only ~64 rows through, far fewer than k
    keys = keys.bfloat16()
    assert _sampled_block_is_used(keys, q, k, 0, n)
    ids, sc = flat_numba.search(keys, q, k, 0, n, 1)
    _assert_exact_topk(ids, sc, keys, q, k, 0, n)


@pytest.mark.parametrize("dot", DOTS)
def test_only_the_head_whose_guess_was_too_high_is_scanned_again_and_all_stay_exact(threads, dot):
    hkv, n, d, k = 3, 8192, 64, 256
    gen = torch.Generator().manual_seed(6)
    keys = torch.randn(hkv, n, d, generator=gen) * 0.1
    keys[1, ::8] += 1.0  # head 1 only: its sampled rows score high, its guess lets ~64 rows through
    keys[2, 6000:6300] += 1.0  # head 2: its best rows all in the last of its four blocks
    q = _for(dot, torch.ones(hkv, 3, d) + 0.1 * torch.randn(hkv, 3, d, generator=gen))
    keys = keys.bfloat16()
    assert _sampled_block_is_used(keys, q, k, 0, n)
    ids, sc = flat_numba.search(keys, q, k, 0, n, threads, block=2048, dot=dot)
    _assert_exact_topk(ids, sc, keys, q, k, 0, n)


def test_ties_everywhere_with_a_sampled_cut_go_to_the_lowest_positions():
    hkv, n, d, k = 1, 8192, 64, 256
    keys = torch.ones(hkv, n, d, dtype=torch.bfloat16)  # the sample's cut equals every score
    q = torch.ones(hkv, 2, d)
    assert _sampled_block_is_used(keys, q, k, 0, n)
    ids, _ = flat_numba.search(keys, q, k, 0, n, 1)
    assert all(set(ids[0, i].tolist()) == set(range(k)) for i in range(2))


@pytest.mark.parametrize("d,kv", [(64, None), (128, None), (64, "int8")])
def test_numba_backend_selects_what_the_torch_backend_selects_from_a_memory_mapped_cache(tmp_path, d, kv):
    """bf16 keys, and int8 ones (`--kv-dtype int8`: scanned as stored, their scales in the queries)."""
    ckv = synthetic_kv(2, 2, d, 3000, torch.bfloat16, seed=d, path=tmp_path / "cache", kv_dtype=kv)
    lo, hi = 4, 2980
    compiled = FlatStrategy(ckv, lo, hi, {"backend": "numba", "threads": 2})
    plain = FlatStrategy(ckv, lo, hi, {"backend": "torch"})
    for s in (compiled, plain):
        s.prepare()
    try:
        for layer, (Q, k) in enumerate(((4, 64), (6, 1000))):
            q = torch.randn(2, Q, d, generator=torch.Generator().manual_seed(layer)).bfloat16().float()
            q = ckv.search_queries(layer, q)
            a, b = compiled.select(layer, q, k), plain.select(layer, q, k)
            assert a.ids.shape == (2, Q, k) and a.no_empty_slots
            assert torch.equal(a.ids.sort(-1).values, b.ids.sort(-1).values)
            torch.testing.assert_close(a.scores.sort(-1).values, b.scores.sort(-1).values, rtol=1e-5, atol=1e-5)
            _assert_exact_topk(a.ids, a.scores, ckv.keys[layer], q, k, lo, hi)
        everything = compiled.select(0, q, hi - lo)  # k covers the range: all tokens, exact
        assert torch.equal(everything.ids, plain.select(0, q, hi - lo).ids)
    finally:
        compiled.close()


@_NO_BF16
@pytest.mark.parametrize("d,Q", [(128, 4), (64, 7), (96, 1)])
def test_bf16_dot_products_select_and_score_what_the_fp32_path_does(threads, d, Q):
    keys, q = _keys_and_queries(3, 5000, d, Q, seed=d * Q)
    q = q.bfloat16().float()
    assert flat_numba.bf16_dot_applies(keys, q)
    a_ids, a_sc = flat_numba.search(keys, q, 100, 2, 4990, threads, dot="fp32")
    b_ids, b_sc = flat_numba.search(keys, q, 100, 2, 4990, threads)  # auto: bf16 here
    assert torch.equal(a_ids.sort(-1).values, b_ids.sort(-1).values)
    torch.testing.assert_close(a_sc.sort(-1).values, b_sc.sort(-1).values, rtol=1e-5, atol=1e-5)


def test_bf16_dot_products_apply_only_to_bf16_exact_queries_and_rows_of_whole_registers(monkeypatch):
    keys, q = _keys_and_queries(1, 100, 64, 4, seed=1)
    assert not flat_numba.bf16_dot_applies(keys, q)  # q: fp32 bits below bf16's
    assert not dots.bf16_available(48)  # 48 is no multiple of 32
    import numba

    try:  # the instruction set is chosen once per process (kernels/jit.py): choose again under each setting
        monkeypatch.setenv("TOPK_NO_BF16_DOT", "1")  # the switch for A/B runs
        jit.instruction_set.cache_clear()
        assert not dots.bf16_available(64)
        monkeypatch.delenv("TOPK_NO_BF16_DOT")
        monkeypatch.setattr(numba.config, "CPU_NAME", "generic")  # numba built for another CPU
        jit.instruction_set.cache_clear()
        assert not dots.bf16_available(64)
    finally:
        monkeypatch.undo()
        jit.instruction_set.cache_clear()


def test_numba_backend_takes_fp32_queries_not_representable_in_bf16():
    keys, q = _keys_and_queries(2, 1500, 64, 4, seed=9)  # q: plain fp32, not bf16-rounded
    ckv = kv_in_memory(list(keys[None]), list(keys[None]), list(range(1500)), "llama")
    strat = FlatStrategy(ckv, 0, 1500, {"backend": "numba", "threads": 1})
    strat.prepare()
    sel = strat.select(0, q, 30)
    _assert_exact_topk(sel.ids, sel.scores, keys, q, 30, 0, 1500)


def test_bad_backend_values_raise_one_line_topk_errors():
    keys, _ = _keys_and_queries(1, 100, 64, 1, seed=0)
    ckv = kv_in_memory([keys], [keys], list(range(100)), "llama")
    with pytest.raises(TopkError, match="backend must be auto, torch, numba or faiss"):
        FlatStrategy(ckv, 0, 100, {"backend": "numbaa"}).prepare()
    fp32 = kv_in_memory([keys.float()], [keys.float()], list(range(100)), "llama")
    with pytest.raises(TopkError, match="reads bf16 or int8 keys, these are float32") as err:
        FlatStrategy(fp32, 0, 100, {"backend": "numba"}).prepare()
    assert "\n" not in str(err.value)


def test_auto_backend_takes_numba_for_long_bf16_contexts_and_torch_otherwise(monkeypatch):
    from topk_decode.index.flat import strategy as flat_mod

    keys, q = _keys_and_queries(2, 3000, 64, 4, seed=11)
    q = q.bfloat16().float()
    ckv = kv_in_memory([keys], [keys], list(range(3000)), "llama")
    fp32 = kv_in_memory([keys.float()], [keys.float()], list(range(3000)), "llama")

    def backend(cache, lo=0, hi=3000):
        strat = FlatStrategy(cache, lo, hi, {"threads": 2})
        strat.prepare()
        return strat

    assert backend(ckv).backend == "torch"  # 3,000 keys: below NUMBA_MIN_KEYS
    monkeypatch.setattr(flat_mod, "NUMBA_MIN_KEYS", 2000)
    auto, plain = backend(ckv), FlatStrategy(ckv, 0, 3000, {"backend": "torch"})
    plain.prepare()
    assert auto.backend == "numba"
    a, b = auto.select(0, q, 100), plain.select(0, q, 100)
    assert torch.equal(a.ids.sort(-1).values, b.ids.sort(-1).values)
    assert backend(ckv, 0, 1000).backend == "torch"  # counts the searchable keys only
    assert backend(fp32).backend == "torch"  # numba reads bf16 keys only


def test_search_reports_the_time_of_each_pass_when_asked():
    keys, q = _keys_and_queries(2, 4096, 64, 4, seed=12)
    parts: dict = {}
    ids, sc = flat_numba.search(keys, q, 256, 0, 4096, 2, parts=parts)
    assert set(parts) == {"cuts", "scan", "rescan", "merge", "total"}
    assert all(t >= 0 for t in parts.values())
    assert parts["total"] >= parts["cuts"] + parts["scan"] + parts["merge"]
    _assert_exact_topk(ids, sc, keys, q, 256, 0, 4096)
