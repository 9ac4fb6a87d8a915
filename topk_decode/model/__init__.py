"""Loading local Hugging Face checkpoints and running their decoder blocks piece by piece."""

from topk_decode.model.blocks import ModelShape, attention_inputs, finish_block, final_logits, rope
from topk_decode.model.loading import eos_token_ids, load_model, load_tokenizer, model_fingerprint

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
