"""The GPU's Triton kernels (index/routed/device_codes.py, index/routed/device_read.py) against their torch reference,
run on the CPU by Triton's interpreter (TRITON_INTERPRET=1), so CI checks them without a GPU.

Each kernel gets its inputs shaped as the decode step hands them (index/routed/device.py `route`, `estimate_part`,
`attend`): G query heads per KV head as Llama's (1, 4) and Qwen2.5's (6, 7: not a power of two, so `row_scores` returns
a view `[:, :G]` of a (Hkv, GP, N) buffer, and `segment_lse` and `residual_sum` read that view), clusters of random
sizes (empty ones, ones longer than a kernel's block), rows that are not searchable, −inf scores, and keys whose few
large dimensions (×50, as Qwen's) make the scores large. Outputs agree to fp32 rounding and are finite wherever the
reference's are (a kernel that read the wrong rows of a padded buffer made the decode step's logits NaN).
"""

from __future__ import annotations

import sys
import types
import zlib

import pytest
import torch

pytest.importorskip("triton")

from topk_decode.index.routed import device_codes, device_read  # noqa: E402
from topk_decode.index.routed.device_codes import (  # noqa: E402
    code_tables,
    device_value_codes,
    row_scores,
    segment_lse,
)
from topk_decode.index.routed.device_read import read_rows, read_scores, weighted_values  # noqa: E402
from topk_decode.index.routed.estimate import softmax_weights  # noqa: E402
from topk_decode.index.routed.pq import ResidualCodes  # noqa: E402

HKV = 2
# (G, D): one query head per KV head (multi-head attention) at D = 64, Llama-3-8B's 4 and Qwen2.5-1.5B's 6 at D = 128,
# Qwen2.5-0.5B's 7 at D = 64
GROUPS = [(1, 64), (4, 128), (6, 128), (7, 64)]
KV_DTYPES = [torch.bfloat16, torch.float32, torch.int8]  # the host cache's keys and values (int8: with scales)
RTOL = 1e-4  # fp32: sums taken in another order
# the interpreter evaluates both sides of a tl.where: log(0) of a cluster without rows, discarded as on the GPU
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")


def _holders() -> list:
    """What running Triton's interpreter changes: triton's modules and the classes of triton.language (the interpreter
    patches tl, tl.core, tl.math, tl.tensor, tl.dtype, ...), and the modules of the kernels it runs."""
    mods = [m for k, m in list(sys.modules.items()) if m is not None and k.split(".")[0] == "triton"]
    classes = [
        v
        for m in mods
        if m.__name__.startswith("triton.language")
        for v in vars(m).values()
        if isinstance(v, type) and v.__module__.startswith("triton.language")
    ]
    return list({id(h): h for h in [*mods, *classes, device_codes, device_read]}.values())


def _restore(snapshot: dict) -> None:
    """Every holder's attributes as in `snapshot` ({id: (holder, its attributes)}); the submodules imported since
    stay (an attribute added to a package that is its submodule)."""
    for holder, before in snapshot.values():
        now = dict(vars(holder))
        for name, value in before.items():
            if now.get(name, _restore) is not value:
                setattr(holder, name, value)
        for name in now.keys() - before.keys():
            if (
                not isinstance(holder, types.ModuleType)
                or sys.modules.get(f"{holder.__name__}.{name}") is not now[name]
            ):
                delattr(holder, name)


@pytest.fixture(scope="module", autouse=True)
def interpreted():
    """Triton's interpreter for this module only, all it changed in this process undone after it.

    `triton.jit` reads TRITON_INTERPRET when a function is decorated: the project's kernels are decorated once per
    process by the cached `_kernels()` (emptied before, so the kernels built here are interpreted, and after, so no
    later test gets one); triton.language's own jit functions (tl.zeros, tl.sum, tl.max, ...) when triton is first
    imported, which may have been before this module ran: they are swapped for interpreted ones here. Running, the
    interpreter patches triton.language's builtins (and leaves some patched where an interpreted jit function calls
    another) and copies its globals into each function's module: every triton module and triton.language class, and
    the kernels' modules, get their attributes back after.
    """
    import triton
    from triton.runtime.jit import JITFunction

    snapshot = {id(h): (h, dict(vars(h))) for h in _holders()}
    device_codes._kernels.cache_clear()
    device_read._kernels.cache_clear()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TRITON_INTERPRET", "1")
            swapped: dict[int, object] = {}
            for holder, attrs in snapshot.values():
                for name, fn in attrs.items():
                    if isinstance(fn, JITFunction):
                        mp.setattr(holder, name, swapped.setdefault(id(fn), triton.jit(fn.fn)))
            # `_pointer` hands the kernels a host tensor as a bare address (a registered host page the GPU reads in
            # place); the interpreter copies each tensor argument to numpy through its storage: it needs the tensor
            mp.setattr(device_read, "_pointer", lambda t: t)
            yield
    finally:
        device_codes._kernels.cache_clear()
        device_read._kernels.cache_clear()
        _restore(snapshot)


def case_seed(*case) -> int:
    """Each test case's own fixed seed: fresh inputs per case, the same on every run."""
    return zlib.crc32(repr(case).encode())


def assert_fp32_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same −inf entries, finite wherever `want` is, and within RTOL of `want` relative to its largest finite
    magnitude (the kernels and torch sum in different orders)."""
    assert got.shape == want.shape
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    finite = torch.isfinite(want)
    assert bool(torch.isfinite(got[finite]).all()), "non-finite output where the reference is finite"
    scale = float(want[finite].abs().max()) if bool(finite.any()) else 1.0
    torch.testing.assert_close(got[finite], want[finite], rtol=RTOL, atol=RTOL * scale)


def dim_scales(d: int, gen: torch.Generator) -> torch.Tensor:
    """(D,) per-dimension magnitudes: a few dimensions ×50 (Qwen's keys have a few with large norms)."""
    s = torch.ones(d)
    s[torch.randperm(d, generator=gen)[:3]] = 50.0
    return s


def cluster_offsets(gen: torch.Generator) -> torch.Tensor:
    """(Hkv, C+1) int64 offsets of ~60 clusters of random sizes, the same N rows per head: some empty, one longer than
    the lse kernel's block of 32 rows."""
    c = int(torch.randint(50, 70, (), generator=gen))
    sizes = torch.randint(1, 30, (HKV, c), generator=gen)
    sizes[torch.rand(HKV, c, generator=gen) < 0.15] = 0
    sizes[:, 3] = 0
    sizes[:, 5] = 90
    sizes[:, -1] += sizes.sum(1).max() - sizes.sum(1)
    return torch.cat([torch.zeros(HKV, 1, dtype=torch.long), sizes.cumsum(1)], 1)


def layer_codes(g: int, d: int, seed: int, m: int = 16):
    """A layer's key codes in the device's form, its queries, scale and routing term base = s·q·μ_c as `route` has
    them: random codes of residuals (m sub-vectors), ~3 % of the rows not searchable (the sinks among them, and every
    row of one cluster), the clusters holding them fixed up by their mean's shift (`fix_delta`)."""
    gen = torch.Generator().manual_seed(seed)
    offsets = cluster_offsets(gen)
    n_clusters, n = offsets.shape[1] - 1, int(offsets[0, -1])
    ds = dim_scales(d, gen)
    books = torch.randn(HKV, m, 16, d // m, generator=gen) * 0.3 * ds.view(m, 1, d // m)
    codes = ResidualCodes.packing(torch.randint(0, 16, (HKV, n, m), dtype=torch.uint8, generator=gen), books)
    outside = torch.rand(HKV, n, generator=gen) < 0.03
    outside[:, :4] = True  # the sinks
    for h in range(HKV):
        outside[h, offsets[h, 7] : offsets[h, 8]] = True
    cent = torch.randn(HKV, n_clusters, d, generator=gen) * ds
    routed = cent + 0.1 * torch.randn(HKV, n_clusters, d, generator=gen) * ds  # the means of the searchable keys
    dc = device_codes.device_codes(codes, offsets, outside.view(-1), cent, routed)
    q = torch.randn(HKV, g, d, generator=gen)
    scale = d**-0.5
    return dc, q, scale, torch.bmm(q, routed.transpose(1, 2)).mul_(scale)


def rows_on_triton(dc, q, scale, base) -> torch.Tensor:
    """`row_scores` through the Triton kernel: the public function (its torch prologue: the fixed-up clusters' shift
    and the code tables), which takes the kernel on CUDA only, with its CPU branch pointed at the kernel."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(device_codes, "_rows_torch", device_codes._rows_triton)
        return row_scores(dc, q, scale, base)


def step_scores(g: int, d: int, seed: int):
    """rank=keys' step up to `estimate_part` (index/routed/device.py): the rows kernel's scores (the view `[:, :G]` of
    its padded buffer) less each query's lse, then the rows read (each head's best 5 %) set to −inf, in place as the
    step does. Returns (codes, scores, lse)."""
    dc, q, scale, base = layer_codes(g, d, seed)
    scores = rows_on_triton(dc, q, scale, base)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (Hkv, G, 1)
    share = scores.sub_(lse).amax(1)  # (Hkv, N)
    read = share.topk(scores.shape[2] // 20, dim=-1).indices
    scores.scatter_(-1, read[:, None, :].expand(-1, g, -1), float("-inf"))
    return dc, scores, lse


def is_pow2(g: int) -> bool:
    return g & (g - 1) == 0


@pytest.mark.parametrize("g,d", GROUPS)
def test_rows_kernel_gives_row_scores_torch_reference(g, d):
    """`_rows_triton` (every row's base_c + s·q·(r̂_k + δ_c), −inf where not searchable) equals `_rows_torch`; with G
    not a power of two its output is a view of the (Hkv, GP, N) buffer, as the later kernels get it."""
    dc, q, scale, base = layer_codes(g, d, case_seed("rows", g, d), m=32)
    want = row_scores(dc, q, scale, base)
    got = rows_on_triton(dc, q, scale, base)
    assert got.is_contiguous() == is_pow2(g)
    assert_fp32_close(got, want)
    assert bool(torch.isneginf(want).any()) and bool(torch.isfinite(want).any(-1).all())
    lut = code_tables(dc, q, scale)  # the kernel alone, on the same tables and base
    assert_fp32_close(device_codes._rows_triton(dc, lut, base), device_codes._rows_torch(dc, lut, base))


@pytest.mark.parametrize("g,d", GROUPS)
def test_lse_kernel_gives_segment_lse_torch_reference(g, d):
    """`_lse_triton` on the step's row scores (the rows kernel's view, the rows read −inf) equals `_lse_torch`: −inf
    for empty clusters and clusters without a searchable unread row, finite elsewhere."""
    dc, scores, _ = step_scores(g, d, case_seed("lse", g, d))
    assert scores.is_contiguous() == is_pow2(g)
    want = device_codes._lse_torch(scores, dc.offsets)
    assert bool(torch.isneginf(want).any()) and bool(torch.isfinite(want).any())
    assert_fp32_close(device_codes._lse_triton(scores, dc.offsets), want)


@pytest.mark.parametrize("g,d", GROUPS)
def test_hist_kernel_gives_residual_sum_torch_reference(g, d):
    """`_residual_hist_triton` on the step's weights equals `_residual_hist_torch`, and `residual_sum` on either: w is
    the unread keys' exp(score − lse), written in place over the rows kernel's view `[:, :G]`, whose padding rows hold
    raw scores, −inf among them (read as a dense (Hkv, G, N) tensor they made the step's logits NaN)."""
    dc, scores, lse = step_scores(g, d, case_seed("hist", g, d))
    logit = segment_lse(scores, dc.offsets).add_(lse)  # (Hkv, G, C) the unread keys of every cluster
    _, rest = softmax_weights(logit)  # the estimate's lse (`unread_part`'s: no cluster is read whole)
    safe = torch.where(torch.isfinite(rest), rest, 0.0)[..., None]
    w = scores.add_(lse).sub_(safe).exp_()  # (Hkv, G, N): 0 where read or not searchable
    assert w.is_contiguous() == is_pow2(g) and bool(torch.isfinite(w).all())
    gen = torch.Generator().manual_seed(case_seed("hist values", g, d))
    m, n_clusters = 16, dc.offsets.shape[1] - 1  # pq_values=16
    books = torch.randn(HKV, m, 16, d // m, generator=gen) * dim_scales(d, gen).view(m, 1, d // m)
    codes = ResidualCodes.packing(torch.randint(0, 16, (HKV, w.shape[2], m), dtype=torch.uint8, generator=gen), books)
    vc = device_value_codes(codes, torch.zeros(HKV, n_clusters, d), torch.float32)
    want = device_codes._residual_hist_torch(vc.packed, w, device_codes.RESIDUAL_ROWS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(device_codes, "RESIDUAL_CHUNK", 256)  # several programs per head add to one histogram (and faster)
        assert_fp32_close(device_codes._residual_hist_triton(vc.packed, w), want)
        assert_fp32_close(device_codes.residual_sum(vc, w, triton=True), device_codes.residual_sum(vc, w, triton=False))


def host_kv(g: int, d: int, dtype: torch.dtype, seed: int):
    """A layer's host keys and values (Hkv, N, D) in `dtype` (int8: keys in a per-channel scale folded into the
    queries, values in per-token scales), their value scales (int8) or None, the layout's position table (Hkv, N)
    int32 (−1 outside the searchable range), and the queries (Hkv, G, D) float32 already scaled, as `attend` has
    them."""
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1000, 1500, (), generator=gen))
    keys = torch.randn(HKV, n, d, generator=gen) * dim_scales(d, gen)
    values = torch.randn(HKV, n, d, generator=gen) * dim_scales(d, gen)
    q = torch.randn(HKV, g, d, generator=gen) * d**-0.5
    scales = None
    if dtype == torch.int8:
        kscale = keys.abs().amax(1, keepdim=True) / 127  # (Hkv, 1, D)
        keys, q = (keys / kscale).round().to(torch.int8), q * kscale
        scales = values.abs().amax(2) / 127  # (Hkv, N)
        values = (values / scales[..., None]).round().to(torch.int8)
    table = torch.stack([torch.randperm(n, generator=gen) for _ in range(HKV)]).to(torch.int32)
    table[torch.rand(HKV, n, generator=gen) < 0.03] = -1
    return keys.to(dtype).contiguous(), values.to(dtype).contiguous(), scales, table, q.contiguous()


def read_layout_rows(n: int, gen: torch.Generator) -> torch.Tensor:
    """(Hkv, W) int32 the layout rows a step reads: head 0 a full width, head 1 only 40 rows (its ranked clusters ran
    short), −1 past them."""
    rows = torch.stack([torch.randperm(n, generator=gen)[:300] for _ in range(HKV)]).to(torch.int32)
    rows[1, 40:] = -1
    return rows


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("g,d", GROUPS)
def test_scores_kernel_gives_read_scores_torch_reference(g, d, dtype):
    """`_scores_triton` (rank=keys: positions gathered on the device, −1 where a row is outside the searchable
    range or none) equals `read_scores`' torch ops: the exact scaled scores, −inf where pos < 0."""
    seed = case_seed("scores", g, d, dtype)
    keys, _, _, table, q = host_kv(g, d, dtype, seed)
    rows = read_layout_rows(keys.shape[1], torch.Generator().manual_seed(seed))
    pos = torch.where(rows >= 0, table.gather(1, rows.clamp(min=0).long()), -1)  # (Hkv, W) int32 as `attend`'s
    want = read_scores(keys, pos, q)
    assert bool(torch.isneginf(want).any())
    assert_fp32_close(device_read._scores_triton(keys, pos, q), want)


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("g,d", GROUPS)
def test_scores_kernel_with_table_gives_read_rows_torch_reference(g, d, dtype):
    """`_scores_triton` given the host's position table (rank=clusters: the ranked clusters' layout rows, their
    positions looked up by the kernel) equals `read_rows`' torch ops: the same scores and positions read."""
    seed = case_seed("rows read", g, d, dtype)
    keys, _, _, table, q = host_kv(g, d, dtype, seed)
    rows = read_layout_rows(keys.shape[1], torch.Generator().manual_seed(seed))
    want, want_pos = read_rows(keys, table, rows, q)
    got, got_pos = device_read._scores_triton(keys, rows, q, table)
    assert torch.equal(got_pos, want_pos) and bool((want_pos < 0).any())
    assert_fp32_close(got, want)


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("g,d", GROUPS)
def test_values_kernel_gives_weighted_values_torch_reference(g, d, dtype):
    """`_values_triton` equals `weighted_values`' torch ops on `attend`'s top-k: each query's k best rows read (−1 and
    weight 0 where a head read fewer than k), weights exp(s − max), an int8 cache's values by their scales."""
    seed = case_seed("values", g, d, dtype)
    keys, values, scales, table, q = host_kv(g, d, dtype, seed)
    rows = read_layout_rows(keys.shape[1], torch.Generator().manual_seed(seed))
    s, pos = read_rows(keys, table, rows, q)
    hkv, k = s.shape[0], 100  # over head 1's rows read: its top-k holds −inf
    top = s.topk(k, dim=-1, sorted=False)
    m = top.values.amax(-1, keepdim=True)
    w = (top.values - torch.where(torch.isfinite(m), m, 0.0)).exp_()
    sel = pos.gather(1, top.indices.view(hkv, -1)).view_as(top.indices)
    assert bool((sel < 0).any())
    want = weighted_values(values, scales, sel, w)
    assert_fp32_close(device_read._values_triton(values, scales, sel, w), want)
