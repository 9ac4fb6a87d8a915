"""One decoder layer around our attention, shared by the eager step (engine.py) and the captured
one-token step (graphs.py): the layer's attention inputs, and the merge of its two attention parts
followed by the rest of the block. Both paths call these, so they compute the same math.
"""

from __future__ import annotations

import torch

from topk_decode.decode.merge import merge_with_context
from topk_decode.model.blocks import ModelShape, attention_inputs, finish_block


def start_layer(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, shape: ModelShape):
    """Layer `layer`'s attention inputs for one token, with the query also as fp32 grouped by KV head.

    Args:
        layer: model.model.layers[l]; x: (1, 1, C) residual entering it.
        cos, sin: (1, 1, D) rotary embedding at the token's position.
        shape: the model's ModelShape.
    Returns:
        q (1, H, 1, D) in the model's dtype, the same q as (Hkv, G, D) float32, k and v (1, Hkv, 1, D).
    """
    q, k, v = attention_inputs(layer, x, cos, sin, shape)
    return q, q.float().reshape(shape.n_kv_heads, shape.group_size, shape.head_dim), k, v


def finish_layer(
    layer,
    x: torch.Tensor,
    win_out: torch.Tensor,
    win_lse: torch.Tensor,
    o: torch.Tensor,
    mz: torch.Tensor,
    shape: ModelShape,
) -> torch.Tensor:
    """Merge a layer's window and context parts and finish the layer: (1, T, C) residual leaving it.

    Args:
        layer: the layer; x: (1, T, C) residual entering it.
        win_out, win_lse: (H, [T,] D), (H, [T]) float32 window part; o, mz: (H, [T,] D), (H, [T,] 2)
            context part (merge.context_part).
        shape: the model's ModelShape.
    """
    attn = merge_with_context(win_out, win_lse, o, mz)  # (H, [T,] D) fp32
    attn = attn.to(x.dtype).view(1, shape.n_heads, -1, shape.head_dim)
    return finish_block(layer, x, attn)


def layer_boundary(
    prev,
    layer,
    x: torch.Tensor,
    win_out: torch.Tensor,
    win_lse: torch.Tensor,
    o: torch.Tensor,
    mz: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    shape: ModelShape,
):
    """The critical path between two layers of a one-token step: finish layer l-1 (`prev`), then
    layer l's attention inputs.

    Every layer runs this same function with its own modules, so one `torch.compile` of it (weights
    are graph inputs, not constants) serves all layers: its ~25 small kernels (merge, residuals,
    norms, SiLU, RoPE, casts) fuse into a few, between the projections' GEMMs.

    Args:
        prev, layer: model.model.layers[l-1] and [l].
        x: (1, 1, C) residual entering layer l-1.
        win_out, win_lse, o, mz: layer l-1's two attention parts (see `finish_layer`).
        cos, sin: (1, 1, D) rotary embedding at the token's position.
        shape: the model's ModelShape.
    Returns:
        x (1, 1, C) entering layer l, then `start_layer`'s q, q32, k, v for layer l.
    """
    x = finish_layer(prev, x, win_out, win_lse, o, mz, shape)
    return (x, *start_layer(layer, x, cos, sin, shape))


def compiled_boundary():
    """`layer_boundary` under torch.compile: one graph for all layers (the modules' weights are inputs)."""
    import torch._inductor.config as inductor_config

    # keep eager's intermediate roundings to the model's dtype (HF's norms round before the weight)
    options = {"emulate_precision_casts": True} if hasattr(inductor_config, "emulate_precision_casts") else {}
    return torch.compile(layer_boundary, dynamic=False, options=options)
