"""Measure selection strategies: top-k id recall, attention-mass recall, search time, memory.

Recall: prefill a task context (`topk_decode/eval/tasks.py`) with a model, decode its question densely
(k ≥ N) while recording every layer's queries, then replay those queries through each strategy
and compare with the exact top-k over the searchable range:
    id recall   = |selected ∩ exact top-k| / k            (per query head, averaged)
    mass recall = Σ_{selected} softmax(q·k/√D)             (softmax over the searchable range)
Search time: wall-clock of `select` per decode step (all layers), one query token, on this machine.

    python benchmarks/bench_strategies.py recall --length 8192 --k 64 256 1024 --out recall.json
    python benchmarks/bench_strategies.py speed --sizes 16384 65536 262144 --out speed.json
    python benchmarks/bench_strategies.py offset --n 8192 --out offset.json
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch

from topk_decode.index import get_strategy
from topk_decode.store.cache_dir import CacheWriter, open_cache

# (label, strategy, options) measured for every budget; budgets are per query head and layer.
CONFIGS = [
    ("flat", "flat", {}),
    ("ivf nprobe=nlist/16 raw", "ivf", {"center": False, "spherical": False, "nprobe_frac": 16}),
    ("ivf nprobe=nlist/16 spherical", "ivf", {"center": False, "spherical": True, "nprobe_frac": 16}),
    ("ivf nprobe=nlist/16 centred+spherical", "ivf", {"center": True, "spherical": True, "nprobe_frac": 16}),
    ("ivf nprobe=nlist/8 raw", "ivf", {"center": False, "spherical": False, "nprobe_frac": 8}),
    ("ivf nprobe=nlist/8 centred (default)", "ivf", {"center": True, "spherical": False, "nprobe_frac": 8}),
    ("ivf nprobe=nlist/8 centred+spherical", "ivf", {"center": True, "spherical": True, "nprobe_frac": 8}),
    ("ivf nprobe=nlist/4 centred (default)", "ivf", {"center": True, "spherical": False, "nprobe_frac": 4}),
    ("hnsw ef=64 raw", "hnsw", {"center": False, "efSearch": 64}),
    ("hnsw ef=64 centred (default)", "hnsw", {"center": True, "efSearch": 64}),
    ("hnsw ef=256 centred", "hnsw", {"center": True, "efSearch": 256}),
    ("quest page=16", "quest", {"page_size": 16, "dense_layers": 0}),
    ("tokenselect no cache", "tokenselect", {"threshold": 2.0}),
    ("tokenselect cache 0.9", "tokenselect", {"threshold": 0.9}),
]


def open_strategy(ckv, name: str, options: dict, lo: int, hi: int):
    """Build (if needed) and open one strategy; returns it and its build seconds (0 when reused)."""
    opts = dict(options)
    frac = opts.pop("nprobe_frac", None)
    if frac is not None:
        nlist = opts.get("nlist") or max(1, min(int(4 * math.sqrt(ckv.n_tokens)), ckv.n_tokens // 39))
        opts.update(nlist=nlist, nprobe=max(1, nlist // frac))
    strat = get_strategy(name)(ckv, lo, hi, opts)
    t0 = time.perf_counter()
    strat.prepare()
    return strat, time.perf_counter() - t0


def artifact_bytes(cache: Path, name: str) -> int:
    """Bytes of a strategy's artifact directory (0 for strategies without artifacts)."""
    d = cache / "index" / name
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file()) if d.is_dir() else 0


# ---- recall --------------------------------------------------------------------------------------
def record_queries(cache: Path, question_ids: list[int], steps: int) -> tuple[list[list[torch.Tensor]], object]:
    """Decode densely and keep each step's per-layer queries (Hkv, G·T, D)."""
    from topk_decode import KVStore

    store = KVStore.open(cache, k=10**9, device="cpu")
    conv = store.decoder.new_conversation()
    per_step: list[list[torch.Tensor]] = []

    def observe(layer, q, sel, c):
        if layer == 0:
            per_step.append([])
        per_step[-1].append(q.clone())

    conv.observer = observe
    out = store.decoder.generate(conv, question_ids, steps)
    return per_step, (store, out)


def _select(strat, routes, layer: int, q: torch.Tensor, k: int, state):
    """One layer's selection: the strategy's own `select`, or (routes: routed's `DeviceRoutes`, here on the CPU)
    the device's ranking and the compiled scan, as a device-routed decode step selects."""
    if routes is None:
        return strat.select(layer, q, k, state)
    hkv, Q, d = q.shape
    routes.route(layer, q)
    o, mz = torch.empty(hkv * Q, d, dtype=torch.bfloat16), torch.empty(hkv * Q, 2)
    return strat.select_and_attend(layer, q, k, state, o, mz, route=routes.host_route(layer))


def recall_rows(
    cache: Path, steps_q: list[list[torch.Tensor]], budgets: list[int], n_sink: int, n_tail: int
) -> list[dict]:
    """Replay recorded queries through every configuration and budget."""
    ckv = open_cache(cache)
    lo, hi = n_sink, ckv.n_tokens - n_tail
    scale = ckv.head_dim**-0.5
    exact = []  # per step, per layer: (scores (Hkv,Q,M), probs)
    for qs in steps_q:
        row = []
        for layer, q in enumerate(qs):
            s = torch.bmm(q, ckv.keys[layer][:, lo:hi].float().transpose(1, 2))
            row.append((s, torch.softmax(s * scale, dim=-1)))
        exact.append(row)
    rows = []
    for label, name, options in CONFIGS:
        strat, build_s = open_strategy(ckv, name, options, lo, hi)
        for k in budgets:
            if k >= hi - lo:
                continue
            id_rec, mass, times = [], [], []
            # routed with device_route=true: rank as the decode device does (its `device_tables` precision)
            routes = (
                strat.device_routes(torch.device("cpu"), [k] * ckv.n_layers)
                if options.get("device_route") == "true"
                else None
            )
            state = strat.new_state()
            strat.stats.searches = strat.stats.reused = 0
            for qs, ex in zip(steps_q, exact):
                t0 = time.perf_counter()
                sels = [_select(strat, routes, layer, q, k, state) for layer, q in enumerate(qs)]
                times.append(time.perf_counter() - t0)
                for sel, (s, p) in zip(sels, ex):
                    top = s.topk(k, dim=-1).indices + lo  # (Hkv, Q, k)
                    ids = sel.ids
                    valid = ids >= 0
                    hit = (ids.unsqueeze(-1) == top.unsqueeze(-2)).any(-2)  # (Hkv, Q, k)
                    id_rec.append(hit.float().mean().item())
                    kept = torch.where(valid, ids - lo, 0)
                    m = (p.gather(-1, kept) * valid).sum(-1)
                    mass.append(m.mean().item())
            reuse = strat.stats.reused / max(1, strat.stats.reused + strat.stats.searches)
            rows.append(
                {
                    "config": label,
                    "k": k,
                    "id_recall": sum(id_rec) / len(id_rec),
                    "mass_recall": sum(mass) / len(mass),
                    "ms_per_step": 1e3 * sum(times) / len(times),
                    "reuse_rate": reuse,
                    "build_s": round(build_s, 2),
                    "artifact_bytes": artifact_bytes(cache, name),
                }
            )
            print(json.dumps(rows[-1]))
    return rows


def random_model(out: Path, head_dim: int) -> Path:
    """A random-weight Llama with a realistic head dim: 2 layers, 8 query / 2 KV heads, hidden 8·head_dim."""
    from topk_decode.demo import default_model_dir
    from topk_decode.model.loading import load_tokenizer
    from topk_decode.model.tiny import make_random_model

    if not (out / "config.json").is_file():
        tok = load_tokenizer(default_model_dir()[0])
        make_random_model(
            out,
            "llama",
            seed=0,
            tokenizer=tok,
            hidden_size=8 * head_dim,
            head_dim=head_dim,
            intermediate_size=16 * head_dim,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=65536,
        )
    return out


def cmd_recall(args) -> None:
    from topk_decode.demo import default_model_dir
    from topk_decode.eval.tasks import make_instance
    from topk_decode.model.loading import load_tokenizer
    from topk_decode.prefill.build import build_cache

    work = Path(args.work or tempfile.mkdtemp(prefix="measure-"))
    if args.model:
        model_dir, trained = Path(args.model), True
    elif args.random_head_dim:
        model_dir, trained = random_model(work / "model", args.random_head_dim), False
    else:
        model_dir, trained = default_model_dir()
    tok = load_tokenizer(model_dir)
    inst = make_instance(args.task, args.length, 0.5, args.seed, tok)
    (work / "docs").mkdir(parents=True, exist_ok=True)
    (work / "docs" / "context.txt").write_text(inst.context)
    cache = work / "cache"
    if not (cache / "manifest.json").is_file():
        t0 = time.perf_counter()
        build_cache(
            work / "docs", cache, model_dir, chunk_size=1024, device="cpu", dtype=args.kv_dtype, allow_long_context=True
        )  # recall is measured on the keys, also past the model's positions
        print(f"prefill {time.perf_counter() - t0:.1f}s")
    question = tok(inst.question, add_special_tokens=False).input_ids
    steps_q, (_, generated) = record_queries(cache, question, args.steps)
    text = tok.decode(generated, skip_special_tokens=True).strip()
    print(f"dense answer {text!r}, expected {inst.answer!r}")
    ckv = open_cache(cache)
    rows = recall_rows(cache, steps_q, args.k, 4, 64)
    result = {
        "model": str(model_dir),
        "trained": trained,
        "task": args.task,
        "n_tokens": ckv.n_tokens,
        "shape": ckv.manifest["shape"],
        "kv_dtype": ckv.manifest["kv_dtype"],
        "steps": len(steps_q),
        "dense_answer": text,
        "expected": inst.answer,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))


# ---- speed ---------------------------------------------------------------------------------------
def synthetic_cache(out: Path, n: int, layers: int, hkv: int, d: int, seed: int = 0) -> Path:
    """A model-free bf16 cache of random keys with a shared offset (the speed of a search does not
    depend on the model; its recall does, which is why recall is measured on model keys)."""
    if (out / "manifest.json").is_file():
        return out
    gen = torch.Generator().manual_seed(seed)
    w = CacheWriter(out)
    for layer in range(layers):
        keys = (torch.randn(hkv, n, d, generator=gen) + torch.randn(hkv, 1, d, generator=gen) * 2).bfloat16()
        w.write_layer(layer, keys, keys)
    w.write_tokens([0] * n)
    w.commit(
        {
            "model": {"path": "none", "fingerprint": "none"},
            "kv_dtype": "bfloat16",
            "n_tokens": n,
            "shape": {"n_layers": layers, "n_heads": hkv * 4, "n_kv_heads": hkv, "head_dim": d},
            "documents": [],
        }
    )
    return out


def cmd_speed(args) -> None:
    work = Path(args.work or tempfile.mkdtemp(prefix="speed-"))
    speed_configs = [
        ("flat faiss", "flat", {}),
        ("flat torch", "flat", {"backend": "torch"}),
        ("ivf nprobe=nlist/16", "ivf", {"nprobe_frac": 16}),
        ("ivf nprobe=nlist/8", "ivf", {"nprobe_frac": 8}),
        ("hnsw ef=64", "hnsw", {"efSearch": 64}),
        ("quest page=16", "quest", {"dense_layers": 0}),
        ("tokenselect no cache", "tokenselect", {"threshold": 2.0}),
    ]
    rows = []
    for n in args.sizes:
        cache = synthetic_cache(work / f"c{n}", n, args.layers, args.kv_heads, args.head_dim)
        ckv = open_cache(cache, verify=False)
        q = torch.randn(args.layers, args.kv_heads, args.group, args.head_dim)
        for label, name, options in speed_configs:
            strat, build_s = open_strategy(ckv, name, options, 4, n - 64)
            for k in args.k:
                strat.select(0, q[0], k, strat.new_state())  # warm up (page in the memory map)
                t0 = time.perf_counter()
                for _ in range(args.repeat):
                    for layer in range(args.layers):
                        strat.select(layer, q[layer], k, strat.new_state())
                ms = 1e3 * (time.perf_counter() - t0) / args.repeat / args.layers
                rows.append(
                    {
                        "n": n,
                        "config": label,
                        "k": k,
                        "ms_per_layer": round(ms, 3),
                        "build_s": round(build_s, 2),
                        "artifact_bytes": artifact_bytes(cache, name),
                    }
                )
                print(json.dumps(rows[-1]))
    Path(args.out).write_text(
        json.dumps(
            {
                "layers": args.layers,
                "kv_heads": args.kv_heads,
                "group": args.group,
                "head_dim": args.head_dim,
                "rows": rows,
            },
            indent=1,
        )
    )


def cmd_offset(args) -> None:
    """Recall@k of ivf/hnsw, raw vs centred keys, on random keys sharing a per-head offset (synthetic:
    real attention keys carry such a common component; the queries do not)."""
    work = Path(args.work or tempfile.mkdtemp(prefix="offset-"))
    gen = torch.Generator().manual_seed(0)
    n, h, d, k = args.n, 2, args.head_dim, args.k
    cache = work / "cache"
    w = CacheWriter(cache)
    keys = torch.randn(h, n, d, generator=gen) + torch.randn(h, 1, d, generator=gen) * 2
    w.write_layer(0, keys, keys)
    w.write_tokens([0] * n)
    w.commit(
        {
            "model": {"path": "none", "fingerprint": "none"},
            "kv_dtype": "float32",
            "n_tokens": n,
            "shape": {"n_layers": 1, "n_heads": 4 * h, "n_kv_heads": h, "head_dim": d},
            "documents": [],
        }
    )
    ckv = open_cache(cache)
    q = torch.randn(h, 16, d, generator=gen)
    ref = open_strategy(ckv, "flat", {}, 0, n)[0].select(0, q, k).ids
    nlist = max(1, min(int(4 * math.sqrt(n)), n // 39))
    rows = []
    for name, opts in [
        ("ivf", dict(center=False, spherical=False)),
        ("ivf", dict(center=False, spherical=True)),
        ("ivf", dict(center=True, spherical=False)),
        ("ivf", dict(center=True, spherical=True)),
        ("hnsw", dict(center=False, efSearch=64)),
        ("hnsw", dict(center=True, efSearch=64)),
    ]:
        if name == "ivf":
            opts.update(nlist=nlist, nprobe=max(1, nlist // 8))
        ids = open_strategy(ckv, name, opts, 0, n)[0].select(0, q, k).ids
        rec = (ids.unsqueeze(-1) == ref.unsqueeze(-2)).any(-2).float().mean().item()
        rows.append({"strategy": name, **opts, "k": k, "id_recall": round(rec, 3)})
        print(json.dumps(rows[-1]))
    Path(args.out).write_text(json.dumps({"n": n, "head_dim": d, "rows": rows}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("recall", help="recall of the exact top-k and of attention mass on model keys")
    r.add_argument("--model", help="checkpoint dir (default: the demo model, else the random stand-in)")
    r.add_argument("--random-head-dim", type=int, help="measure on a random 2-layer Llama with this head dim")
    r.add_argument("--task", default="single_needle")
    r.add_argument("--length", type=int, default=8192)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--steps", type=int, default=8, help="decode steps whose queries are replayed")
    r.add_argument("--k", type=int, nargs="+", default=[32, 128, 512])
    r.add_argument("--work", help="working directory (the cache is reused when present)")
    r.add_argument(
        "--kv-dtype",
        default=None,
        help="the cache's KV dtype, e.g. bf16 (routed's compiled path and "
        "device routing read bf16 only; default: build_cache's)",
    )
    r.add_argument("--out", default="recall.json")
    s = sub.add_parser("speed", help="search time per layer on synthetic bf16 keys")
    s.add_argument("--sizes", type=int, nargs="+", default=[16384, 65536])
    s.add_argument("--k", type=int, nargs="+", default=[256])
    s.add_argument("--layers", type=int, default=2)
    s.add_argument("--kv-heads", type=int, default=8)
    s.add_argument("--group", type=int, default=4)
    s.add_argument("--head-dim", type=int, default=128)
    s.add_argument("--repeat", type=int, default=5)
    s.add_argument("--work")
    s.add_argument("--out", default="speed.json")
    o = sub.add_parser("offset", help="raw vs centred ANN recall on synthetic keys with a shared offset")
    o.add_argument("--n", type=int, default=8192)
    o.add_argument("--head-dim", type=int, default=64)
    o.add_argument("--k", type=int, default=64)
    o.add_argument("--work")
    o.add_argument("--out", default="offset.json")
    args = p.parse_args()
    {"recall": cmd_recall, "speed": cmd_speed, "offset": cmd_offset}[args.cmd](args)


if __name__ == "__main__":
    main()
