"""Fidelity metrics of top-k decoding against dense attention, and task correctness.

The metrics are plain fp32 tensor math with no model in sight, so each can be checked on
hand-computed cases (tests/test_metrics.py). The measuring side sits below them: the decoder's
observer hook (`FidelityObserver`, one layer and step at a time), the HF dense reference
(`dense_reference`) and teacher-forced top-k decoding on its tokens (`teacher_forced`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from topk_decode.index.base import exact_scores


def mass_recall(logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Share of the softmax mass of `logits` that falls on the kept positions.

    Args:
        logits: (..., S) scaled attention logits; -inf where a position is not visible.
        keep: (..., S) bool, True for positions the approximation attends to.
    Returns:
        (...,) in [0, 1]; 1.0 when every visible position is kept.
    """
    p = torch.softmax(logits.float(), dim=-1)
    return (p * keep).sum(-1)


def topk_id_recall(selected: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Fraction of the exact top-k ids that the selection contains.

    Args:
        selected: (..., K) int64 selected ids, -1 for empty slots.
        exact: (..., k) int64 exact top-k ids, -1 for padding (not counted).
    Returns:
        (...,) |selected ∩ exact| / |exact| (1.0 where exact is empty).
    """
    valid_exact = exact >= 0
    hit = (exact[..., :, None] == selected[..., None, :]) & (selected[..., None, :] >= 0)  # (..., k, K)
    found = hit.any(-1) & valid_exact
    n = valid_exact.sum(-1)
    return torch.where(n > 0, found.sum(-1).float() / n.clamp(min=1).float(), torch.ones_like(n, dtype=torch.float32))


def relative_error(approx: torch.Tensor, ref: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """‖approx − ref‖₂ / ‖ref‖₂ over the last dimension.

    Args:
        approx, ref: (..., D) vectors (e.g. attention outputs).
        eps: guards a zero reference.
    Returns:
        (...,) relative errors (0 for identical inputs).
    """
    a, r = approx.float(), ref.float()
    return (a - r).norm(dim=-1) / r.norm(dim=-1).clamp(min=eps)


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(ref) ‖ softmax(logits)) in nats, over the last dimension.

    Args:
        ref_logits: (..., V) the dense reference's logits.
        logits: (..., V) the approximation's logits.
    Returns:
        (...,) ≥ 0, 0 for identical logits.
    """
    lp = torch.log_softmax(ref_logits.float(), dim=-1)
    lq = torch.log_softmax(logits.float(), dim=-1)
    return (lp.exp() * (lp - lq)).sum(-1).clamp(min=0.0)


def greedy_agreement(ref_tokens: list[int], tokens: list[int]) -> tuple[int, int]:
    """Positions where two token sequences agree, counted over the reference's length.

    Args:
        ref_tokens: the dense reference's tokens.
        tokens: the approximation's tokens (missing positions count as disagreements).
    Returns:
        (matches, len(ref_tokens)).
    """
    matches = sum(1 for i, t in enumerate(ref_tokens) if i < len(tokens) and tokens[i] == t)
    return matches, len(ref_tokens)


def is_correct(generated: str, answer: str) -> bool:
    """The task rule: the decoded generation, stripped, starts with the answer.

    Args:
        generated: decoded generated text.
        answer: the expected answer.
    """
    return generated.strip().startswith(answer.strip())


@dataclass
class AttentionFidelity:
    """One layer and step of attention fidelity, per KV head and query: each tensor is (Hkv, Q)."""

    mass_recall: torch.Tensor
    id_recall: torch.Tensor
    output_rel_error: torch.Tensor


def attention_fidelity(
    q: torch.Tensor,
    scale: float,
    ctx_keys: torch.Tensor,
    ctx_values: torch.Tensor,
    lo: int,
    win_k: torch.Tensor,
    win_v: torch.Tensor,
    win_visible: torch.Tensor,
    selected: torch.Tensor,
    k: int,
) -> AttentionFidelity:
    """Compare the selected ∪ window attention with dense attention over searchable context ∪ window.

    The window (sinks, context tail, new tokens) is attended exactly by both, so dense mass outside
    the selected set can only be lost in the searchable range [lo, lo + M).

    Args:
        q: (Hkv, Q, D) fp32 queries grouped by KV head (Q = G·T, head-major).
        scale: softmax scale (1/sqrt(D)).
        ctx_keys, ctx_values: (Hkv, M, D) the searchable context's keys/values (positions lo..lo+M-1).
        lo: absolute position of ctx_keys[:, 0].
        win_k, win_v: (Hkv, W, D) the window's keys/values, this step's tokens included.
        win_visible: (Q, W) bool, True where query i may attend window slot j (causality).
        selected: (Hkv, Q, K) int64 absolute context ids chosen by the strategy, -1 for empty.
        k: the requested budget (exact top-k size for id recall, capped at M).
    Returns:
        per KV head and query: mass recall, exact top-k id recall, relative output error.
    """
    hkv, Q, _ = q.shape
    M = ctx_keys.shape[1]
    q = q.float()
    ctx = torch.bmm(q, ctx_keys.float().transpose(1, 2))  # (Hkv, Q, M) raw q·k
    win = torch.bmm(q, win_k.float().transpose(1, 2)) * scale  # (Hkv, Q, W)
    win = win.masked_fill(~win_visible[None], float("-inf"))
    logits = torch.cat([ctx * scale, win], dim=-1)  # (Hkv, Q, M+W)
    keep_ctx = torch.zeros((hkv, Q, M + 1), dtype=torch.bool)
    # empty slots (-1) and anything out of range land in the extra column M, which is dropped
    rel = selected - lo
    rel = torch.where((rel >= 0) & (rel < M), rel, torch.full_like(rel, M))
    keep_ctx.scatter_(2, rel, True)
    keep = torch.cat([keep_ctx[..., :M], torch.ones_like(win, dtype=torch.bool)], dim=-1)
    p = torch.softmax(logits, dim=-1)  # (Hkv, Q, M+W)
    recall = (p * keep).sum(-1)  # (Hkv, Q)
    values = torch.cat([ctx_values.float(), win_v.float()], dim=1)  # (Hkv, M+W, D)
    dense_out = torch.bmm(p, values)  # (Hkv, Q, D)
    p_sel = p * keep / recall.clamp(min=1e-30)[..., None]
    sel_out = torch.bmm(p_sel, values)
    kk = min(k, M)
    if kk > 0:
        exact = ctx.topk(kk, dim=-1).indices  # (Hkv, Q, kk)
        exact_mask = torch.zeros((hkv, Q, M), dtype=torch.bool).scatter_(2, exact, True)
        id_rec = (exact_mask & keep_ctx[..., :M]).sum(-1).float() / kk
    else:
        id_rec = torch.ones((hkv, Q))
    return AttentionFidelity(mass_recall=recall, id_recall=id_rec, output_rel_error=relative_error(sel_out, dense_out))


@dataclass
class FidelitySummary:
    """Attention fidelity of one run: means over layers, heads and decode steps."""

    mass_recall: float
    id_recall: float
    output_rel_error: float
    score_error: float  # max |returned score − exact q·k| over selected ids
    layer_mass_recall: list[float | None]  # (layers,), None where a layer was never observed
    head_mass_recall: list[list[float | None]]  # (layers, query heads)


class FidelityObserver:
    """The decoder's observer hook: measures `attention_fidelity` at every layer of every step.

    Each step counts once (its T queries are averaged first), so a long prompt step does not
    outweigh the single-token decode steps. Query head h = kv_head · G + g, as in the decoder.

    Args:
        decoder: the `TopKDecoder` whose conversation this observes.
    """

    def __init__(self, decoder) -> None:
        self.decoder = decoder
        shape = decoder.shape
        self.G = shape.group_size
        L, H = shape.n_layers, shape.n_heads
        self.sums = {name: torch.zeros((L, H), dtype=torch.float64) for name in ("mass", "ids", "err")}
        self.counts = torch.zeros(L, dtype=torch.int64)
        self.score_error = 0.0

    def __call__(self, layer: int, q: torch.Tensor, selection, conv) -> None:
        """Observer signature of `Conversation.observer`: (layer, q (Hkv, G·T, D), selection, conversation)."""
        dec, G = self.decoder, self.G
        hkv, Q, _ = q.shape
        T = Q // G
        lo, hi = dec.strategy.lo, dec.strategy.hi
        W = conv.window.length + T  # the window already holds this step's tokens
        win_k = conv.window.k[layer][:, :W].cpu()
        win_v = conv.window.v[layer][:, :W].cpu()
        w0 = conv.window.length
        visible = torch.arange(W)[None, :] <= (w0 + torch.arange(T))[:, None]  # (T, W)
        visible = visible.repeat(G, 1)  # (G·T, W), head-major
        fid = attention_fidelity(
            q,
            dec.scale,
            dec.ckv.keys[layer][:, lo:hi],
            dec.ckv.values[layer][:, lo:hi],
            lo,
            win_k,
            win_v,
            visible,
            selection.ids,
            dec.config.k_for_layer(layer),
        )
        for name, t in (("mass", fid.mass_recall), ("ids", fid.id_recall), ("err", fid.output_rel_error)):
            self.sums[name][layer] += t.view(hkv, G, T).mean(-1).reshape(-1).double()  # (H,)
        self.counts[layer] += 1
        # the decoder attends with the scores the strategy returns: check they are the exact q·k
        valid = selection.ids >= 0
        if bool(valid.any()):
            exact = exact_scores(dec.ckv.keys[layer], q, selection.ids)
            err = ((exact - selection.scores.float()).abs() * valid).max()
            self.score_error = max(self.score_error, float(err))

    def result(self) -> FidelitySummary | None:
        """Means over what was observed (None if no layer searched, e.g. nothing searchable)."""
        seen = self.counts > 0
        if not bool(seen.any()):
            return None
        per = {name: s[seen] / self.counts[seen, None] for name, s in self.sums.items()}  # (L', H)
        head = torch.full_like(self.sums["mass"], float("nan"))
        head[seen] = per["mass"]
        return FidelitySummary(
            mass_recall=float(per["mass"].mean()),
            id_recall=float(per["ids"].mean()),
            output_rel_error=float(per["err"].mean()),
            score_error=self.score_error,
            layer_mass_recall=[_num(x) for x in head.mean(-1)],
            head_mass_recall=[[_num(x) for x in row] for row in head],
        )


def _num(x: torch.Tensor) -> float | None:
    """A float for JSON: None for a layer that was never observed (NaN is not valid JSON)."""
    v = float(x)
    return None if v != v else v


@torch.inference_mode()
def dense_reference(model, ids: list[int], n_steps: int, eos_ids: set[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding with the HF model over the full KV (its own DynamicCache), as `model.generate`.

    Args:
        model: the HF causal LM.
        ids: context + prompt token ids.
        n_steps: at most this many generated tokens (stops after an eos token, which is kept).
        eos_ids: token ids that end generation.
    Returns:
        the generated tokens and the (steps, V) fp32 CPU logits each one was chosen from.
    """
    dev = next(model.parameters()).device
    out = model(input_ids=torch.tensor([ids], device=dev), use_cache=True, logits_to_keep=1)
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    for _ in range(n_steps):
        step_logits = out.logits[0, -1].float().cpu()  # (V,)
        tok = int(torch.argmax(step_logits))
        tokens.append(tok)
        logits.append(step_logits)
        if tok in eos_ids or len(tokens) == n_steps:
            break
        out = model(input_ids=torch.tensor([[tok]], device=dev), past_key_values=out.past_key_values, use_cache=True)
    return tokens, torch.stack(logits)


@dataclass
class TeacherForced:
    """Per-step comparison of top-k logits with dense ones on the dense tokens."""

    matches: list[bool]
    kl_mean: float
    kl_max: float


def teacher_forced(
    decoder,
    prompt_ids: list[int],
    dense_tokens: list[int],
    dense_logits: torch.Tensor,
    observer: Callable | None = None,
    observe_steps: int | None = None,
) -> TeacherForced:
    """Feed the prompt, then the dense tokens, through the top-k decoder; compare every step's logits.

    Args:
        decoder: the `TopKDecoder` (its k already set).
        prompt_ids: the question tokens.
        dense_tokens: the dense reference's generated tokens (fed back one by one).
        dense_logits: (steps, V) the dense logits each dense token was chosen from.
        observer: optional `Conversation.observer` (attention fidelity).
        observe_steps: observe only the first this many steps (the prompt step counts as one);
            None: every step. Attention metrics over the whole context cost more than the step itself.
    """
    conv = decoder.new_conversation()
    conv.observer = observer
    logits = decoder.forward(list(prompt_ids), conv)
    matches: list[bool] = []
    kls: list[float] = []
    for i, tok in enumerate(dense_tokens):
        lf = logits.float().cpu()
        kls.append(float(kl_divergence(dense_logits[i], lf)))
        matches.append(int(torch.argmax(lf)) == tok)
        if i + 1 < len(dense_tokens):
            if observe_steps is not None and i + 1 >= observe_steps:
                conv.observer = None
            logits = decoder.forward([tok], conv)
    return TeacherForced(matches=matches, kl_mean=sum(kls) / max(len(kls), 1), kl_max=max(kls, default=0.0))
