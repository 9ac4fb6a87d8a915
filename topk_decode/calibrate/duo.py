"""DuoAttention calibration: learn one gate per (layer, KV head) that says how much it needs the full context.

Method (Xiao et al. 2024, "DuoAttention"): freeze the model; in every layer each KV head's attention
output becomes α·full_attention + (1−α)·streaming_attention, where streaming attention sees only the
first `sink` tokens and the last `recent` tokens before each query. Train the gates α ∈ [0, 1] with
Adam (clamped to [0, 1] after each step, starting at 1) so that the mixed model's final hidden states
match the full model's on synthetic passkey prompts, plus λ·L1 on the gates to push heads towards
streaming. Heads that retrieval needs keep high gates; the result is written in DuoAttention's
`full_attention_heads.tsv` format, which the `duo` strategy reads.

Our choices (say so when comparing with the paper): the distillation loss is the elementwise mean
squared error over the question and answer positions (where the passkey has to be retrieved), and the
L1 term is λ times the *mean* gate, so that λ does not scale with the number of heads.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from topk_decode.errors import TopkError
from topk_decode.model.blocks import ModelShape, attention_inputs, finish_block, rope


@dataclass
class DuoCalibrationConfig:
    """Settings of one calibration run.

    Args:
        steps: Adam steps (one fresh passkey sample each).
        length: context length of each sample in tokens (question and answer come on top).
        sink: attention-sink tokens a streaming head keeps.
        recent: most recent tokens a streaming head keeps (including the query itself).
        l1: weight λ of the L1 penalty on the mean gate.
        lr: Adam learning rate (DuoAttention uses 0.02).
        seed: seeds the samples.
        grad_checkpoint: recompute each layer in backward (saves memory on long samples; default on CUDA).
    """

    steps: int = 200
    length: int = 2048
    sink: int = 64
    recent: int = 256
    l1: float = 0.05
    lr: float = 0.02
    seed: int = 0
    grad_checkpoint: bool | None = None

    def validate(self) -> None:
        """Raise TopkError for settings that cannot calibrate anything."""
        if self.steps <= 0:
            raise TopkError(f"--steps must be a positive integer, got {self.steps}")
        if self.sink < 0 or self.recent <= 0:
            raise TopkError("--sink must be ≥ 0 and --recent ≥ 1")
        if self.length <= self.sink + self.recent:
            raise TopkError(
                f"--length ({self.length}) must exceed --sink + --recent ({self.sink + self.recent}), "
                f"or streaming attention sees everything and there is nothing to learn"
            )
        if self.l1 < 0 or self.lr <= 0:
            raise TopkError("--l1 must be ≥ 0 and the learning rate > 0")


@dataclass
class DuoCalibrationResult:
    """What a calibration run learned and measured.

    gates: (n_layers, n_kv_heads) float32 in [0, 1].
    distill_loss: the MSE term at every step (before that step's update).
    """

    gates: torch.Tensor
    distill_loss: list[float] = field(default_factory=list)
    mean_gate: list[float] = field(default_factory=list)


def passkey_sample(tokenizer, length: int, seed: int) -> tuple[list[int], int]:
    """One synthetic passkey prompt: [bos] + context (needle at a random depth) + question + answer.

    Args:
        tokenizer: the model's tokenizer.
        length: context length in tokens.
        seed: picks the needle, its depth and the filler.
    Returns:
        token ids, and how many tokens at the end (question + answer) the loss is taken over.
    """
    from topk_decode.eval.tasks import make_instance

    rng = random.Random(seed)
    inst = make_instance("single_needle", length, rng.random(), seed, tokenizer)
    context, question, answer = inst.context, inst.question, " " + inst.answer
    enc = lambda s: tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    tail = enc(question) + enc(answer)
    return bos + enc(context) + tail, len(tail)


def streaming_mask(T: int, sink: int, recent: int, device: torch.device) -> torch.Tensor:
    """(T, T) bool: query i sees key j iff j ≤ i and (j < sink or i − j < recent) — sinks + recent window."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    return (j <= i) & ((j < sink) | (i - j < recent))


def mixed_hidden(
    model, ids: torch.Tensor, gates: torch.Tensor | None, sink: int, recent: int, grad_checkpoint: bool = False
) -> torch.Tensor:
    """Final (normed) hidden states with each head's attention = α·full + (1−α)·streaming.

    Args:
        model: the HF causal LM (frozen).
        ids: (T,) token ids on the model's device.
        gates: (n_layers, n_kv_heads) gates, or None for the plain full-attention model.
        sink, recent: the streaming heads' sinks and recent window.
        grad_checkpoint: recompute each layer during backward instead of storing its activations.
    Returns:
        (T, C) hidden states in the model's dtype.
    """
    shape = ModelShape.from_config(model.config)
    T = ids.shape[0]
    x = model.model.embed_tokens(ids[None])  # (1, T, C)
    cos, sin = rope(model, x, torch.arange(T, device=ids.device))
    mask = streaming_mask(T, sink, recent, ids.device) if gates is not None else None

    def block(layer_idx: int, x: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
        layer = model.model.layers[layer_idx]
        q, k, v = attention_inputs(layer, x, cos, sin, shape)  # (1,H,T,D), (1,Hkv,T,D)
        full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if g is None:
            return finish_block(layer, x, full)
        stream = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        a = (
            g.repeat_interleave(shape.group_size).view(1, shape.n_heads, 1, 1).to(q.dtype)
        )  # query head i → KV head i // G
        return finish_block(layer, x, a * full + (1 - a) * stream)

    for i in range(shape.n_layers):
        g = gates[i] if gates is not None else None
        if grad_checkpoint and g is not None:
            x = checkpoint(block, i, x, g, use_reentrant=False)
        else:
            x = block(i, x, g)
    return model.model.norm(x)[0]


def calibrate_duo(
    model, tokenizer, config: DuoCalibrationConfig, progress: Callable[[int, int, float, float], None] | None = None
) -> DuoCalibrationResult:
    """Learn DuoAttention gates for a model by distillation on synthetic passkey prompts.

    Args:
        model: the HF causal LM (its weights are frozen here).
        tokenizer: its tokenizer.
        config: steps, length, sink, recent, λ, learning rate, seed.
        progress: optional callback(step, steps, distill_loss, mean_gate) after every step.
    Returns:
        The gates and the per-step loss and mean gate.
    """
    config.validate()
    shape = ModelShape.from_config(model.config)
    device = next(model.parameters()).device
    model.eval().requires_grad_(False)
    use_ckpt = device.type == "cuda" if config.grad_checkpoint is None else config.grad_checkpoint
    gates = torch.nn.Parameter(torch.ones(shape.n_layers, shape.n_kv_heads, device=device))
    opt = torch.optim.Adam([gates], lr=config.lr)
    result = DuoCalibrationResult(gates=gates.detach())
    for step in range(config.steps):
        ids, n_loss = passkey_sample(tokenizer, config.length, seed=config.seed * 1_000_003 + step)
        ids_t = torch.tensor(ids, device=device)
        with torch.no_grad():
            target = mixed_hidden(model, ids_t, None, config.sink, config.recent)[-n_loss:].float()
        mixed = mixed_hidden(model, ids_t, gates, config.sink, config.recent, use_ckpt)[-n_loss:].float()
        distill = F.mse_loss(mixed, target)
        loss = distill + config.l1 * gates.abs().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            gates.clamp_(0.0, 1.0)
        result.distill_loss.append(distill.item())
        result.mean_gate.append(gates.detach().mean().item())
        if progress:
            progress(step + 1, config.steps, result.distill_loss[-1], result.mean_gate[-1])
    result.gates = gates.detach().float().cpu()
    return result


def calibrate_duo_to_file(
    model_dir: str | Path,
    out: str | Path,
    config: DuoCalibrationConfig,
    device: str | None = None,
    progress: Callable[[int, int, float, float], None] | None = None,
) -> DuoCalibrationResult:
    """Load a local checkpoint, calibrate, and write `full_attention_heads.tsv`-format gates to `out`.

    Args:
        model_dir: local Llama / Qwen2 / Mistral checkpoint directory.
        out: the TSV file to write.
        config: the calibration settings.
        device: "cuda" / "cpu" (default: CUDA when available).
        progress: optional callback(step, steps, distill_loss, mean_gate).
    """
    from topk_decode.index.duo import write_pattern
    from topk_decode.model.loading import load_model, load_tokenizer
    from topk_decode.prefill.build import pick_device

    config.validate()
    out = Path(out)
    if out.exists() and out.is_dir():
        raise TopkError(f"--out {out} is a directory; give a file path such as full_attention_heads.tsv")
    model = load_model(model_dir, pick_device(device))
    result = calibrate_duo(model, load_tokenizer(model_dir), config, progress)
    write_pattern(out, result.gates)
    return result
