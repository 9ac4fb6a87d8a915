"""The merge of retrieved context tokens with the window is one softmax over their union."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from topk_decode.decode.merge import lse_merge


# ---- references (test-only): the one-pass form of the merge and one part with its lse ---------------
def joint_attention(
    q: torch.Tensor,
    win_k: torch.Tensor,
    win_v: torch.Tensor,
    win_visible: torch.Tensor | None,
    ctx_scores: torch.Tensor | None,
    ctx_values: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Attention of new queries over retrieved context tokens ∪ window tokens, exactly.

    Args:
        q: (H, T, D) queries (post-RoPE).
        win_k, win_v: (Hkv, W, D) window keys/values (GQA: query head i uses KV head i // G).
        win_visible: (T, W) bool, True where query t may attend window slot j (causality); None = all.
        ctx_scores: (H, T, K) float32 raw q·k of retrieved tokens, -inf in empty slots; or None.
        ctx_values: (H, T, K, D) values of retrieved tokens; or None.
        scale: softmax scale, 1/sqrt(D) for these models.
    Returns:
        (H, T, D) in q's dtype.
    """
    H, T, D = q.shape
    hkv, W, _ = win_k.shape
    G = H // hkv
    qf = q.float().reshape(hkv, G * T, D)  # (Hkv, G·T, D)
    b = torch.bmm(qf, win_k.float().transpose(1, 2)).view(H, T, W) * scale  # (H, T, W)
    if win_visible is not None:
        b = b.masked_fill(~win_visible, float("-inf"))
    if ctx_scores is not None and ctx_scores.shape[-1] > 0:
        K = ctx_scores.shape[-1]
        p = torch.softmax(torch.cat([ctx_scores.float() * scale, b], dim=-1), dim=-1)  # (H, T, K+W)
        out_ctx = torch.einsum("htk,htkd->htd", p[..., :K], ctx_values.float())
        p_win = p[..., K:]
    else:
        out_ctx = None
        p_win = torch.softmax(b, dim=-1)
    out = torch.bmm(p_win.reshape(hkv, G * T, W), win_v.float()).view(H, T, D)
    if out_ctx is not None:
        out = out + out_ctx
    return out.to(q.dtype)


def partial_attention(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over one part, with its log-sum-exp.

    Args:
        scores: (..., K) already-scaled logits (-inf allowed).
        values: (..., K, D).
    Returns:
        out (..., D) normalised within the part, and lse (...,).
    """
    lse = torch.logsumexp(scores.float(), dim=-1)
    p = torch.exp(scores.float() - lse[..., None])
    return torch.einsum("...k,...kd->...d", p, values.float()), lse


def _dense(q, keys, values, visible=None):
    """Reference: torch SDPA over all keys with GQA expansion.  q (H,T,D), keys/values (Hkv,S,D)."""
    H, hkv = q.shape[0], keys.shape[0]
    k = keys.repeat_interleave(H // hkv, dim=0)
    v = values.repeat_interleave(H // hkv, dim=0)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=visible)[0]


def _split(q, ctx_k, ctx_v):
    """All context tokens as a 'retrieved' part: raw scores (H,T,N) and values (H,T,N,D)."""
    H, T, _ = q.shape
    G = H // ctx_k.shape[0]
    k = ctx_k.repeat_interleave(G, dim=0)
    v = ctx_v.repeat_interleave(G, dim=0)
    scores = torch.einsum("htd,hnd->htn", q, k)
    return scores, v[:, None].expand(H, T, *v.shape[1:])


def test_joint_attention_equals_sdpa_over_context_and_window():
    torch.manual_seed(0)
    H, hkv, T, D, N, W = 8, 2, 3, 16, 50, 6
    q = torch.randn(H, T, D, dtype=torch.float64)
    ctx_k, ctx_v = torch.randn(hkv, N, D, dtype=torch.float64), torch.randn(hkv, N, D, dtype=torch.float64)
    win_k, win_v = torch.randn(hkv, W, D, dtype=torch.float64), torch.randn(hkv, W, D, dtype=torch.float64)
    # causal over the window: the last T window slots are the new tokens
    visible = torch.arange(W)[None, :] <= (W - T + torch.arange(T))[:, None]  # (T, W)
    scores, values = _split(q, ctx_k, ctx_v)
    ours = joint_attention(q, win_k, win_v, visible, scores, values, D**-0.5)
    full_mask = torch.cat([torch.ones(T, N, dtype=torch.bool), visible], dim=1)
    ref = _dense(q, torch.cat([ctx_k, win_k], 1), torch.cat([ctx_v, win_v], 1), full_mask)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-6, atol=1e-6)


def test_lse_merge_of_two_parts_equals_joint_softmax():
    torch.manual_seed(1)
    a, b = torch.randn(4, 30) * 3, torch.randn(4, 7) * 3
    va, vb = torch.randn(4, 30, 5), torch.randn(4, 7, 5)
    out_a, lse_a = partial_attention(a, va)
    out_b, lse_b = partial_attention(b, vb)
    merged, lse = lse_merge(out_a, lse_a, out_b, lse_b)
    p = torch.softmax(torch.cat([a, b], -1), -1)
    ref = torch.einsum("hk,hkd->hd", p, torch.cat([va, vb], 1))
    torch.testing.assert_close(merged, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(torch.cat([a, b], -1), -1))


def test_adding_two_separately_normalised_softmaxes_is_not_the_merge():
    """Guard against the seed paper's Algorithm 1 line 15 read literally."""
    torch.manual_seed(2)
    a, b = torch.randn(2, 10), torch.randn(2, 4)
    va, vb = torch.randn(2, 10, 3), torch.randn(2, 4, 3)
    out_a, lse_a = partial_attention(a, va)
    out_b, lse_b = partial_attention(b, vb)
    merged, _ = lse_merge(out_a, lse_a, out_b, lse_b)
    assert not torch.allclose(merged, out_a + out_b, atol=1e-3)


def test_empty_slots_get_no_weight():
    torch.manual_seed(3)
    H, T, D, W = 2, 1, 8, 3
    q = torch.randn(H, T, D)
    win_k, win_v = torch.randn(1, W, D), torch.randn(1, W, D)
    scores = torch.randn(H, T, 5)
    values = torch.randn(H, T, 5, D)
    scores_masked = scores.clone()
    scores_masked[..., 3:] = float("-inf")
    with_empty = joint_attention(q, win_k, win_v, None, scores_masked, values, D**-0.5)
    without = joint_attention(q, win_k, win_v, None, scores[..., :3], values[..., :3, :], D**-0.5)
    torch.testing.assert_close(with_empty, without)


def test_small_k_reproduces_dense_output_when_attention_is_concentrated():
    """When a few keys hold nearly all the mass, retrieving just those keys gives the dense output."""
    torch.manual_seed(4)
    H, hkv, D, N, W, k = 4, 2, 32, 2000, 4, 8
    q = torch.randn(H, 1, D)
    ctx_k = torch.randn(hkv, N, D) * 0.05  # background keys: near-zero logits
    ctx_v = torch.randn(hkv, N, D)
    hot = torch.randint(0, N, (hkv, k))
    G = H // hkv
    for h in range(hkv):  # plant keys aligned with the group's queries
        ctx_k[h, hot[h]] = q[h * G : (h + 1) * G, 0].mean(0) * 8.0
    win_k, win_v = torch.randn(hkv, W, D) * 0.05, torch.randn(hkv, W, D)
    dense = _dense(q, torch.cat([ctx_k, win_k], 1), torch.cat([ctx_v, win_v], 1))
    scores_all = torch.einsum("gqd,gnd->gqn", q.view(hkv, G, D), ctx_k)  # (Hkv, G, N)
    top = scores_all.topk(k, dim=-1)
    sel_values = torch.stack([ctx_v[h][top.indices[h]] for h in range(hkv)])  # (Hkv, G, k, D)
    out = joint_attention(q, win_k, win_v, None, top.values.reshape(H, 1, k), sel_values.reshape(H, 1, k, D), D**-0.5)
    rel = (out - dense).norm() / dense.norm()
    assert rel < 1e-3, f"relative error {rel:.2e}"
    # and the same budget misses when attention is spread out (the test is not vacuous)
    spread_k = torch.randn(hkv, N, D)
    dense_spread = _dense(q, torch.cat([spread_k, win_k], 1), torch.cat([ctx_v, win_v], 1))
    s = torch.einsum("gqd,gnd->gqn", q.view(hkv, G, D), spread_k).topk(k, dim=-1)
    v = torch.stack([ctx_v[h][s.indices[h]] for h in range(hkv)])
    out_spread = joint_attention(q, win_k, win_v, None, s.values.reshape(H, 1, k), v.reshape(H, 1, k, D), D**-0.5)
    assert (out_spread - dense_spread).norm() / dense_spread.norm() > 10 * rel
    assert math.isfinite(float(rel))


def _selection_for(q, ctx_k, k):
    """Exact top-k of every query head over ctx_k, as a Selection: ids/scores (Hkv, G·T, k)."""
    from topk_decode.index import Selection

    H, T, D = q.shape
    hkv = ctx_k.shape[0]
    qg = q.reshape(hkv, (H // hkv) * T, D)
    top = torch.bmm(qg, ctx_k.transpose(1, 2)).topk(k, dim=-1)
    return Selection(ids=top.indices, scores=top.values)


def test_cpu_context_part_merged_with_window_part_equals_joint_attention():
    from topk_decode.decode.context import ContextAttention
    from topk_decode.decode.merge import merge_with_context, window_attention

    torch.manual_seed(3)
    H, hkv, T, D, N, W, k = 8, 2, 3, 16, 60, 7, 12
    q = torch.randn(H, T, D)
    ctx_k, ctx_v = torch.randn(hkv, N, D), torch.randn(hkv, N, D)
    win_k, win_v = torch.randn(hkv, W, D), torch.randn(hkv, W, D)
    visible = torch.arange(W)[None, :] <= (W - T + torch.arange(T))[:, None]
    sel = _selection_for(q, ctx_k, k)
    sel.ids[0, 1, 3] = -1  # an empty slot gets no weight
    o, mz = torch.empty(H * T, D), torch.empty(H * T, 2)
    n = ContextAttention([ctx_v], D**-0.5).attend(0, sel, o, mz)
    assert n == hkv * (H // hkv) * T * k - 1
    out_w, lse_w = window_attention(q, win_k, win_v, visible, D**-0.5)
    ours = merge_with_context(out_w, lse_w, o.view(H, T, D), mz.view(H, T, 2))
    # reference: one softmax over [retrieved, window] with the retrieved values gathered explicitly
    G = H // hkv
    scores = sel.scores.masked_fill(sel.ids < 0, float("-inf")).reshape(H, T, k)
    rows = sel.ids.clamp(min=0).reshape(hkv, G * T * k)
    vals = torch.stack([ctx_v[h, rows[h]] for h in range(hkv)]).reshape(H, T, k, D)
    ref = joint_attention(q, win_k, win_v, visible, scores, vals, D**-0.5)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_query_head_that_retrieved_nothing_attends_to_the_window_alone():
    from topk_decode.decode.context import ContextAttention
    from topk_decode.decode.merge import context_part, merge_with_context, window_attention

    torch.manual_seed(4)
    H, hkv, D, N, W, k = 4, 2, 8, 30, 5, 6
    q = torch.randn(H, 1, D)
    ctx_k, ctx_v = torch.randn(hkv, N, D), torch.randn(hkv, N, D)
    win_k, win_v = torch.randn(hkv, W, D), torch.randn(hkv, W, D)
    sel = _selection_for(q, ctx_k, k)
    sel.ids[1] = -1  # KV head 1 (query heads 2, 3): nothing retrieved
    o, mz = torch.empty(H, D), torch.empty(H, 2)
    ContextAttention([ctx_v], D**-0.5).attend(0, sel, o, mz)
    out_c, lse_c = context_part(o, mz)
    assert torch.isinf(lse_c[2:]).all() and (lse_c[2:] < 0).all() and torch.equal(out_c[2:], torch.zeros(2, D))
    out_w, lse_w = window_attention(q, win_k, win_v, None, D**-0.5)
    merged = merge_with_context(out_w, lse_w, o.view(H, 1, D), mz.view(H, 1, 2))
    assert torch.isfinite(merged).all()
    torch.testing.assert_close(merged[2:], out_w[2:])


def test_bf16_context_part_stays_within_bf16_rounding_of_the_fp32_one():
    # bf16 caches: weights and the part's output are rounded to bf16 (as a flash kernel rounds P).
    from topk_decode.decode.context import ContextAttention

    torch.manual_seed(5)
    H, hkv, D, N, k = 8, 2, 64, 500, 64
    q = torch.randn(H, 1, D) * 2
    ctx_k, ctx_v = torch.randn(hkv, N, D), torch.randn(hkv, N, D)
    sel = _selection_for(q, ctx_k, k)
    exact = torch.empty(H, D), torch.empty(H, 2)
    half = torch.empty(H, D, dtype=torch.bfloat16), torch.empty(H, 2)
    ContextAttention([ctx_v.to(torch.bfloat16).float()], D**-0.5).attend(0, sel, *exact)
    ContextAttention([ctx_v.to(torch.bfloat16)], D**-0.5).attend(0, sel, *half)
    assert torch.equal(half[1], exact[1])  # m and z (the lse) are fp32 either way
    err = (half[0].float() - exact[0]).abs().max() / exact[0].abs().max()
    assert 0 < err < 2**-6


def test_a_selection_marked_full_skips_the_empty_slot_check_with_the_same_result():
    from topk_decode.decode.context import ContextAttention

    torch.manual_seed(8)
    H, hkv, D, N, k = 8, 2, 16, 200, 20
    q = torch.randn(H, 1, D)
    ctx_k, ctx_v = torch.randn(hkv, N, D), torch.randn(hkv, N, D)
    sel = _selection_for(q, ctx_k, k)
    checked = torch.empty(H, D, dtype=torch.bfloat16), torch.empty(H, 2)
    skipped = torch.empty(H, D, dtype=torch.bfloat16), torch.empty(H, 2)
    attention = ContextAttention([ctx_v.to(torch.bfloat16)], D**-0.5)
    assert attention.attend(0, sel, *checked) == H * k
    sel.no_empty_slots = True
    assert attention.attend(0, sel, *skipped) == H * k
    assert torch.equal(checked[0], skipped[0]) and torch.equal(checked[1], skipped[1])


def test_context_part_of_prompts_of_different_lengths_warns_nothing(capfd):
    # The prompt step has H·T bags, the next steps H: each shape keeps its own reused buffers (torch
    # prints a deprecation warning to stderr, from C++, when an out= tensor of another shape is resized).
    from topk_decode.decode.context import ContextAttention

    torch.manual_seed(9)
    H, hkv, D, N, k = 4, 2, 8, 50, 5
    ctx_k, ctx_v = torch.randn(hkv, N, D), torch.randn(hkv, N, D).to(torch.bfloat16)
    attention = ContextAttention([ctx_v], D**-0.5)
    for T in (7, 1, 3, 1):
        sel = _selection_for(torch.randn(H, T, D), ctx_k, k)
        o, mz = torch.empty(H * T, D, dtype=torch.bfloat16), torch.empty(H * T, 2)
        assert attention.attend(0, sel, o, mz) == H * T * k
        assert torch.isfinite(o.float()).all() and (mz[:, 1] >= 1).all()
    err = capfd.readouterr().err
    assert "resized" not in err, err


def _chunk_case(seed: int, H: int, hkv: int, T: int, W: int, D: int, capacity: int):
    """Queries of a T-token chunk and a window buffer of `capacity` slots holding W (the chunk's last)."""
    torch.manual_seed(seed)
    q = torch.randn(H, T, D) * 2
    buf_k, buf_v = torch.randn(hkv, capacity, D), torch.randn(hkv, capacity, D)
    visible = torch.arange(W)[None, :] <= (W - T + torch.arange(T))[:, None]  # bottom-right causal
    return q, buf_k[:, :W], buf_v[:, :W], visible


def test_chunk_window_part_equals_the_dense_masked_window_part():
    # the fused split path (earlier slots ⊕ the chunk's own causal block) against the one-matrix fp32 formula
    from topk_decode.decode import merge
    from topk_decode.decode.merge import chunk_window_attention, window_attention

    for H, hkv, T, W in ((8, 2, 37, 100), (4, 4, 5, 5), (6, 1, 64, 64 + 3), (8, 2, 1, 9)):
        q, k, v, visible = _chunk_case(H + T, H, hkv, T, W, 16, capacity=128)  # strided views of a buffer
        out, lse = chunk_window_attention(q, k, v, 16**-0.5)
        ref_out, ref_lse = window_attention(q, k, v, visible, 16**-0.5)
        assert out.dtype == lse.dtype == torch.float32 and out.shape == (H, T, 16) and lse.shape == (H, T)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    assert merge.FUSED_KERNELS["cpu"], "the fused CPU kernel was not taken"


def test_blocked_fallback_equals_the_fused_kernel(monkeypatch):
    # where no fused kernel runs: fp32 key blocks merged by lse (blocks smaller than the chunk here)
    from topk_decode.decode import merge

    q, k, v, visible = _chunk_case(7, 8, 2, 50, 130, 16, capacity=256)
    fused = merge.chunk_window_attention(q, k, v, 0.25)
    monkeypatch.setattr(merge, "KEY_BLOCK", 16)
    monkeypatch.setitem(merge.FUSED_KERNELS, "cpu", False)
    blocked = merge.chunk_window_attention(q, k, v, 0.25)
    ref = merge.window_attention(q, k, v, visible, 0.25)
    for ours in (fused, blocked):
        torch.testing.assert_close(ours[0], ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours[1], ref[1], rtol=1e-5, atol=1e-5)
