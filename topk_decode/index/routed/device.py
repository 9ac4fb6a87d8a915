"""routed's routing and estimate on the decode device, inside the captured one-token step.

On the CPU, routing reads every centroid and the estimate every cluster's mean value at every step and
layer: at 128K tokens and clusters of 16 that is 4 MB per KV head, three times the keys the scan reads,
and it dominated the step on the GPU host (docs/BENCHMARKS.md "routing on the device"). On the GPU
the same arithmetic is a few microseconds of a kernel. So, for the layers whose tables fit the device:

- per layer, the step's segment (decode/graphs.py) scores the query against the centroids, ranks the
  clusters exactly as the CPU path does (a cluster's priority is the largest share of attention any of
  the head's queries gives it), and copies the ranked cluster ids and how many of them fit the budget
  to pinned host memory (`route`); the CPU then scans only those clusters' keys, takes the exact top-k
  and computes the context part (kernels/routed_scan.py `scan_head`);
- while the CPU scans, the device computes the estimate of the clusters not read (index/routed/estimate.py
  `unread_part`, the same function the torch path calls) and merges it into the window part by
  log-sum-exp (`estimate`): a third disjoint part of the same softmax, so the merge stays exact. With
  `estimate_by=keys` a cluster's weight is the sum of its keys' approximate weights from their residual codes
  (index/routed/device_codes.py `cluster_lse`) instead of n_c·exp(s·q·μ_c);
- with `rank=keys` (`rank_keys`) the device ranks keys, not clusters: every row's approximate score
  (`row_scores`), the budget's best rows of each head to the host (in row order, in place of the clusters), and the
  estimate over the rows not read, summed per cluster (`segment_lse`);
- with `estimate_read` as well, the rows read but outside a query's top-k join too (`read_part`, a fourth disjoint
  part, merged once the host's part has come back): the host's scan writes their exact scaled scores (`read_host`,
  −inf at the top-k), each row's value is its cluster's mean plus its coded residual (`row_residuals`);
- with `device_read` (`host_kv`), the device also reads those rows (or the ranked clusters' rows, where it ranks
  clusters) from the host's RAM itself, scores them exactly, takes the top-k and sums their values (`attend`,
  index/routed/device_read.py): the host does nothing for the layer.

The tables: centroids and mean values, log cluster sizes, sizes (and with `rank=keys` or `estimate_by=keys` the
residual codes, m/2 bytes per key: 64 at rank=keys' default m = D = 128). Where the tables of every layer do not fit
beside `reserve` bytes in the keys' dtype, the mean values (they only feed the estimate) go to float8
(e4m3, one scale per KV head and dimension), and where that does not fit either, the centroids too (then
routing ranks with e4m3 rounding, 3 mantissa bits per centroid element: docs/STRATEGIES.md "Routing on
the device"); with codes, float8 tables are taken too where they leave room for finer codes of every layer
(`_place_tables`). Layers whose tables still do not fit route on the CPU as before. The residual codes are placed only
after every layer's tables, coarsened until every layer's fit (`_place_codes`), in layer order while they fit: a layer
left without them ranks and estimates by clusters on the device (routed's default), far faster than routing on the CPU
(the real 1M cache under 16 GiB: docs/BENCHMARKS.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from topk_decode.errors import TopkError
from topk_decode.index.routed.device_codes import (
    DeviceCodes,
    DeviceValueCodes,
    Tensors,
    cluster_lse,
    coarsened,
    residual_sum,
    row_residuals,
    row_scores,
    segment_lse,
)
from topk_decode.index.routed.device_read import HostKV, read_rows, read_scores, weighted_values
from topk_decode.index.routed.estimate import (
    CodeError,
    code_error,
    error_shift,
    softmax_weights,
    unread_part,
)
from topk_decode.index.routed.pq import top_rows

# Free device memory kept beside the tables for the step itself (its graphs' temporaries, the window).
DEFAULT_RESERVE = 384 << 20
# With key codes the step holds (Hkv, G, N) float32 row scores: the reserve is at least this many of them (a layer's
# scores live into the next segment where the host scans its rows; at 1M tokens of Qwen2.5-7B each is 112 MiB).
ROW_SCORE_BUFFERS = 4
MIN_COARSE_M = 16  # key codes are coarsened (`_place_codes`) down to this many sub-vectors, no further
# The tables' precisions, most exact first: what `values="auto"` tries in turn (see `DeviceRoutes`).
TABLE_KINDS = ("keys", "fp8-values", "fp8")
_FP8 = getattr(torch, "float8_e4m3fn", None)


@dataclass
class _Positions(Tensors):
    positions: torch.Tensor  # (Hkv, N) int32


@dataclass
class _First(Tensors):
    first: torch.Tensor  # (Hkv, C) int64


class LayerTables:
    """One layer's routing tables on the device.

    cent: (Hkv, C, D) centroids (keys' dtype or float8); cscale: (Hkv, 1, D) float32 float8 scale or None;
    bias: (Hkv, 1, C) float32 0 or −inf (no searchable key);
    log_n: (Hkv, 1, C) float32; sizes: (Hkv, C) int64 rows per cluster; vmeans: (Hkv, C, D) mean values
    (keys' dtype or float8) or None without the estimate; vscale: (Hkv, 1, D) float32 float8 scale or None.
    budget: keys to read per head; width: clusters ranked per head (W), with rank_keys the rows read.
    codes: the residual codes (index/routed/device_codes.py) of the per-key ranking and estimate, or None;
    vcodes: the value residual codes and the means they are to (`pq_values`), or None.
    error: the key codes' error as placed (routed's `code_error`: the estimate's `error_shift`), or None.
    pad: (Hkv, 1) int64 a row outside the searchable range per head (rank_keys in blocks: `pq.top_rows`), or None.
    kscale: (Hkv, 1, D) float32 an int8 cache's key scales (its tables are in the int8 keys' space: the query is
        scaled by them first, as the CPU's is), or None.
    positions: (Hkv, N) int32 each layout row's cache position (−1 outside the searchable range) where the device reads
        the rows it ranked itself (`device_read`), else None; k: the layer's top-k there.
    reads: where the device reads the rows of the clusters it ranked itself (their positions from the host's table),
        the rows it reads per head at most (the budget plus the largest cluster: the last cluster taken starts inside
        the budget), else 0; first: then (Hkv, C) int64 each cluster's first layout row, else None.
    """

    def __init__(
        self,
        cent,
        cscale,
        bias,
        log_n,
        sizes,
        vmeans,
        vscale,
        budget: int,
        width: int,
        codes: DeviceCodes | None = None,
        pad: torch.Tensor | None = None,
        vcodes: DeviceValueCodes | None = None,
        kscale: torch.Tensor | None = None,
    ) -> None:
        self.cent, self.cscale, self.bias, self.log_n, self.sizes = cent, cscale, bias, log_n, sizes
        self.kscale = kscale
        self.vmeans, self.vscale = vmeans, vscale
        self.budget, self.width = budget, width
        self.codes, self.pad, self.vcodes = codes, pad, vcodes
        self.error: CodeError | None = None
        self.positions: torch.Tensor | None = None
        self.k = self.reads = 0
        self.first: torch.Tensor | None = None

    def nbytes(self) -> int:
        """Device bytes held."""
        ts = [self.cent, self.cscale, self.bias, self.log_n, self.sizes, self.vmeans, self.vscale, self.kscale]
        ts += [self.positions, self.first]
        held = sum(t.numel() * t.element_size() for t in ts if t is not None)
        return held + sum(c.nbytes() for c in (self.codes, self.vcodes, self.error) if c is not None)


def _to_fp8(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Hkv, C, D) → float8 e4m3 and (Hkv, 1, D) float32 scales: each (head, dimension)'s largest magnitude
    maps to 448, the format's largest (keys have a few dimensions far larger than the rest)."""
    scale = v.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-30) / 448.0
    return (v.float() / scale).to(_FP8), scale


def _probe(device: torch.device, nbytes: int) -> None:
    """Allocate `nbytes` on a CUDA device and give them back to the driver (OutOfMemoryError where they do not fit). The
    cache is emptied either way: a probe's block left cached would be split for the next table placed, and the
    remainders, free but too small for the step, count against the GPU budget (docs/BENCHMARKS.md "Capture under
    16 GiB")."""
    try:
        probe = torch.empty(nbytes, dtype=torch.uint8, device=device)
        del probe
    finally:
        torch.cuda.empty_cache()


def _cuda_bmm_to_fp32() -> bool:
    """Whether this torch multiplies bf16 batches into fp32 outputs on CUDA (`torch.bmm(out_dtype=)`)."""
    try:
        a = torch.ones(1, 1, 8, dtype=torch.bfloat16, device="cuda")
        return torch.bmm(a, a.transpose(1, 2), out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError):
        return False


def cluster_rows(
    first: torch.Tensor, order: torch.Tensor, sz: torch.Tensor, end: torch.Tensor, take: torch.Tensor, width: int
) -> torch.Tensor:
    """(Hkv, width) int32 the layout rows of the first `take[h]` clusters of `order[h]`, cluster after cluster in that
    order, −1 past them.

    Args:
        first: (Hkv, C) int64 each cluster's first layout row (clusters are stored one after another in the layout);
        order: (Hkv, W) int64 ranked cluster ids; sz: (Hkv, W) int64 their sizes, end: their cumulative sum (`route`
            has both); take: (Hkv,) clusters taken of them; width: rows per head returned.

    >>> sz = torch.tensor([[1, 2, 3]])  # the sizes of clusters 2, 0, 1 of sizes [2, 3, 1]
    >>> cluster_rows(torch.tensor([[0, 2, 5]]), torch.tensor([[2, 0, 1]]), sz, sz.cumsum(1), torch.tensor([2]), 4)
    tensor([[ 5,  0,  1, -1]], dtype=torch.int32)
    """
    j = torch.arange(width, device=order.device).expand(order.shape[0], width).contiguous()
    slot = torch.searchsorted(end, j, right=True)  # (Hkv, width) the ranked cluster holding read row j
    taken = slot < take[:, None]
    slot = slot.clamp_(max=order.shape[1] - 1)
    rows = first.gather(1, order.gather(1, slot)) + j - (end - sz).gather(1, slot)
    return torch.where(taken, rows, -1).to(torch.int32)


def ranked_width(budget: int, n_clusters: int, n_tokens: int) -> int:
    """Clusters ranked per head: eight times those of average size the budget holds, plus 64.

    The CPU path grows its candidate list until the budget is reached; a captured step needs a fixed
    one, so it takes a margin: the clusters ranked first are often smaller than average (with four times,
    most heads of Llama-3-8B at 32K ran out of ranked clusters ~10 % short of the budget). Ranking more
    costs the GPU little and the CPU nothing (it reads the first `take`)."""
    return min(n_clusters, 8 * math.ceil(budget * n_clusters / max(n_tokens, 1)) + 64)


class DeviceRoutes:
    """The routed strategy's device-side routing for the layers whose tables fit.

    Args:
        stats: per layer the strategy's `SearchableStats` (CPU).
        sizes: per layer (Hkv, C) int64 rows per cluster.
        bias: per layer (Hkv, 1, C) float32 routing bias (0, or −inf for clusters without searchable keys).
        budgets: per layer the keys to read per head where clusters are ranked.
        n_tokens: context tokens N; scale: softmax scale; estimate: compute the unread clusters' estimate.
        device: the decode device.
        values: "auto" (the first of the ladder below that holds every layer), or one of it: "keys" (the
            keys' dtype), "fp8-values" (float8 mean values), "fp8" (float8 centroids and mean values).
        reserve: device bytes to leave free (CUDA only); with `codes`, at least `ROW_SCORE_BUFFERS` of the step's (Hkv,
            group, N) float32 row scores.
        group: query heads per KV head.
        codes: per layer the residual codes (`device_codes`, on the CPU) for the keyed estimate (`estimate_by=keys`)
            and the per-key ranking, or None.
        rank_keys: rank every key by its approximate score (routed's rank=keys) and send the host the `row_budgets`
            best rows of each head instead of clusters (in the layers whose codes fit); the estimate then sums the
            unread keys per cluster. row_budgets: per layer the rows to read per head where keys are ranked.
        value_codes: per layer the value residual codes (`device_value_codes`, on the CPU) with rank_keys and
            `pq_values`, or None: placed with the layer's codes, they give every unread key its own coded value.
        key_block: with rank_keys, read blocks of this many consecutive rows (`pq.top_rows`); pad_rows: per layer
            (Hkv, 1) int64 an outside row of each head, read past the last block's end (needed when key_block > 1).
        key_scales: an int8 cache's per layer (Hkv, D) key scales (`LayerTables.kscale`), or None.
        estimate_read: with rank_keys and the estimate, also weigh the rows read outside each query's top-k by the
            exact scores the host's scan returns (`read_part`).
        host_kv: with rank_keys, the host's keys and values the device reads itself (`device_read`: `attend`), or
            None; positions: then per layer (Hkv, N) int32 each layout row's position (−1 outside the searchable
            range); ks: per layer the top-k; count_read: called with (rows read, rows searchable) for every layer
            the device attends (the strategy's read counters); n_searchable: the searchable rows per head.
    """

    def __init__(
        self,
        stats,
        sizes,
        bias,
        budgets: list[int],
        n_tokens: int,
        scale: float,
        estimate: bool,
        device: torch.device,
        values: str = "auto",
        reserve: int = DEFAULT_RESERVE,
        codes: list[DeviceCodes] | None = None,
        rank_keys: bool = False,
        row_budgets: list[int] | None = None,
        value_codes: list[DeviceValueCodes] | None = None,
        key_block: int = 1,
        pad_rows: list[torch.Tensor] | None = None,
        key_scales: list[torch.Tensor] | None = None,
        estimate_read: bool = False,
        host_kv: HostKV | None = None,
        positions: list[torch.Tensor] | None = None,
        ks: list[int] | None = None,
        count_read=None,
        n_searchable: int = 0,
        group: int = 1,
        error_sample: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
        code_m: int | None = None,
        value_layers: int | None = None,
    ) -> None:
        self.device, self.scale, self.estimate = device, scale, estimate
        self.host_kv, self._count_read, self._n_searchable = host_kv, count_read, n_searchable
        self._group = group  # query heads per KV head
        self.estimate_read = estimate_read and estimate and rank_keys
        self._key_scales = key_scales
        self._codes, self.rank_keys = codes, rank_keys
        self._row_budgets = row_budgets if row_budgets is not None else budgets
        self._value_codes = value_codes
        self._error_sample = error_sample  # the codes' error measured where given (`code_error`)
        # a placement asked for (routed's device_code_m, device_value_layers): at most these sub-vectors and value-coded
        # layers, however much room there is
        self._code_m, self._value_layers = code_m, value_layers
        self.key_block, self._pad_rows = key_block, pad_rows
        if key_block > 1 and pad_rows is None:
            raise ValueError("key blocks need a padding row per layer and head")
        if rank_keys and codes is None:
            raise ValueError("rank_keys needs the residual codes")
        self.n_layers = len(stats)
        hkv = sizes[0].shape[0]
        if codes is not None:
            reserve = max(reserve, ROW_SCORE_BUFFERS * hkv * group * n_tokens * 4)
        self.reserve = reserve  # device bytes left free beside the tables for the step
        self.tables: list[LayerTables | None] = [None] * self.n_layers
        self.code_halvings = 0  # how many times the key codes were halved to fit (`_place_codes`)
        kinds = list(TABLE_KINDS) if values == "auto" else [values]
        if _FP8 is None:
            kinds = ["keys"]
        # On CUDA bf16 products accumulate into fp32 outputs directly: no fp32 copy of a table per step
        # (q is exactly bf16: the model computed it in bf16). Elsewhere the tables are widened per step.
        self._bf16_bmm = device.type == "cuda" and _cuda_bmm_to_fp32()
        # device_read's positions are placed after the codes: room is kept for them
        code_reserve = reserve + (0 if host_kv is None else sum(p.numel() * 4 for p in positions))
        self.values_kind = self._place_tables(stats, sizes, bias, budgets, n_tokens, kinds, reserve, code_reserve)
        if codes is not None:
            self._place_codes(n_tokens, code_reserve)
        if host_kv is not None:
            self._place_positions(positions, ks, reserve)
        # the codes as built on the host: on the device now, or left out; kept, they would hold 5 GiB of RAM at 1M
        # tokens of the Qwen2.5-7B shape (packed key and value codes, the value codes' means) for nothing
        self._codes = self._value_codes = None
        # per layer, what the device sends the CPU: ranked clusters (Hkv, W) int32 and how many to read
        # (rank_keys: the rows to read, all W of them)
        pin = device.type == "cuda"
        self.order_host = [
            None if t is None else torch.zeros((hkv, t.width), dtype=torch.int32, pin_memory=pin) for t in self.tables
        ]
        self.take_host = [
            None
            if t is None
            else torch.full((hkv,), t.width if self.ranks_rows(t) else 0, dtype=torch.int32, pin_memory=pin)
            for t in self.tables
        ]
        self._read: list[tuple[torch.Tensor, ...] | None] = [None] * self.n_layers  # for `estimate_part`
        # with estimate_read, per layer: (Hkv, G, W) float32 the host's exact scores of the rows read (−inf at the
        # top-k; pinned), its copy on the device (the same tensor on a CPU), and the (Hkv, W) rows; made at the first
        # step (G is the queries'), before any capture
        self.read_host: list[torch.Tensor | None] = [None] * self.n_layers
        self._read_dev: list[torch.Tensor | None] = [None] * self.n_layers
        self._read_rows: list[torch.Tensor | None] = [None] * self.n_layers
        self._attend_in: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.n_layers  # for `attend`

    def _place_tables(self, stats, sizes, bias, budgets, n_tokens, kinds, reserve, code_reserve) -> str:
        """Place every layer's tables in the first of `kinds` that holds them all (the last where none does); with key
        codes, in the kind that leaves room for the finest codes of every layer (`_halvings`: all layers keyed first,
        then the fewest halvings, then the most exact tables): a layer ranking clusters, or coarser codes, keep dense's
        answer less often than float8 tables change it (docs/history/eval-2026-11.md "Key codes under a GPU budget",
        docs/STRATEGIES.md "Routing on the device"). Returns the kind placed."""
        best = None  # (score, kind) of the kinds whose tables all fit
        for i, kind in enumerate(kinds):
            self._place(stats, sizes, bias, budgets, n_tokens, kind, reserve)
            if all(t is not None for t in self.tables):
                if self._codes is None:
                    return kind
                r, fit = self._halvings(self._codes, code_reserve)
                if fit and r == 0:
                    return kind
                score = (fit, -r, -i if fit else i)  # none fits: the most compact tables key the most layers
                if best is None or score > best[0]:
                    best = (score, kind)
            elif best is None and i == len(kinds) - 1:
                return kind  # no kind holds every layer's tables: as many layers as the most compact ones allow
            self.tables = [None] * self.n_layers
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self._place(stats, sizes, bias, budgets, n_tokens, best[1], reserve)
        return best[1]

    def _place(self, stats, sizes, bias, budgets, n_tokens, kind, reserve) -> None:
        """Copy the layers' tables to the device in layer order while they fit beside `reserve`."""
        for layer, st in enumerate(stats):
            try:
                self.tables[layer] = self._layer(layer, st, sizes[layer], bias[layer], budgets[layer], n_tokens, kind)
                self._check_reserve(reserve)
            except torch.OutOfMemoryError:
                self.tables[layer] = None
                break

    def _place_codes(self, n_tokens: int, reserve: int) -> None:
        """Add the residual codes to the placed layers in layer order while they fit beside `reserve`: every layer's
        cluster tables come first (a layer without them routes on the CPU, by far the slowest), so a layer whose
        codes do not fit ranks and estimates by clusters on the device. Where the codes of every placed layer do not
        fit but coarser ones would, every layer's are coarsened (`device_codes.coarsened`, half the bytes each time)
        the fewest times that make them fit, down to `MIN_COARSE_M` sub-vectors: a layer ranking keys by coarser codes
        keeps dense's answer more often than one ranking clusters (docs/history/eval-2026-11.md "Key codes under a GPU
        budget").
        Then the value codes (`pq_values`) the same way, after every layer's key codes (per-key ranking keeps more of
        dense's answers than the value codes add: docs/history/eval-2026-11.md), so a layer without them estimates its
        unread keys' values by their clusters' means."""
        placed = [c for t, c in zip(self.tables, self._codes) if t is not None]
        self.code_halvings = max(self._halvings(placed, reserve)[0], self._asked_halvings(placed))
        for layer, (t, codes, rows) in enumerate(zip(self.tables, self._codes, self._row_budgets)):
            if t is None:
                break
            for _ in range(self.code_halvings):
                codes = coarsened(codes)
            t.codes = self._moved(codes, reserve)
            if t.codes is None:
                break
            if self._error_sample is not None and self.estimate:  # the error of the codes as placed
                sample, true = self._error_sample(layer)
                t.error = self._moved(code_error(true, row_residuals(codes, sample, true.shape[2])), reserve)
            if self.rank_keys:  # the host reads rows, not clusters
                t.budget = rows
                t.width = min(rows, n_tokens) // self.key_block * self.key_block
        for layer, (t, vcodes) in enumerate(zip(self.tables, self._value_codes or [])):
            if t is None or t.codes is None or (self._value_layers is not None and layer >= self._value_layers):
                break
            t.vcodes = self._moved(vcodes, reserve)
            if t.vcodes is None:
                break

    def _place_positions(self, positions: list[torch.Tensor], ks: list[int], reserve: int) -> None:
        """Make the layers the device attends itself (`attend`): those that rank rows get the rows' positions, in layer
        order while they fit (the others send the host their rows); those that rank clusters look their rows' positions
        up in the host's table (`HostKV.positions`), which takes no device memory."""
        room = True
        for layer, (t, pos, k) in enumerate(zip(self.tables, positions, ks)):
            if t is None:
                continue
            if not self.ranks_rows(t):
                if self.host_kv.positions[layer] is not None:  # (a layer whose firsts do not fit: the host scans it)
                    moved = self._moved(_First(t.sizes.cumsum(1) - t.sizes), reserve)
                    if moved is not None:
                        t.first, t.reads, t.k = moved.first, t.budget + int(t.sizes.max()), k
                continue
            moved = self._moved(_Positions(pos), reserve) if room else None
            if moved is None:
                room = False
                continue
            t.positions, t.k = moved.positions, k

    def _asked_halvings(self, codes: list[DeviceCodes]) -> int:
        """The halvings that coarsen the codes to the `code_m` sub-vectors asked for (0 where none was asked)."""
        if not codes or not self._code_m:
            return 0
        m = codes[0].books.shape[1]
        r = 0
        while m >> r > self._code_m:
            if (m >> r) % 4:
                raise TopkError(f"device_code_m={self._code_m}: {m} sub-vectors cannot be halved to it")
            r += 1
        if m >> r != self._code_m:
            raise TopkError(f"device_code_m={self._code_m} is not {m} sub-vectors halved")
        return r

    def _halvings(self, codes: list[DeviceCodes], reserve: int) -> tuple[int, bool]:
        """How many times every layer's key codes are halved: the fewest for all of them to fit beside `reserve` (0
        where they fit as built), or as many as `MIN_COARSE_M` allows where none does (the most layers keyed); and
        whether they all fit then."""
        if not codes:
            return 0, True
        m = codes[0].books.shape[1]
        packed = sum(c.packed.numel() for c in codes)  # halved by each halving; the rest is not
        rest = sum(c.nbytes() for c in codes) - packed
        if self._error_sample is not None and self.estimate:  # each layer's `CodeError`, (Hkv, D + 1, D) float32
            hkv, d = codes[0].books.shape[0], codes[0].fix_delta.shape[2]
            rest += len(codes) * hkv * (d + 1) * d * 4
        r = 0
        while not (fit := self.fits(rest + (packed >> r) + reserve)):
            if not (m >> r >= 2 * MIN_COARSE_M and (m >> r) % 4 == 0):
                break
            r += 1
        return r, fit

    def fits(self, nbytes: int) -> bool:
        """Whether `nbytes` more fit on the device now (CUDA: one probe allocation; elsewhere always)."""
        if self.device.type != "cuda":
            return True
        try:
            _probe(self.device, nbytes)
        except torch.OutOfMemoryError:
            return False
        return True

    def _moved(self, tensors: Tensors, reserve: int) -> Tensors | None:
        """`tensors` on the device if they fit beside `reserve`, else None (the copy freed)."""
        try:
            moved = tensors.to(self.device)
            self._check_reserve(reserve)
            return moved
        except torch.OutOfMemoryError:
            return None

    def _check_reserve(self, reserve: int) -> None:
        """Raise OutOfMemoryError unless `reserve` bytes are still free (CUDA only): the step's own memory."""
        if self.device.type == "cuda":
            _probe(self.device, reserve)

    def _layer(self, layer, st, sizes, bias, budget, n_tokens, kind) -> LayerTables:
        dev = self.device
        hkv, C, _ = st.centroids.shape
        vmeans = vscale = cscale = None
        if self.estimate:
            vmeans, vscale = _to_fp8(st.value_means) if kind != "keys" else (st.value_means, None)
            vmeans, vscale = vmeans.to(dev), None if vscale is None else vscale.to(dev)
        cent, cscale = _to_fp8(st.centroids) if kind == "fp8" else (st.centroids, None)
        return LayerTables(
            cent=cent.to(dev),
            cscale=None if cscale is None else cscale.to(dev),
            bias=bias.float().to(dev),
            log_n=st.log_n.float().to(dev),
            sizes=sizes.to(dev, torch.int64),
            vmeans=vmeans,
            vscale=vscale,
            budget=budget,
            width=ranked_width(budget, C, n_tokens),  # clusters; rows once `_place_codes` adds the codes
            pad=self._pad_rows[layer].to(dev) if self._pad_rows is not None else None,
            kscale=None if self._key_scales is None else self._key_scales[layer].float()[:, None, :].to(dev),
        )

    def handles(self, layer: int) -> bool:
        """Whether this layer routes on the device."""
        return self.tables[layer] is not None

    def ranks_rows(self, t: LayerTables) -> bool:
        """Whether a layer's device ranking sends the host rows (rank=keys with its codes placed), not clusters."""
        return self.rank_keys and t.codes is not None

    def sends_rows(self, layer: int) -> bool:
        """Whether layer `layer`'s ranking (`host_route`) holds rows to read rather than ranked clusters."""
        t = self.tables[layer]
        return t is not None and self.ranks_rows(t)

    def attends(self, layer: int) -> bool:
        """Whether the device reads layer `layer`'s rows and computes its context part itself (`attend`)."""
        t = self.tables[layer]
        return t is not None and (t.positions is not None or t.reads > 0)

    def attended(self, layer: int) -> int:
        """Count a step of layer `layer` that the device attended (its rows read, through `count_read`: where it ranks
        clusters, the budget, which the clusters read pass by less than one cluster); returns the top-k slots it
        filled at most (the step's exact counts would need a sync)."""
        t = self.tables[layer]
        hkv = t.sizes.shape[0]
        read = t.width if t.positions is not None else t.budget
        if self._count_read is not None:
            self._count_read(hkv * read, hkv * self._n_searchable)
        return hkv * self._group * min(t.k, read)

    def layers_on_device(self) -> int:
        """How many layers route on the device."""
        return sum(t is not None for t in self.tables)

    def keyed_layers(self) -> int:
        """How many layers score keys by their residual codes (`rank=keys`, `estimate_by=keys`)."""
        return sum(t is not None and t.codes is not None for t in self.tables)

    def value_coded_layers(self) -> int:
        """How many layers add their unread keys' coded value residuals to the estimate (`pq_values`)."""
        return sum(t is not None and t.vcodes is not None for t in self.tables)

    def nbytes(self) -> int:
        """Device bytes held by the tables."""
        return sum(t.nbytes() for t in self.tables if t is not None)

    def route(self, layer: int, q32: torch.Tensor) -> None:
        """Rank the clusters for layer `layer`'s queries and copy the ranking to the host (non-blocking).

        Args:
            q32: (Hkv, G, D) float32 queries on the device.
        """
        t = self.tables[layer]
        if t.kscale is not None:  # an int8 cache: tables in its keys' space, as the host's scaled queries
            q32 = q32 * t.kscale
        q = q32 if t.cscale is None else q32 * t.cscale  # float8 centroids: their scale moves to q
        base = self.bmm(q, t.cent.transpose(1, 2)).mul_(self.scale)  # (Hkv, G, C) s·q·μ_c
        if self.ranks_rows(t):  # every key by centroid + residual code; the budget's best of each head, in row order
            scores = row_scores(t.codes, q32, self.scale, base)  # (Hkv, G, N)
            lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (Hkv, G, 1)
            share = scores.sub_(lse).amax(1)  # (Hkv, N); in place: one (Hkv, G, N) buffer per layer, not two
            # (Hkv, W) in row order (blocks: runs) where the host reads them; in any order where the device does
            rows = top_rows(share, t.width, self.key_block, t.pad, ordered=t.positions is None)
            self.order_host[layer].copy_(rows, non_blocking=True)
            if self.estimate:
                self._read[layer] = (q32, scores, rows, lse)
            if self.estimate_read:
                self._keep_rows(layer, rows, q32.shape[1])
            if t.positions is not None:
                self._attend_in[layer] = (q32, rows)
            return
        logit = base + t.bias
        share = logit - torch.logsumexp(logit, dim=-1, keepdim=True)
        order = share.amax(1).topk(t.width, dim=-1, sorted=True).indices  # (Hkv, W) by priority
        sz = t.sizes.gather(1, order)
        end = sz.cumsum(1)  # (Hkv, W) each ranked cluster's end among the rows read
        take = ((end - sz) < t.budget).sum(1)  # (Hkv,) clusters to read
        if t.reads:  # the device reads them itself (`attend`): the host needs no ranking
            self._attend_in[layer] = (sz, end)
        else:
            self.order_host[layer].copy_(order, non_blocking=True)
            self.take_host[layer].copy_(take, non_blocking=True)
        self._read[layer] = (q32, base, order, take)

    def estimate_part(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The estimate of the clusters layer `layer` does not read, after `route`: out (Hkv, G, D) and
        lse (Hkv, G) float32 (None without the estimate)."""
        if not self.estimate:
            return None
        t = self.tables[layer]
        # dropped here: the captured layers share one memory pool, and a layer's (Hkv, G, N) row scores held past
        # its segment would stay allocated beside every other layer's (32 × 16 MiB at 128K for Llama-3-8B)
        q32, base, order, take = self._read[layer]
        self._read[layer] = None
        hkv, W = order.shape
        if self.ranks_rows(t):  # base: the rows' scores less their lse (take); order: the rows read (exact on the host)
            scores = base.scatter_(-1, order[:, None, :].expand(hkv, base.shape[1], W), float("-inf"))
            logit = segment_lse(scores, t.codes.offsets).add_(take)  # (Hkv, G, C) the unread keys of every cluster
            unread = torch.zeros_like(t.sizes, dtype=torch.bool)
            if t.vcodes is None:
                rest = unread_part(logit, unread, t.vmeans, bmm=self.vmeans_bmm(t))
                return rest.out, self._corrected(t, rest.lse, q32)
            rest = unread_part(logit, unread, t.vcodes.means, bmm=self.bmm)  # the means the residuals are to
            safe = torch.where(torch.isfinite(rest.lse), rest.lse, 0.0)[..., None]
            w = scores.add_(take).sub_(safe).exp_()  # (Hkv, G, N) each unread key's share of the rest (0: read)
            return rest.out + residual_sum(t.vcodes, w), self._corrected(t, rest.lse, q32)
        taken = torch.arange(W, device=order.device) < take[:, None]  # (Hkv, W)
        read = torch.zeros(base.shape[0], base.shape[2], dtype=torch.bool, device=base.device)
        read.scatter_(1, order, taken)  # (Hkv, C)

        # a cluster's log weight beside s·q·μ_c: log n_c, or the log-sum of its keys' residual-code weights
        size = t.log_n if t.codes is None else cluster_lse(t.codes, q32, self.scale)
        rest = unread_part(base + size, read, t.vmeans, bmm=self.vmeans_bmm(t))
        return rest.out, self._corrected(t, rest.lse, q32)

    def _corrected(self, t: LayerTables, lse: torch.Tensor, q32: torch.Tensor) -> torch.Tensor:
        """The estimate's lse (Hkv, G) with every unread key's weight raised by its codes' error (`error_shift`; the
        same for all of a query's unread keys), where the layer holds it."""
        return lse if t.error is None else lse + error_shift(t.error, q32, self.scale)

    def attend(self, layer: int, o: torch.Tensor, mz: torch.Tensor) -> None:
        """Layer `layer`'s context part on the device, after `route`: the rows it ranked read from the host's RAM and
        scored exactly, each query's exact top-k, their values summed (index/routed/device_read.py); written as the
        host's part is, o (H, D) Σ exp(s − m)·v in o's dtype and mz (H, 2) float32 (m, z) (decode/merge.py
        `context_part`). With `estimate_read`, the read rows outside the top-k go to `read_part` too."""
        t, host = self.tables[layer], self.host_kv
        if t.positions is not None:  # the rows it ranked
            q32, rows = self._attend_in[layer]
            self._attend_in[layer] = None
            pos = t.positions.gather(1, rows)  # (Hkv, W) int32
            s = read_scores(host.keys[layer], pos, q32 * self.scale)  # (Hkv, G, W) exact, scaled
        else:  # the rows of the clusters it ranked and took (`route`), their positions from the host's table
            q32, _, order, take = self._read[layer]
            rows = cluster_rows(t.first, order, *self._attend_in[layer], take, t.reads)
            self._attend_in[layer] = None
            s, pos = read_rows(host.keys[layer], host.positions[layer], rows, q32 * self.scale)
        hkv, g, _ = q32.shape
        top = s.topk(min(t.k, s.shape[2]), dim=-1, sorted=False)
        m = top.values.amax(-1, keepdim=True)  # (Hkv, G, 1)
        m = torch.where(torch.isfinite(m), m, 0.0)
        w = (top.values - m).exp_()  # 0 at −inf
        sel = pos.gather(1, top.indices.view(hkv, -1)).view_as(top.indices)
        out = weighted_values(host.values[layer], host.value_scales[layer], sel, w)  # (Hkv, G, D)
        o.copy_(out.view_as(o))
        mz[:, 0].copy_(m.view(-1))
        mz[:, 1].copy_(w.sum(-1).view(-1))
        if self.estimate_read and t.positions is not None:
            self._read_dev[layer].copy_(s.scatter_(-1, top.indices, float("-inf")))

    def _keep_rows(self, layer: int, rows: torch.Tensor, g: int) -> None:
        """Keep layer `layer`'s rows read (Hkv, W) for `read_part`; the first time, make its buffers."""
        if self.read_host[layer] is None:
            hkv, w = rows.shape
            pin = self.device.type == "cuda"
            self.read_host[layer] = torch.full((hkv, g, w), float("-inf"), pin_memory=pin)
            self._read_dev[layer] = torch.empty((hkv, g, w), device=self.device) if pin else self.read_host[layer]
            self._read_rows[layer] = torch.empty((hkv, w), dtype=torch.int64, device=self.device)
        self._read_rows[layer].copy_(rows)

    def read_part(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows layer `layer` read outside each query's top-k (`estimate_read`), once the host's scan has written
        their exact scaled scores to `read_host`: out (Hkv, G, D) and lse (Hkv, G) float32, each row's value its
        cluster's mean (+ its coded residual with `pq_values`); None where not asked or the layer sends clusters."""
        t = self.tables[layer]
        if not self.estimate_read or t is None or not self.ranks_rows(t):
            return None
        logit = self._read_dev[layer]
        if logit is not self.read_host[layer] and not self.attends(layer):  # (attend wrote it on the device)
            logit.copy_(self.read_host[layer], non_blocking=True)
        w, lse = softmax_weights(logit)  # (Hkv, G, W): 0 at −inf; (Hkv, G)
        return torch.bmm(w, self._row_values(t, self._read_rows[layer])), lse

    def _row_values(self, t: LayerTables, rows: torch.Tensor) -> torch.Tensor:
        """(Hkv, W, D) float32 the estimate's value of each layout row in `rows` (Hkv, W): its cluster's mean value
        (the value codes' means with `pq_values`, plus the row's coded residual)."""
        labels = torch.searchsorted(t.codes.offsets, rows.to(torch.int32), right=True).long() - 1  # (Hkv, W)
        means = t.vmeans if t.vcodes is None else t.vcodes.means
        v = means.gather(1, labels[..., None].expand(*labels.shape, means.shape[2])).float()
        if t.vcodes is not None:
            return v.add_(row_residuals(t.vcodes, rows))
        return v if t.vscale is None else v.mul_(t.vscale)

    def vmeans_bmm(self, t: LayerTables):
        """The estimate's product p (Hkv, G, C) × a layer's stored mean values → (Hkv, G, D) float32."""

        def p_times_means(p: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
            out = self.bmm(p, means)  # (Hkv, G, D)
            return out if t.vscale is None else out.mul_(t.vscale)

        return p_times_means

    def bmm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a (B, M, K) float32 × b (B, K, N) stored in bf16 or float8 → (B, M, N) float32."""
        if self._bf16_bmm:
            b = b if b.dtype == torch.bfloat16 else b.to(torch.bfloat16)
            return torch.bmm(a.to(torch.bfloat16), b, out_dtype=torch.float32)
        return torch.bmm(a, b.float())

    def host_route(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s ranking as the CPU reads it, once the step's event says it arrived (where the device reads a
        cluster-ranked layer's rows itself the step sends none: copied here, after `route`, when asked)."""
        if self.tables[layer].reads and self._read[layer] is not None:
            _, _, order, take = self._read[layer]
            self.order_host[layer].copy_(order)
            self.take_host[layer].copy_(take)
        return self.order_host[layer], self.take_host[layer]
