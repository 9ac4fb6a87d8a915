"""How much a compact KV format alone costs dense attention on a real model (issue 28: choose 8-bit by measurement).

For each context of the fidelity suite (`topk_decode/eval/realtext.py`, held-out seeds) the model prefills the context
once; every question is then answered by dense attention over the stored KV (`DenseContext`, as the suite's dense
reference), and again over the same KV rounded through each format and back. Reported per format: the same final
answer as full-precision dense (`paired.same_answer`), correct answers, and the first answer token's KL against it.

Formats (rounded per KV head; KIVI / KVQuant: keys per channel, values per token):
    bf16           what a GPU prefill stores (the floor when the run is fp32)
    fp8            float8 e4m3 with a per-channel scale for keys and a per-token scale for values
    fp8-raw        float8 e4m3 cast with no scale
    int8           symmetric int8, keys per channel, values per token
    int4           symmetric int4 (−7..7), keys per channel, values per token

    python scripts/kv_format_fidelity.py --model Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf --length 4096 \\
        --first-seed 10 --seeds 4 --out kvfmt.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

FORMATS = ("bf16", "fp8", "fp8-raw", "int8", "int4")
FP8_MAX = 448.0  # float8 e4m3's largest finite value


def _scaled(x: torch.Tensor, dim: int, top: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x / scale with scale = max|x| / top over `dim` (kept), and the scale."""
    scale = x.abs().amax(dim=dim, keepdim=True).clamp(min=1e-8) / top
    return x / scale, scale


def roundtrip(x: torch.Tensor, fmt: str, keys: bool) -> torch.Tensor:
    """x (Hkv, N, D), or (1, Hkv, N, D) as the dense reference holds it, rounded through `fmt` and back to its dtype:
    keys scaled per KV head and channel (over N), values per KV head and token (over D)."""
    if x.dim() == 4:  # the batch dimension: before 2026-11-27 (session 8) the scales were taken over the wrong axes
        return roundtrip(x[0], fmt, keys)[None]
    dim = 1 if keys else 2
    xf = x.float()
    if fmt == "bf16":  # what a GPU prefill stores: the floor of this measurement on an fp32 CPU run
        return xf.to(torch.bfloat16).to(x.dtype)
    if fmt == "fp8-raw":
        return xf.to(torch.float8_e4m3fn).to(x.dtype)
    if fmt == "fp8":
        y, s = _scaled(xf, dim, FP8_MAX)
        return (y.to(torch.float8_e4m3fn).float() * s).to(x.dtype)
    if fmt == "int8":  # what `topk prefill --kv-dtype int8` stores
        from topk_decode.store.quant import dequantize_keys, dequantize_values, quantize_keys, quantize_values

        out = dequantize_keys(*quantize_keys(x)) if keys else dequantize_values(*quantize_values(x))
        return out.to(x.dtype)
    top = 7.0  # int4
    y, s = _scaled(xf, dim, top)
    return (y.round().clamp(-top, top) * s).to(x.dtype)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF checkpoint directory or .gguf file")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--first-seed", type=int, default=10)
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--questions", type=int, default=3, help="questions per task per context")
    p.add_argument("--tasks", default="real_needle,real_multi_key,real_qa")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--out", default="kv_format_fidelity.json")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from measure_real import convert_gguf

    from topk_decode.eval.paired import final_answer, same_answer
    from topk_decode.eval.realrun import DenseContext
    from topk_decode.eval.realtext import make_suite
    from topk_decode.model.loading import eos_token_ids, load_model, load_tokenizer
    from topk_decode.prefill.build import build_cache
    from topk_decode.prefill.documents import PromptFormat
    from topk_decode.store.cache_dir import open_cache

    model_dir = Path(args.model)
    if model_dir.suffix == ".gguf":
        model_dir = convert_gguf(model_dir, Path(tempfile.gettempdir()) / "topk-converted")
    model = load_model(model_dir, torch.device("cpu"), torch.float32)
    tok = load_tokenizer(model_dir)
    eos = eos_token_ids(model, tok)
    formats = [f for f in args.formats.split(",") if f]
    rows = []
    t_start = time.perf_counter()
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        suite = make_suite(args.tasks.split(","), args.length, seed, tok, per_task=args.questions)
        with tempfile.TemporaryDirectory(prefix="kvfmt-") as tmp:
            doc = Path(tmp) / "document.txt"
            doc.write_text(suite.context, encoding="utf-8")
            cache, _ = build_cache(doc, Path(tmp) / "cache", model_dir, device="cpu", allow_long_context=True)
            ckv = open_cache(cache, verify=False)
            fmt_prompt = PromptFormat(**ckv.manifest.get("prompt", {"kind": "raw"}))
            dense = DenseContext(model, ckv)
            variants = {}
            for f in formats:
                v = DenseContext.__new__(DenseContext)
                v.model = model
                v.kv = [(roundtrip(k, f, True), roundtrip(x, f, False)) for k, x in dense.kv]
                variants[f] = v
            for q in suite.questions:
                ids = tok(fmt_prompt.question_text(q.question, first_turn=True), add_special_tokens=False).input_ids
                n = max(q.max_new_tokens, 1)
                d_tokens, d_logits = dense.generate(ids, n, eos)
                d_text = tok.decode(d_tokens, skip_special_tokens=True)
                row = {
                    "seed": seed,
                    "task": q.task,
                    "depth": q.depth,
                    "answer": q.answer,
                    "dense": d_text,
                    "dense_correct": q.check(d_text),
                    "formats": {},
                }
                for f, v in variants.items():
                    tokens, logits = v.generate(ids, n, eos)
                    text = tok.decode(tokens, skip_special_tokens=True)
                    kl = torch.nn.functional.kl_div(
                        logits[0].log_softmax(-1), d_logits[0].log_softmax(-1), log_target=True, reduction="sum"
                    )
                    row["formats"][f] = {
                        "generated": text,
                        "correct": q.check(text),
                        "same_answer": same_answer(q.task, text, q.check(text), d_text, row["dense_correct"]),
                        "final": final_answer(q.task, text),
                        "kl_first": float(kl),
                    }
                rows.append(row)
                print(
                    seed,
                    q.task,
                    repr(d_text[:40]),
                    {f: r["same_answer"] for f, r in row["formats"].items()},
                    flush=True,
                )
        Path(args.out).write_text(
            json.dumps({"args": vars(args), "rows": rows, "seconds": time.perf_counter() - t_start}, indent=1)
        )
    n = len(rows)
    print(f"\n{n} questions, dense right {sum(r['dense_correct'] for r in rows)}")
    print("| format | same answer as dense | correct | KL first token (mean) |\n|---|---|---|---|")
    for f in formats:
        same = sum(r["formats"][f]["same_answer"] for r in rows)
        ok = sum(r["formats"][f]["correct"] for r in rows)
        kl = sum(r["formats"][f]["kl_first"] for r in rows) / max(n, 1)
        print(f"| {f} | {same}/{n} | {ok}/{n} | {kl:.2e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
