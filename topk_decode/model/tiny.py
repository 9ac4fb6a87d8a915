"""Small random-weight checkpoints and byte-level BPE tokenizers, built from a config in seconds.

Used by the tests (exactness on Llama / Qwen2 / Mistral layouts), by benchmarks (named real shapes
with random weights: speed does not depend on the weights), and as the stand-in default model when
the trained demo model is absent. Random weights produce noise, never answers.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Attention sinks keep the softmax stable.",
    "Prefill runs once and writes the key value cache to disk; decode retrieves the top keys.",
    "Question: what does the report say? Answer: it says the budget covers every token.",
    "0123456789 alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi",
]


def make_tokenizer(
    out: str | os.PathLike, vocab_size: int = 512, chat_template: str | None = None, texts: list[str] | None = None
):
    """Train a byte-level BPE tokenizer (milliseconds) and save it as a HF fast tokenizer.

    Args:
        out: directory to save into.
        vocab_size: BPE vocabulary size (including the 256 byte symbols and specials).
        chat_template: optional Jinja chat template to attach.
        texts: training texts (a small built-in corpus by default).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((texts or _CORPUS) * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(out)
    return fast


# A minimal template in the usual shape: user turn, end marker, assistant header.
SIMPLE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<|user|>\n{{ m['content'] }}<|end|>\n"
    "{% else %}<|assistant|>\n{{ m['content'] }}<|end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def make_random_model(
    out: str | os.PathLike,
    family: str = "llama",
    seed: int = 0,
    tokenizer=None,
    dtype: torch.dtype = torch.float32,
    **config_overrides,
):
    """Build a random-weight checkpoint of a family from a small config and save it (with tokenizer).

    Args:
        out: directory to save into.
        family: "llama", "qwen2" or "mistral".
        seed: torch seed for the weights.
        tokenizer: a tokenizer to save beside it (its vocab size sets the model's).
        dtype: weight dtype on disk.
        config_overrides: config fields (hidden_size, num_hidden_layers, num_key_value_heads, ...).
    """
    import transformers

    cfg_name, model_name = _FAMILIES[family]
    vocab = len(tokenizer) if tokenizer is not None else 512
    cfg = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    if family == "qwen2":
        cfg["use_sliding_window"] = False
    if family == "mistral":
        cfg["sliding_window"] = None
    cfg.update(config_overrides)
    config = getattr(transformers, cfg_name)(**cfg)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(dtype).eval()
    out = Path(out)
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return model
