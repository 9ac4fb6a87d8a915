"""The product-path suite's bookkeeping (topk_decode/eval/product.py): settings, pairing with dense, the table."""

from __future__ import annotations

import pytest

from topk_decode.eval.product import Answer, compare, markdown, parse_settings, seeds_of, table


def test_settings_by_name_with_the_budget_placement_scaled_to_the_model():
    dense, auto, quest, budget = parse_settings(["dense", "auto", "quest", "auto@llama-3-8b@128K:16GiB"], 40, None, 24)
    assert (dense.strategy, dense.k) == ("flat", None)
    assert (auto.strategy, auto.k, auto.options) == ("auto", 40, {})
    assert quest.strategy == "quest"
    assert budget.strategy == "routed"
    assert budget.options == {"rank": "keys", "pq_values": 32, "device_code_m": 16, "device_value_layers": 1}
    assert parse_settings(["auto@llama-3-8b@128K:16GiB"], None, None, 64)[0].options["device_value_layers"] == 2


def test_a_strategy_with_options_of_its_own_and_its_own_k():
    (s,) = parse_settings(["routed:rank=keys:pq_values=32:k=512"], 40, None, 24)
    assert (s.name, s.strategy, s.k, s.options) == (
        "routed:rank=keys:pq_values=32:k=512",
        "routed",
        512,
        {"rank": "keys", "pq_values": "32"},
    )


@pytest.mark.parametrize("names", [["nonsense"], ["auto@gpt-9@1M:1GiB"], ["routed:rank"], ["flat:k=lots"]])
def test_unknown_settings_are_one_line_errors(names):
    with pytest.raises(SystemExit, match="^error: "):
        parse_settings(names, None, None, 24)


def test_seeds_ranges_and_lists():
    assert seeds_of("0-3") == [0, 1, 2, 3]
    assert seeds_of("1,5,7-8") == [1, 5, 7, 8]


def _answers(texts, task="real_needle", truth="4829104"):
    return [Answer(task, "q", truth, t, truth in t) for t in texts]


def test_compare_pairs_final_answers_and_counts_recomputed_steps():
    dense = _answers(["4829104", "The number is 4829104.", "1234567", "I don't know"])
    other = _answers(["4829104", "4829104", "7654321", "I don't know"])
    other[1].recomputed = 2
    r = compare(dense, other)
    assert (r["n"], r["same_text"], r["same_final"], r["correct"], r["dense_correct"]) == (4, 2, 3, 2, 2)
    assert r["recomputed_steps"] == 2
    lo, hi = r["same_final_ci95"]
    assert lo < r["same_final_pct"] == 75.0 < hi


def test_table_pools_seeds_per_length_against_dense():
    from dataclasses import asdict

    def run(length, seed, dense, auto):
        return {"length": length, "seed": seed, "answers": {"dense": dense, "auto": auto}}

    a, b = [asdict(x) for x in _answers(["4829104"])], [asdict(x) for x in _answers(["1"])]
    results = {"runs": [run(16384, 0, a, a), run(16384, 1, a, b), run(32000, 0, a, a)]}
    rows = table(results, ["dense", "auto"])
    assert [(r["length"], r["n"], r["same_final"]) for r in rows] == [(16384, 2, 1), (32000, 1, 1)]
    assert "| 16,384 | auto | 2 | 1/2 = 50.0 %" in markdown(rows)


def test_a_run_cut_short_is_tabled_where_dense_and_the_setting_were_both_asked():
    from dataclasses import asdict

    a = [asdict(x) for x in _answers(["4829104"])]
    results = {
        "runs": [
            {"length": 16384, "seed": 0, "answers": {"dense": a, "auto": a, "flat": a}},
            {"length": 16384, "seed": 1, "answers": {"dense": a, "auto": a}},
        ]
    }  # cut before flat
    rows = {r["setting"]: r["n"] for r in table(results, ["dense", "auto", "flat"])}
    assert rows == {"auto": 2, "flat": 1}


def test_merge_tables_the_runs_of_several_files(tmp_path):
    import json
    from dataclasses import asdict

    from topk_decode.eval.product import main

    a, b = [asdict(x) for x in _answers(["4829104"])], [asdict(x) for x in _answers(["1"])]
    for i, (length, other) in enumerate([(16384, a), (32000, b)]):
        run = {"length": length, "seed": 0, "answers": {"dense": a, "auto": other}}
        (tmp_path / f"{i}.json").write_text(json.dumps({"model": "m", "runs": [run]}))
    assert main(["--merge", str(tmp_path / "0.json"), str(tmp_path / "1.json"), "--out", str(tmp_path / "all")]) == 0
    md = (tmp_path / "all" / "product.md").read_text()
    assert "| 16,384 | auto | 1 | 1/1 = 100.0 %" in md and "| 32,000 | auto | 1 | 0/1 = 0.0 %" in md
    (tmp_path / "x.json").write_text(json.dumps({"model": "m", "runs": [{"length": 1, "seed": 0, "answers": {}}]}))
    with pytest.raises(SystemExit, match="^error: no dense"):
        main(["--merge", str(tmp_path / "x.json"), "--out", str(tmp_path / "y")])


def test_the_suite_runs_end_to_end_on_the_demo_model(tmp_path):
    """Prefill, open per setting, ask, table: the whole path on the CPU (the demo model; its answers are not the
    point, the bookkeeping is)."""
    import json
    from pathlib import Path

    import topk_decode
    from topk_decode.eval.product import main

    demo = Path(topk_decode.__file__).parent / "demo_model"
    out = tmp_path / "out"
    argv = ["--model", str(demo), "--lengths", "1200", "--seeds", "0", "--per-task", "1", "--tasks", "real_needle"]
    argv += [
        "--settings",
        "dense,flat",
        "--k",
        "64",
        "--device",
        "cpu",
        "--work",
        str(tmp_path / "w"),
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    results = json.loads((out / "product.json").read_text())
    (run,) = results["runs"]
    assert set(run["answers"]) == {"dense", "flat"} and len(run["answers"]["flat"]) == 1
    assert [(r["setting"], r["n"]) for r in results["table"]] == [("flat", 1)]
    assert "| 1,200 | flat | 1 |" in (out / "product.md").read_text()


def test_a_setting_that_cannot_open_is_reported_and_the_others_run(tmp_path):
    import json
    from pathlib import Path

    import topk_decode
    from topk_decode.eval.product import main

    demo = Path(topk_decode.__file__).parent / "demo_model"
    out = tmp_path / "out"
    argv = ["--model", str(demo), "--lengths", "1200", "--seeds", "0", "--per-task", "1", "--tasks", "real_needle"]
    argv += ["--settings", "dense,duo,flat", "--k", "64", "--device", "cpu", "--work", str(tmp_path / "w")]
    assert main([*argv, "--out", str(out)]) == 0  # duo without its head pattern cannot open
    (run,) = json.loads((out / "product.json").read_text())["runs"]
    assert set(run["answers"]) == {"dense", "flat"}
    assert "head pattern" in run["placements"]["duo"]["error"]
    assert "not run: duo: duo needs a head pattern" in (out / "product.md").read_text()


def test_the_one_command_gpu_run_script_runs_its_suite_on_a_cpu(tmp_path):
    """benchmarks/bench_product_gpu.sh, dry on the CPU with the demo model (its suite job only: the GPU tests, the
    bench row and the seed strategies' duo calibration want a GPU or more time): it records the commit and the model,
    runs the suite with the budget's setting, and tables every setting against dense (a fault here cost a GPU run its
    rows before: duo without a pattern, a setting that could not open, --merge pooling two k)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import topk_decode

    root = Path(topk_decode.__file__).parent.parent
    demo = root / "topk_decode" / "demo_model"
    env = {**os.environ, "PY": sys.executable, "DEVICE": "cpu", "JOBS": "suite", "LENGTHS": "1200", "SEEDS": "0"}
    env.update(PER_TASK="1", REV="dry", THREADS="1")
    res = tmp_path / "res"
    run = subprocess.run(
        ["bash", str(root / "benchmarks" / "bench_product_gpu.sh"), str(demo), str(res)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "commit dry" in (res / "env.txt").read_text()
    table = (res / "all" / "product.md").read_text()
    for setting in ("auto", "flat", "auto@llama-3-8b@128K:16GiB"):
        assert f"| 1,200 | {setting} |" in table, table
    assert not (res / "work_p_1200").exists()  # each job removes its caches
    (run,) = json.loads((res / "p_1200" / "product.json").read_text())["runs"]  # dense asked once, in its own job
    assert run["placements"]["dense"] == {"reused_from": str(res / "dense_1200" / "product.json")}


def test_dense_from_an_earlier_run_of_the_same_suite_is_not_asked_again(tmp_path, monkeypatch):
    """Settings run apart share one dense run (`--dense-from`): where the earlier run holds the same suite, its dense
    answers are taken as they are; another length's are asked."""
    import json
    from pathlib import Path

    import topk_decode
    from topk_decode.eval import product

    demo = Path(topk_decode.__file__).parent / "demo_model"
    base = ["--model", str(demo), "--seeds", "0", "--per-task", "1", "--tasks", "real_needle", "--k", "64"]
    base += ["--device", "cpu", "--work", str(tmp_path / "w")]
    assert product.main([*base, "--lengths", "1200", "--settings", "dense", "--out", str(tmp_path / "d")]) == 0
    first = json.loads((tmp_path / "d" / "product.json").read_text())["runs"][0]
    asked = []
    real_ask_all = product.ask_all
    monkeypatch.setattr(
        product, "ask_all", lambda store, qs: asked.append(store.config.strategy) or real_ask_all(store, qs)
    )
    argv = [*base, "--lengths", "1200,1300", "--settings", "dense,flat", "--out", str(tmp_path / "o")]
    assert product.main([*argv, "--dense-from", str(tmp_path / "d" / "product.json")]) == 0
    runs = json.loads((tmp_path / "o" / "product.json").read_text())["runs"]
    assert runs[0]["answers"]["dense"] == first["answers"]["dense"]
    assert runs[0]["placements"]["dense"] == {"reused_from": str(tmp_path / "d" / "product.json")}
    assert "reused_from" not in runs[1]["placements"]["dense"]  # 1,300 tokens: not in the earlier run
    assert asked == ["flat", "flat", "flat"]  # dense asked once (the other length), flat at both
