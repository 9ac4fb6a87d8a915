"""Hand each prefilled layer's KV to `on_layer` from a background thread while the next layer computes.

A synchronous `keys.cpu()` of one layer's KV (512 MiB at 128K tokens for an 8B model) into fresh
pageable memory is slow and leaves the GPU idle, a large share of the prefill (docs/BENCHMARKS.md,
"Prefill"). Here the copy runs on a side stream into small reused pinned buffers, and the CPU-side
copy into owned tensors and the `on_layer` call (the cache writer's disk write) run in a worker
thread, overlapped with the next layer's compute.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext

import torch

OnLayer = Callable[[int, torch.Tensor, torch.Tensor], None]

PIECE_BYTES = 64 * 2**20  # staging piece: two of them stay pinned (128 MiB), whatever the context length


def _pieces(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], piece: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Flat (src, dst) slices of at most `piece` elements, pair after pair."""
    for src, dst in pairs:
        s, d = src.reshape(-1), dst.view(-1)  # src is contiguous (a view); dst is ours, contiguous
        for a in range(0, s.numel(), piece):
            yield s[a : a + piece], d[a : a + piece]


def copy_to_host(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    staging: Sequence[torch.Tensor],
    stream: torch.cuda.Stream | None,
) -> None:
    """Copy each src into its CPU dst through two staging buffers, piece by piece.

    Piece i goes device→staging[i % 2] on `stream` while piece i-1 goes staging→dst on this thread,
    so the DMA and the host memcpy overlap and only the staging buffers need to be pinned.

    Args:
        pairs: (src, dst) with the same dtype and numel; src contiguous (on the device when `stream`
            is given), dst a contiguous CPU tensor.
        staging: two 1-D buffers of the pairs' dtype (pinned with a stream); their length is the piece.
        stream: the CUDA stream for the device→staging copies (already ordered after the producer of
            src); None copies synchronously (CPU, or tests).
    """
    piece = staging[0].numel()
    ctx = torch.cuda.stream(stream) if stream is not None else nullcontext()
    pending = None  # (event, staging slice, dst slice) of the previous piece
    with ctx:
        for i, (src, dst) in enumerate(_pieces(pairs, piece)):
            buf = staging[i % 2][: src.numel()]  # its last reader (piece i-2's landing) has returned
            buf.copy_(src, non_blocking=stream is not None)
            done = None
            if stream is not None:
                done = torch.cuda.Event(blocking=True)  # sleep rather than spin while the layer computes
                done.record(stream)
            if pending is not None:
                _land(*pending)
            pending = (done, buf, dst)
        if pending is not None:
            _land(*pending)


def _land(done: torch.cuda.Event | None, buf: torch.Tensor, dst: torch.Tensor) -> None:
    if done is not None:
        done.synchronize()
    dst.copy_(buf)


class KVDrain:
    """Drains one layer's device KV at a time to owned CPU tensors and calls `on_layer` with them.

    On CUDA, `submit` returns at once: a single worker thread waits for the layer's compute (an event
    recorded on the compute stream), copies through pinned staging buffers on a side stream, then
    calls `on_layer`. At most one layer is in flight — `submit` first waits for the previous drain —
    so the extra device memory is one layer's KV and `on_layer` runs once at a time, in layer order.
    The worker holds the device tensors until its copies have completed, so the caching allocator
    cannot hand their memory to the next layer early. An exception raised by `on_layer` (a full disk,
    KeyboardInterrupt) is re-raised in the caller's thread by the next `submit` or on leaving the
    `with` block. On the CPU, `on_layer` is called synchronously (nothing to overlap).

    Args:
        on_layer: called as on_layer(layer, keys, values) with owned (Hkv, N, D) CPU tensors.
        device: the device the KV is computed on.
        piece_bytes: staging piece size in bytes (two pieces are pinned); default PIECE_BYTES.

    Use as a context manager: leaving the block waits for the last drain (raising its error unless
    the block already raises) and stops the worker.
    """

    threaded_on_cpu = False  # run the worker on the CPU too (tests exercise the threaded path without a GPU)

    def __init__(self, on_layer: OnLayer, device: torch.device, piece_bytes: int | None = None) -> None:
        self.on_layer = on_layer
        self.device = device
        self.piece_bytes = piece_bytes or PIECE_BYTES
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="kv-drain") if cuda or self.threaded_on_cpu else None
        self.pending: Future | None = None
        self.staging: list[torch.Tensor] = []

    def __enter__(self) -> KVDrain:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if exc_type is None:
                self.wait()
            elif self.pending is not None:
                self.pending.exception()  # let it finish (e.g. before the caller deletes its files)
                self.pending = None
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True)
        return False

    def submit(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hand over a layer whose keys/values are fully queued on the current stream.

        Args:
            layer: the layer index.
            keys, values: (Hkv, N, D) contiguous tensors on `device`; the caller must not write them again.
        """
        if self.pool is None:
            self.on_layer(layer, keys.cpu(), values.cpu())
            return
        self.wait()  # one layer in flight: bounds device memory, keeps order
        ready = None
        if self.stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        self.pending = self.pool.submit(self._drain, layer, keys, values, ready)

    def wait(self) -> None:
        """Wait for the drain in flight, if any; re-raise what it raised."""
        pending = self.pending
        if pending is None:
            return
        try:
            pending.result()
        finally:
            if pending.done():  # not when this thread was interrupted: leaving the block waits again
                self.pending = None

    @torch.inference_mode()
    def _drain(self, layer: int, keys: torch.Tensor, values: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        """Worker: copy the layer to owned CPU tensors, then call `on_layer`.

        keys/values (the device tensors) stay referenced by this call until it returns, after its copies.
        """
        host_k = torch.empty(keys.shape, dtype=keys.dtype)  # (Hkv, N, D), owned by on_layer
        host_v = torch.empty(values.shape, dtype=values.dtype)
        device_ctx = torch.cuda.device(self.device) if self.stream is not None else nullcontext()
        try:
            with device_ctx:
                if ready is not None:
                    self.stream.wait_event(ready)
                copy_to_host([(keys, host_k), (values, host_v)], self._staging(keys), self.stream)
        finally:
            if self.stream is not None:
                self.stream.synchronize()  # even on error: no copy may still read keys/values
        self.on_layer(layer, host_k, host_v)

    def _staging(self, like: torch.Tensor) -> list[torch.Tensor]:
        """Two staging buffers of `like`'s dtype, of min(piece, numel) elements: allocated once per shape."""
        n = max(1, min(self.piece_bytes // like.element_size(), like.numel()))
        if not self.staging or self.staging[0].dtype != like.dtype or self.staging[0].numel() != n:
            pin = self.stream is not None
            self.staging = [torch.empty(n, dtype=like.dtype, pin_memory=pin) for _ in range(2)]
        return self.staging
