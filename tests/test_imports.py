"""The package's import graph: no circle, and no underscore-prefixed name imported from another module.

Read from the source with `ast` (nothing is imported): an edge A → B for every `import B` / `from B import x`
in A, at module level or inside a function (a lazy import is still a dependency), where B is a module of
topk_decode (`from pkg import mod` counts as an edge to pkg.mod). TYPE_CHECKING-only imports count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import topk_decode

ROOT = Path(topk_decode.__file__).parent


def modules() -> dict[str, Path]:
    """Module name → file, for every .py file of the package."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import of a package module in this file."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name in known]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            if base not in known:
                continue
            names = [a.name for a in node.names]
            subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in known]
            out += [(s, []) for s in subs]
            plain = [n for n in names if f"{base}.{n}" not in known]
            if plain:
                out.append((base, plain))
    return out


def graph() -> tuple[dict[str, set[str]], list[str]]:
    """Edges per module (a module → the package modules it imports), and every underscore name imported."""
    mods = modules()
    known = set(mods)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    private = []
    for name, path in mods.items():
        for target, names in imports(name, path, known):
            edges[name].add(target)
            private += [f"{name} imports {target}.{n}" for n in names if n.startswith("_") and not n.startswith("__")]
    for name in edges:
        edges[name].discard(name)
    return edges, private


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a list of modules, or None (depth-first search with colours)."""
    colour, stack = dict.fromkeys(edges, 0), []

    def visit(m: str) -> list[str] | None:
        colour[m] = 1
        stack.append(m)
        for n in sorted(edges[m]):
            if colour[n] == 1:
                return stack[stack.index(n) :] + [n]
            if colour[n] == 0 and (found := visit(n)):
                return found
        stack.pop()
        colour[m] = 2
        return None

    for m in sorted(edges):
        if colour[m] == 0 and (found := visit(m)):
            return found
    return None


def test_the_import_graph_has_no_cycle():
    edges, _ = graph()
    assert len(edges) > 50 and sum(map(len, edges.values())) > 100  # the walk found the package
    assert find_cycle(edges) is None, " → ".join(find_cycle(edges))


def test_no_underscore_name_is_imported_from_another_module():
    _, private = graph()
    assert not private, "\n".join(private)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
