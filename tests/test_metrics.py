"""Fidelity metrics on hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from topk_decode.eval.metrics import (
    attention_fidelity,
    greedy_agreement,
    is_correct,
    kl_divergence,
    mass_recall,
    relative_error,
    topk_id_recall,
)

LN2, LN3 = math.log(2.0), math.log(3.0)


def test_mass_recall_is_one_when_everything_is_selected():
    logits = torch.randn(3, 5, 17)
    assert torch.allclose(mass_recall(logits, torch.ones(3, 5, 17, dtype=torch.bool)), torch.ones(3, 5))


def test_mass_recall_equals_the_known_share_of_a_constructed_distribution():
    # softmax([0, ln2, ln3, -inf]) = [1, 2, 3, 0] / 6; keeping slots 1 and 3 keeps 2/6
    logits = torch.tensor([0.0, LN2, LN3, float("-inf")])
    keep = torch.tensor([False, True, False, True])
    assert mass_recall(logits, keep).item() == pytest.approx(1 / 3, abs=1e-6)


def test_topk_id_recall_counts_exact_ids_found_and_ignores_padding():
    selected = torch.tensor([[5, 3, -1], [7, 3, 9]])
    exact = torch.tensor([[3, 7], [3, 7]])
    assert topk_id_recall(selected, exact).tolist() == pytest.approx([0.5, 1.0])
    # -1 in the exact list is padding; -1 in the selection never matches it
    assert topk_id_recall(torch.tensor([-1, 4]), torch.tensor([4, -1])).item() == pytest.approx(1.0)


def test_kl_is_zero_for_identical_logits():
    x = torch.randn(4, 50)
    assert torch.allclose(kl_divergence(x, x), torch.zeros(4), atol=1e-6)


def test_kl_matches_a_hand_computation():
    # p = [1/4, 3/4], q = [1/2, 1/2]: KL(p‖q) = 1/4·ln(1/2) + 3/4·ln(3/2)
    expected = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    assert kl_divergence(torch.tensor([0.0, LN3]), torch.tensor([0.0, 0.0])).item() == pytest.approx(expected, abs=1e-6)


def test_relative_error_is_zero_for_identical_outputs_and_matches_a_hand_case():
    x = torch.randn(2, 8)
    assert torch.all(relative_error(x, x) == 0)
    assert relative_error(torch.tensor([3.0, 5.0]), torch.tensor([3.0, 4.0])).item() == pytest.approx(0.2)


def test_greedy_agreement_counts_matching_positions_over_the_reference():
    assert greedy_agreement([1, 2, 3, 4], [1, 9, 3]) == (2, 4)
    assert greedy_agreement([5, 6], [5, 6]) == (2, 2)


def test_is_correct_strips_and_checks_the_prefix():
    assert is_correct(" 482.\n", "482")
    assert not is_correct(" 48", "482")
    assert not is_correct("The number is 482", "482")


def _one_head_case():
    """Hkv=1, one query, D=1, scale 1: context raw scores [0, ln2, ln3], window [0 (visible), 5 (masked)]."""
    q = torch.ones(1, 1, 1)
    ctx_k = torch.tensor([[[0.0], [LN2], [LN3]]])
    ctx_v = torch.tensor([[[1.0], [2.0], [3.0]]])
    win_k = torch.tensor([[[0.0], [5.0]]])
    win_v = torch.tensor([[[10.0], [-100.0]]])
    visible = torch.tensor([[True, False]])
    return q, ctx_k, ctx_v, win_k, win_v, visible


def test_attention_fidelity_on_a_constructed_head():
    q, ctx_k, ctx_v, win_k, win_v, visible = _one_head_case()
    lo = 10  # the searchable range starts at absolute position 10
    # dense probabilities over [ctx0, ctx1, ctx2, win0] = [1, 2, 3, 1] / 7; select ctx2 (+ the window)
    fid = attention_fidelity(q, 1.0, ctx_k, ctx_v, lo, win_k, win_v, visible, torch.tensor([[[12, -1]]]), k=1)
    assert fid.mass_recall.item() == pytest.approx(4 / 7, abs=1e-6)
    assert fid.id_recall.item() == pytest.approx(1.0)  # the exact top-1 is position 12
    dense, sel = 24 / 7, (3 * 3 + 1 * 10) / 4
    assert fid.output_rel_error.item() == pytest.approx(abs(sel - dense) / dense, rel=1e-5)
    # selecting the wrong token: the top-1 is missed
    miss = attention_fidelity(q, 1.0, ctx_k, ctx_v, lo, win_k, win_v, visible, torch.tensor([[[11]]]), k=1)
    assert miss.id_recall.item() == 0.0
    assert miss.mass_recall.item() == pytest.approx(3 / 7, abs=1e-6)


def test_attention_fidelity_is_exact_when_everything_is_selected():
    torch.manual_seed(0)
    hkv, Q, M, W, D = 2, 6, 40, 5, 8
    q = torch.randn(hkv, Q, D)
    ctx_k, ctx_v = torch.randn(hkv, M, D), torch.randn(hkv, M, D)
    win_k, win_v = torch.randn(hkv, W, D), torch.randn(hkv, W, D)
    visible = torch.ones(Q, W, dtype=torch.bool)
    everything = torch.arange(4, 4 + M).expand(hkv, Q, M)
    fid = attention_fidelity(q, D**-0.5, ctx_k, ctx_v, 4, win_k, win_v, visible, everything, k=16)
    assert torch.allclose(fid.mass_recall, torch.ones(hkv, Q), atol=1e-6)
    assert torch.allclose(fid.id_recall, torch.ones(hkv, Q))
    assert fid.output_rel_error.max().item() < 1e-5
