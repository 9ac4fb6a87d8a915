"""`KVStore.open(cache, config=DecodeConfig(...), **overrides)`: one DecodeConfig, its fields by name on top."""

from __future__ import annotations

import pytest

from topk_decode import KVStore
from topk_decode.api import decode_config
from topk_decode.config import DecodeConfig
from topk_decode.errors import TopkError


def test_fields_by_name_override_the_config_and_the_callers_options_are_not_shared():
    options = {"backend": "torch"}
    base = DecodeConfig(k=64, n_tail=32, strategy_options=options)
    cfg = decode_config(base, k=None, strategy="flat", n_sink=2)
    assert (cfg.k, cfg.strategy, cfg.n_sink, cfg.n_tail) == (64, "flat", 2, 32)
    cfg.strategy_options["backend"] = "numba"
    assert options == {"backend": "torch"} and base.strategy_options is options
    assert decode_config().k == DecodeConfig.k


def test_an_unknown_decoding_option_is_one_line_naming_the_known_ones():
    with pytest.raises(TopkError, match="unknown decoding option 'n_tails'; DecodeConfig has: .*n_tail"):
        decode_config(n_tails=3)


def test_open_with_a_config_equals_open_with_the_same_fields(built_cache):
    cache, _ = built_cache
    prompt = [5, 9, 13]
    by_fields = KVStore.open(cache, k=24, strategy="flat", device="cpu", n_tail=16).generate_ids(prompt, 6)
    cfg = DecodeConfig(k=24, strategy="flat", n_tail=16)
    with KVStore.open(cache, config=cfg, device="cpu") as store:
        assert store.generate_ids(prompt, 6) == by_fields
        assert (store.config.k, store.config.n_tail) == (24, 16)
    with KVStore.open(cache, config=cfg, device="cpu", k=8) as store:  # a field by name wins over the config
        assert store.config.k == 8
    assert cfg.k == 24  # the caller's config is left as it was
    with pytest.raises(TopkError, match="unknown decoding option 'kk'"):
        KVStore.open(cache, device="cpu", kk=3)
