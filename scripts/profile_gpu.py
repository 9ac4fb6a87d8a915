"""Where the time goes on the GPU host: the layer-wise prefill vs HF's, and one top-k decode step.

    python scripts/profile_gpu.py prefill --context 32768 --out prof/      # phases of one layer, HF vs ours
    python scripts/profile_gpu.py decode --context 131072 --out prof/      # StepStats + torch.profiler tables

Random-weight Llama-3-8B shape on the GPU (topk_decode.bench.shapes); prints and writes text reports.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from topk_decode.bench.shapes import build_model
from topk_decode.bench.synthetic import synthetic_kv
from topk_decode.config import DecodeConfig
from topk_decode.decode.engine import TopKDecoder
from topk_decode.model.blocks import ModelShape, attention_inputs, finish_block, rope
from topk_decode.prefill import layerwise
from topk_decode.prefill.layerwise import chunk_attention, prefill_layers


def _timed(fn, device) -> float:
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    return time.perf_counter() - t


def _table(prof, key: str, n: int = 25) -> str:
    return prof.key_averages().table(sort_by=key, row_limit=n, max_name_column_width=60)


@torch.inference_mode()
def profile_prefill(model, n: int, chunk: int, out: Path, device) -> dict:
    """HF's one-forward prefill vs ours at n tokens, and our per-phase time for one layer."""
    shape = ModelShape.from_config(model.config)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, shape.vocab_size, (n,), generator=gen).tolist()
    ids = torch.tensor([tokens], device=device)
    warm = ids[:, :chunk]
    model(input_ids=warm, use_cache=False, logits_to_keep=1)
    prefill_layers(model, tokens[:chunk], lambda *a: None, chunk_size=chunk)
    res: dict = {"n": n, "chunk": chunk}
    res["hf_s"] = _timed(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1), device)
    res["ours_s"] = _timed(lambda: prefill_layers(model, tokens, lambda *a: None, chunk_size=chunk), device)
    res["modes"] = sorted(set(layerwise._MODES.values()))
    kept = []
    res["ours_keep_s"] = _timed(
        lambda: prefill_layers(model, tokens, lambda l, k, v: kept.append((k, v)), chunk_size=chunk), device
    )
    kept = None
    # one layer, phase by phase (CUDA events around each phase of every chunk)
    layer = model.model.layers[1]
    hidden = torch.randn((n, shape.hidden_size), dtype=torch.bfloat16, pin_memory=True)
    keys = torch.empty((1, shape.n_kv_heads, n, shape.head_dim), dtype=torch.bfloat16, device=device)
    values = torch.empty_like(keys)
    phases = {p: 0.0 for p in ("h2d", "qkv", "attention", "finish", "d2h")}
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        evs[0].record()
        x = hidden[s:e].to(device, non_blocking=True)[None]
        evs[1].record()
        cos, sin = rope(model, x, torch.arange(s, e, device=device))
        q, k, v = attention_inputs(layer, x, cos, sin, shape)
        keys[:, :, s:e], values[:, :, s:e] = k, v
        evs[2].record()
        o = chunk_attention(q, keys[:, :, :e], values[:, :, :e])
        evs[3].record()
        y = finish_block(layer, x, o)[0]
        evs[4].record()
        hidden[s:e].copy_(y, non_blocking=True)
        evs[5].record()
        torch.cuda.synchronize(device)
        for i, p in enumerate(phases):
            phases[p] += evs[i].elapsed_time(evs[i + 1])
    res["one_layer_phase_ms"] = phases
    t = _timed(lambda: (keys[0].cpu(), values[0].cpu()), device)
    res["one_layer_kv_to_pageable_ms"] = 1e3 * t
    # attention alternatives for the whole sequence of one layer
    H, Hkv, D = shape.n_heads, shape.n_kv_heads, shape.head_dim
    qf = torch.randn((1, H, n, D), dtype=torch.bfloat16, device=device)
    kf = torch.randn((1, Hkv, n, D), dtype=torch.bfloat16, device=device)
    vf = torch.randn_like(kf)
    alt = {}
    alt["sdpa_full_causal_gqa"] = _timed(
        lambda: torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=True, enable_gqa=True), device
    )

    def chunks(mode):
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            if mode == "auto":
                chunk_attention(qf[:, :, s:e], kf[:, :, :e], vf[:, :, :e])
            else:
                layerwise._split_flash(qf[:, :, s:e], kf[:, :, :e], vf[:, :, :e], expand=mode == "expand")

    for mode in ("auto", "gqa", "expand"):
        try:
            chunks(mode)
            alt[f"chunked_{mode}"] = _timed(lambda: chunks(mode), device)
        except Exception as e:  # noqa: BLE001
            alt[f"chunked_{mode}"] = f"error {type(e).__name__}: {e}"[:200]
    alt.update(_attention_variants(qf, kf, vf, device))
    res["one_layer_attention_s"] = alt
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for s in range(0, min(n, 4 * chunk), chunk):
            e = s + chunk
            x = hidden[s:e].to(device, non_blocking=True)[None]
            cos, sin = rope(model, x, torch.arange(s, e, device=device))
            q, k, v = attention_inputs(layer, x, cos, sin, shape)
            keys[:, :, s:e], values[:, :, s:e] = k, v
            o = chunk_attention(q, keys[:, :, :e], values[:, :, :e])
            hidden[s:e].copy_(finish_block(layer, x, o)[0], non_blocking=True)
        torch.cuda.synchronize(device)
    (out / f"prefill_{n}_profile.txt").write_text(
        _table(prof, "self_cuda_time_total") + "\n\n" + _table(prof, "self_cpu_time_total", 15)
    )
    return res


def _cudnn_lse(q, k, v, causal: bool):
    G = q.shape[1] // k.shape[1]
    if G > 1:
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False)
    return res[0], res[1].reshape(q.shape[:3])


def _attention_variants(qf, kf, vf, device) -> dict:
    """Chunked split-flash at larger chunks, and cuDNN's kernel in the same split, for one layer."""
    n = qf.shape[2]
    out: dict = {}
    for T in (8192, 16384, 32768):
        if T >= n:
            continue

        def run():
            for s in range(0, n, T):
                e = min(s + T, n)
                layerwise._split_flash(qf[:, :, s:e], kf[:, :, :e], vf[:, :, :e], expand=False)

        run()
        out[f"chunked_gqa_{T}"] = _timed(run, device)
    # cuDNN in the same (prefix ⊕ diagonal) split, checked against split-flash on the last chunk
    try:
        T = 4096

        def split_cudnn(q, k, v):
            S = k.shape[2]
            od, ld = _cudnn_lse(q, k[:, :, S - T :], v[:, :, S - T :], True)
            if S == T:
                return od
            op, lp = _cudnn_lse(q, k[:, :, : S - T], v[:, :, : S - T], False)
            lse = torch.logaddexp(lp, ld)
            return (op.float() * torch.exp(lp - lse)[..., None] + od.float() * torch.exp(ld - lse)[..., None]).to(
                q.dtype
            )

        a = split_cudnn(qf[:, :, n - T :], kf, vf)
        b = layerwise._split_flash(qf[:, :, n - T :], kf, vf, expand=False)
        out["cudnn_max_abs_diff_vs_flash"] = float((a.float() - b.float()).abs().max())

        def run_c():
            for s in range(0, n, T):
                e = min(s + T, n)
                split_cudnn(qf[:, :, s:e], kf[:, :, :e], vf[:, :, :e])

        out["chunked_cudnn_4096"] = _timed(run_c, device)
        out["cudnn_full_causal"] = _timed(lambda: _cudnn_lse(qf, kf, vf, True), device)
    except Exception as e:  # noqa: BLE001
        out["cudnn"] = f"error {type(e).__name__}: {e}"[:300]
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out["sdpa_full_causal_flash_only"] = _timed(
                lambda: torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=True, enable_gqa=True),
                device,
            )
    except Exception as e:  # noqa: BLE001
        out["sdpa_flash_only"] = f"error {type(e).__name__}: {e}"[:300]
    return out


def _steps(dec, conv, logits, steps: int) -> tuple[dict, torch.Tensor]:
    """`steps` one-token steps after 2 warm-up steps: tokens/s and the StepStats breakdown."""
    for _ in range(2):
        logits = dec.forward([int(torch.argmax(logits))], conv)
    conv.stats = type(conv.stats)()
    t = time.perf_counter()
    for _ in range(steps):
        logits = dec.forward([int(torch.argmax(logits))], conv)
    res = {"tokens_per_s": steps / (time.perf_counter() - t)}
    res.update({k: round(v, 3) for k, v in conv.stats.summary().items()})
    return res, logits


# Variants of the decode step (name → settings): "compile" (DecodeConfig.compile; changing it rebuilds
# the step's segments: new capture, and compilation) and "threads" (torch's intra-op threads).
_VARIANTS = {
    "default": {},
    "uncompiled": {"compile": False},
    "threads8": {"threads": 8},
    "threads12": {"threads": 12},
}


def _floors(dec, conv, logits, steps: int, device) -> tuple[dict, torch.Tensor]:
    """The GPU side alone: graphs replayed back to back, with a per-layer sync, and whole steps without the CPU part."""
    seg = dec.segments
    L = dec.shape.n_layers
    ev = [torch.cuda.Event() for _ in range(L)]

    def replay_all():
        for l in range(L + 1):
            seg.run(l)

    def replay_sync():
        for l in range(L + 1):
            seg.run(l)
            if l < L:
                ev[l].record()
                ev[l].synchronize()

    replay_all()
    res = {
        "graphs": seg.graphs is not None,
        "compiled": seg.compiled,
        "graphs_ms": 1e3 * min(_timed(replay_all, device) for _ in range(5)),
        "graphs_sync_ms": 1e3 * min(_timed(replay_sync, device) for _ in range(5)),
    }
    real = dec._context_part
    dec._context_part = lambda *a: None
    res["step_without_cpu_part"], logits = _steps(dec, conv, logits, steps)
    dec._context_part = real
    return res, logits


@torch.inference_mode()
def profile_decode(model, n: int, k: int, steps: int, out: Path, device, variants: list[str]) -> dict:
    """Top-k decode steps over synthetic KV: StepStats per variant, floors without the CPU work, profiler tables."""
    shape = ModelShape.from_config(model.config)
    ckv = synthetic_kv(shape.n_layers, shape.n_kv_heads, shape.head_dim, n, torch.bfloat16)
    dec = TopKDecoder(model, ckv, DecodeConfig(k=k, strategy="flat", strategy_options={"backend": "torch"}))
    conv = dec.new_conversation()
    t = time.perf_counter()
    logits = dec.forward([5], conv)
    res: dict = {"n": n, "k": k, "steps": steps, "first_step_s": time.perf_counter() - t, "variants": {}, "floors": {}}
    threads = torch.get_num_threads()
    for i, name in enumerate(variants):
        settings = {"compile": True, "threads": threads, **_VARIANTS[name]}
        torch.set_num_threads(settings.pop("threads"))
        compile = settings.pop("compile")
        if compile != dec.segments.compiled:  # a new capture, compiled or not (at the next step)
            dec.reset_segments(compile=compile)
        key = name if name not in res["variants"] else f"{name}#{i}"
        res["variants"][key], logits = _steps(dec, conv, logits, steps)
        print(key, res["variants"][key], flush=True)
        res["floors"][key], logits = _floors(dec, conv, logits, steps, device)
        print("floors", key, res["floors"][key], flush=True)
    torch.set_num_threads(threads)
    L = shape.n_layers
    # search alone, per layer, on random queries
    q = torch.randn((shape.n_kv_heads, shape.group_size, shape.head_dim)).to(torch.bfloat16).float()
    dec.strategy.select(0, q, k)
    t = time.perf_counter()
    for layer in range(L):
        dec.strategy.select(layer, q, k)
    res["search_only_ms"] = 1e3 * (time.perf_counter() - t)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            logits = dec.forward([int(torch.argmax(logits))], conv)
    (out / f"decode_{n}_profile.txt").write_text(
        _table(prof, "self_cpu_time_total", 30) + "\n\n" + _table(prof, "self_cuda_time_total", 30)
    )
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["prefill", "decode"])
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="prof")
    ap.add_argument("--variants", default="default", help=f"comma-separated decode variants: {', '.join(_VARIANTS)}")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda", 0)
    model = build_model(a.model, device, torch.bfloat16)
    if a.what == "prefill":
        res = profile_prefill(model, a.context, a.chunk, out, device)
    else:
        res = profile_decode(model, a.context, a.k, a.steps, out, device, a.variants.split(","))
    text = json.dumps(res, indent=1, default=str)
    print(text)
    (out / f"{a.what}_{a.context}.json").write_text(text)


if __name__ == "__main__":
    main()
