"""How close `--append` comes to a fresh prefill of old + new on a GPU (docs/DOCUMENTS.md), beside how close two
fresh prefills come to each other: max |difference| of every layer's keys and values and of the last logits.

    PYTHONPATH=. python scripts/append_gpu_check.py [--device cuda] [--dtype bf16] [--chunk-size 100]

Builds, with the bundled demo model, a cache of two generated documents, appends two more, prefills all four
fresh (twice), and prints one line per comparison.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from topk_decode.demo import DEMO_MODEL_DIR
from topk_decode.prefill.append import append_cache
from topk_decode.prefill.build import build_cache
from topk_decode.store.cache_dir import open_cache

WORDS = "harbour tide ledger fox amber north field note travel log spring cod salt rope mast pier".split()


def text(seed: int, n: int = 600) -> str:
    return " ".join(WORDS[(seed * 7 + i * i) % len(WORDS)] for i in range(n)) + "\n"


def write(folder: Path, names: list[str]) -> Path:
    folder.mkdir(parents=True)
    for i, name in enumerate(names):
        (folder / name).write_text(text(hash(name) % 97 + i))
    return folder


def diff(a: Path, b: Path) -> str:
    ca, cb = open_cache(a), open_cache(b)
    assert ca.tokens == cb.tokens
    kv = max(
        max(
            (ca.keys[i].float() - cb.keys[i].float()).abs().max().item(),
            (ca.values[i].float() - cb.values[i].float()).abs().max().item(),
        )
        for i in range(ca.n_layers)
    )
    scale = max(ca.keys[i].float().abs().max().item() for i in range(ca.n_layers))
    la = torch.from_numpy(__import__("numpy").fromfile(a / "last_logits.f32", dtype="float32"))
    lb = torch.from_numpy(__import__("numpy").fromfile(b / "last_logits.f32", dtype="float32"))
    same = all(ca.manifest["files"][f] == cb.manifest["files"][f] for f in ca.manifest["files"])
    return (
        f"{ca.n_tokens} tokens: byte-identical {same}; max |ΔKV| {kv:.3g} (max |key| {scale:.3g}); "
        f"max |Δlogits| {(la - lb).abs().max().item():.3g}; same next token {int(la.argmax()) == int(lb.argmax())}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--chunk-size", type=int, default=100)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        old, new = ["a1.txt", "a2.txt"], ["b1.txt", "b2.txt"]
        write(d / "old", old), write(d / "new", new)
        both = d / "both"
        both.mkdir()
        for f in (d / "old").iterdir():
            (both / f.name).write_text(f.read_text())
        for f in (d / "new").iterdir():
            (both / f.name).write_text(f.read_text())
        kw = dict(chunk_size=args.chunk_size, device=args.device, dtype=args.dtype)
        build_cache(d / "old", d / "app", DEMO_MODEL_DIR, **kw)
        append_cache(d / "new", d / "app", device=args.device)
        build_cache(both, d / "f1", DEMO_MODEL_DIR, **kw)
        build_cache(both, d / "f2", DEMO_MODEL_DIR, **kw)
        name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
        print(f"{name}, {args.dtype}, chunk {args.chunk_size}")
        print("append vs fresh:", diff(d / "app", d / "f1"))
        print("fresh vs fresh: ", diff(d / "f2", d / "f1"))


if __name__ == "__main__":
    main()
