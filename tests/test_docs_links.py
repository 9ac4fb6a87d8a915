"""Every relative link in the repository's markdown points at a file that exists, and at a heading that exists there.

Links are `[text](target)` and `![alt](target)` outside code blocks and inline code; web addresses are not checked.
An anchor (`page.md#some-heading`, `#some-heading`) must be the GitHub slug of one of the target page's headings.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", "node_modules", ".venv", "venv", "build", "dist", ".pytest_cache", ".ruff_cache"}

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def markdown_files() -> list[Path]:
    out = []
    for path in sorted(ROOT.rglob("*.md")):
        rel = path.relative_to(ROOT)
        # hidden folders (.git, a contributor's scratch copies) hold no page of the repository
        if any(part in SKIP_DIRS or part.startswith(".") or part.endswith(".egg-info") for part in rel.parts[:-1]):
            continue
        out.append(path)
    return out


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks, with inline code removed."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield n, INLINE_CODE.sub("", line)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            base = slug(m.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path):
    for n, line in prose_lines(path.read_text(encoding="utf-8")):
        for m in LINK.finditer(line):
            yield n, m.group(1)


def broken_links(path: Path) -> list[str]:
    problems = []
    for n, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
            continue  # http:, https:, mailto: ...
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}:{n}: {target}"
        if not dest.exists():
            problems.append(f"{where} (no such file)")
        elif anchor and dest.is_file() and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where} (no heading with that anchor)")
    return problems


def test_slug_matches_github():
    assert slug("Current figures") == "current-figures"
    assert slug("The device reads the rows itself (`device_read`, 2026-11-28)") == (
        "the-device-reads-the-rows-itself-device_read-2026-11-28"
    )
    assert slug("Run 20 (2026-11-26): flat's numba scan at 61–74 % of the DRAM floor") == (
        "run-20-2026-11-26-flats-numba-scan-at-6174--of-the-dram-floor"
    )


def test_the_checker_finds_a_broken_link_and_a_broken_anchor(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "a.md").write_text("# Title\n\n## Part two\n\n[ok](b.md#section) [gone](c.md) [bad](b.md#nope)\n")
    (tmp_path / "b.md").write_text("# B\n\n## Section\n\n[self](#b) [code `x`](a.md#part-two) `[not](a link)`\n")
    assert broken_links(tmp_path / "b.md") == []
    assert broken_links(tmp_path / "a.md") == [
        "a.md:5: c.md (no such file)",
        "a.md:5: b.md#nope (no heading with that anchor)",
    ]


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert broken_links(page) == []
