"""Named real model shapes with random weights, built directly on the device (speed does not depend
on the weights), or a local checkpoint directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from topk_decode.errors import TopkError


@dataclass(frozen=True)
class BenchShape:
    """A model family and the config fields that give it a real model's shape."""

    family: str  # "llama" | "qwen2" | "mistral"
    config: dict = field(default_factory=dict)


SHAPES: dict[str, BenchShape] = {
    "llama-3-8b": BenchShape(
        "llama",
        dict(
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            hidden_size=4096,
            intermediate_size=14336,
            vocab_size=128256,
            max_position_embeddings=1 << 21,
            rope_theta=500000.0,
        ),
    ),
    "qwen2.5-7b": BenchShape(
        "qwen2",
        dict(  # Qwen2 layers carry q/k/v biases
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            hidden_size=3584,
            intermediate_size=18944,
            vocab_size=152064,
            max_position_embeddings=1 << 21,
            rope_theta=1000000.0,
            use_sliding_window=False,
        ),
    ),
    "llama-3.2-1b": BenchShape(
        "llama",
        dict(
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            hidden_size=2048,
            intermediate_size=8192,
            vocab_size=128256,
            max_position_embeddings=1 << 20,
            rope_theta=500000.0,
            tie_word_embeddings=True,
        ),
    ),
    # CI smoke shape: seconds on a CPU
    "tiny": BenchShape(
        "llama",
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            hidden_size=64,
            intermediate_size=128,
            vocab_size=512,
            max_position_embeddings=1 << 16,
        ),
    ),
}

_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}


def make_config(name: str):
    """The transformers config of a named shape.

    Args:
        name: a key of SHAPES.
    """
    import transformers

    if name not in SHAPES:
        raise TopkError(f"unknown model shape {name!r} (known: {', '.join(SHAPES)}; or pass a checkpoint directory)")
    shape = SHAPES[name]
    cfg = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)
    cfg.update(shape.config)
    return getattr(transformers, _CLASSES[shape.family][0])(**cfg)


def has_real_weights(model: str) -> bool:
    """Whether `model` names a checkpoint the user gave (a directory or a GGUF file, real weights whose tokens
    mean something) rather than a named shape built with random weights.

    Args:
        model: a SHAPES name, a checkpoint directory or a GGUF file.
    """
    from topk_decode.model.gguf import is_gguf_file

    return Path(model).is_dir() or is_gguf_file(model)


def build_model(model: str, device: torch.device, dtype: torch.dtype, layers: int | None = None):
    """A model to benchmark: a named shape with random weights, or a local checkpoint.

    Random weights are created directly on `device` in `dtype` (an 8B model in seconds; nothing is
    written to disk).

    Args:
        model: a SHAPES name, a checkpoint directory or a GGUF file.
        device: where the weights live.
        dtype: weight dtype.
        layers: build only the first `layers` decoder layers of a named shape (None: all).
    """
    from transformers import AutoModelForCausalLM

    if has_real_weights(model):
        from topk_decode.model.loading import load_model

        return load_model(model, device, dtype)
    config = make_config(model)
    if layers is not None:
        config.num_hidden_layers = min(layers, config.num_hidden_layers)
    torch.manual_seed(0)
    with torch.device(device):
        m = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return m.eval()
