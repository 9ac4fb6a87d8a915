"""Never emit garbage silently: a decode step whose logits are not finite is recomputed on the exact path, or fails.

On the CPU, `graphs=True` runs the one-token step's segments eagerly (graphs.py); poisoning their logits for one
step stands for a bug in the captured step on a GPU (issue 50).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from topk_decode.config import DecodeConfig
from topk_decode.decode import engine
from topk_decode.decode.engine import StepRequest, StepStats, TopKDecoder, forward_batch
from topk_decode.decode.graphs import StepSegments
from topk_decode.errors import NonFiniteLogits, TopkError, TopkWarning
from topk_decode.model.loading import load_model
from topk_decode.store.cache_dir import open_cache

PROMPT = [5, 6, 7]
N = 6


@pytest.fixture(scope="module")
def model_and_cache(built_cache):
    cache, model_dir = built_cache
    return load_model(model_dir, "cpu"), open_cache(cache)


def new_decoder(model_and_cache, **kw) -> TopKDecoder:
    model, ckv = model_and_cache
    return TopKDecoder(model, ckv, DecodeConfig(k=8, strategy_options={"backend": "torch"}), **kw)


def poison_last_segment(monkeypatch, steps: set[int]) -> list[int]:
    """NaN logits, and NaN keys and values in the slot the step wrote, from the one-token step's last segment on
    the given calls (counted from 0); returns the count of calls."""
    calls = [0]
    last = StepSegments._last

    def bad_last(self) -> None:
        last(self)
        if calls[0] in steps:
            self.logits = torch.full_like(self.logits, float("nan"))
            for t in self.win_k + self.win_v:
                t.index_fill_(1, self.win_len, float("nan"))
        calls[0] += 1

    monkeypatch.setattr(StepSegments, "_last", bad_last)
    return calls


def snapshot(conv) -> tuple:
    win = conv.window
    return win.length, win.next_position, list(conv.pending), [t[:, : win.length].clone() for t in win.k + win.v]


def assert_same(conv, before: tuple) -> None:
    length, position, pending, rows = before
    win = conv.window
    assert (win.length, win.next_position, conv.pending) == (length, position, pending)
    assert all(torch.equal(t[:, :length], r) for t, r in zip(win.k + win.v, rows))
    assert all(bool(torch.isfinite(t).all()) for t in win.k + win.v)  # slots past the length stay finite too


def test_a_non_finite_one_token_step_is_recomputed_on_the_exact_path_with_one_warning(model_and_cache, monkeypatch):
    dec = new_decoder(model_and_cache, graphs=True)
    conv = dec.new_conversation()
    ref = dec.generate(conv, PROMPT, N)
    ref_length = conv.window.length
    assert conv.stats.recomputed == 0 and conv.stats.summary()["recomputed"] == 0

    calls = poison_last_segment(monkeypatch, {1, 3})  # two of the one-token steps give NaN
    dec = new_decoder(model_and_cache, graphs=True)
    conv = dec.new_conversation()
    with pytest.warns(TopkWarning, match="not finite.*recomputed.*bug.*flat") as caught:
        got = dec.generate(conv, PROMPT, N)
    assert got == ref  # the recomputed steps gave the exact path's answers
    assert calls[0] == N - 1
    assert conv.stats.recomputed == 2 and conv.stats.summary()["recomputed"] == 2
    assert sum(issubclass(w.category, TopkWarning) and "not finite" in str(w.message) for w in caught) == 1
    assert conv.stats.steps == N and conv.stats.tokens == len(PROMPT) + N - 1
    assert conv.window.length == ref_length and conv.window.host is dec.segments  # still resident in the step


def nan_keys_and_values(monkeypatch) -> None:
    """The exact path's keys and values all NaN (a broken model): its logits are NaN too."""
    inputs = engine.attention_inputs

    def bad_inputs(*args, **kw):
        q, k, v = inputs(*args, **kw)
        return q, torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))

    monkeypatch.setattr(engine, "attention_inputs", bad_inputs)


def test_non_finite_logits_on_the_exact_path_too_raise_and_leave_the_conversation_as_it_was(
    model_and_cache, monkeypatch
):
    dec = new_decoder(model_and_cache, graphs=True)
    conv = dec.new_conversation()
    tok = int(dec.forward(PROMPT, conv).argmax())
    tok = int(dec.forward([tok], conv).argmax())  # the window is resident in the step's buffers now
    before = snapshot(conv)
    poison_last_segment(monkeypatch, {0})
    nan_keys_and_values(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TopkWarning)
        with pytest.raises(NonFiniteLogits, match="not finite.*even on the exact path.*broken"):
            dec.forward([tok], conv)
    assert_same(conv, before)  # the NaN keys and values the step wrote are gone
    assert conv.stats.recomputed == 0
    assert issubclass(NonFiniteLogits, TopkError)


def test_non_finite_prompt_logits_raise_and_leave_the_conversation_as_it_was(model_and_cache, monkeypatch):
    dec = new_decoder(model_and_cache, graphs=True)  # a prompt runs on the exact path, the next token the segments
    conv, ref = dec.new_conversation(), dec.new_conversation()
    tok = int(dec.forward(PROMPT, conv).argmax())
    dec.forward(PROMPT, ref)
    want = dec.forward([tok], ref)
    conv.pending = [tok]
    before = snapshot(conv)
    with monkeypatch.context() as mp:
        nan_keys_and_values(mp)
        with pytest.raises(TopkError, match="not finite.*on the exact path"):
            dec.forward([9, 10, 11], conv)
    assert_same(conv, before)
    assert torch.equal(dec.forward([], conv), want)  # and it goes on as if the prompt had never been


def test_a_non_finite_row_of_a_batched_step_is_recomputed_alone(model_and_cache, monkeypatch):
    dec = new_decoder(model_and_cache)
    convs = [dec.new_conversation() for _ in range(3)]
    toks = [int(dec.forward(p, c).argmax()) for c, p in zip(convs, ([5, 6, 7], [9, 10], [20]))]
    alone = [dec.new_conversation() for _ in range(3)]
    for c, p in zip(alone, ([5, 6, 7], [9, 10], [20])):
        dec.forward(p, c)
    want = [dec.forward([t], c) for c, t in zip(alone, toks)]

    final = engine.final_logits

    def nan_row(model, x):
        out = final(model, x)
        if out.shape[0] == 3:  # the batched step: its second row broken
            out[1] = float("nan")
        return out

    monkeypatch.setattr(engine, "final_logits", nan_row)
    reqs = [StepRequest(dec, c, [t]) for c, t in zip(convs, toks)]
    with pytest.warns(TopkWarning, match="batched decode step's logits were not finite"):
        forward_batch(reqs)
    assert all(r.error is None for r in reqs)
    for r, w, c, a in zip(reqs, want, convs, alone):
        torch.testing.assert_close(r.logits, w, rtol=1e-4, atol=1e-4)
        assert c.window.length == a.window.length and c.stats.steps == a.stats.steps
    assert [c.stats.recomputed for c in convs] == [0, 1, 0]


def test_the_server_metrics_count_recomputed_steps():
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from topk_decode.serve.metrics import Metrics

    m = Metrics()
    m.decoded("demo", 3, 4, 0.1, 0.2, StepStats(steps=5, tokens=7, recomputed=2))
    m.decoded("demo", 3, 4, 0.1, 0.2, StepStats(steps=5, tokens=7, recomputed=1))
    samples = {
        (s.name, tuple(s.labels.items())): s.value
        for f in text_string_to_metric_families(m.render().decode())
        for s in f.samples
    }
    assert samples[("topk_recomputed_steps_total", (("model", "demo"),))] == 3


def test_non_finite_logits_are_a_server_error_not_the_clients():
    from topk_decode.serve.worker import _api_error

    assert _api_error(NonFiniteLogits("the decode step's logits are not finite")).status == 500
    assert _api_error(TopkError("bad k")).status == 400
