"""Paired comparison of every strategy with dense on the same questions (the fidelity suite's report).

Each question is answered densely and by every strategy × budget over the same prefilled context, so the
comparison is paired: per (length, method) the report counts the questions both get right, those only the
strategy gets right and those only dense gets right, and how often the strategy gives **dense's final
answer** (right or wrong) — the primary fidelity figure, since small models miss many long-context
questions even densely. Rates carry Wilson 95 % intervals.

Works on saved result JSON (`EvalResult.to_dict()["instances"]`), so runs from several machines or
invocations can be pooled:

    >>> from topk_decode.eval.paired import wilson
    >>> [round(x, 3) for x in wilson(95, 100)]
    [0.888, 0.978]
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

NUMBER_TASKS = ("real_needle", "real_multi_key", "real_vt")  # one number answers the question
SET_TASKS = ("real_multi_value",)  # a set of numbers answers it


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion (95 % by default); (0, 1) when n is 0."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def normalized_text(text: str) -> str:
    """The first non-empty line, case-folded, punctuation dropped, spaces collapsed."""
    line = next((s for s in (text or "").splitlines() if s.strip()), "")
    return " ".join(re.sub(r"[^\w.+\-*/^()]+", " ", line.casefold()).split()).strip(" .")


def final_answer(task: str, text: str | None) -> str:
    """What a generation answers, for comparing two generations: the first number of 5+ digits for the
    one-number tasks, the sorted set of such numbers for multi-value, else the normalized first line."""
    text = text or ""
    numbers = re.findall(r"(?<![\d.])\d{5,}(?![\d])", text)
    if task in NUMBER_TASKS and numbers:
        return numbers[0]
    if task in SET_TASKS and numbers:
        return ",".join(sorted(set(numbers)))
    return normalized_text(text)


def same_answer(task: str, a: str | None, a_correct: bool | None, b: str | None, b_correct: bool | None) -> bool:
    """Whether two generations give the same final answer: both right, or the same extracted answer."""
    if a_correct and b_correct:
        return True
    return final_answer(task, a) == final_answer(task, b)


def _mean(xs) -> float | None:
    vals = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(vals) / len(vals) if vals else None


def paired_rows(instances: list[dict]) -> list[dict]:
    """One row per (length, method) over every question that has an answer.

    Args:
        instances: `asdict(InstanceResult)` dicts (from one or several result JSONs).
    Returns:
        rows with n, correct, accuracy and its interval, dense's correct count, both / only_method /
        only_dense, agree (same final answer as dense) with its interval, same_tokens, and the means of
        mass recall, id recall, KL and greedy agreement, keys_read (None where the strategy does not
        count it); the dense row first per length.
    """
    from topk_decode.eval.runs import method_name

    cells: dict[tuple, dict] = {}
    for inst in instances:
        if inst.get("answer") is None:
            continue
        n_len = inst["length"]
        dense = cells.setdefault((n_len, "dense"), defaultdict(list))
        dense["correct"].append(bool(inst["dense_correct"]))
        for r in inst["runs"]:
            m = method_name(r["strategy"], r["schedule"], r.get("k_label") or r["k"])
            c = cells.setdefault((n_len, m), defaultdict(list))
            c["strategy"] = r["strategy"]
            c["k"].append(r["k"])
            c["correct"].append(bool(r["correct"]))
            c["dense_correct"].append(bool(inst["dense_correct"]))
            c["agree"].append(
                same_answer(inst["task"], r["generated"], r["correct"], inst["dense_generated"], inst["dense_correct"])
            )
            c["same_tokens"].append(bool(r.get("same_as_dense")))
            for f in ("mass_recall", "id_recall", "kl_mean", "agreement", "keys_read"):
                c[f].append(r.get(f))
    rows = []
    for (n_len, m), c in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1] != "dense", kv[0][1])):
        n = len(c["correct"])
        right = sum(c["correct"])
        row = {
            "length": n_len,
            "method": m,
            "n": n,
            "correct": right,
            "accuracy": right / n,
            "accuracy_ci": wilson(right, n),
        }
        if m != "dense":
            both = sum(a and b for a, b in zip(c["correct"], c["dense_correct"]))
            agree = sum(c["agree"])
            row.update(
                strategy=c["strategy"],
                k=sorted(set(c["k"])),
                dense_correct=sum(c["dense_correct"]),
                both=both,
                only_method=right - both,
                only_dense=sum(c["dense_correct"]) - both,
                agree=agree,
                agree_rate=agree / n,
                agree_ci=wilson(agree, n),
                same_tokens=sum(c["same_tokens"]),
                **{f: _mean(c[f]) for f in ("mass_recall", "id_recall", "kl_mean", "agreement", "keys_read")},
            )
        rows.append(row)
    return rows


def sign_p(a: int, b: int) -> float:
    """Two-sided exact sign test (binomial, p = 1/2) of a against b discordant pairs."""
    n = a + b
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(min(a, b) + 1)) / 2**n) if n else 1.0


def sign_tests(instances: list[dict]) -> list[dict]:
    """Per length, every pair of methods on the questions both answered: how often each gives dense's final answer
    where the other does not (`same_answer`, the primary figure, not identical tokens), with the exact sign test."""
    from topk_decode.eval.runs import method_name

    agree: dict[tuple, dict] = defaultdict(dict)  # (length, method) → {question: same answer as dense}
    for q, inst in enumerate(instances):
        if inst.get("answer") is None:
            continue
        for r in inst["runs"]:
            m = method_name(r["strategy"], r["schedule"], r.get("k_label") or r["k"])
            agree[(inst["length"], m)][q] = same_answer(
                inst["task"], r["generated"], r["correct"], inst["dense_generated"], inst["dense_correct"]
            )
    rows = []
    keys = sorted(agree)
    for i, (n_len, a) in enumerate(keys):
        for n_len_b, b in keys[i + 1 :]:
            if n_len_b != n_len:
                continue
            common = agree[(n_len, a)].keys() & agree[(n_len, b)].keys()
            only_a = sum(agree[(n_len, a)][q] and not agree[(n_len, b)][q] for q in common)
            only_b = sum(agree[(n_len, b)][q] and not agree[(n_len, a)][q] for q in common)
            rows.append(
                {
                    "length": n_len,
                    "a": a,
                    "b": b,
                    "n": len(common),
                    "only_a": only_a,
                    "only_b": only_b,
                    "p": sign_p(only_a, only_b),
                }
            )
    return rows


def pool(results: list[dict]) -> list[dict]:
    """The instances of several suite results (their JSON) merged by question: each question's runs from every result.

    A question is (length, seed, task, depth, answer); results that answered it densely in different words cannot be
    paired (another model, another dtype): ValueError.
    """
    merged: dict[tuple, dict] = {}
    for result in results:
        for inst in result["instances"]:
            key = tuple(inst.get(f) for f in ("length", "seed", "task", "depth", "answer"))
            if key not in merged:
                merged[key] = dict(inst, runs=list(inst["runs"]))
            elif merged[key]["dense_generated"] != inst["dense_generated"]:
                raise ValueError(f"dense answered {key} differently in two results: they do not pair")
            else:
                merged[key]["runs"] += inst["runs"]
    return list(merged.values())


def task_rows(instances: list[dict]) -> list[dict]:
    """Dense accuracy per (length, task): which tasks can carry an accuracy claim (dense ≥ 70 %)."""
    acc: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for inst in instances:
        if inst.get("answer") is not None:
            cell = acc[(inst["length"], inst["task"])]
            cell[0] += bool(inst["dense_correct"])
            cell[1] += 1
    return [
        {"length": n_len, "task": t, "dense_correct": c, "n": n, "dense_accuracy": c / n}
        for (n_len, t), (c, n) in sorted(acc.items())
    ]


def _pct(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{100 * x:.{digits}f}"


def markdown(instances: list[dict]) -> str:
    """The paired table (and dense accuracy per task) as GitHub markdown."""
    out = [
        "| length | method | k | n | correct (95 % CI) | both | only method | only dense | **same answer as "
        "dense** (95 % CI) | same tokens | mass recall | KL mean | greedy agree | keys read |",
        "|" + "---|" * 14,
    ]
    for r in paired_rows(instances):
        acc = f"{r['correct']}/{r['n']} = {_pct(r['accuracy'])} % ({_pct(r['accuracy_ci'][0])}–{_pct(r['accuracy_ci'][1])})"
        if r["method"] == "dense":
            out.append(f"| {r['length']} | dense | — | {r['n']} | {acc} | | | | | | | | | |")
            continue
        agree = f"{r['agree']}/{r['n']} = {_pct(r['agree_rate'])} % ({_pct(r['agree_ci'][0])}–{_pct(r['agree_ci'][1])})"
        ks = ",".join(map(str, r["k"]))
        fmt = lambda x, s: "—" if x is None else format(x, s)  # noqa: E731
        out.append(
            f"| {r['length']} | {r['method']} | {ks} | {r['n']} | {acc} | {r['both']} | {r['only_method']} | "
            f"{r['only_dense']} | {agree} | {r['same_tokens']} | {fmt(r['mass_recall'], '.3f')} | "
            f"{fmt(r['kl_mean'], '.3f')} | {fmt(r['agreement'], '.3f')} | "
            f"{'—' if r['keys_read'] is None else _pct(r['keys_read'], 2) + ' %'} |"
        )
    tests = sign_tests(instances)
    if tests:
        out += [
            "",
            "| length | A | B | n | dense's answer: A only | B only | exact sign test p |",
            "|---|---|---|---|---|---|---|",
        ]
        out += [
            f"| {t['length']} | {t['a']} | {t['b']} | {t['n']} | {t['only_a']} | {t['only_b']} | {t['p']:.4f} |"
            for t in tests
        ]
    out += ["", "| length | task | dense correct |", "|---|---|---|"]
    out += [
        f"| {r['length']} | {r['task']} | {r['dense_correct']}/{r['n']} ({_pct(r['dense_accuracy'], 0)} %) |"
        for r in task_rows(instances)
    ]
    return "\n".join(out) + "\n"
