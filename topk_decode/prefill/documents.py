"""Reading a documents folder and laying out the context: template prefix, separators, document table."""

from __future__ import annotations

import bisect
import codecs
import errno
import fnmatch
import os
import stat
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from topk_decode.errors import TopkError
from topk_decode.prefill.formats import BINARY_FORMATS, TEXT_FORMATS, Extracted, NotReadable

_SENTINEL_Q = "\x00TOPKQ\x00"
_SENTINEL_A = "\x00TOPKA\x00"
_SENTINEL_Q2 = "\x00TOPKQ2\x00"
RAW_QUESTION = "\nQuestion: {question}\nAnswer:"


@dataclass
class Document:
    """One input document; `places`: where its pages, slides, sheets ... start (character offset, label)."""

    name: str
    text: str
    places: list[tuple[int, str]] = field(default_factory=list)


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
VCS = "version-control folder"
VENV = "virtual environment"
NODE_MODULES = "npm packages"
PYCACHE = "Python bytecode cache"
TOPK_CACHE = "topk cache"
HIDDEN = "hidden: settings or secrets such as .env, not documents; --include reads it"
GITIGNORED = "matched by .gitignore"
EXCLUDED = "matched by --exclude"
BINARY = "binary"
EMPTY = "empty"

# Names skipped by default (an --include matching them reads them): as files too, since a git worktree's
# or submodule's `.git` is a file.
DEFAULT_SKIPS = {
    ".git": VCS,
    ".hg": VCS,
    ".svn": VCS,
    ".venv": VENV,
    "venv": VENV,
    "node_modules": NODE_MODULES,
    "__pycache__": PYCACHE,
}
SNIFF_BYTES = 8192  # the prefix read to tell binary from text before a file is read whole


def compile_globs(patterns: list[str] | tuple[str, ...], option: str):
    """Patterns (gitignore syntax, relative to the documents folder) as one pathspec, None when there are none."""
    import pathspec  # light, pure Python; imported here so `topk --help` does not pay for it

    if not patterns:
        return None
    for pattern in patterns:
        try:
            pathspec.GitIgnoreSpec.from_lines([pattern])
        except Exception as e:  # pathspec's pattern errors have no common public base class across versions
            raise TopkError(f"{option} {pattern!r} is not a valid pattern ({e})") from None
    return pathspec.GitIgnoreSpec.from_lines(list(patterns))


def gitignore_spec(text: str):
    """A .gitignore's patterns as a pathspec; lines git would not understand are dropped, as git drops them."""
    import pathspec

    good = []
    for line in text.splitlines():
        try:
            pathspec.GitIgnoreSpec.from_lines([line])
        except Exception:  # an invalid line: git ignores it, so do we
            continue
        good.append(line)
    return pathspec.GitIgnoreSpec.from_lines(good)


def default_skip(path: Path, name: str, is_dir: bool) -> str | None:
    """Why a folder or file is skipped by default: VCS, virtual environment, packages, caches, hidden names."""
    from topk_decode.store.format import keys_file

    why = DEFAULT_SKIPS.get(name)
    if why == VCS or (is_dir and why):
        return why
    if is_dir and (path / "pyvenv.cfg").is_file():  # a virtual environment under any name
        return VENV
    if is_dir and (path / keys_file(0)).is_file():  # a cache, or a prefill's partial one, e.g. `--out` in the folder
        return TOPK_CACHE
    if name.startswith("."):  # dotfiles and dot-folders (.env, .github, .vscode): skipped as ripgrep skips them
        return HIDDEN
    return None


def reaches_under(pattern: str, rel_dir: str) -> bool:
    """Whether an --include pattern that is anchored (holds a slash) names a path under the folder `rel_dir`.

    An unanchored pattern (`*.py`) matches names at any depth, so it enters a skipped folder only by
    matching the folder itself: `--include '*.py'` does not read a virtual environment's modules.
    """
    p = pattern.strip()
    if not p or p.startswith(("!", "#")) or "/" not in p.rstrip("/"):
        return False
    segs = p.strip("/").split("/")
    for i, part in enumerate(rel_dir.split("/")):
        if i >= len(segs) or segs[i] == "**":
            return True
        if not fnmatch.fnmatchcase(part, segs[i]):
            return False
    return True


def list_files(
    root: Path,
    follow_symlinks: bool = False,
    include: list[str] | tuple[str, ...] = (),
    exclude: list[str] | tuple[str, ...] = (),
) -> tuple[list[Path], list[str]]:
    """The files to read under a folder (recursively, sorted), and the entries not listed, with why.

    Skipped by default: VCS folders (.git, .hg, .svn), virtual environments (`.venv`, `venv`, any folder
    holding pyvenv.cfg), node_modules, __pycache__, topk caches (finished or partial), hidden files and
    folders (a name starting with "."; `.env` files hold secrets), and what a .gitignore
    in the tree matches (a nested one relative to its own folder, taking precedence over those above it).
    A skipped folder is one entry, never walked. Precedence: `exclude` always wins; then `include` beats the default skips and
    .gitignore (a folder is entered when an include matches it or, anchored, names a path under it).

    Symbolic links are followed when their target stays inside `root` (a linked folder is read under
    its own name); links leaving `root` are skipped unless `follow_symlinks`, which also descends into
    linked folders (a link back into a folder being read is a loop, skipped). FIFOs, sockets and
    devices are skipped: only their metadata is read, never their contents (opening a FIFO blocks).

    Args:
        root: the documents folder.
        follow_symlinks: follow every link, also out of `root`.
        include: gitignore-style patterns (relative to `root`) read even where skipped by default.
        exclude: gitignore-style patterns never read.
    """
    include_spec = compile_globs(include, "--include")
    exclude_spec = compile_globs(exclude, "--exclude")
    real_root = Path(os.path.realpath(root))
    files: list[Path] = []
    skipped: list[str] = []

    def ignored(rel: str, is_dir: bool, specs: tuple) -> bool:
        for base, spec in reversed(specs):  # the deepest .gitignore that has a say decides
            verdict = spec.check_file(rel[len(base) :] + "/" * is_dir).include
            if verdict is not None:
                return verdict
        return False

    def visit(d: Path, real_d: str, ancestors: frozenset[str], specs: tuple, held: str | None) -> None:
        # held: why the folder `d` itself was skipped, when an --include entered it anyway: its entries
        # the includes do not match are skipped for the same reason
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as e:
            skipped.append(f"{safe_name(str(d.relative_to(root)))}/ ({e.strerror})")
            return
        base = "" if d == root else d.relative_to(root).as_posix() + "/"
        for e in entries:
            if e.name == ".gitignore" and e.is_file(follow_symlinks=False):
                try:
                    with open_regular(Path(e.path)) as f:
                        specs = specs + ((base, gitignore_spec(f.read().decode("utf-8", "replace"))),)
                except OSError as err:
                    skipped.append(f"{safe_name(base + e.name)} ({err.strerror}: its patterns not applied)")
        for e in entries:
            posix = base + e.name
            link = e.is_symlink()

            def skip(why: str, slash: bool = False) -> None:
                skipped.append(f"{safe_name(posix)}{'/' * slash} ({why})")

            try:
                mode = os.stat(e.path).st_mode  # the link's target for a link
            except OSError as err:
                skip("broken link" if link else err.strerror)
                continue
            # only a link needs resolving (realpath costs a syscall per path component): under the
            # resolved `real_d`, anything else is itself
            real = os.path.realpath(e.path) if link else os.path.join(real_d, e.name)
            is_dir, is_reg = stat.S_ISDIR(mode), stat.S_ISREG(mode)
            key = posix + "/" * is_dir
            if link and not follow_symlinks and os.path.commonpath([real, real_root]) != str(real_root):
                skip(LINK_OUTSIDE)
                continue
            if not (is_dir or is_reg):
                skip(f"{special_kind(mode)}: not read")
                continue
            if exclude_spec is not None and exclude_spec.match_file(key):
                skip(EXCLUDED, is_dir)
                continue
            p = Path(e.path)
            why = held or default_skip(p, e.name, is_dir) or (GITIGNORED if ignored(posix, is_dir, specs) else None)
            entered_for = None
            if why and not (include_spec is not None and include_spec.match_file(key)):
                if not (is_dir and any(reaches_under(pat, posix) for pat in include)):
                    skip(why, is_dir)
                    continue
                entered_for = why  # only the paths an include names under it are read
            if is_dir:
                if link and not follow_symlinks:
                    skip(LINK_TO_FOLDER)
                elif real in ancestors:
                    skip("link loop")
                else:
                    visit(p, real, ancestors | {real}, specs, entered_for)
            else:
                files.append(p)

    visit(root, str(real_root), frozenset({str(real_root)}), (), None)
    return sorted(files), skipped


def open_regular(path: Path) -> BinaryIO:
    """A file opened for reading in binary, refusing anything but a regular file at open time.

    O_NONBLOCK: a FIFO put where a file was listed is not waited on; fstat then refuses it.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    f = open(fd, "rb")
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        f.close()
        raise OSError(errno.EINVAL, f"{special_kind(mode)}: not read")
    return f


def read_text_file(path: Path) -> str | None:
    """A file's text (UTF-8, universal newlines), or None when it is binary (NUL bytes, or not UTF-8).

    Only the first SNIFF_BYTES are read to turn a binary file away, so a big one is never read whole.
    """
    with open_regular(path) as f:
        head = f.read(SNIFF_BYTES)
        try:  # text files hold no NUL bytes (git decides so too); a multi-byte character may be cut at the end
            if b"\x00" in head:
                return None
            codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
        except UnicodeDecodeError:
            return None
        data = head + f.read()
    if b"\x00" in data:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def read_document(path: Path) -> Extracted | None:
    """A document's text and places: PDF, DOCX, PPTX, XLSX, EPUB, HTML and notebooks converted (formats.py,
    NotReadable when they yield none), anything else as a text file (None when binary)."""
    suffix = path.suffix.lower()
    if suffix in BINARY_FORMATS:
        with open_regular(path) as f:
            return BINARY_FORMATS[suffix](f)
    text = read_text_file(path)
    if text is None:
        return None
    return TEXT_FORMATS[suffix](text) if suffix in TEXT_FORMATS else Extracted(text)


def collect_documents(
    path: str | os.PathLike,
    follow_symlinks: bool = False,
    include: list[str] | tuple[str, ...] = (),
    exclude: list[str] | tuple[str, ...] = (),
) -> tuple[list[Document], list[str]]:
    """Read every text file under a directory (recursively, sorted; see `list_files` for what is skipped) or one file.

    A text file is one that decodes as UTF-8 and holds no NUL byte, whatever its suffix; PDF, DOCX, PPTX,
    XLSX, EPUB, HTML and notebook files are converted to their text (`read_document`).

    Args:
        path: a directory or a single text file.
        follow_symlinks: also follow links that leave the directory (see `list_files`).
        include: patterns read even where skipped by default or by a .gitignore (`list_files`).
        exclude: patterns never read; they win over `include`.
    Returns:
        the documents with readable non-empty text, and the names of the files skipped (with why).
    """
    path = check_documents_path(path)
    if not path.is_dir():
        files, root, skipped = [path], path.parent, []
    else:
        (files, skipped), root = list_files(path, follow_symlinks, include, exclude), path
        if not files and not skipped:
            raise TopkError(f"no files in {path}")
    docs = []
    for f in files:
        raw = str(f.relative_to(root))
        rel = safe_name(raw)  # for messages; the Document keeps the raw name
        try:
            got = read_document(f)
        except NotReadable as e:
            skipped.append(f"{rel} ({e})")
            continue
        except OSError as e:
            skipped.append(f"{rel} ({e.strerror})")
            continue
        if got is None:
            skipped.append(f"{rel} ({BINARY})")
            continue
        if not got.text.strip():
            skipped.append(f"{rel} ({EMPTY})")
            continue
        docs.append(Document(raw, got.text, got.places))
    if not docs:
        why = f"; skipped: {'; '.join(summarize_skipped(skipped))}" if skipped else ""
        raise TopkError(f"no readable text in {path} (looked for non-empty UTF-8 text files){why}")
    return docs, skipped


def summarize_skipped(skipped: list[str], names: int = 3) -> list[str]:
    """Skipped entries ("NAME (why)") grouped by why, one line each: count, then the first few names.

    A group of folders ("NAME/") counts folders, of files files, of both entries.

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
        n_folders = sum(name.endswith("/") for name in group)  # a skipped folder is listed as "NAME/"
        noun = "folder" if n_folders == len(group) else "file" if not n_folders else "entr"
        plural = ("ies" if len(group) != 1 else "y") if noun == "entr" else "s" * (len(group) != 1)
        lines.append(f"{len(group)} {noun}{plural} ({why}): {shown}")
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
        one = tokenizer.apply_chat_template(
            [{"role": "user", "content": _SENTINEL_Q}], tokenize=False, add_generation_prompt=True
        )
        two = tokenizer.apply_chat_template(
            [
                {"role": "user", "content": _SENTINEL_Q},
                {"role": "assistant", "content": _SENTINEL_A},
                {"role": "user", "content": _SENTINEL_Q2},
            ],
            tokenize=False,
            add_generation_prompt=True,
        )
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
    documents: list[dict]  # {"name", "start", "end"} token spans (header included), "places" where known
    prompt: PromptFormat


def place_tokens(tokenizer, text: str, chars: list[int]) -> list[int]:
    """For character offsets into `text`, the index of the token of `tokenizer(text)` that holds each one.

    A fast tokenizer's offset mapping gives them exactly; a slow one (no offsets) counts the tokens of
    the text before each offset, which can differ by a token where a merge crosses it.
    """
    if getattr(tokenizer, "is_fast", False):
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        ends = [e for _, e in offsets]
        return [min(bisect.bisect_right(ends, c), max(len(ends) - 1, 0)) for c in chars]
    return [len(tokenizer(text[:c], add_special_tokens=False).input_ids) for c in chars]


def document_span(doc: Document, header: str, tokenizer, start: int) -> tuple[list[int], dict]:
    """One document's tokens (header and text tokenized as one piece) and its document-table entry.

    The entry is {"name", "start", "end"} and, for a document with places (pages, slides ...),
    "places": [{"label", "start"}] with absolute token positions, in order.

    Args:
        doc: the document.
        header: the separator in front of it ("" for none), see `document_header`.
        tokenizer: the model's tokenizer.
        start: the context position of its first token.
    """
    text = header + doc.text
    ids = tokenizer(text, add_special_tokens=False).input_ids
    entry = {"name": safe_name(doc.name), "start": start, "end": start + len(ids)}
    if doc.places:
        at = place_tokens(tokenizer, text, [len(header) + c for c, _ in doc.places])
        entry["places"] = [{"label": label, "start": start + i} for i, (_, label) in zip(at, doc.places)]
    return ids, entry


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
        name = safe_name(d.name)  # a name must not inject lines into the context (nor the terminal)
        header = document_header(name) if i or fmt.kind == "chat" or len(docs) > 1 else ""
        piece, entry = document_span(d, header, tokenizer, len(ids))
        ids += piece
        table.append(entry)
    return ContextLayout(ids, table, fmt)


def has_headers(documents: list[dict], prompt: dict) -> bool:
    """Whether a cache's documents each start with a `document_header` (all but a lone raw-text document),
    so that more documents can follow them exactly as `layout_context` would lay them out together."""
    return prompt.get("kind") == "chat" or len(documents) > 1


def layout_more(docs: list[Document], tokenizer, start: int) -> tuple[list[int], list[dict]]:
    """The tokens and document-table entries of documents that follow a context of `start` tokens
    (`topk prefill --append`): the same pieces `layout_context` makes for them after earlier documents."""
    ids: list[int] = []
    table = []
    for d in docs:
        piece, entry = document_span(d, document_header(safe_name(d.name)), tokenizer, start + len(ids))
        ids += piece
        table.append(entry)
    return ids, table
