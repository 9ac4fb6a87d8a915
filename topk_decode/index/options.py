"""Strategy options declared once: one frozen dataclass per strategy, a field per option (its type, default,
whether it is a build option, what values it takes, and its doc), parsed once when the strategy is made.

A strategy names its dataclass as `Options`; `SelectionStrategy.OPTIONS` (name → type) is derived from it. Values
arrive from the CLI as strings ("--opt probe_fraction=0.02") or from Python as values; `parse` converts them to
the field's type and checks them, and nothing downstream converts again.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar

from topk_decode.errors import TopkError

POSITIVE = "positive"  # check: an integer > 0
FRACTION = "fraction"  # check: a number in (0, 1]
NON_NEGATIVE = "non-negative"  # check: an integer ≥ 0

_TYPE_WORDS = {int: "an integer", float: "a number", bool: "a boolean (true/false)", str: "a string"}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def option(default: Any, doc: str, *, build: bool = False, check: str | tuple[str, ...] | None = None) -> Any:
    """A dataclass field for one strategy option.

    Args:
        default: the value when the option is not given (None: the strategy computes it, the doc says how).
        doc: what the option does (one or two sentences; `topk info` and the docs quote it).
        build: True for options the strategy's artifacts are built with (recorded in done.json; a different
            value rebuilds them).
        check: POSITIVE, FRACTION, NON_NEGATIVE, or a tuple of the allowed strings.
    """
    return dataclasses.field(default=default, metadata={"doc": doc, "build": build, "check": check})


def coerce(value: Any, kind: type) -> Any:
    """`value` as `kind` (int, float, bool or str; CLI values arrive as str/int/float), or ValueError."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            return int(value.strip())
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            return float(value.strip())
    elif kind is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)  # e.g. pattern=2024.tsv stays a path even if it looked like a number
        if isinstance(value, bool):
            return str(value).lower()  # device_route=false: the CLI reads it as a boolean
    raise ValueError(value)


def one_of(key: str, value: Any, allowed: tuple[str, ...]) -> Any:
    """value when it is one of `allowed`, else a TopkError naming them ("option k must be a, b or c, got 'x'")."""
    if value not in allowed:
        words = ", ".join(allowed[:-1]) + " or " + allowed[-1]
        raise TopkError(f"option {key} must be {words}, got {value!r}")
    return value


def _check(key: str, value: Any, check: str | tuple[str, ...] | None) -> Any:
    """value after the field's check, or TopkError."""
    if value is None or check is None:
        return value
    if check == POSITIVE and value <= 0:
        raise TopkError(f"option {key} must be a positive integer, got {value!r}")
    if check == NON_NEGATIVE and value < 0:
        raise TopkError(f"option {key} must be an integer ≥ 0, got {value!r}")
    if check == FRACTION and not 0 < value <= 1:
        raise TopkError(f"option {key} must be a number in (0, 1], got {value!r}")
    if isinstance(check, tuple):
        return one_of(key, value.lower(), check)
    return value


def _base_type(hint: Any) -> type:
    """int for `int` or `int | None`, and so on."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


@dataclasses.dataclass(frozen=True)
class StrategyOptions:
    """Base of the strategies' options dataclasses (no options of its own).

    `given` holds the names the user gave explicitly: artifacts built with other values of *those* options are
    rebuilt, while the others accept what the artifacts were built with.
    """

    given: frozenset = dataclasses.field(default=frozenset(), repr=False, compare=False, metadata={"internal": True})
    strategy: ClassVar[str] = ""

    @classmethod
    def fields(cls) -> dict[str, dataclasses.Field]:
        """The options (name → field), without `given`."""
        return {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}

    @classmethod
    def types(cls) -> dict[str, type]:
        """Option name → its type (int, float, bool or str)."""
        hints = typing.get_type_hints(cls)
        return {name: _base_type(hints[name]) for name in cls.fields()}

    @classmethod
    def parse(cls, name: str, given: Mapping | StrategyOptions | None) -> StrategyOptions:
        """The options of strategy `name` from what was given, each value converted to its field's type and
        checked; TopkError (one line) for an unknown name or a bad value. An instance is returned as it is."""
        if isinstance(given, StrategyOptions):
            return given
        given = dict(given or {})
        kinds, fields = cls.types(), cls.fields()
        values = {}
        for key, value in given.items():
            if key not in kinds:
                valid = ", ".join(sorted(kinds)) or "none"
                raise TopkError(f"unknown option {key!r} for strategy {name} (valid options: {valid})")
            try:
                value = coerce(value, kinds[key])
            except (ValueError, TypeError):
                raise TopkError(
                    f"option {key} of strategy {name} must be {_TYPE_WORDS[kinds[key]]}, got {value!r}"
                ) from None
            values[key] = _check(key, value, fields[key].metadata["check"])
        return cls(given=frozenset(values), **values)

    def given_values(self) -> dict:
        """The options given explicitly, converted (what `checked_options` hands on: JSON-able)."""
        return {key: getattr(self, key) for key in self.fields() if key in self.given}

    def build_values(self) -> dict:
        """Every build option's value, defaults filled in (recorded in done.json)."""
        return {key: getattr(self, key) for key, f in self.fields().items() if f.metadata["build"]}

    def given_build_values(self) -> dict:
        """The build options given explicitly (`artifacts.ensure_artifacts`' `wanted`)."""
        return {key: value for key, value in self.build_values().items() if key in self.given}

    def replace(self, **changes: Any) -> StrategyOptions:
        """A copy with these options changed (and counted as given)."""
        return dataclasses.replace(self, given=self.given | frozenset(changes), **changes)


def doc_table(options: type[StrategyOptions]) -> list[tuple[str, str, Any, bool, str]]:
    """(name, type name, default, build, doc) per option: for docs and `--help` texts."""
    kinds = options.types()
    return [
        (name, kinds[name].__name__, f.default, f.metadata["build"], f.metadata["doc"])
        for name, f in options.fields().items()
    ]
