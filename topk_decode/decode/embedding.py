"""The input embedding in CPU RAM: a decode step looks up one row, so its table need not hold GPU memory.

Llama-3-8B's input embedding is 1 GiB of bf16 (128K vocabulary × 4096), Qwen2.5-7B's 1 GiB too: under a
16 GiB budget that is the memory routed's routing tables need to run on the GPU for every layer at 128K
(index/routed/device.py; docs/BENCHMARKS.md run 14). A one-token step copies its row
(8 KiB) to a device buffer before the step's graphs run (`stage`); other forwards look rows up on the
CPU and copy them over (`forward`). Only untied embeddings move: a tied table is also the LM head,
which the GPU reads in full every step.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from topk_decode.errors import TopkError


class HostEmbedding(nn.Module):
    """Stands in for `model.model.embed_tokens` while the table lives in CPU RAM.

    Args:
        original: the model's nn.Embedding, already moved to the CPU (kept for `restore`, not registered
            as a submodule: its weight is not a GPU parameter of the model any more).
        device: where the looked-up rows go (the decode device).
    """

    def __init__(self, original: nn.Embedding, device: torch.device) -> None:
        super().__init__()
        object.__setattr__(self, "original", original)
        self.device = device

    @property
    def weight(self) -> torch.Tensor:
        """The (V, C) table, on the CPU (what the prefill reads to find where to look rows up)."""
        return self.original.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids on any device → (B, T, C) rows on the decode device."""
        return F.embedding(ids.cpu(), self.original.weight).to(self.device)

    def stage(self, token: int, out: torch.Tensor) -> None:
        """Copy one token's row into `out` (1, 1, C) on the decode device, in stream order."""
        out.view(-1).copy_(self.original.weight[token], non_blocking=True)


def tied(model) -> bool:
    """Whether the input embedding is also the LM head (the same storage)."""
    head = model.get_output_embeddings()
    emb = model.model.embed_tokens
    return head is not None and head.weight.data_ptr() == emb.weight.data_ptr()


def move_embedding_to_host(model, device: torch.device) -> HostEmbedding:
    """Put the model's input embedding table in CPU RAM, a `HostEmbedding` in its place; `restore` undoes it.

    Args:
        model: an HF causal LM whose `model.model.embed_tokens` is an nn.Embedding on `device`.
        device: the decode device.
    """
    emb = model.model.embed_tokens
    if isinstance(emb, HostEmbedding):
        return emb
    if tied(model):
        raise TopkError("host_embedding: this model's input embedding is also its LM head (tied); it stays on the GPU")
    emb.to("cpu")
    host = HostEmbedding(emb, device)
    model.model.embed_tokens = host
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return host


def restore(model, host: HostEmbedding) -> bool:
    """Undo `move_embedding_to_host`: the original embedding back in the model, on the decode device.

    Returns False, leaving the table in CPU RAM (the model still works), where the device has no room for it.
    """
    if model.model.embed_tokens is not host:
        return True
    try:
        host.original.to(host.device)
    except torch.OutOfMemoryError:
        host.original.to("cpu")
        return False
    model.model.embed_tokens = host.original
    return True
