"""The README's first lines are the two commands a newcomer runs; CI must run the second verbatim."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _first_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", text, re.S)
    assert block, "README has no code block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_opens_with_exactly_two_commands():
    head = (ROOT / "README.md").read_text().split("```")[0]
    assert len(head.splitlines()) <= 4, "the commands must be on the README's first lines"
    assert len(_first_commands()) == 2


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _first_commands()[1] in ci


def test_main_command_prefills_the_bundled_examples():
    main = _first_commands()[0]
    assert "topk prefill examples/docs" in main and "topk chat" in main
    assert (ROOT / "examples" / "docs").is_dir()
