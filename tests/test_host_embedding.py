"""The input embedding in CPU RAM (decode/embedding.py): same tokens, GPU table freed, model given back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from topk_decode.config import DecodeConfig
from topk_decode.decode.embedding import HostEmbedding, tied
from topk_decode.decode.engine import TopKDecoder
from topk_decode.errors import TopkError
from topk_decode.model.loading import load_model
from topk_decode.store.cache_dir import open_cache


def _untied(model_dir):
    model = load_model(model_dir, "cpu")
    if tied(model):
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
        model.config.tie_word_embeddings = False
    return model


def _greedy(dec: TopKDecoder, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    conv = dec.new_conversation()
    logits = dec.forward(prompt, conv)  # a prompt of several tokens: the eager path
    out = []
    for _ in range(n):  # one token at a time: the segment path when enabled
        out.append(int(logits.argmax()))
        logits = dec.forward([out[-1]], conv)
    return out, logits


@pytest.mark.parametrize("segments", [False, True])
def test_host_embedding_decodes_the_same_tokens_and_gives_the_table_back(built_cache, segments):
    cache, model_dir = built_cache
    model, ckv = _untied(model_dir), open_cache(cache)
    original = model.model.embed_tokens
    cfg = dict(k=8, strategy_options={"backend": "torch"})
    ref_tokens, ref_logits = _greedy(TopKDecoder(model, ckv, DecodeConfig(**cfg), graphs=segments), [5, 6, 7], 6)
    dec = TopKDecoder(model, ckv, DecodeConfig(**cfg, host_embedding=True), graphs=segments)
    assert isinstance(model.model.embed_tokens, HostEmbedding)
    assert all(p is not original.weight for p in model.parameters())  # not a model parameter any more
    tokens, logits = _greedy(dec, [5, 6, 7], 6)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    dec.close()
    assert model.model.embed_tokens is original


def test_host_embedding_is_refused_for_a_tied_embedding(built_cache):
    cache, model_dir = built_cache
    model = load_model(model_dir, "cpu")
    model.lm_head.weight = model.model.embed_tokens.weight  # tie them, whatever the checkpoint did
    with pytest.raises(TopkError, match="tied"):
        TopKDecoder(model, open_cache(cache), DecodeConfig(k=8, host_embedding=True))
    assert not isinstance(model.model.embed_tokens, HostEmbedding)


def test_host_embedding_is_off_by_default_on_the_cpu(built_cache):
    cache, model_dir = built_cache
    model = _untied(model_dir)
    dec = TopKDecoder(model, open_cache(cache), DecodeConfig(k=8))
    assert dec.host_embedding is None and not isinstance(model.model.embed_tokens, HostEmbedding)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_host_embedding_in_captured_steps_decodes_the_same_tokens(built_cache):
    cache, model_dir = built_cache
    ckv = open_cache(cache)
    model = _untied(model_dir).to("cuda")
    cfg = dict(k=8, strategy_options={"backend": "torch"})
    ref, _ = _greedy(TopKDecoder(model, ckv, DecodeConfig(**cfg, host_embedding=False)), [5, 6, 7], 8)
    dec = TopKDecoder(model, ckv, DecodeConfig(**cfg))  # default on CUDA for an untied table
    assert dec.host_embedding is not None
    got, _ = _greedy(dec, [5, 6, 7], 8)
    assert dec.segments is not None and dec.segments.graphs is not None
    assert got == ref
    dec.close()
    assert model.model.embed_tokens.weight.is_cuda


def test_close_keeps_the_table_in_cpu_ram_when_the_device_has_no_room_for_it(built_cache, monkeypatch):
    cache, model_dir = built_cache
    model = _untied(model_dir)
    dec = TopKDecoder(model, open_cache(cache), DecodeConfig(k=8, host_embedding=True))
    original, calls = dec.host_embedding.original, []
    move = original.to

    def no_room(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("no room")
        return move(*args, **kwargs)

    monkeypatch.setattr(original, "to", no_room)
    with pytest.warns(Warning, match="stays in CPU RAM"):
        dec.close()
    assert isinstance(model.model.embed_tokens, HostEmbedding)  # still a working model
    assert model.model.embed_tokens(torch.tensor([[5, 6]])).shape == (1, 2, model.config.hidden_size)
