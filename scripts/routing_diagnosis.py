"""Why routed keeps fewer of dense's answers than exact top-k: replay real decode queries against routed's clusters.

One real-text suite context (topk_decode/eval/realtext.py) is prefilled on the CPU in fp32, a few of its
questions are decoded densely while every layer's queries are recorded, and each (step, layer, KV head) is
replayed offline against the product's clustering (index/cluster.py, full k-means as on a GPU build):

- the exact top-k of every query head (k = 1 % / 2 % of the searchable keys), the share of keys their union
  over the G query heads of a KV head covers, and the share the clusters holding them cover;
- recall (|chosen ∩ exact top-k| / k) and attention mass of the exact top-k taken among the keys read, at a
  read budget of 4 % / 5 %, for ways of choosing what to read: routed's cluster ranking (centroid, the union
  of the per-query shares), an upper bound per cluster (centroid + radius, Quest's per-dimension box), the
  oracle ranking (each cluster's true best key), and per-key estimates from product-quantization codes (faiss
  ProductQuantizer): of the raw keys, and of the residuals to routed's centroids (IVF-PQ's estimate).

    python scripts/routing_diagnosis.py --model MODEL_DIR --length 8192 --seed 1 --questions 6 --work /tmp/diag

Writes WORK/diagnosis.json (means over every step, layer and KV head) and prints it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import faiss
import numpy as np
import torch

from topk_decode.eval.realtext import REAL_TASKS, make_suite
from topk_decode.index.routed.cluster import KMeansConfig, build_layer
from topk_decode.store.cache_dir import open_cache

N_SINK, N_TAIL = 4, 64


def prefill(model: Path, length: int, seed: int, work: Path):
    """The suite context's cache in WORK (reused when present) and the suite."""
    from transformers import AutoTokenizer

    from topk_decode.prefill.build import build_cache

    suite = make_suite(list(REAL_TASKS), length, seed, AutoTokenizer.from_pretrained(model), per_task=6)
    cache = work / "cache"
    if not (cache / "manifest.json").exists():
        (work / "docs").mkdir(parents=True, exist_ok=True)
        (work / "docs" / "context.txt").write_text(suite.context)
        build_cache(work / "docs", cache, model, device="cpu", dtype="fp32")
    return cache, suite


def record(cache: Path, suite, n_questions: int, steps: int) -> list[list[list[torch.Tensor]]]:
    """Per question, per decode step, per layer: the (Hkv, G, D) queries of a dense greedy decode."""
    from topk_decode import KVStore

    store = KVStore.open(cache, device="cpu", k=10**9)
    picked = suite.questions[:: max(1, len(suite.questions) // n_questions)][:n_questions]
    out = []
    for q in picked:
        ids = store.tokenizer(
            store.prompt_format.question_text(q.question, first_turn=True), add_special_tokens=False
        ).input_ids
        conv, per_step = store.decoder.new_conversation(), []

        def observe(layer, qq, sel, c, per_step=per_step):
            if layer == 0:
                per_step.append([])
            per_step[-1].append(qq.clone())

        conv.observer = observe
        store.decoder.generate(conv, ids, steps)
        out.append(per_step[1:])  # one-token steps only (the first is the question's prompt)
    store.close()
    return out


def union_priority(scores: torch.Tensor) -> torch.Tensor:
    """(G, X) scores → (X,) the largest share any query gives each item (routed's union over the G heads)."""
    return (scores - torch.logsumexp(scores, -1, keepdim=True)).amax(0)


def take_clusters(priority: torch.Tensor, sizes: torch.Tensor, budget: float) -> torch.Tensor:
    """(C,) bool: clusters by priority until `budget` keys are read (the last one overshoots, as routed)."""
    order = priority.argsort(descending=True)
    n = int((sizes[order].cumsum(0) < budget).sum()) + 1
    chosen = torch.zeros(len(sizes), dtype=torch.bool)
    chosen[order[:n]] = True
    return chosen


def take_keys(priority: torch.Tensor, budget: float) -> torch.Tensor:
    """(M,) bool: the `budget` keys of highest priority."""
    chosen = torch.zeros(len(priority), dtype=torch.bool)
    chosen[priority.argsort(descending=True)[: int(budget)]] = True
    return chosen


def pq_reconstruction(x: np.ndarray, m: int, nbits: int) -> torch.Tensor:
    """x (M, D) through a trained faiss ProductQuantizer of m sub-vectors of nbits each, decoded back."""
    pq = faiss.ProductQuantizer(x.shape[1], m, nbits)
    pq.train(x)
    return torch.from_numpy(pq.decode(pq.compute_codes(x)))


def diagnose(cache: Path, queries, ks=(0.01, 0.02), reads=(0.04, 0.05), pq_m: int = 32, pq_bits: int = 4) -> dict:
    """Means over every (question, step, layer, KV head) of the figures in the module docstring."""
    ckv = open_cache(cache)
    lo, hi = N_SINK, ckv.n_tokens - N_TAIL
    M, D, scale = hi - lo, ckv.head_dim, ckv.head_dim**-0.5
    cfg = KMeansConfig(cluster_size=16, iters=6, cpu_sample=10**9, cpu_seconds=1e9)  # as the GPU build: no sampling
    sums: dict[str, list[float]] = {}

    def add(key, v):
        sums.setdefault(key, []).append(v)

    for layer in range(ckv.n_layers):
        keys = ckv.keys[layer][:, lo:hi].float()
        lay = build_layer(keys, ckv.values[layer][:, lo:hi].float(), cfg, torch.device("cpu"))
        for h in range(ckv.n_kv_heads):
            sizes = lay.offsets[h, 1:] - lay.offsets[h, :-1]
            C = len(sizes)
            label = torch.repeat_interleave(torch.arange(C), sizes)  # cluster of every layout row
            cid = torch.empty(M, dtype=torch.long)
            cid[lay.pos[h]] = label  # cluster of every key
            mu, kl = lay.centroids[h], lay.keys[h].float()
            radius = torch.zeros(C).scatter_reduce(0, label, (kl - mu[label]).norm(dim=1), "amax", include_self=False)
            idx = label[:, None].expand(-1, D)
            box_hi = torch.full((C, D), -1e30).scatter_reduce(0, idx, kl, "amax")
            box_lo = torch.full((C, D), 1e30).scatter_reduce(0, idx, kl, "amin")
            x = keys[h].numpy()
            raw_pq = pq_reconstruction(np.ascontiguousarray(x), pq_m, pq_bits)
            res_pq = pq_reconstruction(np.ascontiguousarray((keys[h] - mu[cid]).numpy()), pq_m, pq_bits)
            for steps in queries:
                for qs in steps:
                    q = qs[layer][h].float()  # (G, D)
                    s = q @ keys[h].T  # (G, M) exact q·k
                    p = torch.softmax(s * scale, -1)
                    base = (q @ mu.T) * scale  # (G, C)
                    qn = q.norm(dim=1, keepdim=True) * scale
                    best = torch.full((q.shape[0], C), -1e30).scatter_reduce(
                        1, cid.expand(q.shape[0], -1), s * scale, "amax"
                    )
                    by_cluster = {
                        "clusters by centroid (routed)": union_priority(base),
                        "clusters by centroid + radius": union_priority(base + qn * radius),
                        "clusters by box bound (Quest)": union_priority(
                            torch.maximum(q[:, None] * box_hi, q[:, None] * box_lo).sum(-1) * scale
                        ),
                        "clusters by their best key (oracle)": union_priority(best),
                    }
                    by_key = {
                        f"keys by PQ {pq_m}x{pq_bits}b of the raw keys": union_priority((q @ raw_pq.T) * scale),
                        f"keys by centroid + PQ {pq_m}x{pq_bits}b of the residual (IVF-PQ)": union_priority(
                            base[:, cid] + (q @ res_pq.T) * scale
                        ),
                    }
                    for kf in ks:
                        k = max(1, int(kf * ckv.n_tokens))
                        top = s.topk(k, -1).indices
                        exact = torch.zeros_like(s, dtype=torch.bool).scatter_(1, top, True)
                        union = exact.any(0)
                        held = torch.zeros(C, dtype=torch.bool)
                        held[cid[union]] = True
                        add(f"k={kf:.0%}: union of the G heads' top-k, share of keys", union.float().mean().item())
                        add(f"k={kf:.0%}: clusters holding them, share of keys", sizes[held].sum().item() / M)
                        add(f"k={kf:.0%}: exact top-k (flat) mass", torch.gather(p, 1, top).sum(1).mean().item())
                        for r in reads:
                            chosen = {n: take_clusters(v, sizes, r * M)[cid] for n, v in by_cluster.items()}
                            chosen |= {n: take_keys(v, r * M) for n, v in by_key.items()}
                            for name, read in chosen.items():
                                got = s.masked_fill(~read[None], -1e30).topk(k, -1).indices
                                hit = torch.zeros_like(exact).scatter_(1, got, True) & exact
                                tag = f"k={kf:.0%} read={r:.0%}: {name}"
                                add(f"{tag}: recall", (hit.sum(1).float() / k).mean().item())
                                add(f"{tag}: mass", torch.gather(p, 1, got).sum(1).mean().item())
        print(f"layer {layer} done", flush=True)
    return {key: sum(v) / len(v) for key, v in sums.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="HF checkpoint directory (e.g. a converted GGUF)")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--steps", type=int, default=6, help="decode steps per question (the first is the prompt)")
    ap.add_argument("--work", required=True, help="working directory (cache and queries reused when present)")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    cache, suite = prefill(Path(args.model), args.length, args.seed, work)
    qfile = work / "queries.pt"
    if qfile.exists():
        queries = torch.load(qfile)
    else:
        queries = record(cache, suite, args.questions, args.steps)
        torch.save(queries, qfile)
    result = {
        "model": str(args.model),
        "length": args.length,
        "seed": args.seed,
        "questions": len(queries),
        "steps": args.steps - 1,
        **diagnose(cache, queries),
    }
    result["seconds"] = round(time.time() - t0, 1)
    (work / "diagnosis.json").write_text(json.dumps(result, indent=1))
    for key, v in result.items():
        print(f"{key:90s} {v:.4f}" if isinstance(v, float) else f"{key:90s} {v}")


if __name__ == "__main__":
    main()
