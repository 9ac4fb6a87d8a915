"""Aggregating an EvalResult: summary rows, rich tables, markdown, JSON, and PNG plots."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from topk_decode.errors import TopkError
from topk_decode.eval.runs import method_name

DENSE = "dense"


def _mean(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(vals) / len(vals) if vals else None


def _worst_layer(rows: list[list[float | None] | None]) -> float | None:
    """The lowest per-layer mean mass recall (a mean over layers can hide one layer that loses the needle)."""
    rows = [r for r in rows if r is not None]
    if not rows:
        return None
    means = [_mean([row[i] for row in rows]) for i in range(len(rows[0]))]
    return min((m for m in means if m is not None), default=None)


def k_value(k: int | str | None) -> float:
    """A budget as a number for sorting and plotting: 16 → 16.0, "0.5%" → 0.5 (percentages after ints)."""
    if k is None:
        return 0.0
    if isinstance(k, str):
        return 1e12 + float(k.rstrip("%")) if k.endswith("%") else float(k)
    return float(k)


def _k_plot(k: int | str) -> float:
    """x coordinate of a budget in plots: k, or the percentage's number for "x%"."""
    return float(str(k).rstrip("%"))


def _order(length: int, strategy: str, schedule: str, k: int | str) -> tuple:
    """Rows by length, strategy, uniform schedule first, then k."""
    return length, strategy, schedule != "uniform", schedule, k_value(k)


def summarize(result) -> dict:
    """Aggregate per-instance results.

    Args:
        result: an `EvalResult`.
    Returns:
        {"accuracy": rows per (task, length, depth, method), "fidelity": rows per (length, strategy, k),
         "layer_mass_recall": {"length": {"strategy@k": [per-layer mean]}}}; a method is "dense",
        "strategy@k", or "strategy/schedule@k" for a non-uniform per-layer schedule.
    """
    acc: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0])  # correct, n, same answer as dense
    fid: dict[tuple, list] = defaultdict(list)
    layers: dict[tuple[int, str], list[list[float]]] = defaultdict(list)
    for inst in result.instances:
        # real tasks spread their questions over depths (each question's depth is in the JSON): one row per task
        key = (inst.task, inst.length, None if inst.task.startswith("real_") else inst.depth)
        if inst.answer is not None:  # documents mode has no answer: fidelity only
            acc[key + (DENSE, None, None, None)][0] += int(inst.dense_correct)
            acc[key + (DENSE, None, None, None)][1] += 1
            acc[key + (DENSE, None, None, None)][2] += 1
        for r in inst.runs:
            kk = r.k_label or r.k
            m = method_name(r.strategy, r.schedule, kk)
            if r.correct is not None:
                cell = acc[key + (m, r.strategy, r.schedule, kk)]
                cell[0] += int(r.correct)
                cell[1] += 1
                cell[2] += int(bool(r.same_as_dense))
            fid[(inst.length, r.strategy, r.schedule, kk)].append(r)
            if r.layer_mass_recall is not None:
                layers[(inst.length, m)].append(r.layer_mass_recall)
    accuracy = [
        {
            "task": t,
            "length": n,
            "depth": d,
            "method": m,
            "strategy": s,
            "schedule": sch,
            "k": k,
            "correct": c,
            "n": total,
            "accuracy": c / total,
            "same_as_dense": same,
        }
        for (t, n, d, m, s, sch, k), (c, total, same) in acc.items()
    ]
    fidelity = [
        {
            "length": n,
            "strategy": s,
            "schedule": sch,
            "k": k,
            "method": method_name(s, sch, k),
            "n": len(rs),
            "mass_recall": _mean([r.mass_recall for r in rs]),
            "id_recall": _mean([r.id_recall for r in rs]),
            "worst_layer_mass_recall": _worst_layer([r.layer_mass_recall for r in rs]),
            "output_rel_error": _mean([r.output_rel_error for r in rs]),
            "score_error_max": max((r.score_error for r in rs if r.score_error is not None), default=None),
            "kl_mean": _mean([r.kl_mean for r in rs]),
            "kl_max": max(r.kl_max for r in rs),
            "agreement": _mean([r.agreement for r in rs]),
            "resolved_k": sorted({r.k for r in rs}),
        }
        for (n, s, sch, k), rs in sorted(fid.items(), key=lambda kv: _order(*kv[0]))
    ]
    layer_means: dict[str, dict[str, list]] = defaultdict(dict)
    for (n, m), rows in layers.items():
        layer_means[str(n)][m] = [_mean([row[i] for row in rows]) for i in range(len(rows[0]))]
    return {"accuracy": accuracy, "fidelity": fidelity, "layer_mass_recall": dict(layer_means)}


def save_json(result, path: str | Path) -> Path:
    """Write `result.to_dict()` as indented JSON (parent directories are created).

    Args:
        result: an `EvalResult`.
        path: the output file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_dict(), indent=1))
    return path


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def accuracy_table_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Accuracy as "correct/n" per (task, length, depth) row and method column (dense first)."""
    methods: list[str] = [DENSE]
    cells: dict[tuple, dict[str, str]] = defaultdict(dict)
    order = sorted(
        {
            (
                r["method"] != DENSE,
                r["strategy"] or "",
                r["schedule"] not in (None, "uniform"),
                r["schedule"] or "",
                k_value(r["k"]),
                r["method"],
            )
            for r in summary["accuracy"]
        }
    )
    methods = [m for *_, m in order]
    for r in summary["accuracy"]:
        cells[(r["task"], r["length"], r["depth"])][r["method"]] = f"{r['correct']}/{r['n']}"
    header = ["task", "length", "depth"] + methods
    rows = [
        [t, str(n), "all" if d is None else f"{d:g}"] + [cells[(t, n, d)].get(m, "") for m in methods]
        for (t, n, d) in sorted(cells, key=lambda c: (c[0], c[1], -1.0 if c[2] is None else c[2]))
    ]
    return header, rows


def fidelity_table_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Fidelity means per (length, strategy, k)."""
    header = [
        "length",
        "method",
        "mass recall",
        "worst layer",
        "id recall",
        "out rel err",
        "KL mean",
        "KL max",
        "agree",
        "score err",
    ]
    rows = [
        [
            str(r["length"]),
            r["method"],
            _fmt(r["mass_recall"], ".4f"),
            _fmt(r["worst_layer_mass_recall"], ".4f"),
            _fmt(r["id_recall"], ".4f"),
            _fmt(r["output_rel_error"], ".2e"),
            _fmt(r["kl_mean"], ".2e"),
            _fmt(r["kl_max"], ".2e"),
            _fmt(r["agreement"], ".3f"),
            _fmt(r["score_error_max"], ".1e"),
        ]
        for r in summary["fidelity"]
    ]
    return header, rows


def print_tables(result, console=None) -> None:
    """Print the accuracy and fidelity tables with rich.

    Args:
        result: an `EvalResult`.
        console: a rich Console (default: a new one on stdout).
    """
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    summary = summarize(result)
    for title, (header, rows) in (
        ("Task accuracy (correct / instances)", accuracy_table_rows(summary)),
        ("Fidelity vs dense (means over instances, layers, heads, steps)", fidelity_table_rows(summary)),
    ):
        table = Table(title=title)
        for h in header:
            table.add_column(h, justify="left" if h in ("task", "method") else "right", no_wrap=True)
        for row in rows:
            table.add_row(*row)
        console.print(table)


def markdown_tables(result) -> str:
    """Both tables as GitHub markdown (for docs/history/eval-2026-11.md)."""
    summary = summarize(result)
    out = []
    for header, rows in (accuracy_table_rows(summary), fidelity_table_rows(summary)):
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "---|" * len(header))
        out += ["| " + " | ".join(r) + " |" for r in rows]
        out.append("")
    return "\n".join(out)


def write_plots(result, out_dir: str | Path) -> list[Path]:
    """PNG plots: accuracy vs k, mass recall vs k (one line per strategy and length), per-layer mass recall.

    Args:
        result: an `EvalResult`.
        out_dir: directory for the PNGs (created).
    Returns:
        the written files.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise TopkError("--plot needs matplotlib: pip install 'topk-decode[plot]'") from None
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(result)
    written = []

    # accuracy vs k, pooled over tasks and depths, per strategy and length; dense as dashed lines
    pooled: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for r in summary["accuracy"]:
        label = (
            DENSE
            if r["strategy"] is None
            else (r["strategy"] if r["schedule"] == "uniform" else f"{r['strategy']}/{r['schedule']}")
        )
        key = (r["length"], label, None if r["k"] is None else _k_plot(r["k"]))
        pooled[key][0] += r["correct"]
        pooled[key][1] += r["n"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for n in sorted({key[0] for key in pooled}):
        for s in sorted({key[1] for key in pooled if key[1] != DENSE}):
            pts = sorted((k, c / t) for (ln, st, k), (c, t) in pooled.items() if ln == n and st == s)
            (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{s}, {n} tokens")
            if (n, DENSE, None) in pooled:
                c, t = pooled[(n, DENSE, None)]
                ax.axhline(c / t, ls="--", color=line.get_color(), label=f"dense, {n} tokens")
    ax.set(
        xscale="log",
        xlabel="k (tokens per query head and layer)",
        ylabel="accuracy",
        ylim=(-0.05, 1.05),
        title="Task accuracy vs k",
    )
    ax.legend(fontsize=7)
    written.append(_save(fig, out_dir / "accuracy_vs_k.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for n in sorted({r["length"] for r in summary["fidelity"]}):
        for s in sorted({(r["strategy"], r["schedule"]) for r in summary["fidelity"]}):
            pts = [
                (_k_plot(r["k"]), r["mass_recall"])
                for r in summary["fidelity"]
                if r["length"] == n and (r["strategy"], r["schedule"]) == s and r["mass_recall"] is not None
            ]
            s = s[0] if s[1] == "uniform" else f"{s[0]}/{s[1]}"
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{s}, {n} tokens")
    ax.set(xscale="log", xlabel="k", ylabel="attention-mass recall", title="Attention-mass recall vs k")
    ax.legend(fontsize=7)
    written.append(_save(fig, out_dir / "mass_recall_vs_k.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    n_layers = 0
    for n, methods in sorted(summary["layer_mass_recall"].items(), key=lambda kv: int(kv[0])):
        for method, vals in sorted(methods.items(), key=lambda kv: (kv[0].split("@")[0], k_value(kv[0].split("@")[1]))):
            ax.plot(range(len(vals)), vals, marker="o", label=f"{method}, {n} tokens")
            n_layers = max(n_layers, len(vals))
    ax.set_xticks(range(n_layers))
    ax.set(xlabel="layer", ylabel="attention-mass recall", title="Per-layer attention-mass recall")
    ax.legend(fontsize=7)
    written.append(_save(fig, out_dir / "layer_mass_recall.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
