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


def window_attention(
    q: torch.Tensor, win_k: torch.Tensor, win_v: torch.Tensor, win_visible: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
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
            res = torch.ops.aten._scaled_dot_product_flash_attention(
                q[None], win_k[None], win_v[None], 0.0, False, False, scale=scale
            )
            return res[0][0].float(), res[1][0]
        except RuntimeError:  # an older torch without GQA in its flash kernel: the fp32 path below
            _FLASH_OK = False
    G = H // hkv
    qf = q.float().reshape(hkv, G * T, D)  # (Hkv, G·T, D)
    b = torch.bmm(qf, win_k.float().transpose(1, 2)).view(H, T, W) * scale  # (H, T, W)
    if win_visible is not None:
        b = b.masked_fill(~win_visible, float("-inf"))
    lse = torch.logsumexp(b, dim=-1)  # (H, T)
    p = torch.exp(b - lse[..., None])
    out = torch.bmm(p.reshape(hkv, G * T, W), win_v.float()).view(H, T, D)
    return out, lse


# Devices whose fused kernels work here (one that raises once is not tried again).
FUSED_KERNELS = {"cpu": True, "cuda": True}
# Keys per block of `blocked_attention`, the fallback where no fused kernel runs: bounds its fp32
# scores to (heads, queries, block).
KEY_BLOCK = 1024


def fused_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of (B, H, T, D) queries over (B, H, S, D) keys/values (same heads) with its log-sum-exp,
    through torch's fused kernels: memory linear in T and S, never a (T, S) score matrix.

    CPU: the flash kernel for CPU (fp32 accumulation; fp32 inputs stay fp32 throughout). CUDA: flash
    for fp16/bf16, memory-efficient attention otherwise. A build without them: `blocked_attention`.
    `causal` masks top-left aligned (query t sees keys ≤ t), so it is meant for square blocks. S ≥ 1.

    Returns:
        out (B, H, T, D) float32 and lse (B, H, T) float32 of the scaled scores.
    """
    dev = q.device.type
    if FUSED_KERNELS.get(dev, False):
        try:
            if dev == "cpu":
                out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
            elif q.dtype in (torch.float16, torch.bfloat16):
                out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[
                    :2
                ]
            else:
                out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                    q, k, v, None, True, 0.0, causal, scale=scale
                )[:2]
            return out.float(), lse[..., : q.shape[2]].float()  # (efficient pads lse's T to 32)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:  # a build or head size without the kernel: the blocked fp32 path from now on
            FUSED_KERNELS[dev] = False
    return blocked_attention(q, k, v, causal, scale)


def blocked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_attention` in fp32 over blocks of `KEY_BLOCK` keys, the blocks merged by their log-sum-exps."""
    B, H, T, D = q.shape
    S = k.shape[2]
    q3, k3, v3 = q.reshape(B * H, T, D), k.reshape(B * H, S, D), v.reshape(B * H, S, D)
    out = lse = None
    for s in range(0, S, KEY_BLOCK):
        e = min(s + KEY_BLOCK, S)
        t0 = min(s, T) if causal else 0  # causal: queries before s see nothing in this block
        if t0 >= T:
            break
        visible = None
        if causal:  # key j visible to query t iff j <= t
            visible = torch.arange(s, e, device=q.device)[None, :] <= torch.arange(t0, T, device=q.device)[:, None]
        o_b, l_b = window_attention(q3[:, t0:], k3[:, s:e], v3[:, s:e], visible, scale)
        if out is None:  # s = 0: every query sees key 0
            out, lse = o_b, l_b
        else:
            out[:, t0:], lse[:, t0:] = lse_merge(out[:, t0:], lse[:, t0:], o_b, l_b)
    return out.reshape(B, H, T, D), lse.reshape(B, H, T)


def chunk_window_attention(
    q: torch.Tensor, win_k: torch.Tensor, win_v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The window part of a chunk of T tokens that are the window's last T slots, causal, with its lse.

    Query t sees every earlier slot and the chunk's slots up to its own (a bottom-right causal mask).
    Split as prefill splits a chunk (prefill/layerwise.py): the W − T earlier slots, seen by every
    query, with the G query heads of a KV head folded into one batch entry of G·T queries; and the
    chunk's own square causal block, K/V repeated per query head (T slots only). Each runs through
    `fused_attention`; the two parts merge exactly by their log-sum-exps. Time and memory grow with
    T·W, never a (H, T, W) score matrix. One token: `window_attention`.

    Args:
        q: (H, T, D) the chunk's queries (post-RoPE).
        win_k, win_v: (Hkv, W, D) the window through the chunk (its T keys last, W ≥ T).
        scale: softmax scale.
    Returns:
        out (H, T, D) float32 and lse (H, T) float32 of the scaled scores.
    """
    H, T, D = q.shape
    hkv, W, _ = win_k.shape
    if T == 1:
        return window_attention(q, win_k, win_v, None, scale)
    G = H // hkv
    W0 = W - T
    own_k = win_k[:, W0:].repeat_interleave(G, dim=0)[None]  # (1, H, T, D)
    own_v = win_v[:, W0:].repeat_interleave(G, dim=0)[None]
    out, lse = fused_attention(q[None].contiguous(), own_k, own_v, True, scale)
    out, lse = out[0], lse[0]  # (H, T, D), (H, T)
    if W0 == 0:
        return out, lse
    qg = q.reshape(hkv, G * T, D)[None]  # (1, Hkv, G·T, D)
    out_p, lse_p = fused_attention(qg, win_k[None, :, :W0], win_v[None, :, :W0], False, scale)
    return lse_merge(out_p.reshape(H, T, D), lse_p.reshape(H, T), out, lse)


_EFFICIENT_OK = True


def fixed_window_attention(
    q: torch.Tensor, win_k: torch.Tensor, win_v: torch.Tensor, bias: torch.Tensor, visible: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
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
                q.view(hkv, 1, G, D),
                win_k.view(hkv, 1, C, D),
                win_v.view(hkv, 1, C, D),
                bias.expand(hkv, 1, G, C),
                True,
                scale=scale,
            )[:2]  # (Hkv,1,G,D), (Hkv,1,≥G)
            return out.float().view(H, 1, D), lse[..., :G].reshape(H, 1)
        except RuntimeError:  # a build without this kernel: the fp32 path
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
