"""The one-token step owns one fixed window; one conversation at a time is resident in it (graphs.py, window.py)."""

from __future__ import annotations

import pytest
import torch

from topk_decode.config import DecodeConfig
from topk_decode.decode.engine import TopKDecoder
from topk_decode.decode.graphs import StepSegments
from topk_decode.decode.window import Window, window_capacity
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
    for _ in range(6):  # each step lends the buffers to the other conversation
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
    for tok in [3] + ref[:-1]:  # teacher-forced: the same inputs as the reference
        got.append(int(dec.forward([tok], conv).argmax()))
        seen.append(dec.segments.capacity)
    assert seen[0] == 16 and seen[-1] == 64  # 10 + 2 + 30 slots: it doubled twice mid-conversation
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
    assert dec.segments is None  # built by the first one-token step
    got = _continue(dec, conv, 3, 3)
    first = dec.segments
    assert first is not None
    dec.reset_segments(compile=False)
    assert dec.segments is None and dec.config.compile is False
    got += _continue(dec, conv, got[-1], 3)  # the same conversation goes on through new segments
    assert dec.segments is not None and dec.segments is not first
    assert got == ref


def test_only_the_activated_window_is_resident_and_a_parked_one_keeps_its_contents(model_and_cache):
    model, ckv = model_and_cache
    dec = TopKDecoder(model, ckv, DecodeConfig(k=8, strategy_options={"backend": "torch"}), graphs=True)
    a, b = dec.new_conversation(), dec.new_conversation()
    dec.forward([5, 6, 7], a)
    dec.forward([3], a)
    seg = dec.segments
    assert a.window.host is seg and seg.resident is a.window and a.window.k is seg.win_k
    kept = [t[:, : a.window.length].clone() for t in a.window.k]
    dec.forward([9], b)
    assert b.window.host is seg and seg.resident is b.window
    assert a.window.host is None and a.window.k is not seg.win_k
    assert all(torch.equal(t[:, : len(kept[0][0])], ref) for t, ref in zip(a.window.k, kept))


def test_a_long_prompt_moves_a_resident_window_out_and_the_next_step_moves_it_back(model_and_cache, monkeypatch):
    model, ckv = model_and_cache
    cfg = DecodeConfig(k=8, n_sink=2, n_tail=8, strategy_options={"backend": "torch"})
    prompt = list(range(20, 60))  # 40 tokens: past the step's 16 slots
    dec = TopKDecoder(model, ckv, cfg, graphs=False)
    conv = dec.new_conversation()
    dec.forward([5, 6], conv)
    ref = [int(dec.forward([3], conv).argmax()), int(dec.forward(prompt, conv).argmax())]
    ref += _continue(dec, conv, ref[-1], 4)
    monkeypatch.setattr(StepSegments, "min_capacity", 16)
    dec = TopKDecoder(model, ckv, cfg, graphs=True)
    conv = dec.new_conversation()
    dec.forward([5, 6], conv)
    got = [int(dec.forward([3], conv).argmax())]
    assert conv.window.host is dec.segments and dec.segments.capacity == 16
    got.append(int(dec.forward(prompt, conv).argmax()))  # the eager path: the window grows on its own
    assert conv.window.host is None and conv.window.capacity >= 10 + 3 + 40
    got += _continue(dec, conv, got[-1], 4)
    assert conv.window.host is dec.segments and dec.segments.capacity == 64
    assert got == ref


def test_window_capacity_is_the_least_doubling_of_the_minimum_that_fits():
    assert [window_capacity(n, 16) for n in (1, 16, 17, 33, 64, 65)] == [16, 16, 32, 64, 64, 128]
    assert window_capacity(300) == 512


def test_window_update_writes_at_explicit_slots_and_relocation_keeps_them():
    init = [torch.arange(12, dtype=torch.float32).view(1, 3, 4)]
    win = Window(init, [init[0] + 100], context_len=50)
    k_all, v_all = win.update(0, 3, torch.ones(1, 2, 4), torch.zeros(1, 2, 4))  # (1, 5, 4)
    win.advance(2)
    assert (
        k_all.shape == (1, 5, 4)
        and torch.equal(k_all[:, :3], init[0])
        and torch.equal(v_all[:, 3:], torch.zeros(1, 2, 4))
    )
    before = win.k[0][:, :5].clone()
    win.reserve(win.capacity + 1)
    assert win.capacity == 2 * window_capacity(4) and torch.equal(win.k[0][:, :5], before)
    assert win.next_position == 52
