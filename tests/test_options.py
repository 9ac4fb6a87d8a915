"""Strategy options are declared once (index/options.py): one dataclass per strategy, parsed once."""

from __future__ import annotations

import pytest

from topk_decode.errors import TopkError
from topk_decode.index import STRATEGIES, get_strategy
from topk_decode.index.options import doc_table


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_option_has_a_type_a_default_and_a_doc(name):
    cls = get_strategy(name)
    rows = doc_table(cls.Options)
    assert rows and {r[0] for r in rows} == set(cls.OPTIONS)
    for option, kind, _default, _build, doc in rows:
        assert kind in ("int", "float", "bool", "str"), option
        assert len(doc) > 10, option
    defaults = cls.parse_options({})
    assert defaults.given_values() == {}  # nothing given: every field at its default


def test_values_are_converted_once_and_build_options_are_told_apart():
    cls = get_strategy("routed")
    opts = cls.parse_options({"probe_fraction": "0.02", "estimate": "false", "cluster_size": "24", "kernel": "TORCH"})
    assert opts.probe_fraction == 0.02 and opts.estimate is False and opts.kernel == "torch"
    assert opts.given_build_values() == {"cluster_size": 24}
    assert opts.build_values() == {
        "cluster_size": 24,
        "iters": 6,
        "store_keys": False,  # one copy of the KV: the layout holds routing tables, codes and positions
        "store_values": False,
        "segment": 65536,
        "pq_m": 0,
        "pq_values": 0,
    }
    assert cls.parse_options(opts) is opts  # an instance is not parsed again
    assert opts.replace(iters=3).given_build_values() == {"cluster_size": 24, "iters": 3}


@pytest.mark.parametrize(
    "options,fragment",
    [
        ({"probe_fraction": 1.5}, "option probe_fraction must be a number in (0, 1], got 1.5"),
        ({"segment": 0}, "option segment must be a positive integer, got 0"),
        ({"kernel": "fast"}, "option kernel must be auto, torch or numba, got 'fast'"),
        ({"estimate": "maybe"}, "option estimate of strategy routed must be a boolean (true/false), got 'maybe'"),
        ({"probe": 1}, "unknown option 'probe' for strategy routed"),
    ],
)
def test_bad_values_are_one_line_topk_errors(options, fragment):
    with pytest.raises(TopkError) as err:
        get_strategy("routed").parse_options(options)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_decode_defaults_are_declared_once_in_decode_config():
    import inspect

    from topk_decode.api import KVStore
    from topk_decode.cli.chat_cmd import chat_command
    from topk_decode.cli.eval_cmd import eval_command
    from topk_decode.cli.serve_cmd import serve_command
    from topk_decode.config import DecodeConfig
    from topk_decode.eval.harness import EvalConfig

    want = DecodeConfig()
    # KVStore.open takes DecodeConfig's own defaults: its k and strategy default to None (the config's), and it
    # re-lists none of the other fields (they come as **overrides)
    from dataclasses import fields

    from topk_decode.api import decode_config

    params = inspect.signature(KVStore.open).parameters
    assert params["k"].default is None and params["strategy"].default is None
    assert not {f.name for f in fields(DecodeConfig)} - {"k", "strategy"} & set(params)
    assert decode_config(k=None, strategy=None) == want
    for fn in (chat_command, serve_command, eval_command):
        params = inspect.signature(fn).parameters
        for name in ("k", "strategy", "k_schedule", "n_sink", "n_tail", "compile"):
            if name in params and fn is not eval_command:
                assert params[name].default == getattr(want, name), (fn.__name__, name)
        for name in ("n_sink", "n_tail"):
            if name in params:
                assert params[name].default == getattr(want, name), (fn.__name__, name)
    assert (EvalConfig.n_sink, EvalConfig.n_tail) == (want.n_sink, want.n_tail)
