"""Reading a documents folder and laying out the context: template prefix, separators, document table."""

from __future__ import annotations

import os
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from topk_decode.errors import TopkError

TEXT_SUFFIXES = (".txt", ".md")
_SENTINEL_Q = "\x00TOPKQ\x00"
_SENTINEL_A = "\x00TOPKA\x00"
_SENTINEL_Q2 = "\x00TOPKQ2\x00"
RAW_QUESTION = "\nQuestion: {question}\nAnswer:"


@dataclass
class Document:
    """One input document."""

    name: str
    text: str


def safe_name(name: str) -> str:
    """A file name as it may appear in the context and in messages: one line, nothing invisible.

    Control, format and line/paragraph-separator characters (and backslashes, so the result is
    unambiguous) become backslash escapes, so a name cannot start a line of its own in the context
    (e.g. forge a `### Document:` separator or a fact) nor drive a terminal. Ordinary names are unchanged.

    Args:
        name: the document's relative path.
    """
    out = []
    for ch in name:
        if ch == "\\":
            out.append("\\\\")
        elif unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"):
            out.append(ch.encode("unicode_escape").decode("ascii"))
        else:
            out.append(ch)
    return "".join(out)


def collect_documents(path: str | os.PathLike) -> tuple[list[Document], list[str]]:
    """Read `.txt` / `.md` files under a directory (recursively, sorted) or one file.

    Args:
        path: a directory or a single text file.
    Returns:
        the documents with readable non-empty text, and the names of the files skipped (with why).
    """
    path = Path(path)
    if not path.exists():
        raise TopkError(f"documents not found: {path}")
    if path.is_file():
        files, root = [path], path.parent
    else:
        files, root = sorted(p for p in path.rglob("*") if p.is_file()), path
        if not files:
            raise TopkError(f"no files in {path}")
    docs, skipped = [], []
    for f in files:
        raw = str(f.relative_to(root))
        rel = safe_name(raw)   # for messages; the Document keeps the raw name
        if f.suffix.lower() not in TEXT_SUFFIXES and not path.is_file():
            skipped.append(f"{rel} (not .txt/.md)")
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            skipped.append(f"{rel} (not UTF-8 text)")
            continue
        except OSError as e:
            skipped.append(f"{rel} ({e.strerror})")
            continue
        if not text.strip():
            skipped.append(f"{rel} (empty)")
            continue
        if "\x00" in text:   # valid UTF-8, but text files hold no NUL bytes: binary, as git decides
            skipped.append(f"{rel} (binary: contains NUL bytes)")
            continue
        docs.append(Document(raw, text))
    if not docs:
        raise TopkError(f"no readable text in {path} (looked for non-empty UTF-8 {'/'.join(TEXT_SUFFIXES)} files)")
    return docs, skipped


@dataclass
class PromptFormat:
    """How questions are appended after the cached context.

    kind "chat": the cache ends inside an open user turn; a question is `first + question + suffix`
    and a later turn is `turn_sep + question + suffix` (turn_sep closes the assistant turn and opens
    a user turn). kind "raw": `RAW_QUESTION` for every turn.
    """

    kind: str
    prefix: str = ""
    suffix: str = ""
    turn_sep: str = ""
    first: str = "\n\n"

    def question_text(self, question: str, first_turn: bool) -> str:
        """The text to append for a question."""
        if self.kind == "chat":
            return (self.first if first_turn else self.turn_sep) + question + self.suffix
        return ("" if first_turn else "\n") + RAW_QUESTION.format(question=question)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def prompt_format(tokenizer) -> PromptFormat:
    """Derive the chat layout from the tokenizer's chat template (raw text when it has none)."""
    if not getattr(tokenizer, "chat_template", None):
        return PromptFormat("raw")
    try:
        one = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL_Q}],
                                            tokenize=False, add_generation_prompt=True)
        two = tokenizer.apply_chat_template(
            [{"role": "user", "content": _SENTINEL_Q}, {"role": "assistant", "content": _SENTINEL_A},
             {"role": "user", "content": _SENTINEL_Q2}], tokenize=False, add_generation_prompt=True)
    except Exception:
        return PromptFormat("raw")
    if one.count(_SENTINEL_Q) != 1 or _SENTINEL_A not in two or _SENTINEL_Q2 not in two:
        return PromptFormat("raw")
    prefix, suffix = one.split(_SENTINEL_Q)
    turn_sep = two.split(_SENTINEL_A)[1].split(_SENTINEL_Q2)[0]
    return PromptFormat("chat", prefix=prefix, suffix=suffix, turn_sep=turn_sep)


def document_header(name: str) -> str:
    """The separator line in front of each document.

    Args:
        name: the name as it appears (already passed through `safe_name`).
    """
    return f"\n\n### Document: {name}\n\n"


@dataclass
class ContextLayout:
    """Token ids of the whole context and which span each document occupies."""

    ids: list[int]
    documents: list[dict]  # {"name", "start", "end"} token spans (header included)
    prompt: PromptFormat


def layout_context(docs: list[Document], tokenizer) -> ContextLayout:
    """Tokenize documents into one context: [BOS] [template prefix] (header + text)*.

    Each piece is tokenized on its own so document spans are exact token ranges.

    Args:
        docs: the documents, in order.
        tokenizer: the model's tokenizer.
    """
    fmt = prompt_format(tokenizer)
    ids: list[int] = []
    if fmt.kind == "chat":
        ids += tokenizer(fmt.prefix, add_special_tokens=False).input_ids
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and (not ids or ids[0] != bos):
        ids = [bos] + ids
    table = []
    for i, d in enumerate(docs):
        start = len(ids)
        name = safe_name(d.name)   # a name must not inject lines into the context (nor the terminal)
        header = document_header(name) if i or fmt.kind == "chat" or len(docs) > 1 else ""
        ids += tokenizer(header + d.text, add_special_tokens=False).input_ids
        table.append({"name": name, "start": start, "end": len(ids)})
    return ContextLayout(ids, table, fmt)
