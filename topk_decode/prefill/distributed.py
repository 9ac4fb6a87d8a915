"""Sequence-parallel layer-wise prefill over torch.distributed ranks (`topk prefill --gpus N`).

The N context tokens are split into contiguous slices, one per rank, cut at the single-process
prefill's chunk boundaries. Per layer every rank computes its slice's Q/K/V chunk by chunk, the
layer's K/V are exchanged with one all-gather (every rank then holds the layer's (Hkv, N, D) keys and
values), and each rank attends its own chunks causally to all earlier keys and finishes the block.
Rank 0 alone hands each layer's KV to `on_layer` (the cache writer, through the same background
drain as the single-process prefill) and takes the resume checkpoints. Every chunk runs exactly the
computation the single-process chunked prefill runs for it, on operands of the same shapes and
layouts, so on the CPU (fp32) the cache is byte-identical to a one-process prefill.

Why an all-gather, not a ring that overlaps the transfer with attention: one layer's KV of
Qwen2.5-7B at 1M tokens is 2 GiB, an all-gather moves it in milliseconds over NVLink while the
layer's attention takes seconds, and a ring would change the attention's arithmetic (partial
results merged by log-sum-exp) and so give up byte equality; `RankStats.exchange_seconds` reports
the share the exchange takes, so the choice can be checked on every run.

The slices are balanced by FLOPs (linear layers plus causal attention, which grows with position),
not by token count: with equal slices the last rank would do 7/16 of a 4-rank prefill's attention.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from topk_decode.errors import TopkError
from topk_decode.model.blocks import ModelShape, attention_inputs, final_logits, finish_block, rope
from topk_decode.prefill.drain import KVDrain
from topk_decode.prefill.layerwise import LayerStreamer, PrefillStats, chunk_attention, device_room

POLL_S = 0.0005  # sleep between polls of a pending collective (the peers are checked meanwhile)
GO, STOP = 1, 0  # the first word of the start message rank 0 sends the others
PEER_EXIT_S = 3.0  # after a failed collective: how long to wait for the failed rank's exit code
PIECE_BYTES = 256 * 2**20  # residual-stream rows move between ranks in pieces of this size (checkpoint, resume)


@dataclass
class Ranks:
    """This process's place in a prefill group (the default torch.distributed process group).

    Args:
        rank, world: this rank and the number of ranks.
        device: the compute device of this rank.
        check: raises when a peer process is gone (a spawned group watches its processes); called
            while a collective is pending, so a dead peer ends the wait instead of hanging it.
    """

    rank: int
    world: int
    device: torch.device
    check: Callable[[], None] = field(default=lambda: None)

    @property
    def comm_device(self) -> torch.device:
        """Where collective buffers live: the GPU for NCCL, the CPU for gloo."""
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def wait(self, work) -> None:
        """Wait for an async collective, checking the peers meanwhile (signals stay deliverable too)."""
        try:
            while not work.is_completed():
                self.check()
                time.sleep(POLL_S)
            work.wait()
        except RuntimeError as e:  # gloo notices a dead peer itself ("Connection closed by peer")
            deadline = time.monotonic() + PEER_EXIT_S
            while time.monotonic() < deadline:  # name the rank and its exit code when it is one we watch
                self.check()
                time.sleep(0.05)
            raise TopkError(
                f"a prefill rank stopped: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            ) from None


@dataclass
class RankStats(PrefillStats):
    """What a sequence-parallel prefill measured (on rank 0)."""

    exchange_seconds: float = 0.0  # rank 0's time in the layers' all-gathers: transfer + waiting for slower ranks
    slices: list[tuple[int, int]] = field(default_factory=list)


def layer_flops(config) -> tuple[float, float]:
    """FLOPs of one layer for one token: (linear part, attention per earlier key)."""
    shape = ModelShape.from_config(config)
    C, H, Hkv, D = shape.hidden_size, shape.n_heads, shape.n_kv_heads, shape.head_dim
    inter = getattr(config, "intermediate_size", 4 * C)
    linear = 2 * (C * H * D + 2 * C * Hkv * D + H * D * C + 3 * C * inter)
    return float(linear), float(4 * H * D)


def plan_slices(n: int, world: int, chunk_size: int, flops: tuple[float, float]) -> list[tuple[int, int]]:
    """Contiguous token slices, one per rank, cut at multiples of `chunk_size`, of about equal FLOPs.

    Args:
        n: context tokens.
        world: ranks.
        chunk_size: the prefill's chunk length (slices hold whole chunks, so each chunk is computed
            as the single-process prefill computes it).
        flops: `layer_flops` of the model.
    Returns:
        [(start, end)] per rank, covering 0..n in order; trailing ranks may get empty slices.
    """
    linear, per_key = flops
    bounds = list(range(0, n, chunk_size)) + [n]
    # cost of each chunk: linear work per token, plus attention to every earlier key (position + 1)
    costs = [linear * (e - s) + per_key * ((s + 1 + e) * (e - s) / 2) for s, e in zip(bounds, bounds[1:])]
    total, acc, cuts = sum(costs), 0.0, [0]
    for i, c in enumerate(costs):
        target = total * len(cuts) / world
        if len(cuts) < world and acc + c / 2 >= target:  # cut before chunk i when its middle passes the target
            cuts.append(i)
        acc += c
    while len(cuts) < world:
        cuts.append(len(costs))
    cuts.append(len(costs))
    return [(bounds[cuts[r]], bounds[cuts[r + 1]]) for r in range(world)]


def _residual(t: int, shape: ModelShape, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This rank's (T, C) residual stream: on the device when it fits comfortably, else pinned host memory
    (the single-process rule, with this rank's queries and the gathered layer's KV set aside)."""
    if device.type == "cuda":
        kv = 2 * shape.n_kv_heads * n * shape.head_dim * dtype.itemsize
        queries = t * shape.n_heads * shape.head_dim * dtype.itemsize
        if t * shape.hidden_size * dtype.itemsize <= (device_room(device) - 3 * kv - queries) // 4:
            return torch.empty((t, shape.hidden_size), dtype=dtype, device=device)
    return torch.empty((t, shape.hidden_size), dtype=dtype, pin_memory=device.type == "cuda")


def send_start(ranks: Ranks, ids: list[int], start_layer: int, slices: list[tuple[int, int]]) -> None:
    """Rank 0: tell the other ranks to start (token ids, first layer, slices)."""
    head = torch.tensor([GO, len(ids), start_layer] + [e for _, e in slices], dtype=torch.int64)
    ranks.wait(dist.broadcast(head.to(ranks.comm_device), 0, async_op=True))
    ranks.wait(dist.broadcast(torch.tensor(ids, dtype=torch.int64, device=ranks.comm_device), 0, async_op=True))


def send_stop(ranks: Ranks, timeout: float) -> bool:
    """Rank 0, before `send_start`: tell the other ranks there is nothing to do. True once delivered."""
    head = torch.zeros(3 + ranks.world, dtype=torch.int64, device=ranks.comm_device)
    work = dist.broadcast(head, 0, async_op=True)
    deadline = time.monotonic() + timeout
    while not work.is_completed():
        if time.monotonic() > deadline:
            return False
        ranks.check()
        time.sleep(POLL_S)
    return True


def receive_start(ranks: Ranks) -> tuple[list[int], int, list[tuple[int, int]]] | None:
    """Other ranks: wait for rank 0's start message; None when it says stop."""
    head = torch.zeros(3 + ranks.world, dtype=torch.int64, device=ranks.comm_device)
    ranks.wait(dist.broadcast(head, 0, async_op=True))
    head = head.cpu().tolist()
    if head[0] != GO:
        return None
    n, start = head[1], head[2]
    ends = head[3:]
    ids = torch.empty(n, dtype=torch.int64, device=ranks.comm_device)
    ranks.wait(dist.broadcast(ids, 0, async_op=True))
    slices = [(0 if r == 0 else ends[r - 1], ends[r]) for r in range(ranks.world)]
    return ids.cpu().tolist(), start, slices


def _pieces(slices: list[tuple[int, int]], row_bytes: int) -> list[tuple[int, int]]:
    """Row ranges [j0, j1) within a slice that move together (bounded transient buffers)."""
    t_max = max(e - s for s, e in slices)
    step = max(1, PIECE_BYTES // row_bytes)
    return [(j, min(j + step, t_max)) for j in range(0, t_max, step)]


def scatter_rows(ranks: Ranks, full: torch.Tensor | None, local: torch.Tensor, slices: list[tuple[int, int]]) -> None:
    """Rank 0 sends each rank its slice of the (N, C) CPU tensor `full`; every rank fills `local` (T, C).

    Collectives only (piece by piece, padded to the longest slice): gloo completes point-to-point
    operations only inside wait(), which the polling of `Ranks.wait` never calls.
    """
    a, b = slices[ranks.rank]
    width = local.shape[1]
    for j0, j1 in _pieces(slices, width * local.element_size()):
        recv = torch.empty((j1 - j0, width), dtype=local.dtype, device=ranks.comm_device)
        parts = None
        if ranks.rank == 0:
            parts = [torch.zeros_like(recv) for _ in slices]
            for part, (s, e) in zip(parts, slices):
                rows = max(0, min(e - s, j1) - j0)
                part[:rows] = full[s + j0 : s + j0 + rows]
        ranks.wait(dist.scatter(recv, parts, src=0, async_op=True))
        rows = max(0, min(b - a, j1) - j0)
        local[j0 : j0 + rows].copy_(recv[:rows])


def gather_rows(ranks: Ranks, local: torch.Tensor, slices: list[tuple[int, int]]) -> torch.Tensor | None:
    """The ranks' (T, C) slices assembled on rank 0 as one (N, C) CPU tensor; None on the other ranks."""
    width = local.shape[1]
    out = torch.empty((slices[-1][1], width), dtype=local.dtype) if ranks.rank == 0 else None
    a, b = slices[ranks.rank]
    for j0, j1 in _pieces(slices, width * local.element_size()):
        send = torch.zeros((j1 - j0, width), dtype=local.dtype, device=ranks.comm_device)
        rows = max(0, min(b - a, j1) - j0)
        send[:rows] = local[j0 : j0 + rows]
        parts = [torch.empty_like(send) for _ in slices] if ranks.rank == 0 else None
        ranks.wait(dist.gather(send, parts, dst=0, async_op=True))
        if ranks.rank == 0:
            for part, (s, e) in zip(parts, slices):
                rows = max(0, min(e - s, j1) - j0)
                out[s + j0 : s + j0 + rows].copy_(part[:rows])
    return out


def last_row(ranks: Ranks, local: torch.Tensor, slices: list[tuple[int, int]]) -> torch.Tensor:
    """The residual stream of the last token (1, C), on every rank (its owner broadcasts it)."""
    n = slices[-1][1]
    owner = next(r for r, (a, b) in enumerate(slices) if a <= n - 1 < b)
    row = torch.empty((1, local.shape[1]), dtype=local.dtype, device=ranks.comm_device)
    if ranks.rank == owner:
        row.copy_(local[n - 1 - slices[owner][0] :])
    ranks.wait(dist.broadcast(row, owner, async_op=True))
    return row


def _exchange_kv(
    ranks: Ranks, send: torch.Tensor, slices: list[tuple[int, int]], shape: ModelShape, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather the ranks' (Tmax, 2, Hkv, D) token-major K/V into the layer's (1, Hkv, N, D) keys and values."""
    parts = [torch.empty_like(send) for _ in range(ranks.world)]
    ranks.wait(dist.all_gather(parts, send, async_op=True))
    keys = torch.empty((1, shape.n_kv_heads, n, shape.head_dim), dtype=send.dtype, device=ranks.device)
    values = torch.empty_like(keys)
    for (a, b), part in zip(slices, parts):
        if b > a:
            keys[0, :, a:b] = part[: b - a, 0].transpose(0, 1)
            values[0, :, a:b] = part[: b - a, 1].transpose(0, 1)
    return keys, values


def _layer(
    model,
    layer,
    ranks: Ranks,
    hidden: torch.Tensor,
    slices: list[tuple[int, int]],
    shape: ModelShape,
    chunk_size: int,
    stats: RankStats,
    on_chunk: Callable[[int], None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer over this rank's slice (`hidden` (T, C) updated in place); returns the layer's K/V."""
    a, b = slices[ranks.rank]
    n, device, dtype = slices[-1][1], ranks.device, hidden.dtype
    t_max = max(e - s for s, e in slices)
    send = torch.zeros((t_max, 2, shape.n_kv_heads, shape.head_dim), dtype=dtype, device=ranks.comm_device)
    # the chunk's queries keep the layout attention_inputs gives them ((1, T, H, D) storage seen as (1, H, T, D))
    queries = torch.empty((1, b - a, shape.n_heads, shape.head_dim), dtype=dtype, device=device).transpose(1, 2)
    chunks = [(s, min(s + chunk_size, b)) for s in range(a, b, chunk_size)]
    for s, e in chunks:
        x = hidden[s - a : e - a].to(device, non_blocking=True)[None]  # (1, T, C)
        cos, sin = rope(model, x, torch.arange(s, e, device=device))
        q, k, v = attention_inputs(layer, x, cos, sin, shape)  # (1, H|Hkv, T, D)
        queries[:, :, s - a : e - a] = q
        send[s - a : e - a, 0] = k[0].transpose(0, 1)
        send[s - a : e - a, 1] = v[0].transpose(0, 1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the timer below then sees the exchange, not this rank's projections
    t0 = time.perf_counter()
    keys, values = _exchange_kv(ranks, send, slices, shape, n)
    stats.exchange_seconds += time.perf_counter() - t0
    del send
    for s, e in chunks:
        x = hidden[s - a : e - a].to(device, non_blocking=True)[None]
        out = chunk_attention(queries[:, :, s - a : e - a], keys[:, :, :e], values[:, :, :e])  # (1, H, T, D)
        hidden[s - a : e - a].copy_(finish_block(layer, x, out)[0], non_blocking=True)
        on_chunk(e - s)
    return keys, values


class _Progress:
    """Rank 0's progress callback, scaled from its own chunks to whole layers of N tokens."""

    def __init__(self, fn: Callable[[int], None] | None, n: int, mine: int) -> None:
        self.fn, self.n, self.mine, self.done, self.told = fn, n, mine, 0, 0

    def chunk(self, tokens: int) -> None:
        self.done += tokens
        self.tell(self.n * self.done // max(self.mine, 1))

    def tell(self, total: int) -> None:
        if self.fn is not None and total > self.told:
            self.fn(total - self.told)
            self.told = total

    def layer_done(self) -> None:
        self.tell(self.n)
        self.done = self.told = 0


@torch.inference_mode()
def run_rank(
    model,
    ids: list[int],
    ranks: Ranks,
    slices: list[tuple[int, int]],
    chunk_size: int,
    on_layer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
    progress: Callable[[int], None] | None = None,
    offload_weights: bool = False,
    start_layer: int = 0,
    hidden: torch.Tensor | None = None,
    checkpoint: Callable[[int, torch.Tensor], None] | None = None,
    checkpoint_every: float = 60.0,
) -> tuple[torch.Tensor | None, RankStats]:
    """This rank's share of a sequence-parallel prefill; every rank of the group calls it together.

    Args:
        model: the HF causal LM, replicated on every rank (on the CPU with `offload_weights`).
        ids: the N context token ids (the same on every rank).
        ranks: this process's place in the group.
        slices: `plan_slices` (the same on every rank).
        chunk_size: tokens per chunk.
        on_layer, progress, checkpoint, checkpoint_every: as `prefill_layers`; used on rank 0 only.
        offload_weights: stream one decoder layer at a time to the device (see layerwise.py).
        start_layer: resume at this layer; rank 0 then passes the (N, C) residual stream entering it as `hidden`.
        hidden: see `start_layer` (rank 0 only).
    Returns:
        rank 0: the logits (V,) after the last token and the stats; other ranks: None and their stats.
    """
    shape = ModelShape.from_config(model.config)
    device, n = ranks.device, len(ids)
    dtype = next(model.parameters()).dtype
    a, b = slices[ranks.rank]
    lead = ranks.rank == 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    stats = RankStats(n, 0.0, None, start_layer, ranks=ranks.world, slices=slices)
    local = _residual(b - a, shape, n, dtype, device)  # (T, C)
    if start_layer:
        scatter_rows(ranks, hidden, local, slices)
        hidden = None
    else:
        embed = model.model.embed_tokens
        tokens = torch.tensor(ids[a:b], dtype=torch.int64)
        for s in range(0, b - a, chunk_size):
            local[s : s + chunk_size].copy_(embed(tokens[s : s + chunk_size].to(embed.weight.device)))
    streamer = rotary_host = None
    if offload_weights:
        rotary = model.model.rotary_emb
        rotary_host = {name: buf.data for name, buf in rotary.named_buffers()}
        for buf in rotary.buffers():
            buf.data = buf.data.to(device)
        streamer = LayerStreamer(model, device)
    tell = _Progress(progress if lead else None, n, b - a)
    last_checkpoint = time.monotonic()
    try:
        with KVDrain(on_layer, device) if lead and on_layer is not None else nullcontext() as drain:
            for layer_idx, layer in enumerate(model.model.layers):
                if layer_idx < start_layer:
                    continue
                if streamer is not None:
                    streamer.acquire(layer_idx)
                    streamer.prefetch(layer_idx + 1)
                keys, values = _layer(model, layer, ranks, local, slices, shape, chunk_size, stats, tell.chunk)
                if streamer is not None:
                    streamer.release(layer_idx)
                if drain is not None:
                    drain.submit(layer_idx, keys[0], values[0])
                tell.layer_done()
                del keys, values
                due = torch.zeros(1, dtype=torch.int64, device=ranks.comm_device)
                if (
                    lead
                    and checkpoint is not None
                    and layer_idx + 1 < shape.n_layers
                    and time.monotonic() - last_checkpoint >= checkpoint_every
                ):
                    due.fill_(1)
                ranks.wait(dist.broadcast(due, 0, async_op=True))
                if int(due.item()):
                    if drain is not None:
                        drain.wait()  # the layers below the checkpoint are on disk first
                    if device.type == "cuda" and not local.is_cuda:
                        torch.cuda.synchronize(device)  # async copies into the pinned slice have landed
                    full = gather_rows(ranks, local, slices)
                    if lead:
                        checkpoint(layer_idx + 1, full)
                        last_checkpoint = time.monotonic()
            if device.type == "cuda" and not local.is_cuda:
                torch.cuda.synchronize(device)
            row = last_row(ranks, local, slices)
            last = None
            if lead:
                head = model.lm_head.weight.device
                last = final_logits(model, row.to(head)[None])[0].cpu()
    finally:
        if streamer is not None:
            for name, buf in model.model.rotary_emb.named_buffers():
                buf.data = rotary_host[name]
            for i in list(streamer.ready):
                streamer.release(i)
    stats.seconds = time.perf_counter() - t0
    stats.peak_device_bytes = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return last, stats
