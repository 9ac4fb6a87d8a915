"""The exact GPU window: attention sinks, the context tail, and every token since the prefill."""

from __future__ import annotations

import torch


class Window:
    """Per-layer (Hkv, capacity, D) key/value buffers on the decode device, grown by doubling.

    A step appends its T new tokens to every layer, then `advance(T)` makes them part of the window.
    `reset()` drops everything added after the initial sinks + tail (a new conversation).

    Args:
        init_k, init_v: per layer (Hkv, W0, D): the sinks and the tail of the context.
        context_len: N, the number of prefilled context tokens (first new position).
        capacity: initial slots per layer.
    """

    def __init__(self, init_k: list[torch.Tensor], init_v: list[torch.Tensor], context_len: int,
                 capacity: int = 256) -> None:
        hkv, w0, d = init_k[0].shape
        cap = max(capacity, 2 * w0, 16)
        self.k = [torch.empty((hkv, cap, d), dtype=t.dtype, device=t.device) for t in init_k]
        self.v = [torch.empty((hkv, cap, d), dtype=t.dtype, device=t.device) for t in init_v]
        for layer, (k, v) in enumerate(zip(init_k, init_v)):
            self.k[layer][:, :w0] = k
            self.v[layer][:, :w0] = v
        self.base_length = w0
        self.length = w0
        self.context_len = context_len

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

    def _grow(self, need: int) -> None:
        if need <= self.capacity:
            return
        self._move_to_new(max(need, 2 * self.capacity))

    def _move_to_new(self, capacity: int) -> None:
        k0 = self.k[0]
        self.move_into(*[[torch.empty((k0.shape[0], capacity, k0.shape[2]), dtype=k0.dtype, device=k0.device)
                          for _ in self.k] for _ in range(2)])

    def move_into(self, k_bufs: list[torch.Tensor], v_bufs: list[torch.Tensor]) -> None:
        """Copy the window into other per-layer (Hkv, capacity ≥ length, D) buffers and keep using those.

        The lists themselves are adopted (never mutated here), so whoever holds them (the CUDA-graph
        segments, graphs.py) keeps seeing the window's storage.
        """
        for dst, src in zip(k_bufs + v_bufs, self.k + self.v):
            dst[:, :self.length] = src[:, :self.length]
        self.k, self.v = k_bufs, v_bufs

    def detach(self) -> None:
        """Move into private buffers (the current ones are about to be lent to another window)."""
        self._move_to_new(max(2 * self.length, 16))

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a step's (Hkv, T, D) keys/values for `layer`; return the layer's whole window incl. them."""
        T = k.shape[1]
        self._grow(self.length + T)
        self.k[layer][:, self.length:self.length + T] = k
        self.v[layer][:, self.length:self.length + T] = v
        end = self.length + T
        return self.k[layer][:, :end], self.v[layer][:, :end]

    def advance(self, T: int) -> None:
        """Commit a step's T tokens (after every layer has appended them)."""
        self.length += T

    def reset(self) -> None:
        """Forget the conversation; keep the sinks and the tail."""
        self.length = self.base_length

    def nbytes(self) -> int:
        """Device bytes held by the buffers."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
