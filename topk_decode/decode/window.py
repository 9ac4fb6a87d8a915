"""The exact GPU window: attention sinks, the context tail, and every token since the prefill.

Ownership (docs/DESIGN.md, "Who owns which buffer"): a `Window` owns its per-layer buffers, except
while it is *resident* in the one-token step (`StepSegments`, graphs.py). The step's CUDA graphs are
captured on fixed buffers, so the step owns one set and the conversation being decoded lives in it:
`StepSegments.activate` moves a window in and records itself as `window.host`; a window that must grow
past the step's capacity (a long prompt on the eager path), or another conversation's activation,
moves it back into buffers of its own (`relocate`, which clears `host`). `host` is the only record of
residency. Both sides size buffers by the one rule `window_capacity`.
"""

from __future__ import annotations

from typing import Any

import torch

# Fewest slots per layer a window buffer has (16 is the window kernels' alignment, merge.py).
MIN_CAPACITY = 256


def window_capacity(need: int, minimum: int = MIN_CAPACITY) -> int:
    """Slots per layer for a window of `need` tokens: the least power-of-two multiple of `minimum` that fits."""
    cap = minimum
    while cap < need:
        cap *= 2
    return cap


def new_buffers(like: torch.Tensor, n_layers: int, capacity: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Zeroed per-layer (Hkv, capacity, D) key and value buffers shaped, typed and placed like `like`.

    Zeros, not `empty`: the step's kernels read every slot and mask the ones past the length, which
    must therefore hold finite values.
    """
    hkv, _, d = like.shape
    return tuple(
        [torch.zeros((hkv, capacity, d), dtype=like.dtype, device=like.device) for _ in range(n_layers)]
        for _ in range(2)
    )


class Window:
    """One conversation's exact window: per-layer (Hkv, capacity, D) keys and values on the decode device.

    A step writes its T new tokens at slots [length, length + T) of every layer (`update`), then
    `advance(T)` commits them. `reset()` drops everything added after the initial sinks + tail.

    Args:
        init_k, init_v: per layer (Hkv, W0, D): the sinks and the tail of the context.
        context_len: N, the number of prefilled context tokens (first new position).
    """

    def __init__(self, init_k: list[torch.Tensor], init_v: list[torch.Tensor], context_len: int) -> None:
        w0 = init_k[0].shape[1]
        self.k, self.v = new_buffers(init_k[0], len(init_k), window_capacity(w0 + 1))
        for layer, (k, v) in enumerate(zip(init_k, init_v)):
            self.k[layer][:, :w0] = k
            self.v[layer][:, :w0] = v
        self.base_length = w0
        self.length = w0
        self.context_len = context_len
        # the StepSegments whose fixed buffers self.k / self.v are while resident there, else None
        self.host: Any = None

    @property
    def next_position(self) -> int:
        """Absolute position of the next token (positions continue after the context)."""
        return self.context_len + self.length - self.base_length

    @property
    def n_new(self) -> int:
        """Tokens added since the prefill."""
        return self.length - self.base_length

    @property
    def capacity(self) -> int:
        """Slots per layer in the current buffers."""
        return self.k[0].shape[1]

    def move_into(self, k_bufs: list[torch.Tensor], v_bufs: list[torch.Tensor], host: Any = None) -> None:
        """Copy the window's `length` slots into other per-layer buffers and keep using those.

        Args:
            k_bufs, v_bufs: per layer (Hkv, capacity ≥ length, D); adopted, never reallocated here.
            host: the StepSegments that owns them (the window is then resident there), or None.
        """
        for dst, src in zip(k_bufs + v_bufs, self.k + self.v):
            dst[:, : self.length] = src[:, : self.length]
        self.k, self.v, self.host = k_bufs, v_bufs, host

    def relocate(self, need: int | None = None) -> None:
        """Move into buffers of the window's own, with room for `need` slots (default: its length + 1)."""
        cap = window_capacity(max(need or 0, self.length + 1))
        self.move_into(*new_buffers(self.k[0], len(self.k), cap))

    def reserve(self, need: int) -> None:
        """Make room for `need` slots per layer, moving to larger buffers of its own when they do not fit."""
        if need > self.capacity:
            self.relocate(need)

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write (Hkv, T, D) keys/values of `layer` at slots [start, start + T); return the layer's window
        through them, (Hkv, start + T, D) each. `reserve(start + T)` must have made room.

        Args:
            layer: the layer; start: the first slot (the window's length before the step).
            k, v: (Hkv, T, D) the step's keys and values for this layer.
        """
        end = start + k.shape[1]
        self.k[layer][:, start:end] = k
        self.v[layer][:, start:end] = v
        return self.k[layer][:, :end], self.v[layer][:, :end]

    def advance(self, T: int) -> None:
        """Commit a step's T tokens (after every layer has written them)."""
        self.length += T

    def rewind(self, length: int) -> None:
        """Undo the steps after `length`: the slots they wrote, [length, self.length), are zeroed (slots past
        the length must hold finite values: the step's kernels read them masked) and the length goes back."""
        for t in self.k + self.v:
            t[:, length : self.length].zero_()
        self.length = length

    def reset(self) -> None:
        """Forget the conversation; keep the sinks and the tail."""
        self.length = self.base_length

    def nbytes(self) -> int:
        """Device bytes held by the buffers."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
