"""Real-text tasks: needles, multi-key, multi-value, variable tracking and document QA over Python's docs.

The filler is real English technical prose shipped with every CPython: the documentation topics of
`pydoc_data.topics` (about 80 topics, ~110K tokens), shuffled per seed and cut at paragraph
boundaries. One *suite* is one context of about `length` tokens that holds the facts of every
requested task at spread-out depths, and a list of questions about it. One prefill then serves
every question (each asked on a fresh conversation), which is what makes 16K–32K contexts
affordable on a CPU.

| task | facts in the context | question | correct iff the answer contains |
|---|---|---|---|
| real_needle | "The special magic number for amber-fox is 4829104." (distinct keys) | that key's number | the number, and no other needle's |
| real_multi_key | a group of confusable keys (shared adjective or animal), same sentence | one key of the group | its number, no other group number |
| real_multi_value | "One of the special magic numbers for KEY is N." × 3 | all numbers of KEY | every one of them |
| real_vt | "VAR ABCDE = 4829104." then "VAR FGHIJ = VAR ABCDE." (3 hops) | the last variable's number | the chain's number, no other chain's |
| real_qa | a whole pydoc topic | a fact stated in that topic | an accepted phrase (e.g. "42") |

Checks are deterministic string rules (numbers match whole, other phrases case-insensitively).
The pydoc text differs slightly between Python versions: the suite records the Python version and
a hash of its context so runs on different hosts are compared knowingly.
"""

from __future__ import annotations

import hashlib
import random
import re
import string
import sys
from dataclasses import dataclass, field
from typing import Any

from topk_decode.eval.tasks import count_tokens, random_keys

REAL_TASKS: tuple[str, ...] = ("real_needle", "real_multi_key", "real_multi_value", "real_vt", "real_qa")
MULTI_KEY_GROUP = 4  # confusable keys per real_multi_key question (1 asked + 3 distractors)
MULTI_VALUE_COUNT = 3  # numbers per real_multi_value key
VT_HOPS = 3  # assignments per real_vt chain: VAR A = N, VAR B = VAR A, VAR C = VAR B
MAX_NEW_TOKENS = {"real_needle": 24, "real_multi_key": 24, "real_multi_value": 48, "real_vt": 24, "real_qa": 24}


@dataclass(frozen=True)
class QAPair:
    """A question answered by one pydoc topic.

    Attributes:
        topic: key of `pydoc_data.topics.topics`.
        evidence: text the topic must contain (whitespace-normalised); the pair is skipped if not.
        question: the question.
        accept: accepted answer phrases (any one suffices).
    """

    topic: str
    evidence: str
    question: str
    accept: tuple[str, ...]


QA_PAIRS: tuple[QAPair, ...] = (
    QAPair(
        "dynamic-features",
        "the following code will print 42",
        "In the section 'Interaction with dynamic features', what number does the example code print?",
        ("42",),
    ),
    QAPair(
        "power",
        '"-1**2" results in "-1"',
        "According to the section on the power operator, what does -1**2 result in?",
        ("-1",),
    ),
    QAPair(
        "imaginary",
        "complex number with a real part of 0.0",
        "According to the section on imaginary literals, what real part does the complex number they yield have?",
        ("0.0", "zero"),
    ),
    QAPair(
        "pass",
        "when it is executed, nothing happens",
        "According to the documentation of the pass statement, what happens when it is executed?",
        ("nothing",),
    ),
    QAPair(
        "shifting",
        'A right shift by *n* bits is defined as floor division by "pow(2,n)"',
        "According to the section on shifting operations, a right shift by n bits is defined as floor "
        "division by what?",
        ("pow(2,n)", "pow(2, n)", "2**n", "2 ** n", "2^n"),
    ),
    QAPair(
        "integers",
        "apart from what can be stored in available memory",
        "According to the section on integer literals, what limits the length of an integer literal?",
        ("memory",),
    ),
    QAPair(
        "floating",
        'denotes the same number as "77e10"',
        "According to the section on floating point literals, the literal 077e010 denotes the same number "
        "as which literal?",
        ("77e10",),
    ),
    QAPair(
        "break",
        "the loop control target keeps its current value",
        "According to the documentation of the break statement, what happens to the loop control target "
        "of a for loop terminated by break?",
        ("current value",),
    ),
    QAPair(
        "assert",
        "if __debug__:",
        "According to the documentation of the assert statement, which built-in variable is tested "
        "before the assertion is checked?",
        ("__debug__",),
    ),
)


@dataclass
class RealQuestion:
    """One question of a suite.

    Attributes:
        task: one of REAL_TASKS.
        question: the user's question (put through the store's prompt format when asked).
        answer: the expected answer, for reports.
        accept: groups of alternatives: every group must match one of its phrases.
        forbid: phrases that must not appear (other facts' numbers: guessing all of them is not an answer).
        depth: where the asked fact starts in the context, in [0, 1] (tokens before it / all tokens).
        max_new_tokens: generation budget.
    """

    task: str
    question: str
    answer: str
    accept: list[list[str]]
    forbid: list[str] = field(default_factory=list)
    depth: float = 0.0
    max_new_tokens: int = 16

    def check(self, text: str) -> bool:
        """The task rule on a decoded generation (see the module table)."""
        return all(any(_contains(text, a) for a in group) for group in self.accept) and not any(
            _contains(text, f) for f in self.forbid
        )


@dataclass
class RealSuite:
    """One context and its questions.

    Attributes:
        context: the document text (prefilled once).
        questions: asked one by one, each on a fresh conversation.
        length: target context length in tokens.
        seed: the suite's seed.
        python: the Python version whose pydoc topics were used.
        sha: blake2 hash (16 hex) of the context.
        qa_topics: the topics the QA questions are about.
    """

    context: str
    questions: list[RealQuestion]
    length: int
    seed: int
    python: str
    sha: str
    qa_topics: list[str]


def _contains(text: str, phrase: str) -> bool:
    """Numbers match whole (482 is not in 4821); other phrases case-insensitively."""
    if re.fullmatch(r"-?\d+(\.\d+)?", phrase):
        return re.search(rf"(?<![\d.]){re.escape(phrase)}(?![\d])", text) is not None
    return phrase.casefold() in text.casefold()


def _norm(s: str) -> str:
    return " ".join(s.split())


def pydoc_topics() -> dict[str, str]:
    """CPython's documentation topics (`pydoc_data.topics.topics`).

    Raises:
        TopkError: if this Python ships without `pydoc_data` (some minimal distributions strip it).
    """
    try:
        from pydoc_data.topics import topics
    except ImportError:
        from topk_decode.errors import TopkError

        raise TopkError("the real_* tasks need CPython's pydoc_data module (missing from this Python)") from None
    return dict(topics)


def available_qa(topics: dict[str, str]) -> list[QAPair]:
    """The QA pairs whose evidence this Python's pydoc topics state."""
    return [p for p in QA_PAIRS if p.topic in topics and _norm(p.evidence) in _norm(topics[p.topic])]


def _numbers(rng: random.Random, n: int, used: set[int]) -> list[int]:
    """n distinct 7-digit numbers not used before in the suite."""
    out: list[int] = []
    while len(out) < n:
        v = rng.randint(1_000_000, 9_999_999)
        if v not in used:
            used.add(v)
            out.append(v)
    return out


def _keys(rng: random.Random, n: int, used: set[str], hard: bool) -> list[str]:
    """n distinct adjective-animal keys not used before; hard: confusable with each other."""
    while True:
        keys = random_keys(rng, n, hard=hard)
        if not used & set(keys):
            used.update(keys)
            return keys


def _var_names(rng: random.Random, n: int, used: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        v = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if v not in used:
            used.add(v)
            out.append(v)
    return out


@dataclass
class _Item:
    """A piece inserted into the filler: its text and the depth it should start at."""

    text: str
    depth: float
    question: RealQuestion | None = None  # the question whose asked fact this item is
    tokens: int = 0


def _plan(
    tasks: list[str], per_task: int, rng: random.Random, qa: list[QAPair]
) -> tuple[list[_Item], list[RealQuestion]]:
    """Facts and questions of every task. The asked facts' depths spread evenly over [0.05, 0.95]."""
    items: list[_Item] = []
    questions: list[RealQuestion] = []
    nums: set[int] = set()
    keys: set[str] = set()
    needle_values: list[str] = []
    vt_values: list[str] = []
    only = " Answer with the number only."
    for task in tasks:
        for _ in range(per_task if task != "real_qa" else min(per_task, len(qa))):
            if task == "real_needle":
                (key,) = _keys(rng, 1, keys, hard=False)
                (v,) = _numbers(rng, 1, nums)
                q = RealQuestion(task, f"What is the special magic number for {key}?{only}", str(v), [[str(v)]])
                needle_values.append(str(v))
                items.append(_Item(f"The special magic number for {key} is {v}.", 0.0, q))
            elif task == "real_multi_key":
                group = _keys(rng, MULTI_KEY_GROUP, keys, hard=True)
                vals = _numbers(rng, MULTI_KEY_GROUP, nums)
                q = RealQuestion(
                    task,
                    f"What is the special magic number for {group[0]}?{only}",
                    str(vals[0]),
                    [[str(vals[0])]],
                    forbid=[str(x) for x in vals[1:]],
                )
                items.append(_Item(f"The special magic number for {group[0]} is {vals[0]}.", 0.0, q))
                items += [
                    _Item(f"The special magic number for {k} is {x}.", rng.random())
                    for k, x in zip(group[1:], vals[1:])
                ]
            elif task == "real_multi_value":
                (key,) = _keys(rng, 1, keys, hard=False)
                vals = _numbers(rng, MULTI_VALUE_COUNT, nums)
                q = RealQuestion(
                    task,
                    f"What are all the special magic numbers for {key}? Answer with the numbers only.",
                    ", ".join(map(str, vals)),
                    [[str(x)] for x in vals],
                    max_new_tokens=MAX_NEW_TOKENS[task],
                )
                items.append(_Item(f"One of the special magic numbers for {key} is {vals[0]}.", 0.0, q))
                items += [_Item(f"One of the special magic numbers for {key} is {x}.", rng.random()) for x in vals[1:]]
            elif task == "real_vt":
                names = _var_names(rng, VT_HOPS, keys)
                (v,) = _numbers(rng, 1, nums)
                q = RealQuestion(
                    task,
                    f"The document assigns numbers to variables with VAR statements, directly "
                    f"or through other variables. What number does VAR {names[-1]} equal?{only}",
                    str(v),
                    [[str(v)]],
                )
                vt_values.append(str(v))
                first = _Item(f"VAR {names[0]} = {v}.", 0.0, q)
                # the later hops follow the first in reading order (their depths are set in _depths)
                items.append(first)
                items += [_Item(f"VAR {b} = VAR {a}.", -1.0) for a, b in zip(names, names[1:])]
            elif task == "real_qa":
                pair = qa[len([x for x in questions if x.task == "real_qa"])]
                q = RealQuestion(task, pair.question + " Answer in a few words.", pair.accept[0], [list(pair.accept)])
                items.append(_Item(pair.topic, 0.0, q))  # the topic's text is filled in by the caller
            else:
                raise ValueError(f"unknown real task {task!r}; expected one of {REAL_TASKS}")
            questions.append(q)
            q.max_new_tokens = MAX_NEW_TOKENS[task]
    # a needle or chain answer must not contain another's number
    for q in questions:
        if q.task == "real_needle":
            q.forbid = [x for x in needle_values if x != q.answer]
        elif q.task == "real_vt":
            q.forbid = [x for x in vt_values if x != q.answer]
    return items, questions


def _depths(items: list[_Item], questions: list[RealQuestion], rng: random.Random) -> None:
    """Asked facts at evenly spread, shuffled depths; a chain's later hops after its first fact."""
    n = len(questions)
    spread = [0.05 + 0.9 * (i + 0.5) / n for i in range(n)]
    rng.shuffle(spread)
    by_q = {id(q): d for q, d in zip(questions, spread)}
    last = 0.0
    for it in items:
        if it.question is not None:
            it.depth = last = by_q[id(it.question)]
            it.question.depth = it.depth
        elif it.depth < 0:  # a chain hop: somewhere after the previous hop
            it.depth = last = last + (1.0 - last) * rng.random() * 0.5


def make_suite(tasks: list[str], length: int, seed: int, tokenizer: Any, per_task: int = 2) -> RealSuite:
    """Build one seeded real-text context of about `length` tokens with the facts of every task.

    The same arguments (and Python version) always give the same suite.

    Args:
        tasks: names from REAL_TASKS.
        length: target context length in tokens (BOS and any chat prefix not counted); the result
            is within one paragraph below it.
        seed: the suite's seed.
        tokenizer: the model's tokenizer (counts tokens).
        per_task: questions per task (real_qa: at most the available QA pairs).

    Returns:
        the RealSuite.
    """
    bad = [t for t in tasks if t not in REAL_TASKS]
    if bad:
        raise ValueError(f"unknown real task {bad[0]!r}; expected one of {REAL_TASKS}")
    topics = pydoc_topics()
    rng = random.Random(f"topk-decode-realtext/{','.join(tasks)}/{int(length)}/{int(seed)}/{per_task}")
    qa = available_qa(topics)
    rng.shuffle(qa)
    items, questions = _plan(tasks, per_task, rng, qa)
    qa_topics = [it.text for it in items if it.question is not None and it.question.task == "real_qa"]
    for it in items:
        if it.question is not None and it.question.task == "real_qa":
            it.text = topics[it.text].strip()
    _depths(items, questions, rng)
    item_tokens = count_tokens(tokenizer, ["\n\n" + it.text for it in items])
    for it, n in zip(items, item_tokens):
        it.tokens = n
    budget = int(length) - sum(item_tokens)
    if budget <= 0:
        raise ValueError(f"length {length} is too short for these real tasks ({length - budget} fact tokens)")

    # filler: paragraphs of the other topics, in a seeded topic order, until the budget is spent
    names = sorted(t for t in topics if t not in qa_topics)
    rng.shuffle(names)
    paras = [p.strip() for t in names for p in topics[t].split("\n\n") if p.strip()]
    filler: list[str] = []
    lens: list[int] = []
    total, i = 0, 0
    source = paras * 4  # repeats the text only past its length (~110K tokens)
    while i < len(source):
        batch = ["\n\n" + p for p in source[i : i + 64]]
        i += 64
        for s, n in zip(batch, count_tokens(tokenizer, batch)):
            if total + n <= budget:  # a paragraph too long for what is left is skipped, not cut
                filler.append(s)
                lens.append(n)
                total += n
        if budget - total < 32:
            break
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    slots: dict[int, list[_Item]] = {}
    for it in sorted(items, key=lambda it: it.depth):
        slot = min(range(len(offsets)), key=lambda j: abs(offsets[j] - it.depth * total))
        slots.setdefault(slot, []).append(it)
    out: list[str] = []
    at, n_all = 0, total + sum(item_tokens)
    for j in range(len(filler) + 1):
        for it in slots.get(j, []):
            if it.question is not None:  # the realised depth: tokens before the fact / all tokens
                it.question.depth = round(at / n_all, 4)
            out.append("\n\n" + it.text)
            at += it.tokens
        if j < len(filler):
            out.append(filler[j])
            at += lens[j]
    context = "".join(out).strip() + "\n"
    sha = hashlib.blake2b(context.encode(), digest_size=8).hexdigest()
    return RealSuite(
        context=context,
        questions=questions,
        length=int(length),
        seed=int(seed),
        python=".".join(map(str, sys.version_info[:3])),
        sha=sha,
        qa_topics=qa_topics,
    )
