"""routed's clustered layout on disk: built once per cache, memory-mapped at open.

Per layer, `artifact_dir(cache, "routed")` holds the cluster-contiguous keys (and values), their
original positions, the cluster offsets, centroids, spreads and mean values (index/routed/cluster.py builds them)
and, with `pq_m`, the residual codes and codebooks (index/routed/pq.py),
one file per array and layer (`keys.000.bin`, ...), checksummed in `done.json` (artifacts.py). The
permuted keys and values are memory-mapped, the small per-cluster arrays read into RAM.

An int8 cache (`--kv-dtype int8`, store/quant.py) is clustered and coded as the float keys and values it stands for,
and its layout stores what the cache stores: the int8 rows, permuted, with the values' scales beside them
(`vscales`); the centroids and key codes are moved into the int8 keys' space (`in_key_space`), where the decoder's
scaled queries (q ⊙ s_k) score them as they score the int8 keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from topk_decode.errors import TopkError
from topk_decode.index.artifacts import artifact_dir, start_artifacts, write_done, write_file, writing
from topk_decode.index.routed.cluster import KMeansConfig, LayerLayout, build_layer, kmeans_device
from topk_decode.index.routed.pq import NBITS, ResidualCodes, packed_bytes, train_codes
from topk_decode.store import huge_pages
from topk_decode.store.cache_dir import ContextKV
from topk_decode.store.format import QUANTIZED, as_torch, dtype_name, numpy_storage
from topk_decode.store.quant import TINY_SCALE, dequantize_keys, dequantize_values


def on_disk(ckv: ContextKV) -> bool:
    """False for in-RAM contexts (the benchmark's), whose layout stays in RAM."""
    return Path(ckv.path).is_dir()


def layer_layouts(ckv: ContextKV, opts: dict, progress: Callable[[int, int], None] | None) -> Iterator[LayerLayout]:
    """Each layer's clustered layout, built in turn (k-means on the GPU when there is one, index/routed/cluster.py).

    Args:
        ckv: the context; opts: routed's build options (cluster_size, iters, store_values, segment, pq_m,
            pq_values); progress: (done, total).
    """
    cfg = KMeansConfig(cluster_size=opts["cluster_size"], iters=opts["iters"], segment=opts["segment"])
    device = kmeans_device()
    m, mv = opts.get("pq_m", 0), opts.get("pq_values", 0)
    for name, sub in (("pq_m", m), ("pq_values", mv)):
        if sub and ckv.head_dim % sub:
            raise TopkError(f"routed: {name}={sub} must divide the head dimension {ckv.head_dim}")
    for layer in range(ckv.n_layers):
        keys, values = ckv.keys[layer], ckv.values[layer]
        if ckv.quantized:  # clustered as the float keys they stand for (one layer at a time: 2 GiB each at 1M)
            keys = dequantize_keys(keys, ckv.key_scales[layer])
            values = dequantize_values(values, ckv.value_scales[layer])
        lay = build_layer(keys, values, cfg, device, store_values=opts["store_values"])
        if m:
            lay.codes = train_codes(lay.keys, lay.centroids, lay.labels(), m)
        if mv:  # the values in row order, coded as residuals to their cluster's mean value
            rows = (
                lay.values
                if lay.values is not None
                else values.gather(1, lay.pos[..., None].expand(-1, -1, ckv.head_dim))
            )
            lay.value_codes = train_codes(rows, lay.value_means, lay.labels(), mv)
        if not opts.get("store_keys", True):  # the scan reads the cache's own keys at each row's position
            lay.keys = None
        if ckv.quantized:
            lay = in_key_space(lay, ckv, layer)
        yield lay
        if progress:
            progress(layer + 1, ckv.n_layers)


def in_key_space(lay: LayerLayout, ckv: ContextKV, layer: int) -> LayerLayout:
    """An int8 cache's layout built on its dequantised keys, as stored: the cache's int8 rows permuted (values with
    their scales), the centroids and the key codes' codebooks divided by the key scales (q ⊙ s_k scores them as
    q scores the float ones; the spread, used only with `spread=true`, stays in the float space)."""
    ks = ckv.key_scales[layer]  # (Hkv, D)
    inv = torch.where(ks > TINY_SCALE, 1.0 / ks, 0.0)  # an all-zero channel: its codes are 0, and so is it here
    hkv, n, d = ckv.n_kv_heads, ckv.n_tokens, ckv.head_dim
    keys = torch.empty((hkv, n, d), dtype=torch.int8) if lay.keys is not None else None
    values = torch.empty((hkv, n, d), dtype=torch.int8) if lay.values is not None else None
    for h in range(hkv):  # index_select per head: a gather's (Hkv, N, D) int64 index would be 8 bytes per element
        if keys is not None:
            torch.index_select(ckv.keys[layer][h], 0, lay.pos[h], out=keys[h])
        if values is not None:
            torch.index_select(ckv.values[layer][h], 0, lay.pos[h], out=values[h])
    lay.keys, lay.values = keys, values
    lay.value_scales = ckv.value_scales[layer].gather(1, lay.pos) if values is not None else None
    lay.centroids = lay.centroids * inv[:, None, :]
    if lay.codes is not None:
        m = lay.codes.m
        lay.codes = ResidualCodes(lay.codes.codes, lay.codes.codebooks * inv.view(hkv, m, 1, d // m))
    return lay


def _files(lay: LayerLayout) -> dict[str, torch.Tensor]:
    """A layer's arrays by file tag (what `load_layouts` reads back)."""
    arrays = {
        "pos": lay.pos.to(torch.int32),
        "offsets": lay.offsets,
        "centroids": lay.centroids,
        "spread": lay.spread,
    }
    if lay.keys is not None:
        arrays["keys"] = lay.keys
    if lay.values is not None:
        arrays["values"] = lay.values
    if lay.value_scales is not None:
        arrays["vscales"] = lay.value_scales
    if lay.value_means is not None:
        arrays["vmeans"] = lay.value_means
    if lay.codes is not None:
        arrays["pqcodes"] = lay.codes.codes
        arrays["pqbooks"] = lay.codes.codebooks
    if lay.value_codes is not None:
        arrays["pqvcodes"] = lay.value_codes.codes
        arrays["pqvbooks"] = lay.value_codes.codebooks
    return arrays


def write_layouts(ckv: ContextKV, name: str, opts: dict, progress: Callable[[int, int], None] | None) -> None:
    """Build every layer's layout and write it under the strategy's artifact folder, `done.json` last.

    Args:
        ckv: the context; name: the strategy's name (its folder); opts: validated build options.
        progress: (done, total) callback.
    """
    d = start_artifacts(ckv.path, name)
    files = []
    with writing(d, name):
        for layer, lay in enumerate(layer_layouts(ckv, opts, progress)):
            for tag, t in _files(lay).items():
                raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # bf16 has no numpy dtype
                files.append(d / f"{tag}.{layer:03d}.bin")
                write_file(files[-1], raw.contiguous().numpy().reshape(-1).view(np.uint8).data)
        n_clusters = -(-ckv.n_tokens // opts["cluster_size"])
        # packed_codes: residual codes two per byte (pq.py `ResidualCodes`); layouts from before are rebuilt
        meta = {
            "options": dict(
                opts, dtype=dtype_name(ckv.dtype), n_clusters=n_clusters, value_means=True, packed_codes=True
            )
        }
        write_done(d, files, meta, ckv.cache_id)


def load_layouts(ckv: ContextKV, name: str, built: dict) -> list[LayerLayout]:
    """Memory-map the permuted keys/values/positions; read the small per-cluster arrays into RAM.

    Args:
        ckv: the context; name: the strategy's name; built: the options recorded in `done.json`.
    """
    d = artifact_dir(ckv.path, name)
    hkv, n, D = ckv.n_kv_heads, ckv.n_tokens, ckv.head_dim
    C, dt = int(built["n_clusters"]), built["dtype"]

    def arr(tag: str, layer: int, dtype: np.dtype, shape: tuple, dtype_tag: str | None = None) -> torch.Tensor:
        m = np.memmap(d / f"{tag}.{layer:03d}.bin", dtype=dtype, mode="r", shape=shape)
        return as_torch(m, dtype_tag) if dtype_tag else torch.from_numpy(np.array(m))

    def coded(tag: str, layer: int, m: int) -> ResidualCodes | None:
        if not m:
            return None
        return ResidualCodes(
            arr(f"{tag}codes", layer, np.uint8, (hkv, n, packed_bytes(m))),
            arr(f"{tag}books", layer, np.float32, (hkv, m, 1 << NBITS, D // m)),
        )

    m, mv = int(built.get("pq_m", 0)), int(built.get("pq_values", 0))
    out = []
    for layer in range(ckv.n_layers):
        codes = coded("pq", layer, m)
        values = arr("values", layer, numpy_storage(dt), (hkv, n, D), dt) if built.get("store_values") else None
        scales = (
            arr("vscales", layer, np.float32, (hkv, n), "float32") if values is not None and dt == QUANTIZED else None
        )
        out.append(
            LayerLayout(
                keys=arr("keys", layer, numpy_storage(dt), (hkv, n, D), dt) if built.get("store_keys", True) else None,
                values=values,
                pos=arr("pos", layer, np.int32, (hkv, n)).long(),
                offsets=arr("offsets", layer, np.int64, (hkv, C + 1)),
                centroids=arr("centroids", layer, np.float32, (hkv, C, D)),
                spread=arr("spread", layer, np.float32, (hkv, C)),
                value_means=arr("vmeans", layer, np.float32, (hkv, C, D)) if built.get("value_means") else None,
                codes=codes,
                value_codes=coded("pqv", layer, mv),
                value_scales=scales,
            )
        )
    return out


def to_huge_pages(layouts: list[LayerLayout], ckv: ContextKV) -> int:
    """Move what the compiled path reads into huge-page memory (routed's `hugepages` option, store/huge_pages.py): per
    layer the keys and values, the layout's or, where it stores none (`store_keys`, `store_values` false), the cache's
    own (replaced in `ckv`, so every reader shares the one copy), the values' scales and the cluster offsets. Returns the
    bytes moved (0 where the platform cannot, or where memory-mapped arrays would not fit in half the available
    memory: their copies add to RAM, where an in-RAM original is freed as its copy replaces it).
    """
    scales = ckv.value_scales or [None] * len(layouts)

    def read(layer: int, lay: LayerLayout) -> tuple:
        return (
            lay.keys if lay.keys is not None else ckv.keys[layer],
            lay.values if lay.values is not None else ckv.values[layer],
            lay.value_scales if lay.values is not None else scales[layer],
            lay.offsets,
        )

    # (no list of the arrays: it would keep every original alive until all copies exist)
    need = sum(t.numel() * t.element_size() for i, lay in enumerate(layouts) for t in read(i, lay) if t is not None)
    avail = huge_pages.available_bytes()
    if not huge_pages.supported() or (on_disk(ckv) and (avail is None or need > avail // 2)):
        return 0
    copy = huge_pages.huge_copy
    for layer, lay in enumerate(layouts):  # layer by layer: an in-RAM original is freed as its copy replaces it
        lay.offsets = copy(lay.offsets)
        if lay.keys is not None:
            lay.keys = copy(lay.keys)
        else:
            ckv.keys[layer] = copy(ckv.keys[layer])
        if lay.values is not None:
            lay.values = copy(lay.values)
            if lay.value_scales is not None:  # read beside each value row
                lay.value_scales = copy(lay.value_scales)
        else:
            ckv.values[layer] = copy(ckv.values[layer])
            if ckv.value_scales is not None:
                ckv.value_scales[layer] = copy(ckv.value_scales[layer])
    return need
