"""The fidelity suite's paired report (eval/paired.py) on hand-made results."""

from __future__ import annotations

import math

import pytest

from topk_decode.eval import paired


def test_wilson_interval_matches_hand_computed_values():
    lo, hi = paired.wilson(95, 100)
    assert lo == pytest.approx(0.8883, abs=1e-4) and hi == pytest.approx(0.9785, abs=1e-4)
    assert paired.wilson(0, 10)[0] == 0.0 and paired.wilson(10, 10)[1] == 1.0
    assert paired.wilson(0, 0) == (0.0, 1.0)
    lo, hi = paired.wilson(50, 100)
    assert lo < 0.5 < hi and math.isclose(0.5 - lo, hi - 0.5, rel_tol=1e-9)


@pytest.mark.parametrize(
    "task, text, expected",
    [
        ("real_needle", "The special magic number for amber-fox is 4829104.", "4829104"),
        ("real_needle", "4829104", "4829104"),
        ("real_vt", "VAR ABCDE is 1234567, not 7654321", "1234567"),
        ("real_multi_value", "7654321, 1234567\n* 7654321", "1234567,7654321"),
        ("real_qa", "Nothing happens!\nMore text", "nothing happens"),
        ("real_needle", "I do not know.", "i do not know"),
    ],
)
def test_final_answer(task, text, expected):
    assert paired.final_answer(task, text) == expected


def _inst(task, dense, dense_ok, runs, length=100):
    return {
        "task": task,
        "length": length,
        "answer": "x",
        "dense_generated": dense,
        "dense_correct": dense_ok,
        "runs": [
            {
                "strategy": s,
                "schedule": "uniform",
                "k": 5,
                "k_label": "1%",
                "generated": g,
                "correct": ok,
                "same_as_dense": g == dense,
                "mass_recall": 0.9,
                "id_recall": 1.0,
                "kl_mean": 0.01,
                "agreement": 1.0,
                "keys_read": None,
            }
            for s, g, ok in runs
        ],
    }


def test_paired_rows_count_agreement_and_discordant_pairs():
    instances = [
        _inst("real_needle", "1234567", True, [("flat", "The number is 1234567.", True)]),  # same answer, both right
        _inst("real_needle", "1111111", False, [("flat", "1111111", False)]),  # same wrong answer
        _inst("real_needle", "2222222", False, [("flat", "3333333", True)]),  # only flat right
        _inst("real_qa", "Forty two", True, [("flat", "no idea", False)]),  # only dense right
        _inst("real_qa", "It prints 42.", True, [("flat", "42 is printed", True)]),  # both right, other words
    ]
    dense, flat = paired.paired_rows(instances)
    assert dense["method"] == "dense" and dense["correct"] == 3 and dense["n"] == 5
    assert flat["method"] == "flat@1%" and flat["correct"] == 3
    assert (flat["both"], flat["only_method"], flat["only_dense"]) == (2, 1, 1)
    assert flat["agree"] == 3 and flat["agree_rate"] == pytest.approx(0.6)
    assert flat["same_tokens"] == 1
    assert flat["agree_ci"] == paired.wilson(3, 5)
    table = paired.markdown(instances)
    assert "| 100 | flat@1% | 5 | 5 | 3/5 = 60.0 %" in table
    assert "| 100 | real_needle | 1/3 (33 %) |" in table


def test_sign_tests_count_dense_answers_not_identical_tokens():
    """The paired sign test compares *same final answer as dense* (the suite's primary figure): a generation in
    other words with dense's answer counts for a method, and the exact binomial p-value is two-sided."""
    instances = [
        _inst("real_needle", "1234567", True, [("flat", "It is 1234567.", True), ("routed", "7654321", False)]),
        _inst("real_needle", "1111111", False, [("flat", "1111111", False), ("routed", "1111111", False)]),
        _inst("real_needle", "2222222", False, [("flat", "number 2222222", False), ("routed", "3333333", False)]),
        _inst("real_qa", "Forty two", True, [("flat", "no idea", False), ("routed", "Forty two", True)]),
    ]
    (row,) = paired.sign_tests(instances)
    assert (row["a"], row["b"], row["n"], row["only_a"], row["only_b"]) == ("flat@1%", "routed@1%", 4, 2, 1)
    assert row["p"] == pytest.approx(1.0)  # 2 against 1 of 3: P(X ≤ 1) · 2 = 1
    assert paired.sign_p(30, 5) == pytest.approx(2 * sum(math.comb(35, i) for i in range(6)) / 2**35)
    assert paired.sign_p(0, 0) == 1.0
    assert "| 100 | flat@1% | routed@1% | 4 | 2 | 1 | 1.0000 |" in paired.markdown(instances)


def test_pool_merges_the_runs_of_one_question_from_several_results_and_refuses_other_dense_answers():
    a = _inst("real_needle", "1234567", True, [("flat", "1234567", True)])
    b = _inst("real_needle", "1234567", True, [("routed", "7654321", False)])
    other = _inst("real_qa", "Forty two", True, [("routed", "Forty two", True)])
    (merged, qa) = paired.pool([{"instances": [a, other]}, {"instances": [b]}])
    assert [r["strategy"] for r in merged["runs"]] == ["flat", "routed"] and qa["runs"] == other["runs"]
    assert len(a["runs"]) == 1  # the inputs are not changed
    (row,) = paired.sign_tests([merged, qa])
    assert (row["only_a"], row["only_b"], row["n"]) == (1, 0, 1)  # flat and routed paired on the needle only
    with pytest.raises(ValueError, match="do not pair"):
        paired.pool([{"instances": [a]}, {"instances": [dict(b, dense_generated="7")]}])
