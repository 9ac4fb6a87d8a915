"""Reading a documents folder and laying out the context: template prefix, separators, document table."""

from __future__ import annotations

import errno
import os
import stat
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


def check_documents_path(path: str | os.PathLike) -> Path:
    """The documents path when it is a folder or a regular file, else TopkError (a FIFO is never opened)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise TopkError(f"documents not found: {path}") from None
    except OSError as e:
        raise TopkError(f"cannot read the documents at {path} ({e.strerror})") from None
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        raise TopkError(f"{path} is {special_kind(mode)}, not a text file or a folder of them")
    return path


def special_kind(mode: int) -> str:
    """What a non-regular, non-directory file is, for messages ("a FIFO", "a socket", "a device")."""
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a special file"


# Reasons a file under the documents folder is not read (grouped in the one warning `summarize_skipped` makes).
LINK_OUTSIDE = "link leaving the documents folder; --follow-symlinks reads it"
LINK_TO_FOLDER = "link to a folder inside the documents folder, read there"


def list_files(root: Path, follow_symlinks: bool = False) -> tuple[list[Path], list[str]]:
    """The regular files under a folder (recursively, sorted), and the entries not listed, with why.

    Symbolic links are followed when their target stays inside `root` (a linked folder is read under
    its own name); links leaving `root` are skipped unless `follow_symlinks`, which also descends into
    linked folders (a link back into a folder being read is a loop, skipped). FIFOs, sockets and
    devices are skipped: only their metadata is read, never their contents (opening a FIFO blocks).

    Args:
        root: the documents folder.
        follow_symlinks: follow every link, also out of `root`.
    """
    real_root = Path(os.path.realpath(root))
    files: list[Path] = []
    skipped: list[str] = []

    def visit(d: Path, ancestors: frozenset[str]) -> None:
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as e:
            skipped.append(f"{safe_name(str(d.relative_to(root)))}/ ({e.strerror})")
            return
        for e in entries:
            p = Path(e.path)
            rel = safe_name(str(p.relative_to(root)))
            link = e.is_symlink()
            try:
                mode = p.stat().st_mode              # the link's target for a link
            except OSError as err:
                skipped.append(f"{rel} ({'broken link' if link else err.strerror})")
                continue
            real = os.path.realpath(p)
            if link and not follow_symlinks and os.path.commonpath([real, real_root]) != str(real_root):
                skipped.append(f"{rel} ({LINK_OUTSIDE})")
            elif stat.S_ISDIR(mode):
                if link and not follow_symlinks:
                    skipped.append(f"{rel} ({LINK_TO_FOLDER})")
                elif real in ancestors:
                    skipped.append(f"{rel} (link loop)")
                else:
                    visit(p, ancestors | {real})
            elif stat.S_ISREG(mode):
                files.append(p)
            else:
                skipped.append(f"{rel} ({special_kind(mode)}: not read)")

    visit(root, frozenset({str(real_root)}))
    return sorted(files), skipped


def read_text_file(path: Path) -> str:
    """A file's text (UTF-8, universal newlines), refusing anything but a regular file at open time.

    O_NONBLOCK: a FIFO put where a file was listed is not waited on; fstat then refuses it.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with open(fd, encoding="utf-8") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"{special_kind(mode)}: not read")
        return f.read()


def collect_documents(path: str | os.PathLike, follow_symlinks: bool = False) -> tuple[list[Document], list[str]]:
    """Read `.txt` / `.md` files under a directory (recursively, sorted) or one file.

    Args:
        path: a directory or a single text file.
        follow_symlinks: also follow links that leave the directory (see `list_files`).
    Returns:
        the documents with readable non-empty text, and the names of the files skipped (with why).
    """
    path = check_documents_path(path)
    single = not path.is_dir()
    if single:
        files, root, skipped = [path], path.parent, []
    else:
        (files, skipped), root = list_files(path, follow_symlinks), path
        if not files and not skipped:
            raise TopkError(f"no files in {path}")
    docs = []
    for f in files:
        raw = str(f.relative_to(root))
        rel = safe_name(raw)   # for messages; the Document keeps the raw name
        if f.suffix.lower() not in TEXT_SUFFIXES and not single:
            skipped.append(f"{rel} (not .txt/.md)")
            continue
        try:
            text = read_text_file(f)
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
        why = f"; skipped: {'; '.join(summarize_skipped(skipped))}" if skipped else ""
        raise TopkError(f"no readable text in {path} (looked for non-empty UTF-8 {'/'.join(TEXT_SUFFIXES)} "
                        f"files){why}")
    return docs, skipped


def summarize_skipped(skipped: list[str], names: int = 3) -> list[str]:
    """Skipped entries ("NAME (why)") grouped by why, one line each: count, then the first few names.

    Args:
        skipped: as `collect_documents` returns them.
        names: how many names each line shows.
    """
    groups: dict[str, list[str]] = {}
    for entry in skipped:
        name, sep, why = entry.rpartition(" (")
        name, why = (name, why[:-1]) if sep and entry.endswith(")") else (entry, "not read")
        groups.setdefault(why, []).append(name)
    lines = []
    for why, group in groups.items():
        shown = ", ".join(group[:names]) + (f" and {len(group) - names} more" if len(group) > names else "")
        lines.append(f"{len(group)} file{'s' * (len(group) != 1)} ({why}): {shown}")
    return lines


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
