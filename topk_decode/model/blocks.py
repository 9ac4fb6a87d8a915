"""A decoder block of a Llama-family HF model, split at the attention so that we can own the attention.

Llama, Qwen2 and Mistral share one block layout (pre-norm, q/k/v/o projections, RoPE, gated MLP);
we call the checkpoint's own modules for everything except the attention itself, so the numerics
of the projections, norms and MLP are exactly those of transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


@dataclass(frozen=True)
class ModelShape:
    """The attention geometry of a model."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_positions: int
    model_type: str
    sliding_window: int | None = None

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA group size G)."""
        return self.n_heads // self.n_kv_heads

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """Read the shape from a transformers config.

        Args:
            config: a LlamaConfig / Qwen2Config / MistralConfig.
        """
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        sliding = getattr(config, "sliding_window", None)
        if getattr(config, "model_type", "") == "qwen2" and not getattr(config, "use_sliding_window", False):
            sliding = None
        return cls(
            n_layers=config.num_hidden_layers,
            n_heads=config.num_attention_heads,
            n_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            max_positions=config.max_position_embeddings,
            model_type=config.model_type,
            sliding_window=sliding,
        )


def rope(model, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of the model's rotary embedding at absolute positions.

    Args:
        model: the HF causal LM.
        x: any tensor with the compute dtype and device.
        positions: (T,) int64 absolute positions.
    Returns:
        cos, sin, each (1, T, D).
    """
    return model.model.rotary_emb(x, positions[None, :])


def attention_inputs(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, shape: ModelShape):
    """Norm, project and rotate: the part of a block before attention.

    Args:
        layer: model.model.layers[i].
        x: (1, T, C) residual stream.
        cos, sin: (1, T, D) from `rope`.
        shape: the model's ModelShape.
    Returns:
        q (1, H, T, D) and k, v (1, Hkv, T, D); q and k post-RoPE.
    """
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    T = x.shape[1]
    q = attn.q_proj(h).view(1, T, shape.n_heads, shape.head_dim).transpose(1, 2)
    k = attn.k_proj(h).view(1, T, shape.n_kv_heads, shape.head_dim).transpose(1, 2)
    v = attn.v_proj(h).view(1, T, shape.n_kv_heads, shape.head_dim).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v


def finish_block(layer, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    """Output projection, residual, post-attention norm, MLP, residual.

    Args:
        layer: model.model.layers[i].
        x: (1, T, C) residual stream entering the block.
        attn_out: (1, H, T, D) attention output.
    Returns:
        (1, T, C) residual stream leaving the block.
    """
    T = x.shape[1]
    a = attn_out.transpose(1, 2).reshape(1, T, -1)
    x = x + layer.self_attn.o_proj(a)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def final_logits(model, x: torch.Tensor) -> torch.Tensor:
    """Final norm and LM head.

    Args:
        model: the HF causal LM.
        x: (1, T, C) residual stream after the last block.
    Returns:
        (T, V) logits in fp32.
    """
    return model.lm_head(model.model.norm(x))[0].float()
