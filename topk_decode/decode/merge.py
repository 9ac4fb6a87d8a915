"""The exact merge of retrieved context tokens with the GPU window: one softmax over their union.

For a query head with scale s = 1/sqrt(d): context part A (raw scores a_i = q·k_i, values va_i) and
window part B (b_j = s·q·k_j, values vb_j, causally masked). We take ONE softmax over [s·a, b] in
fp32 — never two separately normalised softmaxes added together. `partial_attention` + `lse_merge`
is the equivalent two-pass form (used when the parts are computed in different places).
"""

from __future__ import annotations

import torch


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
    qf = q.float().reshape(hkv, G * T, D)                                    # (Hkv, G·T, D)
    b = torch.bmm(qf, win_k.float().transpose(1, 2)).view(H, T, W) * scale   # (H, T, W)
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


def lse_merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two disjoint parts' partial attentions into the attention over their union.

    Args:
        out_a, out_b: (..., D) per-part outputs; lse_a, lse_b: (...,) per-part log-sum-exps.
    Returns:
        merged output (..., D) and merged lse (...,).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a * torch.exp(lse_a - lse)[..., None] + out_b * torch.exp(lse_b - lse)[..., None], lse
