"""routed's `rank=keys`: residual codes (index/routed/pq.py), the per-key ranking, its estimate, exactness."""

from __future__ import annotations

import math

import pytest
import torch

from tests.test_routed_estimate import context_output, grouped_cache  # noqa: F401
from topk_decode.errors import TopkError
from topk_decode.index import get_strategy
from topk_decode.index.routed import pq
from topk_decode.store.cache_dir import open_cache


def _routed(cache, lo, hi, **options):
    strat = get_strategy("routed")(open_cache(cache), lo, hi, dict(cluster_size=32, **options))
    strat.prepare()
    return strat


def _trained(gen: torch.Generator):
    """Random keys of 2 KV heads × 700 rows × 16 dimensions in 5 clusters, and their codes at m = 8."""
    keys = torch.randn(2, 700, 16, generator=gen)
    labels = torch.randint(0, 5, (2, 700), generator=gen)
    cent = torch.randn(2, 5, 16, generator=gen)
    return keys, labels, cent, pq.train_codes(keys, cent, labels, m=8)


def test_codes_decode_to_the_residuals_they_encode():
    keys, labels, cent, codes = _trained(torch.Generator().manual_seed(0))
    res = keys - cent.gather(1, labels[..., None].expand(-1, -1, 16))
    # 16 codewords per 2-dimensional sub-vector: the decoded residuals are far closer than the residuals' own size
    assert (pq.decode(codes) - res).norm() < 0.5 * res.norm()
    # sub-vector j of row i decodes to codeword codes[h, i, j] of codebook j
    h, i, j = 1, 17, 3
    want = codes.codebooks[h, j, codes.unpacked()[h, i, j].long()]
    assert torch.equal(pq.decode(codes)[h, i, 2 * j : 2 * j + 2], want)


def test_approximate_scores_decoded_block_by_block_equal_one_product_over_the_decoded_keys():
    gen = torch.Generator().manual_seed(1)
    _, labels, cent, codes = _trained(gen)
    q = torch.randn(2, 3, 16, generator=gen)
    whole = torch.bmm(q, pq.approximate_keys(cent, labels, codes).transpose(1, 2))
    for block in (64, 700, 10_000):  # several blocks with a short last one, one block, one larger than N
        torch.testing.assert_close(pq.approximate_scores(q, cent, labels, codes, block=block), whole)


def test_top_rows_takes_the_best_rows_or_the_blocks_holding_them():
    share = torch.full((2, 10), -5.0)
    share[0, [1, 6, 9]] = torch.tensor([3.0, 2.0, 1.0])
    share[1, [0, 4]] = torch.tensor([1.0, 2.0])
    assert pq.top_rows(share, 2).tolist() == [[1, 6], [0, 4]]  # single rows, in row order
    pad = torch.tensor([[7], [8]])
    # blocks of 3 over 10 rows: [0-2] [3-5] [6-8] [9, pad, pad]; head 0's best blocks hold rows 1 and 6, then 9
    assert pq.top_rows(share, 6, block=3, pad=pad).tolist() == [[0, 1, 2, 6, 7, 8], [0, 1, 2, 3, 4, 5]]
    assert pq.top_rows(share, 9, block=3, pad=pad)[0].tolist() == [0, 1, 2, 6, 7, 8, 9, 7, 7]
    assert pq.top_rows(share, 8, block=3, pad=pad).shape == (2, 6)  # whole blocks only


def test_codes_are_kept_two_per_byte_the_first_sub_vector_in_the_low_nibble():
    books = torch.zeros(1, 3, 16, 2)
    packed = pq.ResidualCodes(torch.tensor([[[0x21, 0x03]]], dtype=torch.uint8), books)  # an odd m: 3 codes
    assert packed.unpacked().tolist() == [[[1, 2, 3]]]
    again = pq.ResidualCodes.packing(torch.tensor([[[1, 2, 3]]], dtype=torch.uint8), books)
    assert torch.equal(again.codes, packed.codes)


def test_rank_keys_builds_codes_and_finds_most_of_the_exact_top_k(grouped_cache):  # noqa: F811
    n = 3000
    keys = open_cache(grouped_cache).keys[0][:, 4 : n - 16].float()
    strat = _routed(grouped_cache, 4, n - 16, rank="keys", probe_fraction=0.1, estimate=False)
    assert strat.layouts[0].codes is not None and strat.options.pq_m == pq.default_m(16) == 16
    clusters = _routed(grouped_cache, 4, n - 16, probe_fraction=0.1, estimate=False)
    q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1))
    k = 30
    exact = torch.bmm(q, keys.transpose(1, 2)).topk(k, -1).indices + 4  # (Hkv, Q, k) positions
    recalls = {}
    for name, s in (("keys", strat), ("clusters", clusters)):
        sel = s.select(0, q, k)
        hit = sum(len(set(sel.ids[h, i].tolist()) & set(exact[h, i].tolist())) for h in range(2) for i in range(4))
        recalls[name] = hit / (2 * 4 * k)
        assert s.keys_read_fraction() >= 0.1  # whole clusters overshoot the budget; keys meet it
    assert strat.keys_read_fraction() == pytest.approx(0.1, abs=0.001)
    assert recalls["keys"] >= 0.8 and recalls["keys"] >= recalls["clusters"], recalls


def test_rank_keys_with_its_estimate_is_closer_to_dense_than_without(grouped_cache):  # noqa: F811
    lo, hi = 4, 2984
    ckv = open_cache(grouped_cache)
    q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(2))
    scale = 16**-0.5
    s = torch.bmm(q, ckv.keys[0][:, lo:hi].float().transpose(1, 2)) * scale
    dense = torch.bmm(s.softmax(-1), ckv.values[0][:, lo:hi].float())
    errs = {}
    for est in (False, True):
        strat = _routed(grouped_cache, lo, hi, rank="keys", probe_fraction=0.05, estimate=est)
        sel = strat.select(0, q, 20)
        out, _ = context_output(strat, sel, q.shape)
        errs[est] = ((out - dense).norm() / dense.norm()).item()
    assert errs[True] < errs[False], errs


def test_value_codes_bring_the_keyed_estimate_closer_to_the_unread_keys_values(grouped_cache):  # noqa: F811
    """pq_values: each unread key's value as its cluster's mean plus its own 4-bit coded residual, not the mean alone
    (the lever docs/history/eval-2026-11.md's ablation found): against the same weights' exact Σ_i p_i·v_i the
    estimate's error halves; built with the layout and read back."""
    from topk_decode.index.routed.estimate import keyed_rest_part

    lo, hi = 4, 2984
    q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(4))
    errs = {}
    for mv in (0, 8):
        strat = _routed(grouped_cache, lo, hi, rank="keys", pq_values=mv)
        lay = strat.layouts[0]
        logit = strat.approx_scores(0, q).masked_fill(((lay.pos < lo) | (lay.pos >= hi))[:, None, :], float("-inf"))
        rest = keyed_rest_part(logit, lay.labels(), *strat.rest_values(0))
        values = torch.take_along_dim(strat.ckv.values[0], lay.pos[..., None], dim=1)  # each layout row's value
        exact = torch.bmm((logit - rest.lse[..., None]).exp(), values.float())
        errs[mv] = ((rest.out - exact).norm() / exact.norm()).item()
    assert lay.value_codes is not None and lay.value_codes.codes.shape == (2, 3000, 4)
    assert errs[8] < 0.7 * errs[0], errs
    reopened = _routed(grouped_cache, lo, hi, rank="keys", pq_values=8)
    assert torch.equal(reopened.layouts[0].value_codes.codes, lay.value_codes.codes)  # read back, not rebuilt


def test_rank_keys_is_exact_when_it_reads_everything(grouped_cache):  # noqa: F811
    lo, hi = 4, 2984
    keys = open_cache(grouped_cache).keys[0][:, lo:hi].float()
    strat = _routed(grouped_cache, lo, hi, rank="keys", probe_fraction=1.0)
    q = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(3))
    sel = strat.select(0, q, 50)
    want = torch.bmm(q, keys.transpose(1, 2)).topk(50, -1).indices + lo
    assert torch.equal(sel.ids.sort(-1).values, want.sort(-1).values)


def test_rank_keys_refuses_a_bad_pq_m(grouped_cache):  # noqa: F811
    with pytest.raises(TopkError, match="pq_m=5 must divide"):
        _routed(grouped_cache, 4, 2984, rank="keys", pq_m=5)


def test_rank_keys_reading_every_key_decodes_like_flat_through_the_store(tmp_path, built_cache):
    """End to end through KVStore: with every key read, rank=keys keeps the exact top-k and no estimate."""
    import shutil

    from topk_decode import KVStore

    cache = tmp_path / "cache"
    shutil.copytree(built_cache[0], cache)
    prompt = [5, 17, 42, 99]
    flat = KVStore.open(cache, k=24, strategy="flat", device="cpu").generate_ids(prompt, 8)
    keys = KVStore.open(
        cache, k=24, strategy="routed", strategy_options={"rank": "keys", "probe_fraction": 1}, device="cpu"
    )
    assert keys.generate_ids(prompt, 8) == flat
    assert keys.decoder.strategy.layouts[0].codes is not None  # built on open, with the layout


def test_prefill_with_rank_keys_builds_the_codes_and_open_reuses_them(tmp_path, grouped_cache):  # noqa: F811
    import shutil

    from topk_decode.index import artifact_dir, prepare_artifacts

    cache = tmp_path / "cache"
    shutil.copytree(grouped_cache, cache)
    shutil.rmtree(artifact_dir(cache, "routed"), ignore_errors=True)
    prepare_artifacts(open_cache(cache), ["routed"], {"cluster_size": 32, "rank": "keys"})
    done = artifact_dir(cache, "routed") / "done.json"
    stamp = done.stat().st_mtime_ns
    strat = _routed(cache, 4, 2984, rank="keys")
    assert done.stat().st_mtime_ns == stamp and strat.layouts[0].codes.codes.shape == (2, 3000, 8)
    # a layout whose codes were kept one per byte (built before `packed_codes`) is rebuilt, not misread
    import json

    record = json.loads(done.read_text())
    del record["meta"]["options"]["packed_codes"]
    done.write_text(json.dumps(record))
    assert _routed(cache, 4, 2984, rank="keys").layouts[0].codes.codes.shape == (2, 3000, 8)
    assert json.loads(done.read_text())["meta"]["options"]["packed_codes"] is True
    # a layout built without codes is rebuilt with them when rank=keys asks
    shutil.rmtree(artifact_dir(cache, "routed"))
    _routed(cache, 4, 2984)
    assert _routed(cache, 4, 2984, rank="keys").layouts[0].codes is not None


def test_estimate_by_keys_weighs_the_unread_clusters_closer_to_their_true_mass(grouped_cache):  # noqa: F811
    """After the same cluster routing, per-key weights estimate the unread keys' log-mass more closely than
    n_c·exp(s·q·μ_c), which is below the truth by Jensen."""
    lo, hi = 4, 2984
    q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(4))
    errs, ids = {}, {}
    for by in ("clusters", "keys"):
        strat = _routed(grouped_cache, lo, hi, probe_fraction=0.05, estimate_by=by, kernel="torch")
        sel = strat.select(0, q, 20)
        lay, n = strat.layouts[0], strat.layouts[0].pos.shape[1]
        budget = max(math.ceil(0.05 * (hi - lo)), 2 * 20)  # routed's read: probe_fraction, at least 2·k
        rows = strat.route(0, q, budget).rows % n  # flat rows (Hkv·N) → each head's own
        read = torch.zeros(2, n, dtype=torch.bool).scatter_(1, rows, True)
        unread = ~read & (lay.pos >= lo) & (lay.pos < hi)
        keys = torch.take_along_dim(strat.ckv.keys[0], lay.pos[..., None], dim=1)  # each layout row's key
        s = torch.bmm(q, keys.float().transpose(1, 2)) * strat.scale
        true = s.masked_fill(~unread[:, None, :], float("-inf")).logsumexp(-1)  # (Hkv, Q)
        errs[by], ids[by] = (sel.rest.lse - true).abs().mean().item(), sel.ids
        if by == "clusters":
            assert bool((sel.rest.lse <= true + 1e-4).all())  # the Jensen lower bound
    assert torch.equal(ids["keys"], ids["clusters"])  # the same keys selected: only the estimate differs
    assert errs["keys"] < 0.5 * errs["clusters"], errs


def test_the_codes_error_lifts_the_keyed_estimate_to_the_unread_keys_true_mass(grouped_cache):  # noqa: F811
    """Coarse codes (8 dimensions per 4-bit sub-vector) weigh the unread keys too little on average: k-means leaves
    the error uncorrelated with k̂, so Σ exp(s·q·k̂) is below Σ exp(s·q·k). `code_error` (opt-in) adds
    log E[exp(s·q·e)] and lands closer to the truth, without changing what is selected."""
    lo, hi = 4, 2984
    q = 1.5 * torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(5))
    bias, errs, ids = {}, {}, {}
    for corrected in (False, True):
        strat = _routed(
            grouped_cache, lo, hi, probe_fraction=0.05, estimate_by="keys", pq_m=2, code_error=corrected, kernel="torch"
        )
        sel = strat.select(0, q, 20)
        lay, n = strat.layouts[0], strat.layouts[0].pos.shape[1]
        budget = max(math.ceil(0.05 * (hi - lo)), 2 * 20)
        rows = strat.route(0, q, budget).rows % n
        read = torch.zeros(2, n, dtype=torch.bool).scatter_(1, rows, True)
        unread = ~read & (lay.pos >= lo) & (lay.pos < hi)
        keys = torch.take_along_dim(strat.ckv.keys[0], lay.pos[..., None], dim=1)
        s = torch.bmm(q, keys.float().transpose(1, 2)) * strat.scale
        true = s.masked_fill(~unread[:, None, :], float("-inf")).logsumexp(-1)  # (Hkv, Q)
        bias[corrected] = (sel.rest.lse - true).mean().item()
        errs[corrected], ids[corrected] = (sel.rest.lse - true).abs().mean().item(), sel.ids
    assert torch.equal(ids[True], ids[False])
    assert bias[False] < -0.05, bias  # too little mass without the correction
    assert errs[True] < 0.5 * errs[False], errs


def test_rank_keys_refuses_a_cluster_estimate(grouped_cache):  # noqa: F811
    with pytest.raises(TopkError, match="estimate_by=clusters needs rank=clusters"):
        _routed(grouped_cache, 4, 2984, rank="keys", estimate_by="clusters")


def test_with_codes_fills_pq_m_for_rank_keys_and_bounds_pq_values_by_half_the_head_dimension():
    from topk_decode.index.routed.strategy import RoutedOptions, with_codes

    o = with_codes(RoutedOptions(rank="keys", pq_values=32), 128)
    assert (o.pq_m, o.pq_values) == (128, 32)  # key codes: one dimension per sub-vector, at most 128
    assert with_codes(RoutedOptions(rank="keys", pq_values=32), 64).pq_m == 64
    assert with_codes(RoutedOptions(rank="keys"), 256).pq_m == 128
    assert with_codes(RoutedOptions(rank="keys", pq_values=64), 128).pq_values == 64  # a user's 2-dimension codes
    small = with_codes(RoutedOptions(rank="keys", pq_values=32), 16)  # auto's 32 on 16-dimension heads
    assert (small.pq_m, small.pq_values) == (16, 8)
    assert with_codes(RoutedOptions(), 128) == RoutedOptions()  # rank=clusters, no value codes: nothing to fill


def test_codes_trained_by_several_threads_equal_one_threads():
    """train_codes trains the KV heads' sub-vectors in parallel: the same codes and codebooks as one head after
    another (each head's training sample is drawn in head order), with fewer or more threads than heads."""
    gen = torch.Generator().manual_seed(70)
    keys = torch.randn(3, 70_000, 16, generator=gen)  # more rows than TRAIN_ROWS: each head draws a sample
    cent = torch.randn(3, 50, 16, generator=gen)
    labels = torch.randint(0, 50, (3, 70_000), generator=gen)
    one, three, eight = (pq.train_codes(keys, cent, labels, 4, threads=t) for t in (1, 3, 8))
    for other in (three, eight):
        assert torch.equal(one.codes, other.codes) and torch.equal(one.codebooks, other.codebooks)


@pytest.mark.parametrize("m", [4, 16])  # 4 dimensions per sub-vector, and one
def test_codes_are_faiss_product_quantizers(m):
    """Each head's codebooks and codes are those of faiss' `ProductQuantizer` trained on its residuals."""
    import faiss

    gen = torch.Generator().manual_seed(72)
    keys, cent = torch.randn(2, 3000, 16, generator=gen), torch.randn(2, 40, 16, generator=gen)
    labels = torch.randint(0, 40, (2, 3000), generator=gen)
    got = pq.train_codes(keys, cent, labels, m, threads=5)
    for h in range(2):
        res = (keys[h] - cent[h][labels[h]]).numpy()
        want = faiss.ProductQuantizer(16, m, pq.NBITS)
        want.train(res)
        assert torch.equal(got.codebooks[h].flatten(), torch.from_numpy(faiss.vector_to_array(want.centroids)))
        assert torch.equal(got.codes[h], torch.from_numpy(want.compute_codes(res)))


def test_codes_trained_by_several_threads_under_inference_mode():
    """The decoder opens under torch.inference_mode (`topk bench`, chat): the heads' threads write the codes made
    in it (a worker thread does not inherit the mode: an in-place write there was an error)."""
    gen = torch.Generator().manual_seed(71)
    keys, cent = torch.randn(2, 600, 16, generator=gen), torch.randn(2, 10, 16, generator=gen)
    labels = torch.randint(0, 10, (2, 600), generator=gen)
    one = pq.train_codes(keys, cent, labels, 4, threads=1)
    with torch.inference_mode():
        two = pq.train_codes(keys, cent, labels, 4, threads=2)
    assert torch.equal(one.codes, two.codes) and torch.equal(one.codebooks, two.codebooks)
