"""The embedded default model: the project's trained demo model when shipped, else a labelled stand-in."""

from __future__ import annotations

import os
from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).parent / "demo_model"


def default_model_dir() -> tuple[Path, bool]:
    """The default model directory, and whether it is a trained model (False: random weights, noise).

    The trained demo model ships in `topk_decode/demo_model/`. Without it, a small random-weight
    Llama is built once under ~/.cache/topk-decode/ (it prefills and decodes, but answers are noise).
    """
    if (DEMO_MODEL_DIR / "config.json").is_file():
        return DEMO_MODEL_DIR, True
    cache = Path(os.environ.get("TOPK_CACHE_HOME", Path.home() / ".cache" / "topk-decode")) / "random-demo"
    if not (cache / "config.json").is_file():
        from topk_decode.model.tiny import make_random_model, make_tokenizer

        tmp = cache.with_name(cache.name + f".tmp-{os.getpid()}")
        tok = make_tokenizer(tmp, vocab_size=1024)
        make_random_model(
            tmp,
            "llama",
            seed=0,
            tokenizer=tok,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=32768,
        )
        tmp.rename(cache) if not cache.exists() else None
    return cache, False
