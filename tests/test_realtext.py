"""Real-text eval tasks (Python's documentation): builders, answer checks, k percentages, one prefill → many questions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from topk_decode.errors import TopkError
from topk_decode.eval.harness import EvalConfig, resolve_k, run_eval, strategy_options
from topk_decode.eval.realtext import QA_PAIRS, REAL_TASKS, RealQuestion, available_qa, make_suite, pydoc_topics

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def _n_tokens(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=False).input_ids)


def test_the_qa_pairs_are_stated_in_this_pythons_pydoc_topics():
    topics = pydoc_topics()
    assert len(topics) > 50
    assert len(available_qa(topics)) == len(QA_PAIRS)


def test_same_arguments_give_the_same_suite_and_other_seeds_another(tok):
    a = make_suite(list(REAL_TASKS), 3000, 0, tok, per_task=2)
    b = make_suite(list(REAL_TASKS), 3000, 0, tok, per_task=2)
    c = make_suite(list(REAL_TASKS), 3000, 1, tok, per_task=2)
    assert a.context == b.context and a.sha == b.sha
    assert [(q.question, q.answer, q.depth) for q in a.questions] == [
        (q.question, q.answer, q.depth) for q in b.questions
    ]
    assert c.context != a.context
    assert [q.task for q in a.questions] == [t for t in REAL_TASKS for _ in range(2)]


def test_the_context_length_is_close_to_the_target_below_it(tok):
    for length in (1500, 6000):
        s = make_suite(["real_needle", "real_qa"], length, 3, tok, per_task=2)
        n = _n_tokens(tok, s.context)
        assert 0.9 * length <= n <= length + 16  # joined text may merge a few boundary tokens


def test_every_asked_fact_is_in_the_context_at_its_depth(tok):
    s = make_suite(list(REAL_TASKS), 4000, 5, tok, per_task=2)
    n = _n_tokens(tok, s.context)
    depths = []
    for q in s.questions:
        if q.task == "real_qa":
            continue
        marker = q.answer.split(",")[0]
        pos = s.context.index(marker)
        assert s.context.count(marker) == 1
        got = _n_tokens(tok, s.context[:pos]) / n
        assert abs(got - q.depth) < 0.05, (q.task, got, q.depth)
        depths.append(q.depth)
    assert min(depths) < 0.3 and max(depths) > 0.7  # spread over the context, not bunched


def test_qa_topics_are_inserted_whole_and_variable_chains_read_in_order(tok):
    topics = pydoc_topics()
    s = make_suite(["real_vt", "real_qa"], 4000, 2, tok, per_task=3)
    assert len(s.qa_topics) == 3
    for t in s.qa_topics:
        assert topics[t].strip() in s.context
    for q in (q for q in s.questions if q.task == "real_vt"):
        last = q.question.split("VAR ")[-1].split(" ")[0].rstrip("?")
        # walk the chain back from the asked variable to the number
        pos, var = [], last
        while True:
            line = next(x for x in s.context.split("\n") if x.startswith(f"VAR {var} = "))
            pos.append(s.context.index(line))
            rhs = line.split(" = ", 1)[1].rstrip(".")
            if not rhs.startswith("VAR "):
                break
            var = rhs[4:]
        assert rhs == q.answer and len(pos) == 3
        assert pos == sorted(pos, reverse=True)  # the number is assigned first, the asked variable last


def test_answer_checks_match_whole_numbers_and_reject_other_facts():
    q = RealQuestion("real_needle", "?", "4829104", [["4829104"]], forbid=["1234567"])
    assert q.check("The special magic number is 4829104.")
    assert not q.check("48291045")
    assert not q.check("4829104 or 1234567")
    mv = RealQuestion("real_multi_value", "?", "1, 2", [["1111111"], ["2222222"]])
    assert mv.check("2222222, 1111111") and not mv.check("1111111")
    qa = RealQuestion("real_qa", "?", "42", [["Lib/pdb.py", "pdb.py"]])
    assert qa.check("It is in LIB/PDB.PY") and not qa.check("pdb")


def test_k_percentages_resolve_per_context_and_bad_ones_fail():
    assert resolve_k("1%", 4096) == 41 and resolve_k("0.5%", 100) == 1 and resolve_k(16, 4096) == 16
    for bad in ("0%", "101%", "x%", 0, -3):
        with pytest.raises(TopkError):
            resolve_k(bad, 4096)


def test_dotted_options_go_to_their_strategy_only():
    opts = {"backend": "torch", "duo.pattern": "g.tsv", "ivf.nprobe": 4}
    assert strategy_options(opts, "duo") == {"backend": "torch", "pattern": "g.tsv"}
    assert strategy_options(opts, "flat") == {"backend": "torch"}


def test_dense_on_the_stored_context_equals_hf_over_the_whole_prompt(model_factory, tmp_path):
    from topk_decode.eval.realrun import DenseContext
    from topk_decode.model.loading import load_model
    from topk_decode.prefill.build import build_cache
    from topk_decode.store.cache_dir import open_cache

    md = model_factory("qwen2")
    (tmp_path / "d.txt").write_text("Prefill once, then ask many questions about the text. " * 12)
    cache, _ = build_cache(tmp_path / "d.txt", tmp_path / "c", md, device="cpu", chunk_size=64)
    ckv = open_cache(cache, verify=False)
    model = load_model(md, torch.device("cpu"), torch.float32)
    prompt = [5, 6, 7, 8]
    toks, logits = DenseContext(model, ckv).generate(prompt, 6, set())
    with torch.inference_mode():
        ids = list(ckv.tokens) + prompt
        ref = []
        for _ in range(6):
            out = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ref.append(out)
            ids.append(int(out.argmax()))
    assert toks == ids[len(ckv.tokens) + len(prompt) :]
    assert torch.allclose(logits, torch.stack(ref), atol=1e-4)
    # a second question starts again from the bare context (the first one's tokens are gone)
    assert DenseContext(model, ckv).generate(prompt, 6, set())[0] == toks


def test_one_prefill_serves_every_question_and_covering_k_equals_dense(model_factory, tmp_path):
    cfg = EvalConfig(
        model=str(model_factory("llama_gqa", chat=True)),
        tasks=["real_needle", "real_qa"],
        lengths=[2500],
        questions=2,
        strategies=["flat"],
        ks=["100%", 4],
        fidelity_steps=2,
        device="cpu",
        work_dir=str(tmp_path),
    )
    res = run_eval(cfg)
    assert len(res.contexts) == 1 and res.contexts[0]["layout"] == "chat"
    assert [i.task for i in res.instances] == ["real_needle"] * 2 + ["real_qa"] * 2
    n = res.contexts[0]["n_context_tokens"]
    for inst in res.instances:
        assert inst.question and inst.n_context_tokens == n
        assert [(r.k_label, r.k) for r in inst.runs] == [(None, 4), ("100%", n)]
        full = inst.runs[1]
        assert full.same_as_dense and full.agreement == 1.0 and full.kl_max < 1e-4
        assert full.mass_recall == pytest.approx(1.0, abs=1e-5)
        assert full.correct == inst.dense_correct
    from topk_decode.eval.report import markdown_tables, summarize

    rows = summarize(res)["accuracy"]
    assert {(r["task"], r["depth"]) for r in rows} == {("real_needle", None), ("real_qa", None)}
    assert "flat@100%" in markdown_tables(res)


def test_a_kv_int8_variant_decodes_an_int8_copy_against_full_precision_dense(model_factory, tmp_path):
    """`kv=int8` runs a strategy over the prefill stored as `--kv-dtype int8` stores it: every key attended, it is
    dense over the int8 KV (KL against full-precision dense small but not zero); the variant without it stays exact."""
    cfg = EvalConfig(
        model=str(model_factory("llama_gqa", chat=True)),
        tasks=["real_needle"],
        lengths=[2500],
        questions=2,
        strategies=["flat:k=100%", "flat:k=100%:kv=int8", "routed:k=4:rank=keys:kv=int8"],
        ks=[4],
        fidelity_steps=2,
        device="cpu",
        work_dir=str(tmp_path),
    )
    res = run_eval(cfg)
    for inst in res.instances:
        full, int8, routed = inst.runs
        assert (full.strategy, int8.strategy, routed.strategy) == ("flat", "flat:kv=int8", "routed:rank=keys:kv=int8")
        assert full.kl_max < 1e-4 and 0 < int8.kl_max < 1e-2
        assert routed.k == 4 and routed.steps == full.steps
    from topk_decode.eval.realrun import kv_variant

    assert kv_variant("routed:rank=keys:kv=int8") == ("routed:rank=keys", "int8")
    with pytest.raises(TopkError, match="kv must be int8"):
        kv_variant("flat:kv=int4")


def test_cli_rejects_a_bad_percentage_in_one_line():
    r = subprocess.run(
        [sys.executable, "-m", "topk_decode", "eval", "--tasks", "real_needle", "--k", "1%,abc"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0
    assert "error:" in r.stderr and "abc" in r.stderr and "Traceback" not in r.stderr


def test_bench_fidelity_help_prints_the_suite_preset():
    r = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_fidelity.py"), "--help"], capture_output=True, text=True
    )
    assert r.returncode == 0 and "routed:rank=keys" in r.stdout and "Traceback" not in r.stderr


def test_bench_fidelity_writes_json_and_a_markdown_table_and_skips_unknown_strategies(model_factory, tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_fidelity", REPO / "benchmarks" / "bench_fidelity.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    md = model_factory("llama_gqa", chat=True)
    mod.main(
        [
            "--model",
            str(md),
            "--lengths",
            "2500",
            "--tasks",
            "real_needle,real_vt",
            "--strategies",
            "flat,no_such_strategy,duo,routed:rank=keys:k=2%",
            "--duo-steps",
            "0",
            "--k",
            "1%,100%",
            "--device",
            "cpu",
            "--out-dir",
            str(tmp_path),
        ]
    )
    err = capsys.readouterr().err
    assert "'no_such_strategy' is not registered" in err and "duo skipped" in err
    table = (tmp_path / f"real_{md.name}.md").read_text()
    assert "| dense |" in table and "| flat@1% |" in table and "| flat@100% |" in table
    assert "| routed:rank=keys@2% |" in table and "| routed:rank=keys@1% |" not in table  # the variant's own k
    data = json.loads((tmp_path / f"real_{md.name}_2500.json").read_text())
    assert data["seconds"] > 0 and data["contexts"][0]["questions"] == 2


def test_a_kept_suite_is_reused_with_its_dense_answers_and_routed_reports_keys_read(model_factory, tmp_path):
    cfg = EvalConfig(
        model=str(model_factory("llama_gqa", chat=True)),
        tasks=["real_needle"],
        lengths=[2500],
        questions=1,
        strategies=["routed"],
        ks=[8],
        fidelity_steps=1,
        device="cpu",
        work_dir=str(tmp_path),
        keep_dir=str(tmp_path / "kept"),
        strategy_options={"probe_fraction": 0.1, "cluster_size": 16},
    )
    first = run_eval(cfg)
    kept = list((tmp_path / "kept").iterdir())
    assert len(kept) == 1 and (kept[0] / "cache" / "manifest.json").is_file() and (kept[0] / "dense_refs.pt").is_file()
    stamp = (kept[0] / "cache" / "manifest.json").stat().st_mtime_ns
    second = run_eval(cfg)
    assert (kept[0] / "cache" / "manifest.json").stat().st_mtime_ns == stamp  # no second prefill
    a, b = first.instances[0], second.instances[0]
    assert a.dense_generated == b.dense_generated and a.runs[0].generated == b.runs[0].generated
    assert 0.1 <= a.runs[0].keys_read < 0.5
    assert a.runs[0].device_layers is None  # a CPU decode device has no device stage: the CPU ranked every layer
