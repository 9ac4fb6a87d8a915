"""`topk bench`: top-k decoding beside HF transformers (dense and offloaded cache), one process, one run.

Per context length N, in this order (so that the most important rows land first):
1. our layer-wise prefill of N tokens (weights resident; random ids for a named shape, real text for a checkpoint:
   `context_tokens`), whose KV the decode then uses
   (`kv: prefill`); above `prefill_max` the KV is synthetic instead (`kv: synthetic`, see synthetic.py);
   with `kv_cache`, the KV of a cache directory (`kv: cache`: e.g. the real 1M prefill that
   `topk bench --prefill-only --keep-cache` kept), whose length is then the only context;
2. top-k decoding (`strategy`: flat, exact, by default; or e.g. routed) under the GPU budget, with the
   per-step breakdown and the share of the searchable keys the search read per step; with a real checkpoint
   (a directory or GGUF file, not a named random shape) each row also counts how many of its greedy tokens
   equal HF dense's on the same context and first input (`tokens_equal_dense` of `tokens_compared`);
3. HF dense `DynamicCache` and HF `DynamicCache(offloading=True)`: prefill + decode, where they fit
   (estimated before trying; OOM caught) — they run without the budget, and each row says whether its
   peak would have fit it;
and at the end the layer-wise prefill with `offload_weights` under the budget (the weights go to CPU).
Every row is appended to the JSON file as soon as it is measured.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from topk_decode.bench.hf import fits_hf, hf_decode, hf_greedy_tokens, weights_bytes
from topk_decode.bench.measure import GIB, anon_huge_pages, cpu_rss, is_oom, peak_gpu, release, set_gpu_budget
from topk_decode.bench.shapes import build_model, has_real_weights
from topk_decode.bench.synthetic import kv_bytes, kv_in_memory, synthetic_kv
from topk_decode.config import DecodeConfig
from topk_decode.cpus import usable_cpus
from topk_decode.decode.engine import TopKDecoder
from topk_decode.errors import TopkError
from topk_decode.index.routed.compiled import SPLIT_ROUNDS
from topk_decode.model.blocks import ModelShape
from topk_decode.prefill.layerwise import prefill_layers
from topk_decode.store.format import check_kv_dtype
from topk_decode.store.huge_pages import available_bytes
from topk_decode.store.quant import quantize_context

SYSTEMS = ("topk", "hf-dense", "hf-offload")
FIRST_TOKEN = 5  # the first decoded input after the context, of the top-k rows and of their dense reference


@dataclass
class BenchConfig:
    """What one `topk bench` run measures.

    Args:
        model: a named shape (llama-3-8b, qwen2.5-7b, llama-3.2-1b, tiny) or a checkpoint directory.
        contexts: context lengths N in tokens.
        systems: any of "topk", "hf-dense", "hf-offload".
        k: retrieved tokens per query head and layer.
        strategy: the selection strategy of the top-k rows (flat: exact; routed: clustered, reads a share);
            comma-separated names ("flat,routed") decode over the same context KV one after the other.
        strategy_options: options of the non-flat strategies (e.g. {"probe_fraction": 0.02}).
        backend: flat search backend ("auto": numba for long bf16 contexts, else torch; "torch" and "numba"
            scan the memory map; "faiss" builds indices).
        steps, warmup: timed and untimed decode steps per row (HF offloaded: `hf_offload_steps`).
        hf_offload_steps: timed steps of the (slow) offloaded baseline.
        gpu_memory: budget in bytes for top-k decoding and the offloaded prefill (None: whole GPU).
        kv: "auto" (prefill up to `prefill_max`, synthetic above), "prefill" or "synthetic".
        kv_dtype: "int8": the top-k rows decode that KV quantised as `topk prefill --kv-dtype int8` stores it
            (store/quant.py); None: as computed.
        kv_cache: decode over this cache directory's KV instead (its token count replaces `contexts`; the model
            must have the cache's shape).
        prefill_max: longest context prefilled for real under kv="auto".
        hf_max: longest context the HF baselines are run at (their prefill is quadratic: time budget).
        prefill_chunk: layer-wise prefill chunk length.
        offload_prefill: also run the layer-wise prefill with weights streamed from the CPU, under the budget.
        graphs: replay the dense part of each one-token step as CUDA graphs (decode/graphs.py).
        compile: fuse each layer's small ops in those graphs with torch.compile (DecodeConfig.compile).
        device, dtype: compute device and dtype.
        out: directory for bench_<model>.json and .png.
        seed: token and KV seed.
    """

    model: str = "llama-3-8b"
    contexts: list[int] = field(default_factory=lambda: [32768, 131072])
    systems: list[str] = field(default_factory=lambda: list(SYSTEMS))
    k: int = 1024
    strategy: str = "flat"
    strategy_options: dict = field(default_factory=dict)
    backend: str = "auto"
    steps: int = 16
    warmup: int = 3
    hf_offload_steps: int = 4
    gpu_memory: int | None = None
    kv: str = "auto"
    kv_dtype: str | None = None
    kv_cache: str | None = None
    prefill_max: int = 131072
    hf_max: int = 131072
    prefill_chunk: int = 8192
    offload_prefill: bool = True
    graphs: bool = True
    compile: bool = True
    device: str = "cuda"
    dtype: str = "bf16"
    out: str = "bench-results"
    seed: int = 0

    def validate(self) -> None:
        """Raise TopkError on options that cannot work."""
        bad = [s for s in self.systems if s not in SYSTEMS]
        if bad:
            raise TopkError(f"unknown system(s) {', '.join(bad)} (choose from {', '.join(SYSTEMS)})")
        if self.kv not in ("auto", "prefill", "synthetic"):
            raise TopkError(f"--kv must be auto, prefill or synthetic, got {self.kv!r}")
        check_kv_dtype(self.kv_dtype)
        if self.kv_dtype is not None and self.kv_cache is not None:
            raise TopkError(
                "--kv-dtype applies to the bench's own KV: a --kv-cache keeps the dtype it was prefilled with"
            )
        if self.kv_cache is not None and not Path(self.kv_cache).is_dir():
            raise TopkError(f"--kv-cache {self.kv_cache}: no such cache directory")
        if not self.contexts or min(self.contexts) < 128:
            raise TopkError("context lengths must be at least 128 tokens")
        from topk_decode.index import check_requested_strategy

        for name in strategies(self):
            check_requested_strategy(name)  # unknown names fail here, before any model is built ("auto" is one)
        if self.k <= 0 or self.steps <= 0 or self.warmup < 0:
            raise TopkError("k and steps must be positive, warmup ≥ 0")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise TopkError("CUDA is not available here: use --device cpu (or --smoke)")


def smoke_config(out: str) -> BenchConfig:
    """The CI smoke run: the tiny shape on the CPU, two short contexts, every system, seconds."""
    return BenchConfig(
        model="tiny",
        contexts=[512, 1024],
        k=64,
        steps=3,
        warmup=1,
        hf_offload_steps=2,
        device="cpu",
        dtype="fp32",
        out=out,
        prefill_chunk=256,
        prefill_max=512,
    )


def environment(device: torch.device) -> dict:
    """Versions and hardware, recorded with the results."""
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_threads": torch.get_num_threads(),
        "usable_cpus": usable_cpus(),
        "host": platform.node(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, gpu_total_gib=round(p.total_memory / GIB, 1))
    try:
        env["host_ram_gib"] = round(int(open("/proc/meminfo").read().split()[1]) * 1024 / GIB, 1)
    except OSError:
        pass
    return env


def _gib(x: int | None) -> float | None:
    return None if x is None else round(x / GIB, 2)


class _Recorder:
    """Collects rows and rewrites the JSON file after each one (a crash loses nothing measured)."""

    def __init__(self, cfg: BenchConfig, env: dict, log: Callable[[str], None]) -> None:
        self.cfg, self.log = cfg, log
        name = Path(cfg.model).name if Path(cfg.model).exists() else cfg.model  # a directory or a GGUF file
        self.model_name = name
        self.path = Path(cfg.out) / f"bench_{name}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.data = {"config": asdict(cfg), "environment": env, "rows": []}

    def add(self, system: str, context: int, status: str = "ok", **fields) -> dict:
        row = {"model": self.model_name, "system": system, "context": context, "status": status, **fields}
        self.data["rows"].append(row)
        self.path.write_text(json.dumps(self.data, indent=1))
        shown = {
            k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items() if k not in ("model", "breakdown")
        }
        self.log(
            f"{json.dumps(shown)}"
            + (f"\n    breakdown ms/step: {json.dumps(row['breakdown'])}" if row.get("breakdown") else "")
        )
        return row


def _prefill(model, tokens: list[int], chunk: int, offload: bool, device: torch.device, keep: bool):
    """Layer-wise prefill; returns (ContextKV or None, PrefillStats)."""
    from topk_decode.prefill.layerwise import ATTENTION_PATHS

    ATTENTION_PATHS.clear()  # this row reports the paths of this prefill only
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []

    def on_layer(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if keep:
            keys.append(k)
            values.append(v)

    _, stats = prefill_layers(model, tokens, on_layer, chunk_size=chunk, offload_weights=offload, device=device)
    ckv = kv_in_memory(keys, values, tokens, model.config.model_type) if keep else None
    return ckv, stats


def strategies(cfg: BenchConfig) -> list[str]:
    """The strategy names of the top-k rows, in order."""
    return [s.strip() for s in cfg.strategy.split(",") if s.strip()]


def tokens_equal_dense(generated: list[int], reference: list[int] | str | None) -> dict:
    """The row fields comparing a top-k row's greedy tokens with HF dense's (nothing for random weights).

    Args:
        generated: the row's greedy tokens, in order.
        reference: HF dense's greedy tokens from the same context and first input; a string: why there are
            none (the row says so); None: no comparison (a named shape's random weights).
    Returns:
        {"tokens_equal_dense": the matching prefix length (up to the first divergence), "tokens_compared": n},
        or {"tokens_equal_dense": None, "tokens_equal_dense_reason": why}, or {}.
    """
    if reference is None:
        return {}
    if isinstance(reference, str):
        return {"tokens_equal_dense": None, "tokens_equal_dense_reason": reference}
    compared = min(len(generated), len(reference))
    equal = next((i for i in range(compared) if generated[i] != reference[i]), compared)
    return {"tokens_equal_dense": equal, "tokens_compared": compared}


@torch.inference_mode()
def _topk_decode(
    model, ckv, cfg: BenchConfig, device: torch.device, strategy: str = "flat", reference: list[int] | str | None = None
) -> dict:
    """Greedy top-k decoding over `ckv` with one strategy: tokens/s and the per-step breakdown (and, given a
    dense `reference`, how many of its tokens equal it: `tokens_equal_dense`)."""
    options = {"backend": cfg.backend} if strategy == "flat" else dict(cfg.strategy_options)
    config = DecodeConfig(k=cfg.k, strategy=strategy, strategy_options=options, compile=cfg.compile)
    t_open = time.perf_counter()
    decoder = TopKDecoder(model, ckv, config, graphs=cfg.graphs and device.type == "cuda")
    open_s = time.perf_counter() - t_open  # includes building the strategy's layout (routed: k-means)
    try:
        conv = decoder.new_conversation()
        t_first = time.perf_counter()
        logits = decoder.forward([FIRST_TOKEN], conv)  # the first one-token step captures (and compiles) the graphs
        first_step_s = time.perf_counter() - t_first
        generated = [int(torch.argmax(logits))]  # the greedy tokens, compared with HF dense's (real weights)
        for _ in range(cfg.warmup):
            logits = decoder.forward([generated[-1]], conv)
            generated.append(int(torch.argmax(logits)))
        conv.stats = type(conv.stats)()
        extra = decoder.strategy.stats.extra
        read0, total0, kernel0 = extra.get("keys_read", 0), extra.get("keys_searchable", 0), extra.get("kernel_s")
        timed0 = {
            name: extra.get(name, 0.0)
            for name in ("head_mean_s", "head_max_s", "span_s", *(r + "_s" for r in SPLIT_ROUNDS))
        }
        t0 = time.perf_counter()
        for _ in range(cfg.steps):
            logits = decoder.forward([generated[-1]], conv)
            generated.append(int(torch.argmax(logits)))
        wall = time.perf_counter() - t0
        read, total = extra.get("keys_read", 0) - read0, extra.get("keys_searchable", 0) - total0
        # flat reads every searchable key; strategies that read a share count what they read
        ran = decoder.config.strategy  # "auto" resolved for this context and device
        keys_read_pct = 100.0 if ran == "flat" else (round(100 * read / total, 2) if total else None)
        s = conv.stats.summary()
        if kernel0 is not None:  # routed's compiled call alone, inside search_ms
            s["kernel_ms"] = 1e3 * (extra["kernel_s"] - kernel0) / cfg.steps
        for name, v0 in timed0.items():  # inside it: the heads' own work, their span, the split rounds (HeadTimes)
            if name in extra:
                s[name[:-2] + "_ms"] = 1e3 * (extra[name] - v0) / cfg.steps
        rss, hwm = cpu_rss()
        breakdown = {
            k: round(s[k], 2)
            for k in (
                "gpu_ms",
                "d2h_ms",
                "search_ms",
                "kernel_ms",
                "span_ms",
                "head_max_ms",
                "head_mean_ms",
                *(r + "_ms" for r in SPLIT_ROUNDS),
                "context_ms",
                "h2d_ms",
            )
            if k in s
        }
        return {
            "tokens_per_s": cfg.steps / wall,
            "ms_per_step": 1e3 * wall / cfg.steps,
            "breakdown": breakdown,
            "steps": cfg.steps,
            "k": cfg.k,
            "strategy_options": options,
            "ran": ran,
            "ran_options": dict(decoder.config.strategy_options),
            "keys_read_pct": keys_read_pct,
            **tokens_equal_dense(generated, reference),
            "open_s": round(open_s, 1),
            "cuda_graphs": decoder.segments is not None and decoder.segments.graphs is not None,
            "compiled": decoder.segments is not None and decoder.segments.compiled,
            "first_step_s": round(first_step_s, 2),
            "fp32_rescans": decoder.strategy.stats.extra.get("fp32_rescans", 0),
            "host_embedding": decoder.host_embedding is not None,
            **device_routes_row(decoder),
            "peak_gpu_gib": _gib(peak_gpu(device)),
            "cpu_rss_gib": _gib(rss),
            "cpu_peak_rss_gib": _gib(hwm),
            "huge_pages_gib": _gib(anon_huge_pages()),
        }  # routed's `hugepages` copies (store/huge_pages.py)
    finally:  # the model gets its input embedding back (decode/embedding.py) for the rows after
        decoder.close()


def device_routes_row(decoder) -> dict:
    """How the strategy's device part ran (routed: layers routed on the device, value format, GiB held)."""
    routes = decoder.segments.routes if decoder.segments is not None else None
    if routes is None:
        return {}
    return {
        "device_route_layers": routes.layers_on_device(),
        "device_values": routes.values_kind,
        "device_route_gib": _gib(routes.nbytes()),
        "device_keyed_layers": routes.keyed_layers(),
        "device_key_code_halvings": routes.code_halvings,
        "device_value_coded_layers": routes.value_coded_layers(),
        "device_read_layers": sum(routes.attends(layer) for layer in range(routes.n_layers)),
    }


def _try(rec: _Recorder, system: str, n: int, fn: Callable[[], dict], device: torch.device, **extra) -> dict | None:
    """Run one measurement; OOM and other failures become clean rows instead of ending the run."""
    try:
        return rec.add(system, n, **extra, **fn())
    except Exception as e:  # noqa: BLE001 - a benchmark row must never take the whole run down
        status = (
            "does not fit: out of memory" if is_oom(e) else f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        )
        release(device)
        return rec.add(system, n, status=status, **extra)


def run_bench(cfg: BenchConfig, log: Callable[[str], None] = print) -> dict:
    """Run the benchmark; write bench_<model>.json (and .png) under cfg.out; return the results.

    Args:
        cfg: the benchmark configuration.
        log: where progress lines go.
    """
    from topk_decode.prefill.build import parse_dtype

    cfg.validate()
    device, dtype = torch.device(cfg.device), parse_dtype(cfg.dtype)
    if device.type == "cuda" and device.index is None:  # memory-fraction calls need an explicit index
        device = torch.device("cuda", torch.cuda.current_device())
    rec = _Recorder(cfg, environment(device), log)
    t0 = time.perf_counter()
    model = build_model(cfg.model, device, dtype)
    shape = ModelShape.from_config(model.config)
    rec.data["model"] = {
        "name": rec.model_name,
        "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
        "weights_gib": _gib(weights_bytes(model)),
        "layers": shape.n_layers,
        "heads": shape.n_heads,
        "kv_heads": shape.n_kv_heads,
        "head_dim": shape.head_dim,
        "built_s": round(time.perf_counter() - t0, 1),
    }
    log(f"model {rec.model_name}: {rec.data['model']}")
    budget = cfg.gpu_memory
    gen = torch.Generator().manual_seed(cfg.seed)
    cached = None if cfg.kv_cache is None else open_kv_cache(cfg.kv_cache, shape)
    real = has_real_weights(cfg.model)  # a user's checkpoint: its top-k rows' tokens are checked against HF dense
    for n in [cached.n_tokens] if cached is not None else sorted(cfg.contexts):
        tokens = (
            context_tokens(cfg.model if real else None, shape.vocab_size, n, gen) if cached is None else cached.tokens
        )
        kv = kv_bytes(shape.n_layers, shape.n_kv_heads, shape.head_dim, n, dtype)
        source = "prefill" if cfg.kv == "prefill" or (cfg.kv == "auto" and n <= cfg.prefill_max) else "synthetic"
        if "topk" in cfg.systems:
            reference = _dense_reference(model, tokens, kv, cached or source, cfg, device) if real else None
            _run_topk(rec, model, shape, tokens, kv, cached or source, cfg, device, dtype, budget, reference)
        for system in ("hf-dense", "hf-offload"):
            if system in cfg.systems:
                _run_hf(rec, model, tokens, kv, system, cfg, device, budget)
    if cfg.offload_prefill:
        _run_offload_prefill(rec, model, shape, cfg, device, budget, gen)
    rec.data["total_s"] = round(time.perf_counter() - t0, 1)
    rec.path.write_text(json.dumps(rec.data, indent=1))
    try:
        from topk_decode.bench.plot import plot_results

        rec.data["plot"] = str(plot_results(rec.data, rec.path.with_suffix(".png")))
    except Exception as e:  # noqa: BLE001 - a missing plot must not lose the numbers
        log(f"plot failed: {e}")
    rec.path.write_text(json.dumps(rec.data, indent=1))
    return rec.data


def open_kv_cache(path: str, shape: ModelShape):
    """The cache `--kv-cache` names, memory-mapped, after checking it has the model's attention shape."""
    from topk_decode.store.cache_dir import open_cache

    ckv = open_cache(path, verify=False)
    have = ckv.manifest["shape"]
    want = {"n_layers": shape.n_layers, "n_kv_heads": shape.n_kv_heads, "head_dim": shape.head_dim}
    if any(have.get(k) != v for k, v in want.items()):
        got = {k: have.get(k) for k in want}
        raise TopkError(f"--kv-cache {path} holds KV of shape {got}, the model has {want}")
    return ckv


def _dense_reference(model, tokens, kv, source, cfg, device) -> list[int] | str:
    """HF dense greedy tokens after `tokens` + FIRST_TOKEN, as many as a top-k row generates (computed once
    per context, before the rows, without the budget), or why there are none."""
    n = len(tokens)
    if isinstance(source, str) and source == "synthetic":
        return "synthetic KV is not the context's: its tokens cannot match"
    fits, why = fits_hf(model, kv, n + 1, False, device)
    if not fits:
        return f"dense reference does not fit: {why}"
    if n > cfg.hf_max:
        return f"dense reference skipped: above --hf-max-context {cfg.hf_max}"
    try:
        return hf_greedy_tokens(model, tokens, FIRST_TOKEN, 1 + cfg.warmup + cfg.steps, device)
    except Exception as e:  # noqa: BLE001 - a missing reference must not lose the timing rows
        release(device)
        if is_oom(e):
            return "dense reference does not fit: out of memory"
        return f"dense reference failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _run_topk(rec, model, shape, tokens, kv, source, cfg, device, dtype, budget, reference=None) -> None:
    """The top-k rows of one context; `source` is "prefill", "synthetic" or an opened cache (ContextKV);
    `reference`: HF dense's greedy tokens (or why there are none) for a real checkpoint, else None."""
    n = len(tokens)
    kind = source if isinstance(source, str) else "cache"
    avail = available_bytes()
    if kind != "cache" and avail is not None and kv > 0.9 * avail:
        rec.add(
            "topk",
            n,
            status=f"does not fit: KV is {kv / GIB:.1f} GiB, host RAM available {avail / GIB:.1f} GiB",
            kv=kind,
            kv_gib=_gib(kv),
        )
        return
    ckv = None if isinstance(source, str) else source
    if kind == "prefill":
        release(device)
        set_gpu_budget(device, None)
        try:
            ckv, st = _prefill(model, tokens, cfg.prefill_chunk, False, device, keep=True)
            from topk_decode.prefill.layerwise import ATTENTION_PATHS

            rec.add(
                "topk-prefill",
                n,
                tokens_per_s=st.tokens_per_s,
                seconds=st.seconds,
                chunk=cfg.prefill_chunk,
                attention=sorted(ATTENTION_PATHS),
                peak_gpu_gib=_gib(st.peak_device_bytes),
                cpu_rss_gib=_gib(cpu_rss()[0]),
            )
        except Exception as e:  # noqa: BLE001
            rec.add("topk-prefill", n, status=f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            release(device)
            return
    elif kind == "synthetic":
        t = time.perf_counter()
        ckv = synthetic_kv(
            shape.n_layers,
            shape.n_kv_heads,
            shape.head_dim,
            n,
            dtype,
            cfg.seed,
            model_type=shape.model_type,
            kv_dtype=cfg.kv_dtype,
        )
        rec.data.setdefault("synthetic_build_s", {})[str(n)] = round(time.perf_counter() - t, 1)
    if cfg.kv_dtype is not None and not ckv.quantized:  # a prefill's KV, stored as the cache would store it
        ckv = quantize_context(ckv)
    release(device)
    set_gpu_budget(device, budget)
    for name in strategies(cfg):
        _try(
            rec,
            "topk",
            n,
            lambda: _topk_decode(model, ckv, cfg, device, name, reference),
            device,
            kv=kind,
            kv_gib=_gib(sum(t.numel() * t.element_size() for t in ckv.keys + ckv.values)),  # as stored (int8: half)
            kv_dtype=ckv.manifest["kv_dtype"],
            gpu_budget_gib=_gib(budget),
            strategy=name,
        )
        release(device)
    set_gpu_budget(device, None)
    ckv = None  # the KV's memory goes before the next context
    release(device)


def _run_hf(rec, model, tokens, kv, system, cfg, device, budget) -> None:
    n = len(tokens)
    offloading = system == "hf-offload"
    if offloading and device.type != "cuda":
        rec.add(system, n, status="skipped: the offloaded cache needs CUDA")
        return
    fits, why = fits_hf(model, kv, n, offloading, device)
    avail = available_bytes()
    if offloading and avail is not None and kv > 0.9 * avail:
        fits, why = False, f"offloaded KV {kv / GIB:.1f} GiB > host RAM available {avail / GIB:.1f} GiB"
    if not fits:
        rec.add(system, n, status=f"does not fit: {why}", kv_gib=_gib(kv))
        return
    if n > cfg.hf_max:
        rec.add(
            system,
            n,
            status=f"skipped: fits by estimate ({why}) but above --hf-max-context {cfg.hf_max} (time budget)",
            kv_gib=_gib(kv),
        )
        return
    steps = cfg.hf_offload_steps if offloading else cfg.steps
    warm = min(cfg.warmup, 1) if offloading else cfg.warmup

    def measure() -> dict:
        r = hf_decode(model, tokens, steps, warm, offloading, device)
        peak, rss, hwm = r.pop("peak_gpu_bytes"), r.pop("cpu_rss_bytes"), r.pop("cpu_peak_rss_bytes")
        return {
            **r,
            "peak_gpu_gib": _gib(peak),
            "cpu_rss_gib": _gib(rss),
            "cpu_peak_rss_gib": _gib(hwm),
            "fits_budget": None if budget is None or peak is None else peak <= budget,
        }

    _try(rec, system, n, measure, device, kv_gib=_gib(kv))


def context_tokens(checkpoint: str | None, vocab_size: int, n: int, gen: torch.Generator) -> list[int]:
    """n context tokens: for a user's checkpoint real text, so that its rows' greedy tokens against HF dense's
    (`tokens_equal_dense`) say something (on random ids a greedy continuation follows no text and parts from dense's
    at the first close call); random ids for a named shape, whose weights are random too.

    The text is CPython's documentation topics (`pydoc_data.topics`, English technical prose shipped with Python),
    in an order shuffled by `gen`, tokenized by the checkpoint's tokenizer and repeated to n tokens.

    Args:
        checkpoint: a checkpoint directory or GGUF file (its tokenizer), or None for random ids.
        vocab_size: the model's vocabulary (random ids are drawn from 3 up, past the usual special tokens).
        n: tokens wanted; gen: the bench's seeded generator.
    """
    if checkpoint is None:
        return torch.randint(3, vocab_size, (n,), generator=gen).tolist()
    from topk_decode.eval.realtext import pydoc_topics
    from topk_decode.model.loading import load_tokenizer

    topics = pydoc_topics()

    order = torch.randperm(len(topics), generator=gen).tolist()
    names = sorted(topics)
    tok = load_tokenizer(checkpoint)
    ids: list[int] = []
    for i in order:
        ids += tok.encode(topics[names[i]] + "\n\n", add_special_tokens=False)
        if len(ids) >= n:
            break
    while len(ids) < n:  # the topics hold ~110K tokens: longer contexts repeat them
        ids += ids[: n - len(ids)]
    return ids[:n]


def _run_offload_prefill(rec, model, shape, cfg, device, budget, gen) -> None:
    """The layer-wise prefill with weights streamed from the CPU, under the GPU budget (model moves to CPU)."""
    contexts = [n for n in sorted(cfg.contexts) if n <= cfg.prefill_max]
    if not contexts:
        return
    model.to("cpu")
    release(device)
    set_gpu_budget(device, budget)
    for n in contexts:
        tokens = torch.randint(3, shape.vocab_size, (n,), generator=gen).tolist()

        def measure() -> dict:
            release(device)
            _, st = _prefill(model, tokens, cfg.prefill_chunk, True, device, keep=False)
            from topk_decode.prefill.layerwise import ATTENTION_PATHS

            return {
                "tokens_per_s": st.tokens_per_s,
                "seconds": st.seconds,
                "chunk": cfg.prefill_chunk,
                "attention": sorted(ATTENTION_PATHS),
                "peak_gpu_gib": _gib(st.peak_device_bytes),
                "gpu_budget_gib": _gib(budget),
                "cpu_rss_gib": _gib(cpu_rss()[0]),
            }

        _try(rec, "topk-prefill-offload", n, measure, device)
    set_gpu_budget(device, None)
