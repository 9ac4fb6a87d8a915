"""The decoder: exact GPU window + top-k retrieval from the CPU store, merged in one softmax."""

import importlib

# name → submodule; imported on first use, so importing a light submodule (sampling, messages) does
# not pull in the engine and transformers' model code.
_EXPORTS = {
    "Conversation": "engine",
    "StepStats": "engine",
    "TopKDecoder": "engine",
    "Window": "window",
    "lse_merge": "merge",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Conversation", "StepStats", "TopKDecoder", "Window", "lse_merge"]
