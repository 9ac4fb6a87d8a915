"""Offline loading of local Llama / Qwen2 / Mistral checkpoints (directories or GGUF files), and the
fingerprint a cache records."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for annotations: imported where used, so start-up does without it
    import torch

from topk_decode.errors import TopkError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
# Config fields that do not change the math of the model (and so must not change its fingerprint).
_FINGERPRINT_IGNORED = {
    "_name_or_path",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "architectures",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
}
_SAMPLE_BYTES = 1 << 20


def resolve_model_path(path: str | os.PathLike) -> Path:
    """The checkpoint directory behind a `--model` path: the path itself, or for a GGUF file its
    converted bf16 directory in the user cache (converted on first use; see `topk_decode.model.gguf`).

    Args:
        path: a checkpoint directory or a GGUF file.
    """
    from topk_decode.model.gguf import converted_dir, is_gguf_file

    path = Path(path)
    return converted_dir(path) if is_gguf_file(path) else path


def _check_model_dir(path: Path) -> dict:
    """Read config.json of a checkpoint directory; raise TopkError if it is not a supported model."""
    if not path.exists():
        what = "GGUF file" if path.suffix.lower() == ".gguf" else "model directory"
        raise TopkError(f"{what} not found: {path}")
    if not path.is_dir():
        raise TopkError(f"model path is neither a directory nor a GGUF file: {path}")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise TopkError(f"not a Hugging Face checkpoint (no config.json): {path}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TopkError(f"unreadable config.json in {path}: {e}") from None
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise TopkError(
            f"unsupported model type {model_type!r} in {path} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise TopkError(f"no weights (*.safetensors or *.bin) in model directory {path}")
    return cfg


def check_model_path(path: str | os.PathLike) -> None:
    """Raise TopkError unless `path` is a GGUF file with a readable header or a supported checkpoint
    directory: the cheap checks `--model` gets before torch and the model load (nothing is converted)."""
    from topk_decode.model.gguf import inspect_gguf, is_gguf_file

    path = Path(path)
    if is_gguf_file(path):
        inspect_gguf(path)
    else:
        _check_model_dir(path)


# --dtype names → torch dtype attribute names (torch is imported only once a name checks out)
DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float32": "float32",
}


def parse_dtype(name: str | None) -> torch.dtype | None:
    """'bf16' / 'fp16' / 'fp32' (or None for the device default) → torch dtype."""
    if name is None:
        return None
    if name not in DTYPES:
        raise TopkError(f"unknown dtype {name!r} (use bf16, fp16 or fp32)")
    import torch

    return getattr(torch, DTYPES[name])


def model_fingerprint(path: str | os.PathLike) -> str:
    """A short hash of a checkpoint: its math-relevant config plus samples of every weight file.

    Two checkpoints with the same config but different weights (e.g. two random inits) differ here,
    because the first and last MiB of each weight file are hashed along with the file sizes.

    A GGUF file's fingerprint is its sha256 (first 16 hex digits), and so is that of the directory it
    was converted into: a cache built with either opens with the other.

    Args:
        path: the checkpoint directory or GGUF file.
    """
    from topk_decode.model.gguf import converted_source, gguf_fingerprint, is_gguf_file

    path = Path(path)
    if is_gguf_file(path):
        return gguf_fingerprint(path)
    cfg = _check_model_dir(path)
    source = converted_source(path)
    if source is not None and len(source.get("sha256", "")) == 64:
        return source["sha256"][:16]
    h = hashlib.sha256()
    relevant = {k: v for k, v in sorted(cfg.items()) if k not in _FINGERPRINT_IGNORED}
    h.update(json.dumps(relevant, sort_keys=True).encode())
    for f in sorted(list(path.glob("*.safetensors")) + list(path.glob("*.bin"))):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(_SAMPLE_BYTES))
            if size > 2 * _SAMPLE_BYTES:
                fh.seek(size - _SAMPLE_BYTES)
                h.update(fh.read(_SAMPLE_BYTES))
    return h.hexdigest()[:16]


def _quiet_transformers() -> None:
    """Our own progress bars and errors speak to the user; transformers' loading bars would be noise."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_model(path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype | None = None):
    """Load a causal LM from a local checkpoint directory, offline, in eval mode.

    Args:
        path: the checkpoint directory (config.json + safetensors), or a GGUF file.
        device: where the weights go.
        dtype: weight dtype; default bf16 on CUDA and fp32 on CPU (CPU bf16 matmuls are slow).
    """
    import torch
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    path = resolve_model_path(path)
    _check_model_dir(path)
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except Exception as e:  # transformers raises many types for broken checkpoints
        raise TopkError(f"could not load model from {path}: {str(e).splitlines()[0]}") from None
    return model.to(device).eval()


def load_config(path: str | os.PathLike):
    """The transformers config of a checkpoint directory or GGUF file, offline (no weights are read).

    Args:
        path: the checkpoint directory, or a GGUF file.
    """
    from transformers import AutoConfig

    _quiet_transformers()
    path = resolve_model_path(path)
    _check_model_dir(path)
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many types for broken configs
        raise TopkError(f"could not read the model config in {path}: {str(e).splitlines()[0]}") from None


def load_tokenizer(path: str | os.PathLike):
    """Load the tokenizer saved beside a checkpoint, offline.

    Args:
        path: the checkpoint directory, or a GGUF file.
    """
    from transformers import AutoTokenizer

    _quiet_transformers()  # e.g. its "sequence length is longer than the maximum" line: we say that ourselves
    path = resolve_model_path(path)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise TopkError(f"could not load tokenizer from {path}: {str(e).splitlines()[0]}") from None


def eos_token_ids(model, tokenizer) -> set[int]:
    """Every token id that ends a turn: the generation config's eos ids and the tokenizer's."""
    ids: set[int] = set()
    for src in (getattr(model.generation_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(int(i) for i in src)
    return ids
