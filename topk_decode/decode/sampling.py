"""Picking the next token: greedy (the default, exact) or temperature / top-p sampling with a seeded generator."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for annotations: imported where used, so start-up does without it
    import torch

from topk_decode.errors import TopkError


@dataclass
class Sampling:
    """How `TopKDecoder.stream` picks each token.

    Args:
        temperature: 0 = greedy (argmax, exact); > 0 divides the logits before the softmax.
        top_p: nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1 = all).
        seed: seeds this sampler's own torch.Generator (None: a random seed), so one request's draws
            never depend on another's.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    generator: torch.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            raise TopkError(f"temperature must be a number in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise TopkError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise TopkError(f"seed must be an integer, got {self.seed!r}")
        import torch  # after the checks: a bad option is reported without importing torch

        self.generator = torch.Generator(device="cpu")
        seed = self.seed if self.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.generator.manual_seed(seed % (2 ** 63))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def pick(self, logits: torch.Tensor) -> int:
        """The next token id.

        Args:
            logits: (V,) logits of the next token, on any device.
        """
        import torch

        if self.greedy:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.detach().float().cpu() / self.temperature, dim=-1)   # (V,)
        if self.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            # keep a token while the mass before it is still short of top_p (the first token always stays)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < self.top_p
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=self.generator))
