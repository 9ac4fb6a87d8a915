"""Decode tokens/s against context length, one line per system, from a `topk bench` JSON."""

from __future__ import annotations

from pathlib import Path

_LABELS = {
    "topk": "top-k flat (exact), GPU budget",
    "hf-dense": "HF DynamicCache (KV on GPU)",
    "hf-offload": "HF DynamicCache(offloading=True)",
}


def plot_results(data: dict, out: str | Path) -> Path:
    """Write a PNG: x = context length (log scale), y = decode tokens/s; rows that did not run or fit
    are marked on the x axis with a cross in the system's colour.

    Args:
        data: the benchmark results (as written to bench_<model>.json).
        out: the PNG path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    rows = data["rows"]
    # one line per top-k strategy (rows of older files carry no strategy: flat)
    names = sorted({r.get("strategy", "flat") for r in rows if r["system"] == "topk"}) or ["flat"]
    labels = {(s, None): l for s, l in _LABELS.items() if s != "topk"}
    labels = {**{("topk", n): _LABELS["topk"] if n == "flat" else f"top-k {n}, GPU budget" for n in names}, **labels}
    for i, ((system, strat), label) in enumerate(labels.items()):
        mine = [r for r in rows if r["system"] == system and (strat is None or r.get("strategy", "flat") == strat)]
        ok = sorted((r["context"], r["tokens_per_s"]) for r in mine if r["status"] == "ok")
        missing = sorted(r["context"] for r in mine if r["status"] != "ok")
        if ok:
            (line,) = ax.plot([c for c, _ in ok], [t for _, t in ok], marker="o", label=label)
            color = line.get_color()
        else:
            color = None
        if missing:
            # side by side (x nudged per system) so that three systems missing at one length all show
            ax.scatter(
                [m * (1 + 0.06 * i) for m in missing],
                [0] * len(missing),
                marker="x",
                color=color,
                label=f"{label}: did not run / fit" if not ok else None,
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode tokens/s (batch 1)")
    env = data.get("environment", {})
    ax.set_title(f"{data.get('model', {}).get('name', '')} — {env.get('gpu', 'CPU')}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_files(paths: list[str | Path], out: str | Path) -> Path:
    """One plot from several `topk bench` JSON files of the same model (e.g. a 32K–128K run and a
    512K–1M run): their rows are concatenated.

    Args:
        paths: bench_<model>.json files.
        out: the PNG path.
    """
    import json

    datas = [json.loads(Path(p).read_text()) for p in paths]
    merged = dict(datas[0], rows=[r for d in datas for r in d["rows"]])
    return plot_results(merged, out)
