"""Seeded RULER-style long-context retrieval tasks, written in the demo model's filler language.

One generator serves both the training of the shipped demo model
(``tools/train_demo_model.py``) and the evaluation harness, so the two always agree on the
text format. A task instance is a *context* (the document that gets prefilled and cached), a
*question* (the prompt appended after the context; it ends exactly where the answer starts) and
the expected *answer*.

The model sees ``[bos] + tokenize(context) + tokenize(question)`` (context and question are
tokenized separately) and is correct iff its greedy continuation, decoded and stripped of
whitespace, starts with ``answer``.

Example (``single_needle``)::

    context:  "... The special magic number for amber-fox is 482. ..."
    question: "\\nQuestion: What is the special magic number for amber-fox?\\n"
              "Answer: The special magic number for amber-fox is"
    answer:   "482"

Filler is generated from a small made-up vocabulary and grammar ("The brisk dolmar trenas the
vaith of Kelorn."), so no downloaded text is needed and nothing in the filler looks like a fact.
Every sentence piece starts with whitespace and ends with punctuation, so tokenizing pieces
separately and concatenating gives the same ids as tokenizing the joined text with a
byte-level BPE tokenizer (the lengths below rely on it).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

TASKS: tuple[str, ...] = ("single_needle", "multi_key", "multi_value", "variable_tracking")
"""Names accepted by :func:`make_instance`."""

MULTI_KEY_FACTS = 8
"""Number of key→number facts in a ``multi_key`` context (one is asked)."""
MULTI_VALUE_COUNT = 4
"""Number of values stored under the asked key in a ``multi_value`` context."""
VT_CHAIN = 3
"""Variables per chain in ``variable_tracking`` (two chains: the asked one and a distractor)."""
VALUE_RANGE = (100, 999)
"""Values are three-digit numbers; the demo tokenizer has one token per value."""

ADJECTIVES: tuple[str, ...] = tuple(
    """amber azure bold brave bright brisk calm clever coral crimson dapper eager fancy fierce
    gentle golden grand happy honest hungry ivory jolly keen lively lucky mellow merry misty
    noble olive proud quick quiet rapid royal rusty scarlet shy silent silver sleepy sly smooth
    snowy solar steady stormy sunny swift tawny tender tiny velvet vivid wild windy wise witty
    young zesty dusty frosty""".split()
)
"""First half of a key such as ``amber-fox``."""

ANIMALS: tuple[str, ...] = tuple(
    """fox owl yak lynx bear wolf hare seal crow swan toad mole newt wren lark duck goat lamb
    mouse otter panda tiger zebra camel eagle falcon gecko heron horse koala lemur llama moose
    raven robin shark sheep snake squid stork trout whale bison crane dingo egret ferret finch
    gopher hawk hyena ibis jackal kiwi macaw marten okapi oriole puffin quail rhino cobra
    badger""".split()
)
"""Second half of a key such as ``amber-fox``."""


# --------------------------------------------------------------------------------------------
# The filler language: a generated vocabulary and a small grammar.
# --------------------------------------------------------------------------------------------

_ONSETS = (
    "b",
    "d",
    "f",
    "g",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "z",
    "br",
    "dr",
    "gl",
    "kr",
    "pl",
    "st",
    "th",
    "tr",
    "sh",
    "ch",
)
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou", "ea", "y")
_CODAS = ("", "", "", "n", "r", "l", "s", "m", "th", "nd", "rk", "sk")
_RESERVED = (
    set(ADJECTIVES)
    | set(ANIMALS)
    | {
        "the",
        "a",
        "is",
        "are",
        "of",
        "for",
        "and",
        "one",
        "special",
        "magic",
        "number",
        "numbers",
        "variable",
        "equals",
        "which",
        "question",
        "answer",
        "what",
        "all",
        "does",
        "equal",
    }
)


def _make_words(rng: random.Random, n: int, syllables: tuple[int, int], suffix: str = "") -> list[str]:
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < n:
        k = rng.randint(*syllables)
        w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(k))
        w = w + suffix
        if w in seen or w in _RESERVED or len(w) < 3:
            continue
        seen.add(w)
        words.append(w)
    return words


class FillerGrammar:
    """Random sentences of the made-up filler language.

    The vocabulary is generated once from a fixed seed (it is part of the demo model's
    "language"); each call to :meth:`sentence` draws from the ``rng`` it is given.
    """

    def __init__(self, vocab_seed: int = 20261121) -> None:
        """Build the vocabulary.

        Args:
            vocab_seed: seed of the generated vocabulary. Keep the default: the demo model was
                trained on it.
        """
        r = random.Random(vocab_seed)
        self.nouns = _make_words(r, 360, (1, 2))
        self.verbs = _make_words(r, 120, (1, 2))
        self.adjectives = _make_words(r, 120, (1, 2))
        self.places = [w.capitalize() for w in _make_words(r, 60, (2, 3))]
        self.templates = (
            "The {a} {n} {v}s the {n2}.",
            "A {n} from {P} {v}s {a2}ly.",
            "In {P}, every {n} {v}s the {a} {n2}.",
            "The {n} of the {n2} is {a}.",
            "{P} has many {n}s and few {n2}s.",
            "When the {n} {v}s, the {a} {n2} {v2}s too.",
            "Nobody {v}s the {n} near {P}.",
            "The {n}s {v} under the {a} {n2} of {P}.",
            "Each {a} {n} in {P} {v}s a {n2} and a {n3}.",
            "Some say the {n} {v}s only when the {n2} is {a}.",
            "The old {n} {v}s toward {P}.",
            "Before the {n} {v}s, a {a} {n2} {v2}s the {n3}.",
        )

    def sentence(self, rng: random.Random) -> str:
        """One sentence piece, starting with whitespace (a space, or a paragraph break).

        Args:
            rng: the random generator to draw from.

        Returns:
            e.g. ``" The brisk dolmar trenas the vaith."``
        """
        t = rng.choice(self.templates)
        s = t.format(
            a=rng.choice(self.adjectives),
            a2=rng.choice(self.adjectives),
            n=rng.choice(self.nouns),
            n2=rng.choice(self.nouns),
            n3=rng.choice(self.nouns),
            v=rng.choice(self.verbs),
            v2=rng.choice(self.verbs),
            P=rng.choice(self.places),
        )
        lead = "\n\n" if rng.random() < 0.06 else " "
        return lead + s


_GRAMMAR: FillerGrammar | None = None


def grammar() -> FillerGrammar:
    """The shared :class:`FillerGrammar` (built once)."""
    global _GRAMMAR
    if _GRAMMAR is None:
        _GRAMMAR = FillerGrammar()
    return _GRAMMAR


# --------------------------------------------------------------------------------------------
# Fact and question templates (shared with training).
# --------------------------------------------------------------------------------------------


def magic_fact(key: str, value: int | str) -> str:
    """Context sentence of ``single_needle`` / ``multi_key``.

    Args:
        key: e.g. ``"amber-fox"``.
        value: the number.
    """
    return f" The special magic number for {key} is {value}."


def magic_question(key: str) -> str:
    """Question of ``single_needle`` / ``multi_key``; the answer follows it after a space.

    Args:
        key: the asked key.
    """
    return _prompt_question("single_needle", key)


def chat_query(task: str, key: str) -> tuple[str, str]:
    """The same question as a user would type it in ``topk chat``, and the answer's fixed start.

    ``topk chat`` appends ``"\nQuestion: {question}\nAnswer:"``; the demo model then answers
    with a full sentence, ``" " + prefix + " " + answer + "."``, e.g.
    ``"The special magic number for amber-fox is 482."``.

    Args:
        task: one of :data:`TASKS`.
        key: the asked key (the asked variable for ``variable_tracking``).

    Returns:
        (question, answer prefix).
    """
    if task in ("single_needle", "multi_key"):
        return (f"What is the special magic number for {key}?", f"The special magic number for {key} is")
    if task == "multi_value":
        return (f"What are all the special magic numbers for {key}?", f"The special magic numbers for {key} are")
    if task == "variable_tracking":
        return f"Which number does variable {key} equal?", f"Variable {key} equals"
    raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")


def _prompt_question(task: str, key: str) -> str:
    """The question as it follows the context in a raw prompt: chat_query's two parts on their lines."""
    question, prefix = chat_query(task, key)
    return f"\nQuestion: {question}\nAnswer: {prefix}"


def multi_value_fact(key: str, value: int | str) -> str:
    """Context sentence of ``multi_value`` (several of them share one key).

    Args:
        key: the key.
        value: one of its numbers.
    """
    return f" One of the special magic numbers for {key} is {value}."


def multi_value_question(key: str) -> str:
    """Question of ``multi_value``; the answer lists the numbers in context order.

    Args:
        key: the asked key.
    """
    return _prompt_question("multi_value", key)


def vt_fact(var: str, target: int | str) -> str:
    """Context sentence of ``variable_tracking``.

    Args:
        var: the variable being assigned.
        target: a number, or the name of another variable.
    """
    return f" Variable {var} equals {target}."


def vt_question(var: str) -> str:
    """Question of ``variable_tracking``; the answer walks the chain to the number.

    Args:
        var: the asked variable (the last one of its chain).
    """
    return _prompt_question("variable_tracking", var)


def vt_answer(chain: Sequence[str], value: int | str) -> str:
    """Answer of ``variable_tracking`` for ``chain = [v0, v1, ..., vn]`` (vn asked, v0 = value).

    Args:
        chain: variables from the one holding the number to the asked one.
        value: the number held by ``chain[0]``.

    Returns:
        e.g. ``"calm-owl, which equals amber-fox, which equals 482"`` for the chain
        ``[amber-fox, calm-owl, red-yak]``.
    """
    hops = list(reversed(chain[:-1]))
    return ", which equals ".join(hops + [str(value)])


def random_keys(rng: random.Random, n: int, hard: bool = True) -> list[str]:
    """Draw ``n`` distinct keys such as ``amber-fox``.

    Args:
        rng: the random generator.
        n: how many.
        hard: when True, keys after the first share an adjective or an animal with the first
            one about half the time, so that matching half a key is not enough.
    """
    keys: list[str] = []
    first_a, first_b = rng.choice(ADJECTIVES), rng.choice(ANIMALS)
    while len(keys) < n:
        a, b = rng.choice(ADJECTIVES), rng.choice(ANIMALS)
        if keys and hard:
            u = rng.random()
            if u < 0.25:
                a = first_a
            elif u < 0.5:
                b = first_b
        elif not keys:
            a, b = first_a, first_b
        k = f"{a}-{b}"
        if k not in keys:
            keys.append(k)
    return keys


def random_values(rng: random.Random, n: int) -> list[int]:
    """``n`` distinct three-digit numbers.

    Args:
        rng: the random generator.
        n: how many.
    """
    return rng.sample(range(VALUE_RANGE[0], VALUE_RANGE[1] + 1), n)


# --------------------------------------------------------------------------------------------
# Instances.
# --------------------------------------------------------------------------------------------


@dataclass
class TaskInstance:
    """One seeded task instance.

    Attributes:
        task: one of :data:`TASKS`.
        context: the document text (what gets prefilled and cached).
        question: text appended after the context; ends right where the answer starts.
        answer: expected answer text (greedy generation, stripped, must start with it).
        length: target context length in tokens (the context is within a sentence of it).
        depth: depth of the asked fact in the context, in [0, 1].
    """

    task: str
    context: str
    question: str
    answer: str
    length: int
    depth: float


def count_tokens(tokenizer: Any, texts: Sequence[str]) -> list[int]:
    """Token counts of ``texts`` without special tokens.

    Args:
        tokenizer: a transformers tokenizer, or a ``tokenizers.Tokenizer``.
        texts: the strings.
    """
    if hasattr(tokenizer, "encode_batch"):  # tokenizers.Tokenizer
        return [len(e.ids) for e in tokenizer.encode_batch(list(texts), add_special_tokens=False)]
    return [len(x) for x in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def _facts_for(task: str, rng: random.Random) -> tuple[list[str], int, str, str]:
    """(fact sentences, index of the asked fact, question, answer)."""
    if task == "single_needle":
        key = random_keys(rng, 1)[0]
        value = random_values(rng, 1)[0]
        return [magic_fact(key, value)], 0, magic_question(key), str(value)
    if task == "multi_key":
        keys = random_keys(rng, MULTI_KEY_FACTS)
        values = random_values(rng, MULTI_KEY_FACTS)
        facts = [magic_fact(k, v) for k, v in zip(keys, values)]
        return facts, 0, magic_question(keys[0]), str(values[0])
    if task == "multi_value":
        key = random_keys(rng, 1)[0]
        values = random_values(rng, MULTI_VALUE_COUNT)
        facts = [multi_value_fact(key, v) for v in values]
        return facts, 0, multi_value_question(key), ", ".join(str(v) for v in values)
    if task == "variable_tracking":
        names = random_keys(rng, 2 * VT_CHAIN)
        v1, v2 = random_values(rng, 2)
        chains = (names[:VT_CHAIN][::-1], names[VT_CHAIN:][::-1])  # asked chain ends at names[0]
        facts: list[str] = []
        asked_idx = 0
        for ci, (chain, val) in enumerate(zip(chains, (v1, v2))):
            for i, var in enumerate(chain):
                if ci == 0 and i == len(chain) - 1:
                    asked_idx = len(facts)
                facts.append(vt_fact(var, val if i == 0 else chain[i - 1]))
        return facts, asked_idx, vt_question(chains[0][-1]), vt_answer(chains[0], v1)
    raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")


def make_instance(task: str, length: int, depth: float, seed: int, tokenizer: Any) -> TaskInstance:
    """Build one seeded instance of ``task`` with a context of about ``length`` tokens.

    The same arguments always give the same instance (the random stream is seeded from all of
    them). The asked fact sits at ``depth`` (0 = right after BOS, 1 = end of the context); the
    other facts sit at random depths. In ``multi_value`` the answer lists the values in the
    order they appear in the context; in ``variable_tracking`` the chain facts are scattered in
    random order.

    Args:
        task: one of :data:`TASKS`.
        length: target context length in tokens (BOS not counted); the result is within one
            filler sentence (about 20 tokens) below it.
        depth: where the asked fact goes, in [0, 1].
        seed: instance seed. The demo model was trained on other random streams; evaluate
            with any seed.
        tokenizer: the model's tokenizer (transformers or ``tokenizers``), used to count tokens.

    Returns:
        The :class:`TaskInstance`.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(f"topk-decode-task/{task}/{int(length)}/{float(depth):.6f}/{int(seed)}")
    facts, asked, question, answer = _facts_for(task, rng)
    fact_tokens = sum(count_tokens(tokenizer, facts))
    budget = int(length) - fact_tokens
    if budget < 0:
        raise ValueError(f"length {length} is too short for task {task} ({fact_tokens} fact tokens)")

    g = grammar()
    sentences: list[str] = []
    lens: list[int] = []
    total = 0
    done = False
    while not done:
        batch = [g.sentence(rng) for _ in range(64)]
        for s, n in zip(batch, count_tokens(tokenizer, batch)):
            if total + n > budget:
                done = True
                break
            sentences.append(s)
            lens.append(n)
            total += n
    # Boundaries: slot i = before sentence i (slot len(sentences) = end). Pick the slot whose
    # token offset is closest to each fact's depth.
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)

    def slot_for(d: float) -> int:
        target = d * total
        return min(range(len(offsets)), key=lambda i: abs(offsets[i] - target))

    slots: dict[int, list[int]] = {}
    order = list(range(len(facts)))
    other = [i for i in order if i != asked]
    depths = {asked: depth}
    for i in other:
        depths[i] = rng.random()
    for i in sorted(order, key=lambda i: depths[i]):
        slots.setdefault(slot_for(depths[i]), []).append(i)
    if task == "multi_value":
        # The answer lists the values in context order.
        ordered = [i for s in sorted(slots) for i in slots[s]]
        values = [facts[i].rsplit(" ", 1)[1].rstrip(".") for i in ordered]
        answer = ", ".join(values)

    pieces: list[str] = []
    for i in range(len(sentences) + 1):
        for f in slots.get(i, []):
            pieces.append(facts[f])
        if i < len(sentences):
            pieces.append(sentences[i])
    context = "".join(pieces)
    return TaskInstance(
        task=task, context=context, question=question, answer=answer, length=int(length), depth=float(depth)
    )
