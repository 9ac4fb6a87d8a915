"""The exact merge of retrieved context tokens with the GPU window: one softmax over their union.

For a query head with scale s = 1/sqrt(d): context part A (raw scores a_i = q·k_i, values va_i) and
window part B (b_j = s·q·k_j, values vb_j, causally masked). We take ONE softmax over [s·a, b] in
fp32 — never two separately normalised softmaxes added together. The parts are computed in different
places (window on the device, context on the CPU), so each comes with its log-sum-exp and `lse_merge`
combines them: exactly the one softmax over the union, because the two token sets are disjoint
(docs/DESIGN.md, "The merge"). The one-pass reference `joint_attention` lives in tests/test_merge.py.
"""

from __future__ import annotations

import torch


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


_FLASH_OK = True


def window_attention(q: torch.Tensor, win_k: torch.Tensor, win_v: torch.Tensor, win_visible: torch.Tensor | None,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The window part of attention, normalised within the window, with its log-sum-exp.

    On CUDA in fp16/bf16 with no mask (a one-token step sees the whole window) this is one flash-kernel
    call on the unexpanded KV heads; otherwise an fp32 computation.

    Args:
        q: (H, T, D) queries (post-RoPE).
        win_k, win_v: (Hkv, W, D) window keys/values.
        win_visible: (T, W) bool causal visibility, or None (all visible).
        scale: softmax scale.
    Returns:
        out (H, T, D) float32 and lse (H, T) float32 of the scaled scores.
    """
    global _FLASH_OK
    H, T, D = q.shape
    hkv, W, _ = win_k.shape
    if _FLASH_OK and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and win_visible is None:
        try:
            res = torch.ops.aten._scaled_dot_product_flash_attention(q[None], win_k[None], win_v[None], 0.0,
                                                                     False, False, scale=scale)
            return res[0][0].float(), res[1][0]
        except RuntimeError:   # an older torch without GQA in its flash kernel: the fp32 path below
            _FLASH_OK = False
    G = H // hkv
    qf = q.float().reshape(hkv, G * T, D)                                    # (Hkv, G·T, D)
    b = torch.bmm(qf, win_k.float().transpose(1, 2)).view(H, T, W) * scale   # (H, T, W)
    if win_visible is not None:
        b = b.masked_fill(~win_visible, float("-inf"))
    lse = torch.logsumexp(b, dim=-1)                                         # (H, T)
    p = torch.exp(b - lse[..., None])
    out = torch.bmm(p.reshape(hkv, G * T, W), win_v.float()).view(H, T, D)
    return out, lse


_EFFICIENT_OK = True


def fixed_window_attention(q: torch.Tensor, win_k: torch.Tensor, win_v: torch.Tensor, bias: torch.Tensor,
                           visible: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The window part of one token's attention over fixed-capacity buffers with a visibility mask.

    Used inside the CUDA-graph segments (graphs.py), whose tensors cannot change shape as the window
    grows: every slot is computed and those past the window's length are masked out (they hold
    finite stale or zero values, so their zero weights stay zero). On CUDA in fp16/bf16 this is one
    memory-efficient attention kernel with an additive mask, each KV head a batch entry whose G query
    heads are its queries; otherwise the fp32 path of `window_attention`.

    Args:
        q: (H, 1, D) one token's queries (post-RoPE).
        win_k, win_v: (Hkv, C, D) window buffers of capacity C (a multiple of 16).
        bias: (1, 1, 1, C) in q's dtype: 0 for visible slots, −inf for the rest.
        visible: (1, C) bool, the same mask.
        scale: softmax scale.
    Returns:
        out (H, 1, D) float32 and lse (H, 1) float32 of the scaled scores.
    """
    global _EFFICIENT_OK
    H, T, D = q.shape
    hkv, C, _ = win_k.shape
    G = H // hkv
    if _EFFICIENT_OK and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and T == 1:
        try:
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                q.view(hkv, 1, G, D), win_k.view(hkv, 1, C, D), win_v.view(hkv, 1, C, D),
                bias.expand(hkv, 1, G, C), True, scale=scale)[:2]              # (Hkv,1,G,D), (Hkv,1,≥G)
            return out.float().view(H, 1, D), lse[..., :G].reshape(H, 1)
        except RuntimeError:   # a build without this kernel: the fp32 path
            _EFFICIENT_OK = False
    return window_attention(q, win_k, win_v, visible, scale)


def context_part(o: torch.Tensor, mz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Finish a context part sent as o and (m, z) (`ContextAttention.attend`): out_c = o / z, lse_c = m + log z.

    Args:
        o: (..., D) in the values' dtype; mz: (..., 2) float32. A query that retrieved nothing has z = 0:
            output 0 and lse −inf.
    Returns:
        out_c (..., D) and lse_c (...), float32.
    """
    z = mz[..., 1]
    return o.float() / z.clamp(min=torch.finfo(torch.float32).tiny)[..., None], mz[..., 0] + torch.log(z)


def merge_with_context(out_w: torch.Tensor, lse_w: torch.Tensor, o: torch.Tensor, mz: torch.Tensor) -> torch.Tensor:
    """Window part ⊕ context part (from `ContextAttention.attend`), as one softmax over their union.

    Args:
        out_w: (..., D) float32 window output; lse_w: (...) its log-sum-exp.
        o, mz: the context part (see `context_part`).
    Returns:
        (..., D) float32.
    """
    out_c, lse_c = context_part(o, mz)
    return lse_merge(out_w, lse_w, out_c, lse_c)[0]
