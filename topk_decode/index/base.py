"""The interface of the selection strategies: `SelectionStrategy` (plain select, what every strategy implements)
and two capabilities a strategy declares by subclassing them: `FusedAttention` (its search also computes the
context part) and `DeviceStaged` (part of its search runs on the decode device inside the captured step). The
decoder (decode/engine.py) checks the type, not a return value.

Per decode step and layer, the decoder hands a strategy the step's queries grouped by KV head and
asks: which context tokens should each query attend to, and with which exact scores q·k? A strategy
may return a different set per query head (flat), one set shared by a whole layer (TokenSelect), or
nothing for some heads (DuoAttention streaming heads); it may keep per-conversation state (a
selection cache) in the object `new_state()` returns.

Only context positions in `[lo, hi)` are searchable: the attention sinks below `lo` and the context
tail from `hi` on live in the decoder's exact GPU window, and the two sets must stay disjoint.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from topk_decode.errors import TopkError
from topk_decode.index.artifacts import artifact_dir, artifacts_complete  # noqa: F401 - re-exported
from topk_decode.index.options import StrategyOptions
from topk_decode.store.cache_dir import ContextKV
from topk_decode.store.format import KV_DTYPES, QUANTIZED

FLOAT_KV_DTYPES = tuple(name for name in KV_DTYPES if name != QUANTIZED)

# What the compiled kernels (topk_decode.kernels) read: bf16 keys and values (what GPU prefills write), as their
# uint16 bits; fp32 and fp16 caches take the strategies' torch paths.
KERNEL_DTYPES = (torch.bfloat16,)


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    """A bf16 tensor's storage as uint16, the kernels' view of it (no copy)."""
    return t.view(torch.int16).numpy().view(np.uint16)


@dataclass
class RestPart:
    """An estimate of the attention over searchable tokens a selection left out (routed's `estimate`).

    A third attention part beside the selected tokens and the window, disjoint from both, merged into the
    context part by the same log-sum-exp as the window (decode/context.py, docs/DESIGN.md "The merge").
    out: (Hkv, Q, D) float32 softmax-weighted mean value of the left-out tokens (0 where lse is −inf).
    lse: (Hkv, Q) float32 log Σ exp(s·q·k) over them, s = 1/√D (−inf: nothing left out).
    """

    out: torch.Tensor
    lse: torch.Tensor


@dataclass
class Selection:
    """The answer of a strategy for one layer and one step.

    ids: (Hkv, Q, K) int64 context positions, -1 marks an empty slot (no token).
    scores: (Hkv, Q, K) float32 exact unscaled q·k of those positions (ignored where ids == -1).
    Q = G·T (group query heads × new tokens, head-major); K may differ from the requested k.
    rest: an estimate of the attention over the searchable tokens not in `ids`, or None (attend to the
        selected tokens only: every strategy's default).
    filled: how many slots hold a token, where the strategy counted them (the decoder's statistics; None:
        the decoder counts).
    """

    ids: torch.Tensor
    scores: torch.Tensor
    searched: bool = True  # False when the answer came from a cache instead of a search
    no_empty_slots: bool = False  # True when the strategy knows no slot is empty (lets the decoder skip the check)
    rest: RestPart | None = None
    filled: int | None = None


@dataclass
class StrategyStats:
    """Counters a strategy keeps across steps (shown by `/stats` in chat)."""

    searches: int = 0
    reused: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class SelectionStrategy(ABC):
    """Base class: one instance per opened store, shared by all conversations over it.

    Args:
        ckv: the opened cache (memory-mapped keys/values).
        lo, hi: the searchable context range [lo, hi).
        options: strategy-specific options (e.g. nprobe, page size).
    """

    name: ClassVar[str] = ""
    # The strategy's options (index/options.py): a frozen dataclass, one field per option.
    Options: ClassVar[type[StrategyOptions]] = StrategyOptions
    # Option name → type, derived from `Options` (the registry's and the CLI's view: `split_options`).
    OPTIONS: ClassVar[dict[str, type]] = {}
    # whether `select` may keep a reference to its query tensor after returning (a selection cache);
    # if not, the decoder hands it the reused buffer the query was copied into instead of a copy
    keeps_query: ClassVar[bool] = True
    # whether each query row's selection depends on that row alone (no selection shared across rows), so
    # that a stateless `select` over several conversations' rows at once answers each as alone: the
    # decoder then searches concurrent conversations' queries in one call (decode/engine.py forward_batch)
    rows_independent: ClassVar[bool] = False
    # the stored KV dtypes (the manifest's `kv_dtype`) the strategy reads: int8 caches (store/quant.py) only where it
    # declares it
    kv_dtypes: ClassVar[tuple[str, ...]] = FLOAT_KV_DTYPES

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.OPTIONS = cls.Options.types()

    def __init__(self, ckv: ContextKV, lo: int, hi: int, options: dict | StrategyOptions | None = None) -> None:
        self.check_kv_dtype(ckv.manifest["kv_dtype"])
        self.ckv = ckv
        self.lo, self.hi = lo, hi
        self.options = self.parse_options(options)
        self.stats = StrategyStats()

    @classmethod
    def check_kv_dtype(cls, kv_dtype: str) -> None:
        """Refuse, with a one-line TopkError, a cache whose KV is stored in a dtype this strategy does not read."""
        if kv_dtype not in cls.kv_dtypes:
            readers = "flat" if kv_dtype == QUANTIZED else "the other strategies"
            raise TopkError(
                f"{cls.name} does not read {kv_dtype} caches yet: decode with --strategy {readers}, or prefill without "
                "--kv-dtype"
            )

    @classmethod
    def parse_options(cls, options: dict | StrategyOptions | None) -> StrategyOptions:
        """`options` as the strategy's `Options`, every value converted and checked; TopkError otherwise."""
        return cls.Options.parse(cls.name, options)

    @classmethod
    def checked_options(cls, options: dict | None) -> dict:
        """The given options validated and converted, as a plain dict (JSON-able: eval configs, reports)."""
        return cls.parse_options(options).given_values()

    @property
    def n_searchable(self) -> int:
        """Number of searchable context tokens."""
        return max(0, self.hi - self.lo)

    @classmethod  # noqa: B027 - an optional hook: strategies without artifacts build nothing
    def build_artifacts(
        cls,
        ckv: ContextKV,
        options: dict | StrategyOptions | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        """Build and save, under `artifact_dir(ckv.path, cls.name)`, what the strategy needs on disk.

        Called by `topk prefill --strategy NAME` (and by `prepare` on first open when missing).
        Artifacts cover all N context tokens; `select` restricts itself to [lo, hi). A strategy's
        artifacts are complete only once `done.json` exists in its directory (written last, with
        every file's size and checksum: use the helpers of `topk_decode.index.artifacts`).
        """

    def prepare(self, progress: Callable[[int, int], None] | None = None) -> None:  # noqa: B027 - an optional hook
        """Build or load whatever the strategy searches (called once, at open)."""

    def close(self) -> None:
        """Stop the strategy's worker threads, if it has any (`KVStore.close`)."""
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.close()

    def new_state(self) -> Any:
        """Per-conversation state (e.g. TokenSelect's selection cache); None if stateless."""
        return None

    @abstractmethod
    def select(self, layer: int, q: torch.Tensor, k: int, state: Any = None) -> Selection:
        """Pick context tokens for one layer's queries.

        Args:
            layer: layer index.
            q: (Hkv, Q, D) float32 CPU queries, post-RoPE, grouped by the KV head they attend with.
            k: token budget per query head for this layer.
            state: what `new_state()` returned for this conversation.
        """

    def all_tokens(self, q: torch.Tensor, layer: int, heads: list[int] | None = None) -> Selection:
        """The whole searchable range with exact scores: what every strategy returns when k covers it.

        Args:
            q: (Hkv, Q, D) float32 queries.
            layer: layer index.
            heads: only these KV heads (Duo's retrieval heads); the others get empty slots (-1) and
                their keys are never read. None: every head.
        """
        if heads is None:
            keys = self.ckv.keys[layer][:, self.lo : self.hi]  # (Hkv, M, D)
            scores = torch.bmm(q, keys.float().transpose(1, 2))  # (Hkv, Q, M)
            ids = torch.arange(self.lo, self.hi, dtype=torch.int64).expand_as(scores)
            return Selection(ids=ids, scores=scores)
        hkv, Q, _ = q.shape
        ids = torch.full((hkv, Q, self.n_searchable), -1, dtype=torch.int64)
        scores = torch.zeros((hkv, Q, self.n_searchable), dtype=torch.float32)
        idx = torch.tensor(heads, dtype=torch.int64)
        keys = self.ckv.keys[layer].index_select(0, idx)[:, self.lo : self.hi]  # (R, M, D)
        scores[idx] = torch.bmm(q[idx], keys.float().transpose(1, 2))
        ids[idx] = torch.arange(self.lo, self.hi, dtype=torch.int64)
        return Selection(ids=ids, scores=scores)


def exact_scores(keys: torch.Tensor, q: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Exact q·k for chosen ids of one layer, for strategies whose search does not yield them.

    Args:
        keys: (Hkv, N, D) the layer's keys.
        q: (Hkv, Q, D) float32 queries.
        ids: (Hkv, Q, K) int64, -1 allowed (scored 0; callers mask them).
    Returns:
        (Hkv, Q, K) float32.
    """
    hkv, n, d = keys.shape
    flat = ids.clamp(min=0) + torch.arange(hkv).view(hkv, 1, 1) * n
    k_sel = keys.reshape(hkv * n, d).index_select(0, flat.reshape(-1)).float().view(*ids.shape, d)
    return torch.einsum("hqd,hqkd->hqk", q, k_sel)


class FusedAttention(ABC):
    """Capability: the strategy computes the context part inside its search (routed's compiled path).

    The decoder calls `select_and_attend` instead of `select` + decode/context.py's `ContextAttention.attend`
    wherever `attends` says it applies; elsewhere it calls `select` as for any strategy.
    """

    @abstractmethod
    def attends(self, layer: int, k: int, o: torch.Tensor, routed: bool = False) -> bool:
        """Whether `select_and_attend` runs for this layer, budget and output buffer (dtype, layout); routed: the
        strategy's device stage ran for this layer (its `route` is at hand)."""

    @abstractmethod
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
        """`select` and the context part in one pass: writes what `ContextAttention.attend` would (estimate
        included) into o and mz and returns the selection (for observers and counts).

        Args:
            layer, q, k, state: as `SelectionStrategy.select`.
            o: (Hkv·Q, D) host tensor in the values' dtype; mz: (Hkv·Q, 2) float32 (ContextAttention.attend).
            route: what this strategy's device stage sent the host for this layer (`DeviceStage.host_route`),
                or None.
        """


class DeviceStage(Protocol):
    """The part of a strategy's search that runs on the decode device inside the captured one-token step
    (decode/graphs.py runs it; index/routed/device.py's `DeviceRoutes` is the one there is)."""

    def handles(self, layer: int) -> bool:
        """Whether this layer's stage runs on the device."""

    def route(self, layer: int, q32: torch.Tensor) -> None:
        """Run the layer's device stage for the step's float32 queries (inside the captured step)."""

    def estimate_part(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's (out, lse) part computed on the device, merged by the step, or None."""

    def host_route(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What the host's `FusedAttention.select_and_attend` receives as `route` for this layer."""

    def attends(self, layer: int) -> bool:
        """Whether the device also computes this layer's context part (`attend`): the host then does nothing for it."""

    def attend(self, layer: int, o: torch.Tensor, mz: torch.Tensor) -> None:
        """The layer's context part on the device, after `route` (inside the captured step), into the step's device
        buffers o (H, D) and mz (H, 2) (decode/merge.py `context_part`)."""

    def attended(self, layer: int) -> int:
        """Count one step of a layer the device attended; returns the top-k slots it filled (at most)."""


class DeviceStaged(ABC):
    """Capability: part of the strategy's search can run on the decode device (`DeviceStage`)."""

    @abstractmethod
    def device_routes(self, device: torch.device, k_per_layer: list[int], group: int = 1) -> DeviceStage | None:
        """The device stage for these layer budgets on `device`, or None where it does not apply there (the
        device, the options or the budgets rule it out).

        Args:
            device: the decode device; k_per_layer: each layer's k (fixed in the captured step); group: query heads per
            KV head (sizes the step's temporaries).
        """
