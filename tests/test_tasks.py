"""Tests of the seeded task generator (topk_decode/eval/tasks.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from topk_decode.eval import tasks as T

DEMO = Path(__file__).resolve().parents[1] / "topk_decode" / "demo_model"


@pytest.fixture(scope="module")
def tokenizer():
    """The shipped demo tokenizer when present, else a small byte-level BPE built here."""
    if (DEMO / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(DEMO), local_files_only=True)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    g = T.grammar()
    texts = ["".join(g.sentence(rng) for _ in range(20)) for _ in range(300)]
    texts += [T.magic_fact(f"{a}-{b}", 123) for a in T.ADJECTIVES[:10] for b in T.ANIMALS[:10]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=600,
            special_tokens=["<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return tok


def _ids(tokenizer, text: str) -> list[int]:
    if hasattr(tokenizer, "encode_batch"):
        return tokenizer.encode(text, add_special_tokens=False).ids
    return tokenizer(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("task", T.TASKS)
def test_seeded_determinism(task, tokenizer):
    a = T.make_instance(task, 1024, 0.5, 11, tokenizer)
    b = T.make_instance(task, 1024, 0.5, 11, tokenizer)
    c = T.make_instance(task, 1024, 0.5, 12, tokenizer)
    assert a == b
    assert a.context != c.context
    assert a.task == task and a.length == 1024 and a.depth == 0.5


@pytest.mark.parametrize("task", T.TASKS)
@pytest.mark.parametrize("length", [512, 2048, 8192])
def test_length_within_tolerance(task, length, tokenizer):
    inst = T.make_instance(task, length, 0.3, 5, tokenizer)
    n = len(_ids(tokenizer, inst.context))
    assert length - 48 <= n <= length, (n, length)


@pytest.mark.parametrize("task", T.TASKS)
def test_answer_is_in_context(task, tokenizer):
    inst = T.make_instance(task, 2048, 0.7, 3, tokenizer)
    assert inst.question.startswith("\nQuestion:")
    assert not inst.question.endswith(" ")
    if task in ("single_needle", "multi_key"):
        key = inst.question.split(" for ", 1)[1].split("?", 1)[0]
        assert T.magic_fact(key, inst.answer) in inst.context
    elif task == "multi_value":
        key = inst.question.split(" for ", 1)[1].split("?", 1)[0]
        values = inst.answer.split(", ")
        assert len(values) == T.MULTI_VALUE_COUNT
        positions = [inst.context.index(T.multi_value_fact(key, v)) for v in values]
        assert positions == sorted(positions)  # answer lists the values in context order
    else:
        var = inst.question.split("variable ", 1)[1].split(" equal?", 1)[0]
        hops = inst.answer.split(", which equals ")
        chain = [var] + hops
        for x, y in zip(chain, chain[1:]):
            assert T.vt_fact(x, y) in inst.context


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_needle_depth(depth, tokenizer):
    inst = T.make_instance("single_needle", 4096, depth, 1, tokenizer)
    pos = inst.context.index(" The special magic number for ")
    frac = pos / len(inst.context)
    assert abs(frac - depth) < 0.05


def test_pieces_tokenize_like_the_whole(tokenizer):
    """Context + question tokenized separately equals what the model was trained on."""
    inst = T.make_instance("multi_key", 1024, 0.4, 9, tokenizer)
    pieces = [p for p in inst.context.split(".") if p]
    joined = sum((_ids(tokenizer, p + ".") for p in pieces), [])
    assert joined == _ids(tokenizer, inst.context)


def test_unknown_task(tokenizer):
    with pytest.raises(ValueError):
        T.make_instance("nope", 512, 0.5, 0, tokenizer)
