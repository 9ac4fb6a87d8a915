"""Loading local Hugging Face checkpoints and running their decoder blocks piece by piece."""

import importlib

# name → submodule; imported on first use, so checking a model path (loading, gguf) does not pull in
# torch and transformers' model code.
_EXPORTS = {
    **dict.fromkeys(("ModelShape", "attention_inputs", "finish_block", "final_logits", "rope"), "blocks"),
    **dict.fromkeys(("eos_token_ids", "load_model", "load_tokenizer", "model_fingerprint"), "loading"),
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ModelShape",
    "attention_inputs",
    "finish_block",
    "final_logits",
    "rope",
    "eos_token_ids",
    "load_model",
    "load_tokenizer",
    "model_fingerprint",
]
