"""Picking the next token: greedy (the default, exact) or temperature / top-p sampling with a seeded generator,
after OpenAI's presence / frequency penalties and logit bias; optionally recording each token's log-probability."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for annotations: imported where used, so start-up does without it
    import torch

from topk_decode.errors import TopkError

PENALTY_MAX = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]
LOGIT_BIAS_MAX = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
TOP_LOGPROBS_MAX = 20  # OpenAI's most alternatives per token (top_logprobs)


@dataclass
class Sampling:
    """How `TopKDecoder.stream` picks each token.

    Args:
        temperature: 0 = greedy (argmax, exact); > 0 divides the logits before the softmax.
        top_p: nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1 = all).
        seed: seeds this sampler's own torch.Generator (None: a random seed), so one request's draws
            never depend on another's.
        presence_penalty: subtracted from the logit of every token already generated in this answer.
        frequency_penalty: subtracted from a token's logit once per time it was generated in this answer.
        logit_bias: {token id: value} added to those logits (-100 bans a token, +100 all but forces it).
        logprobs: None, or record in `picked` each token's log-probability and its `logprobs` most likely
            alternatives (the model's own distribution: before penalties, bias, temperature and top-p).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    generator: torch.Generator = field(init=False, repr=False)
    counts: dict[int, int] = field(init=False, repr=False, default_factory=dict)  # this answer's tokens
    # this answer's tokens as (id, logprob, [(alternative id, logprob), ...] most likely first), when logprobs is set
    picked: list[tuple[int, float, list[tuple[int, float]]]] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            raise TopkError(f"temperature must be a number in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise TopkError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise TopkError(f"seed must be an integer, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -PENALTY_MAX <= v <= PENALTY_MAX:
                raise TopkError(f"{name} must be a number in [-{PENALTY_MAX:g}, {PENALTY_MAX:g}], got {v!r}")
        for t, v in (self.logit_bias or {}).items():
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise TopkError(f"logit_bias keys must be token ids (integers ≥ 0), got {t!r}")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -LOGIT_BIAS_MAX <= v <= LOGIT_BIAS_MAX:
                raise TopkError(
                    f"logit_bias values must be numbers in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}], got {v!r}"
                )
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool)
            or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= TOP_LOGPROBS_MAX
        ):
            raise TopkError(f"logprobs must be an integer in [0, {TOP_LOGPROBS_MAX}], got {self.logprobs!r}")
        import torch  # after the checks: a bad option is reported without importing torch

        self.generator = torch.Generator(device="cpu")
        seed = self.seed if self.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.generator.manual_seed(seed % (2**63))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain(self) -> bool:
        """Greedy with nothing to apply or record: the decoder's own argmax gives the same tokens."""
        return (
            self.greedy
            and not self.presence_penalty
            and not self.frequency_penalty
            and not self.logit_bias
            and self.logprobs is None
        )

    def start_answer(self) -> None:
        """Forget the tokens counted and recorded so far: penalties count within one answer, as OpenAI's do."""
        self.counts.clear()
        self.picked.clear()

    def pick(self, logits: torch.Tensor) -> int:
        """The next token id.

        Args:
            logits: (V,) logits of the next token, on any device.
        """
        import torch

        scores = self.adjusted(logits)
        if self.greedy:
            tok = int(torch.argmax(scores))
        else:
            probs = torch.softmax(scores.detach().float().cpu() / self.temperature, dim=-1)  # (V,)
            if self.top_p < 1.0:
                sorted_p, order = torch.sort(probs, descending=True)
                # keep a token while the mass before it is still short of top_p (the first token always stays)
                keep = torch.cumsum(sorted_p, 0) - sorted_p < self.top_p
                probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
            tok = int(torch.multinomial(probs, 1, generator=self.generator))
        if self.logprobs is not None:
            logp = torch.log_softmax(logits.detach().float(), dim=-1)
            top = torch.topk(logp, self.logprobs) if self.logprobs else None
            alternatives = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
            self.picked.append((tok, float(logp[tok]), alternatives))
        self.counts[tok] = self.counts.get(tok, 0) + 1
        return tok

    def adjusted(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits after the penalties (on this answer's tokens so far) and the logit bias."""
        import torch

        penalize = (self.presence_penalty or self.frequency_penalty) and self.counts
        if not penalize and not self.logit_bias:
            return logits
        out = logits.detach().float().clone()
        if penalize:
            ids = torch.tensor(list(self.counts), device=out.device)
            n = torch.tensor(list(self.counts.values()), dtype=torch.float32, device=out.device)
            out[ids] -= n * self.frequency_penalty + self.presence_penalty
        if self.logit_bias:
            if max(self.logit_bias) >= out.shape[0]:
                raise TopkError(
                    f"logit_bias names token {max(self.logit_bias)}; this model's vocabulary has {out.shape[0]} tokens"
                )
            ids = torch.tensor(list(self.logit_bias), device=out.device)
            out[ids] += torch.tensor(list(self.logit_bias.values()), dtype=torch.float32, device=out.device)
        return out
