"""The one-token segments lend their fixed window buffers to one conversation at a time (graphs.py)."""

from __future__ import annotations

import pytest
import torch

from topk_decode.config import DecodeConfig
from topk_decode.decode.engine import TopKDecoder
from topk_decode.decode.graphs import StepSegments
from topk_decode.model.loading import load_model
from topk_decode.store.cache_dir import open_cache


@pytest.fixture(scope="module")
def model_and_cache(built_cache):
    cache, model_dir = built_cache
    return load_model(model_dir, "cpu"), open_cache(cache)


def _continue(dec, conv, first: int, n: int) -> list[int]:
    """Greedy tokens after feeding `first`, one token per step (the segment path)."""
    out, tok = [], first
    for _ in range(n):
        tok = int(dec.forward([tok], conv).argmax())
        out.append(tok)
    return out


def test_two_interleaved_conversations_decode_as_each_would_alone(model_and_cache):
    model, ckv = model_and_cache
    cfg = DecodeConfig(k=8, strategy_options={"backend": "torch"})
    alone = []
    for prompt in ([5, 6, 7], [9, 10]):
        dec = TopKDecoder(model, ckv, cfg, graphs=True)
        conv = dec.new_conversation()
        dec.forward(prompt, conv)
        alone.append(_continue(dec, conv, 3, 6))
    dec = TopKDecoder(model, ckv, cfg, graphs=True)
    a, b = dec.new_conversation(), dec.new_conversation()
    dec.forward([5, 6, 7], a)
    dec.forward([9, 10], b)
    got_a, got_b, ta, tb = [], [], 3, 3
    for _ in range(6):        # each step lends the buffers to the other conversation
        ta = int(dec.forward([ta], a).argmax())
        tb = int(dec.forward([tb], b).argmax())
        got_a.append(ta)
        got_b.append(tb)
    assert [got_a, got_b] == alone


def test_window_growing_past_the_buffers_capacity_keeps_the_result(model_and_cache, monkeypatch):
    model, ckv = model_and_cache
    cfg = DecodeConfig(k=8, n_sink=2, n_tail=8, strategy_options={"backend": "torch"})
    dec = TopKDecoder(model, ckv, cfg, graphs=False)
    conv = dec.new_conversation()
    dec.forward([5, 6], conv)
    ref = _continue(dec, conv, 3, 30)
    monkeypatch.setattr(StepSegments, "min_capacity", 16)
    dec = TopKDecoder(model, ckv, cfg, graphs=True)
    conv = dec.new_conversation()
    dec.forward([5, 6], conv)
    seen = []
    got = []
    for tok in [3] + ref[:-1]:                      # teacher-forced: the same inputs as the reference
        got.append(int(dec.forward([tok], conv).argmax()))
        seen.append(dec.segments.capacity)
    assert seen[0] == 16 and seen[-1] == 64         # 10 + 2 + 30 slots: it doubled twice mid-conversation
    assert got == ref


def test_reset_segments_rebuilds_them_at_the_next_step_and_keeps_the_result(model_and_cache):
    model, ckv = model_and_cache
    cfg = DecodeConfig(k=8, strategy_options={"backend": "torch"})
    dec = TopKDecoder(model, ckv, cfg, graphs=True)
    conv = dec.new_conversation()
    dec.forward([5, 6, 7], conv)
    ref = _continue(dec, conv, 3, 6)
    dec = TopKDecoder(model, ckv, DecodeConfig(k=8, strategy_options={"backend": "torch"}), graphs=True)
    conv = dec.new_conversation()
    dec.forward([5, 6, 7], conv)
    assert dec.segments is None                     # built by the first one-token step
    got = _continue(dec, conv, 3, 3)
    first = dec.segments
    assert first is not None
    dec.reset_segments(compile=False)
    assert dec.segments is None and dec.config.compile is False
    got += _continue(dec, conv, got[-1], 3)         # the same conversation goes on through new segments
    assert dec.segments is not None and dec.segments is not first
    assert got == ref
