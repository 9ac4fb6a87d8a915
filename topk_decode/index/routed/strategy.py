"""routed: read only the clusters a query routes to, then take the exact top-k of what was read.

Built once per cache (`topk prefill --strategy routed`, or on first open): per (layer, KV head) the keys
are clustered into clusters of ~`cluster_size` tokens and stored cluster-contiguously (index/routed/cluster.py, on
disk by index/routed/layout.py).
Per step and layer, for each KV head:

1. routing (CPU): each of its G·T queries estimates the share of its attention mass in every cluster c
   from the cluster's centroid μ_c: log m_c ≈ s·q·μ_c (s = 1/√D), normalised over the clusters; with
   `sizes=true` plus log n_c (n_c keys of the cluster), with `spread=true` plus s²·|q|²·σ_c²/2 (σ_c² the
   mean squared distance to μ_c per dimension: the log-mean-exp of s·q·k for keys spread isotropically
   around μ_c). Both terms lowered recall on real keys, so both are off by default (docs/STRATEGIES.md).
   A cluster's priority for the head is the largest
   share any of its queries gives it (the union over the G query heads);
2. the clusters are taken by priority until `probe_fraction` of the head's keys (at least 2·k) are read;
3. their keys (contiguous runs) are scanned exactly in fp32, and every query takes its exact top-k among
   them. Ids are ORIGINAL positions, so the decoder's context part is unchanged. The compiled path
   (`kernel=numba`) computes the context part itself and reads the layout's permuted values next to their
   keys (`store_values`); the torch path's context part reads the original values by id.

With `estimate` (and `estimate_read`) the selection also carries an estimate of the attention over what
it left out (index/routed/estimate.py), which the context part merges by log-sum-exp (decode/context.py).

When the budget covers the searchable range (k ≥ hi − lo, or `probe_fraction` = 1) the result is the
exact top-k, as flat's (and the estimate is empty).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from topk_decode.errors import TopkError, TopkWarning
from topk_decode.index.artifacts import ensure_artifacts, recorded_options
from topk_decode.index.base import (
    KERNEL_DTYPES,
    DeviceStaged,
    FusedAttention,
    RestPart,
    Selection,
    SelectionStrategy,
    bf16_bits,
)
from topk_decode.index.options import FRACTION, NON_NEGATIVE, POSITIVE, StrategyOptions, option
from topk_decode.index.routed import compiled as routed_compiled
from topk_decode.index.routed.device import TABLE_KINDS, DeviceRoutes
from topk_decode.index.routed.device_codes import device_codes, device_value_codes
from topk_decode.index.routed.device_read import HostKV
from topk_decode.index.routed.estimate import CodeError, code_error, error_rows, searchable_stats
from topk_decode.index.routed.layout import layer_layouts, load_layouts, on_disk, to_huge_pages, write_layouts
from topk_decode.index.routed.pq import ResidualCodes, approximate_scores, decode, default_m, row_centroids
from topk_decode.index.routed.torch_path import TorchPath
from topk_decode.index.threads import default_threads
from topk_decode.store import huge_pages
from topk_decode.store.cache_dir import ContextKV
from topk_decode.store.format import KV_DTYPES, dtype_name

# Every query must find at least k candidates: read at least this many keys per k.
_MIN_READ_PER_K = 2
# stats.extra's keys of the split call's parts (bench: enter_ms ... exit_ms)
_ROUND_KEYS = tuple(name + "_s" for name in routed_compiled.SPLIT_ROUNDS)


@dataclass(frozen=True)
class RoutedOptions(StrategyOptions):
    """routed's options. Build options are recorded in done.json; a different value rebuilds the layout."""

    cluster_size: int = option(
        16,
        "Target tokens per cluster. On real keys 16 routes better than 32 at the same keys "
        "read (0.97 of flat's mass on Qwen2.5-Coder-1.5B at 16K, 32: 0.95); the centroids and "
        "value means read every step grow as 1/S (docs/STRATEGIES.md).",
        build=True,
        check=POSITIVE,
    )
    iters: int = option(
        6,
        "Lloyd iterations of k-means (on a CPU also bounded by time, index/routed/cluster.py).",
        build=True,
        check=POSITIVE,
    )
    store_keys: bool = option(
        False,
        "Store the keys cluster-contiguously (a second copy of them, on disk and in RAM); false (default): the scan "
        "reads the cache's own keys at each row's position, so that with store_values=false the KV is held once "
        "(as fast end to end, less RSS: docs/STRATEGIES.md 'One copy of the KV').",
        build=True,
    )
    store_values: bool = option(
        False,
        "Also store the values cluster-contiguously (a second copy; the compiled context part reads them next to their "
        "keys); false (default): the cache's own values, read by position.",
        build=True,
    )
    segment: int = option(
        65536,
        "Tokens clustered together: longer contexts are clustered segment by segment, which "
        "bounds k-means' cost per key (a value ≥ the context clusters it whole).",
        build=True,
        check=POSITIVE,
    )
    pq_m: int = option(
        0,
        "Sub-vectors of the 4-bit residual codes stored per key (index/routed/pq.py; 0: none). rank=keys builds "
        "them with one per dimension, at most 128, when not given: D/2 bytes per key; two or four dimensions per "
        "sub-vector kept dense's answers less often (docs/history/eval-2026-11.md 'pq_m=64 on the GPU', 'Key codes on a d = 128 "
        "model at 16K and 32K').",
        build=True,
        check=NON_NEGATIVE,
    )
    pq_values: int = option(
        0,
        "Sub-vectors of 4-bit codes of each value's residual to its cluster's mean value (0: none; 32 is 16 bytes per "
        "key; at most D/2): the per-key estimate (rank=keys, estimate_by=keys) then adds each unread key's own coded "
        "residual to its cluster's mean value. With rank=keys also on the device (index/routed/device_codes.py "
        "`residual_sum`); with estimate_by=keys alone the torch path's. auto runs 32 (docs/history/eval-2026-11.md).",
        build=True,
        check=NON_NEGATIVE,
    )
    rank: str = option(
        "clusters",
        "What is ranked to choose the keys read: clusters (by centroid, reading whole clusters) or keys (every key "
        "by centroid + its residual code, reading the best keys; needs pq_m codes: in one-token steps on the device, "
        "which sends the host the rows to read, elsewhere on the torch path). keys also weighs the estimate of the "
        "unread keys per key (docs/history/eval-2026-11.md).",
        check=("clusters", "keys"),
    )
    key_block: int = option(
        1,
        "rank=keys reads blocks of this many consecutive layout rows (neighbours in one cluster), each block ranked by "
        "its best key: the host then reads runs of rows rather than single rows (docs/STRATEGIES.md).",
        check=POSITIVE,
    )
    probe_fraction: float = option(
        0.04,
        "Share of a KV head's searchable keys read per step (with the last cluster's overshoot at most ~5 %).",
        check=FRACTION,
    )
    max_read_per_k: int = option(
        16,
        "rank=keys reads at most this many keys per retrieved key (0: probe_fraction alone). Keys ranked one by one "
        "need few more than k (the fidelity suite's settings read 2.5–4·k), while 4 % of a long context is many more: "
        "41·k at 1M tokens for k = 1,024, each a scattered row (docs/STRATEGIES.md).",
        check=NON_NEGATIVE,
    )
    spread: bool = option(
        False,
        "Include the clusters' spread in the mass estimate (neutral to slightly worse on "
        "real keys, docs/STRATEGIES.md; torch path only).",
    )
    sizes: bool = option(
        False,
        "Include log n_c (the cluster's size) in the estimate (clusters ranked by s·q·μ_c "
        "alone, as IVF probes, had the higher id recall at the same mass on real keys).",
    )
    estimate: bool = option(
        True,
        "Add RetroInfer's estimate of the unread clusters' attention, n_c·exp(s·q·μ_c) with "
        "the cluster's mean value, as a third part of the softmax (index/routed/estimate.py; it "
        "lowered KL and raised agreement on every real model measured, docs/STRATEGIES.md).",
    )
    estimate_by: str = option(
        "auto",
        "How the unread keys are weighed in the estimate: clusters (n_c·exp(s·q·μ_c) per unread cluster), keys (every "
        "unread key by its approximate score s·q·(μ_c + r̂) from the residual codes: in one-token steps on the device "
        "beside routing (index/routed/device_codes.py), elsewhere on the torch path) or auto (keys with rank=keys, "
        "else clusters).",
        check=("auto", "clusters", "keys"),
    )
    estimate_read: bool = option(
        False,
        "Add the read keys outside the top-k to the estimate too (exact weights; their cluster's mean value, with "
        "pq_values plus their coded residual): on the torch path, and with rank=keys in the device's one-token steps "
        "(index/routed/device.py `read_part`); not in layers that rank clusters.",
    )
    code_error: bool = option(
        False,
        "With residual codes in the estimate (rank=keys, estimate_by=keys): raise every unread key's approximate weight "
        "by log E[exp(s·q·e)] of the codes' error e = k − k̂, Gaussian per KV head as measured on a sample of rows "
        "(index/routed/estimate.py `error_shift`; the device measures its own, coarsened, codes). It calibrates the "
        "unread keys' total weight (too low without it, the more the coarser the codes) but kept no more of dense's "
        "answers on the suite (docs/history/eval-2026-11.md 'What the 16 GiB fast path keeps'): off by default.",
    )
    device_read: str = option(
        "auto",
        "In the layers the device routes: the device reads the rows it ranked (rank=keys, where it holds the layer's "
        "codes) or the rows of the clusters it ranked from the host's RAM itself (registered with CUDA, unified "
        "addressing), scores them exactly, takes the top-k and sums their values inside the captured step "
        "(index/routed/device_read.py), and the CPU leaves the step's critical path (the same arithmetic; "
        "docs/BENCHMARKS.md 'The device reads the rows itself'). auto: on a CUDA device; true: "
        "also on a CPU decode device (the tests' way in); false: the host scans the rows. Needs the KV in RAM (huge "
        "pages or an in-RAM cache) and the cache's own keys and values (store_keys=false, store_values=false).",
        check=("auto", "true", "false"),
    )
    kernel: str = option(
        "auto",
        "auto (numba where it applies, else torch), numba (index/routed/compiled.py: each "
        "layer one compiled call over all KV heads, which also computes the context part; bf16 keys "
        "and values, no spread; estimate_read with rank=keys and the estimate only) or torch (index/routed/torch_path.py, the "
        "exact reference). Both give the same selection and estimate (tests/test_routed_kernel.py).",
        check=("auto", "torch", "numba"),
    )
    device_route: str = option(
        "auto",
        "auto (on a CUDA decode device, for the layers whose tables fit), true (also on "
        "a CPU decode device: the tests' way in) or false. Routing and the estimate then run "
        "inside the captured one-token step on the device (index/routed/device.py) and the CPU "
        "only scans the chosen clusters (compiled path only).",
        check=("auto", "true", "false"),
    )
    device_tables: str = option(
        "auto",
        "Precision of the device's routing tables: auto (the first of keys, "
        "fp8-values, fp8 that holds every layer beside the step), keys, fp8-values or fp8 "
        "(index/routed/device.py).",
        check=("auto", *TABLE_KINDS),
    )
    device_code_m: int = option(
        0,
        "Sub-vectors of the key codes the device holds: 0 (default) the finest that fit every layer beside the model "
        "(the codes as built where they fit, else coarsened by halves); a smaller power-of-two fraction of pq_m "
        "coarsens them to that many (index/routed/device_codes.py `coarsened`). Set it to reproduce, on a larger "
        "GPU or a smaller model, what a tighter GPU budget places (the fidelity suite's --as-budget).",
        check=NON_NEGATIVE,
    )
    device_value_layers: int = option(
        -1,
        "With pq_values on the device: the value codes go to at most this many layers, first layers first (-1, the "
        "default: every layer whose codes fit). Set it, as device_code_m, to reproduce a tighter GPU budget's "
        "placement.",
    )
    hugepages: bool = option(
        True,
        "The compiled path reads the layout from copies backed by transparent huge pages "
        "(store/huge_pages.py): always for a layout in RAM, for a memory-mapped one when it fits "
        "in half the available memory. Scattered cluster reads otherwise miss the TLB on almost "
        "every cluster (docs/BENCHMARKS.md 'segmented k-means, Qwen2.5-7B at 1M, one position "
        "array, huge pages').",
    )


def with_codes(o: RoutedOptions, head_dim: int) -> RoutedOptions:
    """The options with `pq_m` filled in where `rank=keys` needs codes and none were asked for (counted as given,
    so a layout without codes is rebuilt), and `pq_values` at most D/2 (sub-vectors of ≥ 2 dimensions: `auto` asks
    for 32 on every model)."""
    needs = o.rank == "keys" or o.estimate_by == "keys"
    o = o.replace(pq_m=default_m(head_dim)) if needs and not o.pq_m else o
    return o.replace(pq_values=max(1, head_dim // 2)) if o.pq_values > head_dim // 2 else o


class RoutedStrategy(TorchPath, SelectionStrategy, FusedAttention, DeviceStaged):
    """Clustered keys, mass-estimate routing, exact top-k over the routed clusters (options: `RoutedOptions`)."""

    name = "routed"
    keeps_query = False
    Options = RoutedOptions
    kv_dtypes = KV_DTYPES  # int8: clustered as the float keys, stored and scanned as int8 (layout.py `in_key_space`)

    @classmethod
    def build_artifacts(
        cls,
        ckv: ContextKV,
        options: dict | RoutedOptions | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        write_layouts(ckv, cls.name, with_codes(cls.parse_options(options), ckv.head_dim).build_values(), progress)

    def prepare(self, progress: Callable[[int, int], None] | None = None) -> None:
        o = self.options = with_codes(self.options, self.ckv.head_dim)
        self.rank_keys = o.rank == "keys"
        self.routes: DeviceRoutes | None = None  # set by `device_routes` when the decode device routes
        self.host_kv: HostKV | None = None  # the KV the device reads (`device_read`), registered at the first stage
        self.probe_fraction = o.probe_fraction
        self.use_spread, use_sizes = o.spread, o.sizes
        self.estimate, self.estimate_read = o.estimate, o.estimate_read
        # the estimate weighs unread keys one by one (their approximate keys) rather than per cluster
        self.estimate_keys = o.estimate_by == "keys" or (o.estimate_by == "auto" and self.rank_keys)
        if self.rank_keys and o.estimate_by == "clusters":  # keys read one by one leave no cluster wholly unread
            raise TopkError(
                "routed: rank=keys estimates the unread keys one by one; estimate_by=clusters needs rank=clusters"
            )
        if self.ckv.quantized and self.use_spread:
            raise TopkError("routed: spread=true is not available on an int8 cache (its spread is in the float space)")
        # the centroids' and mean values' precision: the keys' own, bf16 for an int8 cache (its layout: layout.py)
        self.table_dtype = torch.bfloat16 if self.ckv.quantized else self.ckv.dtype
        self.kernel = self._use_kernel(o.kernel)  # refused before any build
        self.device_route, self.device_tables, self.hugepages = o.device_route, o.device_tables, o.hugepages
        if not on_disk(self.ckv):
            self.layouts = list(layer_layouts(self.ckv, o.build_values(), progress))
        else:
            wanted = o.given_build_values()
            if self.estimate or self.estimate_read:
                wanted["value_means"] = True  # layouts built before the estimate lack them: rebuild
            if o.pq_m or o.pq_values:
                wanted["packed_codes"] = True  # codes of layouts built before were one per byte: rebuild

            def build() -> None:
                # a rebuild for the value means alone keeps the build options recorded before
                old = recorded_options(self.ckv.path, self.name) or {}
                kept = {k: v for k, v in old.items() if k in o.build_values()} if old.get("dtype") else {}
                self.build_artifacts(self.ckv, {**kept, **o.given_values()}, progress)

            self.layouts = load_layouts(self.ckv, self.name, ensure_artifacts(self.ckv, self.name, wanted, build))
        self.scale = 1.0 / math.sqrt(self.ckv.head_dim)
        hkv, n = self.ckv.n_kv_heads, self.ckv.n_tokens
        self._row_base = (torch.arange(hkv) * n).view(hkv, 1)  # (Hkv, 1) flat row of head h
        # Per layout row, whether its position is outside [lo, hi) (sinks, tail): one gather per step
        # instead of two compares of the positions.
        self._outside = [((lay.pos < self.lo) | (lay.pos >= self.hi)).reshape(-1) for lay in self.layouts]
        # Cluster statistics over the searchable keys only (the window attends to sinks and tail exactly):
        # routing ranks and the estimate sums what the strategy may return (index/routed/estimate.py).
        vscales = self.ckv.value_scales or [None] * self.ckv.n_layers  # an int8 cache's: the means dequantised
        self._stats = [
            searchable_stats(lay, out, self.ckv.keys[i], self.ckv.values[i], vscales[i])
            for i, (lay, out) in enumerate(zip(self.layouts, self._outside))
        ]
        if (self.estimate or self.estimate_read) and any(st.value_means is None for st in self._stats):
            raise TopkError("routed: estimate needs the clusters' mean values; rebuild the layout")
        if self.table_dtype == torch.bfloat16:
            # Routing and the estimate read every centroid and mean value each step: in the keys' own
            # precision that is half the bytes of fp32 (docs/STRATEGIES.md "routed: the compiled path").
            self._stats = [st.stored_as(torch.bfloat16) for st in self._stats]
            # The layout's own tables (the residual codes' reference, read by the per-key paths) likewise, once the
            # statistics above are made from them: the device's copies are bf16 or float8 already, and at 1M tokens
            # these are gigabytes (docs/BENCHMARKS.md "RAM at decode").
            for lay in self.layouts:
                lay.centroids = lay.centroids.to(torch.bfloat16)
                lay.value_means = None if lay.value_means is None else lay.value_means.to(torch.bfloat16)
        # The torch path's fp32 tables (`fp32_centroids`, `fp32_value_means`; the compiled path reads the stored ones):
        # made here where the torch path runs every step (no compiled path), else on first use.
        self._cent_t: list[torch.Tensor | None] = [None] * self.ckv.n_layers
        self._vmeans: list[torch.Tensor | None] = [None] * self.ckv.n_layers
        if not self.kernel:
            for layer in range(self.ckv.n_layers):
                self.fp32_centroids(layer)
                self.fp32_value_means(layer)
        # Log cluster sizes as the bias (−inf for a cluster without searchable keys), the spread scaled by s²/2.
        self._bias = [st.log_n for st in self._stats]  # (Hkv, 1, C)
        if not use_sizes:  # 0 for every cluster with searchable keys, −inf for the others
            self._bias = [torch.where(torch.isinf(b), b, 0.0) for b in self._bias]
        self._spread = [(lay.spread * (0.5 * self.scale**2)).unsqueeze(1) for lay in self.layouts]
        self._sizes = [lay.sizes for lay in self.layouts]
        per_key = self.rank_keys or self.estimate_keys
        self._labels = [lay.labels() for lay in self.layouts] if per_key else None  # (Hkv, N) per layer
        if not (per_key or o.pq_values):
            # The layout's own fp32 centroids and mean values (over every key, sinks and tail included) feed only the
            # residual codes' paths; ranking clusters reads the searchable statistics above. 7 GiB at 1M tokens of
            # the Qwen2.5-7B shape (docs/BENCHMARKS.md "RAM at decode").
            for lay in self.layouts:
                lay.centroids = lay.value_means = None
        self._starts = [lay.offsets[:, :-1] + self._row_base for lay in self.layouts]  # (Hkv, C) flat rows
        # Padding reads an outside row of its head when there is one (then the flag alone masks padding
        # too), else the head's first row, masked by `valid`.
        self._pad_rows = []
        for out in self._outside:
            has = out.view(hkv, n).any(1)
            first = out.view(hkv, n).to(torch.uint8).argmax(1)  # first outside row per head
            self._pad_rows.append((self._row_base[:, 0] + first).view(hkv, 1) if bool(has.all()) else None)
        # rank=keys in blocks pads the last block with an outside row: without one (no sinks, no tail) single rows
        self.key_block = o.key_block if all(p is not None for p in self._pad_rows) else 1
        self._code_error: list[CodeError | None] = [None] * self.ckv.n_layers  # `code_error`, made on first use
        self.huge_bytes = 0
        self.device_read_off: str | None = None  # why `device_read` did not apply where it was on (`auto` or `true`)
        if self.kernel:
            if self.hugepages:
                self.huge_bytes = to_huge_pages(self.layouts, self.ckv)
            self.threads = routed_compiled.team_size(default_threads())  # numba threads per layer call
            self._kernel_in = [self._kernel_arrays(layer) for layer in range(self.ckv.n_layers)]
            routed_compiled.warm_up(self._kernel_in[0])  # compile at open, not inside the first step
            self._kernel_scratch: dict = {}  # routing buffers, reused (routed_compiled.search_layer)
            self._split_scratch: dict = {}  # the split scan's buffers (routed_compiled.split_layer)
        self.stats.extra.update(
            keys_read=0, keys_searchable=0, kernel_s=0.0, head_mean_s=0.0, head_max_s=0.0, span_s=0.0
        )

    def _use_kernel(self, choice: str) -> bool:
        """Whether the compiled path (index/routed/compiled.py) runs (the `kernel` option; "auto": wherever it applies)."""
        why = (
            f"it reads bf16 or int8 keys and values, these are {dtype_name(self.ckv.dtype)}"
            if self.ckv.dtype not in (*KERNEL_DTYPES, torch.int8)
            else "it does not implement spread=true"
            if self.use_spread
            else "it implements estimate_read=true only with rank=keys and estimate=true"
            if self.estimate_read and not (self.rank_keys and self.estimate)
            else None
        )
        if choice == "numba" and why:
            raise TopkError(f"routed: kernel=numba is not available: {why}")
        return choice != "torch" and why is None

    def _kernel_arrays(self, layer: int) -> routed_compiled.LayerArrays:
        """One layer's arrays as numpy views for the compiled path (the layout's memory maps, no copies)."""
        lay, st, hkv = self.layouts[layer], self._stats[layer], self.ckv.n_kv_heads
        by_row = lay.values is not None  # the cluster-contiguous copy: values next to their keys
        vmeans = (
            st.value_means
            if st.value_means is not None
            else torch.zeros(hkv, 1, self.ckv.head_dim, dtype=torch.bfloat16)
        )
        bias = self._bias[layer][:, 0].contiguous()  # (Hkv, C)
        # n_c·exp(−bias_c): turns routing's exp(s·q·μ_c + bias_c − max) into the estimate's weights
        size_factor = torch.where(torch.isinf(bias), 0.0, (st.log_n[:, 0] - bias).exp())
        if self.ckv.quantized:  # int8 rows as they are, the values' scales in the values' order
            stored, vscale = (lambda t: t.numpy()), (lay.value_scales if by_row else self.ckv.value_scales[layer])
        else:
            stored, vscale = bf16_bits, torch.empty((hkv, 0))
        keys_by_row = lay.keys is not None  # else the cache's keys, read at each row's position (`store_keys`)
        return routed_compiled.LayerArrays(
            keys=stored(lay.keys if keys_by_row else self.ckv.keys[layer]),
            pos=self._positions(layer),
            offsets=lay.offsets.numpy(),
            cent=bf16_bits(st.centroids.contiguous()),
            bias=bias.numpy(),
            size_factor=size_factor.numpy(),
            vmeans=bf16_bits(vmeans.contiguous()),
            vals=stored(lay.values if by_row else self.ckv.values[layer]),
            values_by_row=by_row,
            vscale=vscale.numpy(),
            keys_by_row=keys_by_row,
        )

    def _positions(self, layer: int) -> np.ndarray:
        """The kernels' int32 positions of a layer (−1 outside the searchable range), in huge pages with the
        rest of the layout."""
        pos = routed_compiled.kernel_positions(self.layouts[layer].pos, self._outside[layer])
        return huge_pages.huge_copy(torch.from_numpy(pos)).numpy() if self.huge_bytes else pos

    # ---- search ----------------------------------------------------------------------------------
    def select(self, layer: int, q: torch.Tensor, k: int, state: Any = None) -> Selection:
        M = self.n_searchable
        if k >= M:
            return self.all_tokens(q, layer)
        self.stats.searches += 1
        if self.rank_keys:
            return self._select_keys(layer, q, k, self._budget(k, rows=True))
        budget = self._budget(k)
        if self.kernel and not self.estimate_keys:  # the keyed estimate on the CPU: the torch path's
            return self._compiled(layer, q, k, budget)
        return self._select_torch(layer, q, k, budget)

    def fp32_centroids(self, layer: int) -> torch.Tensor:
        """(Hkv, D, C) float32 a layer's searchable centroids for the torch path's one bmm (`_kept_fp32`)."""
        return self._kept_fp32(self._cent_t, layer, lambda st: st.centroids.float().transpose(1, 2).contiguous())

    def fp32_value_means(self, layer: int) -> torch.Tensor | None:
        """(Hkv, C, D) float32 a layer's searchable mean values for the torch path's estimate, or None."""
        return self._kept_fp32(
            self._vmeans, layer, lambda st: None if st.value_means is None else st.value_means.float()
        )

    def _kept_fp32(self, kept: list, layer: int, make) -> torch.Tensor | None:
        """`make(stats)`, kept in `kept` once made, except where the device routes every one-token step: the torch
        path then runs only for a question's tokens, and keeping the fp32 tables would cost the RAM of a quarter of
        the keys (twice 1/16 of the rows in fp32)."""
        t = kept[layer]
        if t is None:
            t = make(self._stats[layer])
            if self.routes is None:
                kept[layer] = t
        return t

    def rest_values(self, layer: int) -> tuple[torch.Tensor, ResidualCodes | None]:
        """The per-key estimate's values: the clusters' mean values and, with `pq_values`, every row's coded
        residual to them (the layout's means, over all its keys); else the searchable keys' means and None."""
        lay = self.layouts[layer]
        if self.options.pq_values:  # asked for: a layout built with other options is rebuilt with them
            return lay.value_means, lay.value_codes
        return self.fp32_value_means(layer), None

    def key_rows(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the keys of flat layout rows `rows` (M,) int64 (row = head·N + r) are: a (rows, D) tensor of stored
        keys and the indices into it; the layout's own keys, or with `store_keys=false` the cache's at each row's
        position."""
        lay, D = self.layouts[layer], self.ckv.head_dim
        if lay.keys is not None:
            return lay.keys.reshape(-1, D), rows
        n = self.ckv.n_tokens
        return self.ckv.keys[layer].reshape(-1, D), lay.pos.reshape(-1).index_select(0, rows) + rows // n * n

    def error_sample(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows `code_error` measures a layer's codes on, (Hkv, S) int64 (`error_rows`), and their true residuals
        k − μ_c, (Hkv, S, D) float32: the stored keys (an int8 cache's in its keys' space, the codes' space) less their
        cluster's centroid (the codes' reference)."""
        lay, D = self.layouts[layer], self.ckv.head_dim
        hkv, n = lay.pos.shape
        rows = error_rows(~self._outside[layer].view(hkv, n))
        stored, at = self.key_rows(layer, (rows + self._row_base).view(-1))
        keys = stored.index_select(0, at).float().view(hkv, -1, D)
        return rows, keys - row_centroids(lay.centroids.float(), self._labels[layer].gather(1, rows))

    def code_error(self, layer: int) -> CodeError:
        """The error of a layer's residual codes as built (the torch path's `error_shift`), measured once on
        `error_sample`."""
        if self._code_error[layer] is None:
            codes = self.layouts[layer].codes
            rows, true = self.error_sample(layer)
            picked = codes.codes.gather(1, rows[..., None].expand(-1, -1, codes.codes.shape[2]))
            self._code_error[layer] = code_error(true, decode(ResidualCodes(picked, codes.codebooks)))
        return self._code_error[layer]

    def approx_scores(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """(Hkv, Q, N) float32 s·q·k̂ for every layout row, k̂ = μ_c + r̂ its approximate key (rank=keys,
        estimate_by=keys on the torch path), decoded from the codes block by block."""
        lay = self.layouts[layer]
        return approximate_scores(q, lay.centroids, self._labels[layer], lay.codes).mul_(self.scale)

    def _budget(self, k: int, rows: bool = False) -> int:
        """Keys to read per KV head: probe_fraction of the searchable ones, at least 2·k (probe_fraction 1:
        every cluster, since sinks and tail sit in clusters too); where keys are ranked one by one (`rows`, rank=keys)
        at most max_read_per_k·k and the searchable keys. A layer that ranks clusters (rank=keys' fallback too) reads
        the whole share."""
        if self.probe_fraction >= 1:
            budget = self.ckv.n_tokens
        else:
            budget = max(math.ceil(self.probe_fraction * self.n_searchable), _MIN_READ_PER_K * k)
            if rows and self.options.max_read_per_k:
                budget = min(budget, max(self.options.max_read_per_k, _MIN_READ_PER_K) * k)
        return min(budget, self.n_searchable) if rows else budget

    def _compiled(
        self,
        layer: int,
        q: torch.Tensor,
        k: int,
        budget: int,
        o: np.ndarray | None = None,
        mz: np.ndarray | None = None,
    ) -> Selection:
        """The compiled path's selection (and, given o and mz, its context part): routed_compiled.search_layer."""
        res = routed_compiled.search_layer(
            self._kernel_in[layer], q, budget, k, self.scale, self.estimate, self.threads, o, mz, self._kernel_scratch
        )
        return self._kernel_selection(res, RestPart(out=res.rest_out, lse=res.rest_lse) if self.estimate else None)

    def _kernel_selection(self, res: routed_compiled.LayerResult, rest: RestPart | None = None) -> Selection:
        """A compiled call's result as a Selection, its keys read added to the strategy's counters."""
        extra = self.stats.extra
        extra["keys_read"] += res.read
        extra["keys_searchable"] += res.ids.shape[0] * self.n_searchable
        extra["head_mean_s"] += res.times.mean  # inside the compiled call (bench: head_*_ms, span_ms)
        extra["head_max_s"] += res.times.slowest
        extra["span_s"] += res.times.span
        for name, seconds in zip(_ROUND_KEYS, res.times.rounds):  # bench: rows_ms ... sums_ms
            extra[name] = extra.get(name, 0.0) + seconds
        return Selection(
            ids=res.ids, scores=res.scores, no_empty_slots=res.filled == res.ids.numel(), rest=rest, filled=res.filled
        )

    def device_routes(self, device: torch.device, k_per_layer: list[int], group: int = 1) -> DeviceRoutes | None:
        """Routing and the estimate on the decode device for the layers whose tables fit (index/routed/device.py),
        or None where the option, the device or the compiled path rules it out.

        Args:
            device: the decode device; k_per_layer: each layer's k (the budgets are fixed in the step); group: query
            heads per KV head.
        """
        wanted = self.device_route == "true" or (self.device_route == "auto" and device.type == "cuda")
        if not wanted or not self.kernel or any(k >= self.n_searchable for k in k_per_layer):
            return None
        if self.estimate_keys and not self.rank_keys and self.options.pq_values:
            return None  # the cluster-ranked keyed estimate has no value codes on the device: the torch path's
        codes = None
        if self.rank_keys or (self.estimate and self.estimate_keys):
            codes = [
                device_codes(lay.codes, lay.offsets, out, lay.centroids, st.centroids)
                for lay, out, st in zip(self.layouts, self._outside, self._stats)
            ]
        routes = DeviceRoutes(
            self._stats,
            self._sizes,
            self._bias,
            [self._budget(k) for k in k_per_layer],
            self.ckv.n_tokens,
            self.scale,
            self.estimate,
            device,
            values=self.device_tables,
            codes=codes,
            rank_keys=self.rank_keys,
            row_budgets=[self._budget(k, rows=True) for k in k_per_layer] if self.rank_keys else None,
            value_codes=[
                device_value_codes(codes, means, self.table_dtype)
                for means, codes in map(self.rest_values, range(self.ckv.n_layers))
            ]
            if self.rank_keys and self.estimate and self.options.pq_values
            else None,
            key_block=self.key_block if self.rank_keys else 1,
            pad_rows=[p - self._row_base for p in self._pad_rows] if self.rank_keys and self.key_block > 1 else None,
            key_scales=self.ckv.key_scales,
            estimate_read=self.estimate_read,
            group=group,
            code_m=self.options.device_code_m or None,
            value_layers=None if self.options.device_value_layers < 0 else self.options.device_value_layers,
            error_sample=self.error_sample if self.estimate and self.options.code_error else None,
            **self._device_read_args(device, k_per_layer),
        )
        self.routes = routes if routes.layers_on_device() else None
        if self.routes is not None and self.kernel:  # the torch path runs for a question's tokens only: no fp32 tables
            self._cent_t, self._vmeans = [None] * self.ckv.n_layers, [None] * self.ckv.n_layers
        keyed = 0 if self.routes is None else self.routes.keyed_layers()
        if self.routes is not None and self.routes.code_halvings:
            m = self.options.pq_m
            warnings.warn(
                f"routed: the key codes are coarsened from {m} to {m >> self.routes.code_halvings} sub-vectors per key "
                f"so that more layers' codes fit the {device.type} beside the model ({keyed} of {self.ckv.n_layers} layers "
                "rank keys); a larger GPU memory budget keeps them finer",
                TopkWarning,
                stacklevel=2,
            )
        if self.routes is not None and (self.rank_keys or self.estimate_keys) and keyed < self.ckv.n_layers:
            warnings.warn(
                f"routed: the residual codes of {keyed} of {self.ckv.n_layers} layers fit the {device.type} beside the "
                "model; the other layers rank and estimate by clusters (as rank=clusters: as fast, less often dense's "
                "answer); a larger GPU memory budget fits more",
                TopkWarning,
                stacklevel=2,
            )
        return self.routes

    def _device_read_args(self, device: torch.device, k_per_layer: list[int]) -> dict:
        """`DeviceRoutes`' arguments for `device_read`: the host's KV registered once (`HostKV`, kept across device
        stages), the layers' positions, their k; none where the option is off or does not apply (a warning where it was asked
        for with `true`; `auto` falls back to the host's scan quietly)."""
        asked = self.options.device_read
        if asked == "false" or (asked == "auto" and device.type != "cuda"):
            return {}
        why = (
            "it reads the cache's own keys and values (store_keys=false, store_values=false)"
            if any(lay.keys is not None or lay.values is not None for lay in self.layouts)
            else "the KV is memory-mapped from disk, not in RAM (hugepages=true copies it in when it fits)"
            if on_disk(self.ckv) and not self.huge_bytes
            else None
        )
        positions = [torch.from_numpy(self._kernel_in[layer].pos) for layer in range(self.ckv.n_layers)]
        if why is None and self.host_kv is None:
            try:
                self.host_kv = HostKV(self.ckv.keys, self.ckv.values, self.ckv.value_scales, device, positions)
            except (RuntimeError, ValueError) as e:
                why = f"the host's KV could not be mapped for the device ({e})"
        self.device_read_off = why
        if why is not None:
            if asked == "true":
                warnings.warn(f"routed: device_read is off: {why}", TopkWarning, stacklevel=3)
            return {}

        def count_read(read: int, searchable: int) -> None:
            self.stats.extra["keys_read"] += read
            self.stats.extra["keys_searchable"] += searchable

        return dict(
            host_kv=self.host_kv,
            positions=positions,
            ks=k_per_layer,
            count_read=count_read,
            n_searchable=self.n_searchable,
        )

    def close(self) -> None:
        """Unregister the host's KV from the device (`device_read`), then as every strategy."""
        if getattr(self, "host_kv", None) is not None:
            self.host_kv.close()
            self.host_kv = None
        super().close()

    def attends(self, layer: int, k: int, o: torch.Tensor, routed: bool = False) -> bool:
        """The compiled path attends (bf16 values) wherever k leaves something to search; with rank=keys or
        estimate_by=keys where the device ranked and estimates, and in the layers whose codes did not fit a device
        that routes the others (there by clusters: the torch path would score every key on the CPU per token);
        elsewhere the torch path does both."""
        per_key = self.rank_keys or self.estimate_keys
        left_out = per_key and self.routes is not None and not self.routes.handles(layer)
        part_dtype = o.dtype in KERNEL_DTYPES or (self.ckv.quantized and o.dtype == torch.float32)
        return self.kernel and k < self.n_searchable and part_dtype and (routed or not per_key or left_out)

    def select_and_attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: int,
        state: Any,
        o: torch.Tensor,
        mz: torch.Tensor,
        route: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Selection:
        """The compiled path computes the context part inside each head's search (kernels/routed_scan.py).

        Args: as `FusedAttention.select_and_attend`; route: the device's ranking of this layer's
            clusters (`DeviceRoutes.host_route`): then only the scan, top-k and context part run here.
        """
        self.stats.searches += 1
        hkv, Q, D = q.shape
        o32 = routed_compiled.reused_buffer(self._split_scratch, "o32", (hkv, Q, D), np.float32)
        o16, mz_np = self._part_views(o, mz, (hkv, Q, D))
        t = time.perf_counter()
        if route is None:
            sel = self._compiled(layer, q, k, self._budget(k), o32, mz_np)
        else:  # o16: the kernel rounds o to bf16 into the decoder's buffer itself
            sel = self._kernel_selection(
                routed_compiled.split_layer(
                    self._kernel_in[layer],
                    q,
                    route[0],
                    route[1],
                    k,
                    self.scale,
                    self.threads,
                    o32,
                    mz_np,
                    self._split_scratch,
                    o16,
                    rows_given=self.routes is not None and self.routes.sends_rows(layer),  # rows, not clusters
                    read_scores=self._read_scores(layer),
                )
            )
        self.stats.extra["kernel_s"] += time.perf_counter() - t  # the compiled call (bench: kernel_ms)
        if o16 is None or route is None:
            o.copy_(torch.from_numpy(o32).view(hkv * Q, D))  # fp32 → the values' dtype, rounded once
        if not mz.is_contiguous():  # mz_np is a buffer of our own
            mz.copy_(torch.from_numpy(mz_np).view(hkv * Q, 2))
        return sel

    def _read_scores(self, layer: int) -> np.ndarray | None:
        """Where the device weighs the rows read outside the top-k (`estimate_read`), the host buffer their exact
        scores go to (`DeviceRoutes.read_host`, as numpy), else None."""
        buf = None if self.routes is None or not self.routes.sends_rows(layer) else self.routes.read_host[layer]
        return None if buf is None else buf.numpy()

    def _part_views(self, o: torch.Tensor, mz: torch.Tensor, shape: tuple) -> tuple[np.ndarray | None, np.ndarray]:
        """Numpy views of the decoder's part buffers for the compiled calls: o's bf16 bits (Hkv, Q, D) uint16
        (None where o is not contiguous) and mz (Hkv, Q, 2), or a fresh array where mz is not contiguous.
        Kept per buffer: the decoder passes the same per-layer buffers every step, and making the views costs
        about what a small layer's compiled call does (docs/BENCHMARKS.md "huge pages over a whole step, a faster top-k, less Python per layer")."""
        views = self._split_scratch.setdefault("views", {})
        hit = views.get((id(o), id(mz)))
        if hit is not None and hit[0] is o and hit[1] is mz and hit[3].shape[:2] == shape[:2]:
            return hit[2], hit[3]
        hkv, Q, D = shape
        o16 = bf16_bits(o).reshape(hkv, Q, D) if o.is_contiguous() and o.dtype == torch.bfloat16 else None
        mz_np = mz.numpy().reshape(hkv, Q, 2) if mz.is_contiguous() else np.empty((hkv, Q, 2), np.float32)
        if len(views) > 4 * self.ckv.n_layers:  # the eager path's buffers are new every call
            views.clear()
        views[(id(o), id(mz))] = (o, mz, o16, mz_np)
        return o16, mz_np

    def keys_read_fraction(self) -> float | None:
        """Keys read / searchable keys over all searches so far (None before the first search)."""
        s = self.stats.extra
        return s["keys_read"] / s["keys_searchable"] if s.get("keys_searchable") else None
