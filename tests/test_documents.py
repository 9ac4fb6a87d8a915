"""The documents people have (issue 29): every UTF-8 text file is a document whatever its suffix; VCS folders,
virtual environments, node_modules, __pycache__ and .gitignore'd paths are skipped; --include / --exclude
override (exclude always wins); binary files are skipped without being read whole; skips are summarised.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from topk_decode.cli.app import app
from topk_decode.errors import TopkError
from topk_decode.prefill import documents
from topk_decode.prefill.documents import (
    BINARY,
    EXCLUDED,
    GITIGNORED,
    HIDDEN,
    NODE_MODULES,
    PYCACHE,
    SNIFF_BYTES,
    TOPK_CACHE,
    VCS,
    VENV,
    collect_documents,
    read_text_file,
    summarize_skipped,
)
from topk_decode.prefill.formats import EXTRA, NO_TEXT_LAYER


def write_tree(root: Path, files: dict[str, str | bytes]) -> Path:
    """Files under `root` (text written as UTF-8, bytes as they are); returns `root`."""
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    return root


def names(docs) -> list[str]:
    return [d.name for d in docs]


def topk(*args: object):
    """`topk ARGS` in-process (typer's CliRunner, stdout and stderr apart)."""
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output, result.output
    return result


# ---- every text file -------------------------------------------------------------------------------
def test_code_config_and_data_files_are_documents_in_path_order(tmp_path):
    docs = write_tree(
        tmp_path / "docs",
        {
            "src/main.py": "def main():\n    return 42\n",
            "config.yaml": "answer: 42\n",
            "data.csv": "a,b\n1,2\n",
            "pkg.json": '{"name": "x"}\n',
            "guide.rst": "Guide\n=====\n",
            "paper.tex": "\\section{Intro}\n",
            "Makefile": "all:\n\techo hi\n",
            "notes.md": "# Notes\n",
            "a.txt": "plain\n",
            "src/util.c": "int x;\n",
        },
    )
    found, skipped = collect_documents(docs)
    assert names(found) == [
        "Makefile",
        "a.txt",
        "config.yaml",
        "data.csv",
        "guide.rst",
        "notes.md",
        "paper.tex",
        "pkg.json",
        "src/main.py",
        "src/util.c",
    ]
    assert skipped == []
    assert found[-2].text == "def main():\n    return 42\n"
    assert names(collect_documents(docs)[0]) == names(found)  # the same order every time


def test_a_single_file_of_any_suffix_is_read(tmp_path):
    one = write_tree(tmp_path, {"script.sh": "echo hello\n"}) / "script.sh"
    found, skipped = collect_documents(one)
    assert names(found) == ["script.sh"] and skipped == []


def test_binary_files_are_skipped_with_one_reason(tmp_path):
    text_across_sniff = "a" * (SNIFF_BYTES - 1) + "é" * 10  # a two-byte character cut by the sniffed prefix
    docs = write_tree(
        tmp_path / "docs",
        {
            "img.png": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR",
            "latin1.txt": "café\n".encode("latin-1"),
            "late_nul.txt": b"x" * (SNIFF_BYTES + 100) + b"\x00tail",
            "ok.txt": "fine\n",
            "edge.txt": text_across_sniff,
            "crlf.txt": b"one\r\ntwo\rthree\n",
        },
    )
    found, skipped = collect_documents(docs)
    assert names(found) == ["crlf.txt", "edge.txt", "ok.txt"]
    assert found[0].text == "one\ntwo\nthree\n"  # universal newlines, as before
    assert found[1].text == text_across_sniff
    assert sorted(skipped) == [f"img.png ({BINARY})", f"late_nul.txt ({BINARY})", f"latin1.txt ({BINARY})"]
    with pytest.raises(TopkError, match=r"no readable text .*1 file \(binary\): img.png"):
        collect_documents(docs / "img.png")


def test_a_big_binary_file_is_judged_by_its_prefix(tmp_path, monkeypatch):
    big = tmp_path / "blob.bin"
    with open(big, "wb") as f:  # 64 MiB, sparse: NULs from the first byte
        f.truncate(64 << 20)
    read: list[int] = []
    real_open = documents.open_regular

    class Counting:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            data = self.f.read(n)
            read.append(len(data))
            return data

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(documents, "open_regular", lambda p: Counting(real_open(p)))
    assert read_text_file(big) is None
    assert sum(read) <= SNIFF_BYTES
    read.clear()
    not_utf8 = tmp_path / "noise.dat"  # no NUL at all, but not UTF-8 in its first bytes
    not_utf8.write_bytes(bytes(range(128, 256)) * (1 << 14))
    assert read_text_file(not_utf8) is None
    assert sum(read) <= SNIFF_BYTES


# ---- what is skipped by default -----------------------------------------------------------------------
def default_tree(root: Path) -> Path:
    return write_tree(
        root,
        {
            "README.md": "# Project\n",
            "app.py": "print('hi')\n",
            ".git/config": "[core]\n",
            ".git/HEAD": "ref: refs/heads/main\n",
            ".hg/hgrc": "x\n",
            ".svn/entries": "12\n",
            "wt/.git": "gitdir: ../.git/worktrees/wt\n",
            "wt/code.py": "x = 1\n",
            ".venv/pyvenv.cfg": "home = /usr/bin\n",
            ".venv/lib/mod.py": "y = 2\n",
            "venv/lib/m.py": "z = 3\n",
            "env-3.11/pyvenv.cfg": "home = /usr\n",
            "env-3.11/lib/site.py": "w = 4\n",
            "web/node_modules/left-pad/index.js": "module.exports = 1;\n",
            "web/app.js": "console.log(1);\n",
            "pkg/__pycache__/mod.cpython-311.pyc": "not really bytecode\n",
            "pkg/mod.py": "v = 5\n",
        },
    )


def test_vcs_venv_node_modules_and_pycache_are_skipped_whole(tmp_path):
    docs = default_tree(tmp_path / "docs")
    found, skipped = collect_documents(docs)
    assert names(found) == ["README.md", "app.py", "pkg/mod.py", "web/app.js", "wt/code.py"]
    assert sorted(skipped) == sorted(
        [
            f".git/ ({VCS})",
            f".hg/ ({VCS})",
            f".svn/ ({VCS})",
            f"wt/.git ({VCS})",
            f".venv/ ({VENV})",
            f"venv/ ({VENV})",
            f"env-3.11/ ({VENV})",  # the last one: by its pyvenv.cfg
            f"web/node_modules/ ({NODE_MODULES})",
            f"pkg/__pycache__/ ({PYCACHE})",
        ]
    )
    assert summarize_skipped(skipped) == [  # one line per reason
        "4 entries (version-control folder): .git/, .hg/, .svn/ and 1 more",
        "3 folders (virtual environment): .venv/, env-3.11/, venv/",
        "1 folder (Python bytecode cache): pkg/__pycache__/",
        "1 folder (npm packages): web/node_modules/",
    ]


def test_a_topk_cache_in_the_folder_is_not_read_back(tmp_path):
    docs = write_tree(
        tmp_path / "docs",
        {
            "notes.md": "# Notes\n",
            "cache/manifest.json": '{"format": "topk"}\n',
            "cache/kv/keys.000.bin": b"\x00" * 64,
            ".cache2.partial/kv/keys.000.bin": b"\x00" * 64,
            ".cache2.partial/checkpoint.json": "{}\n",
        },
    )
    found, skipped = collect_documents(docs)
    assert names(found) == ["notes.md"]
    assert sorted(skipped) == [f".cache2.partial/ ({TOPK_CACHE})", f"cache/ ({TOPK_CACHE})"]


# ---- .gitignore -----------------------------------------------------------------------------------------
def ignored_tree(root: Path) -> Path:
    return write_tree(
        root,
        {
            ".gitignore": "*.log\nbuild/\n/only_top.txt\n",
            "keep.txt": "kept\n",
            "run.log": "log line\n",
            "only_top.txt": "top\n",
            "build/out.txt": "built\n",
            "sub/.gitignore": "secret.txt\n!important.log\n/local.txt\n",
            "sub/secret.txt": "s\n",
            "sub/important.log": "re-included by the nested file\n",
            "sub/debug.log": "d\n",
            "sub/local.txt": "anchored to sub/\n",
            "sub/only_top.txt": "not anchored here\n",
            "sub/deeper/local.txt": "l\n",
            "other/secret.txt": "the nested file does not reach here\n",
        },
    )


def test_gitignore_files_are_honoured_nested_ones_from_their_own_folder(tmp_path):
    docs = ignored_tree(tmp_path / "docs")
    found, skipped = collect_documents(docs)
    assert names(found) == [
        "keep.txt",
        "other/secret.txt",
        "sub/deeper/local.txt",
        "sub/important.log",
        "sub/only_top.txt",
    ]
    assert sorted(skipped) == sorted(
        [
            f"{n} ({GITIGNORED})"
            for n in ["build/", "only_top.txt", "run.log", "sub/debug.log", "sub/local.txt", "sub/secret.txt"]
        ]
        + [f"{n} ({HIDDEN})" for n in [".gitignore", "sub/.gitignore"]]
    )


# ---- --include / --exclude ------------------------------------------------------------------------------
def test_include_beats_the_default_skips_and_gitignore(tmp_path):
    docs = ignored_tree(default_tree(tmp_path / "docs"))
    found, skipped = collect_documents(docs, include=[".venv", "*.log", "build/"])
    got = names(found)
    assert {".venv/lib/mod.py", ".venv/pyvenv.cfg", "run.log", "sub/debug.log", "build/out.txt"} <= set(got)
    assert "venv/lib/m.py" not in got and f"venv/ ({VENV})" in skipped  # only what an include names
    assert got == sorted(got, key=lambda n: Path(n))  # still in path order


def test_an_include_naming_a_path_under_a_skipped_folder_reads_only_that(tmp_path):
    docs = default_tree(tmp_path / "docs")
    found, skipped = collect_documents(docs, include=["env-3.11/lib/*.py"])
    assert "env-3.11/lib/site.py" in names(found)
    assert f"env-3.11/pyvenv.cfg ({VENV})" in skipped  # the folder's other entries stay skipped
    found, _ = collect_documents(docs, include=["*.py"])  # unanchored: does not enter folders
    assert not any(n.startswith((".venv/", "venv/", "env-3.11/")) for n in names(found))


def test_exclude_always_wins(tmp_path):
    docs = ignored_tree(default_tree(tmp_path / "docs"))
    found, skipped = collect_documents(docs, include=["*.log", ".venv"], exclude=["*.log", "sub/", "*.md"])
    got = names(found)
    assert not any(n.endswith((".log", ".md")) or n.startswith("sub/") for n in got)
    assert ".venv/lib/mod.py" in got
    assert f"sub/ ({EXCLUDED})" in skipped and f"run.log ({EXCLUDED})" in skipped
    assert f"README.md ({EXCLUDED})" in skipped


def test_a_bad_pattern_is_one_clear_error(tmp_path):
    docs = write_tree(tmp_path / "docs", {"a.txt": "a\n"})
    with pytest.raises(TopkError, match=r"--exclude '!' is not a valid pattern"):
        collect_documents(docs, exclude=["!"])


def test_an_unparseable_gitignore_line_is_dropped_as_git_drops_it(tmp_path):
    docs = write_tree(tmp_path / "docs", {".gitignore": "[z-a]\n*.log\n", "a.txt": "a\n", "b.log": "b\n"})
    found, skipped = collect_documents(docs)
    assert names(found) == ["a.txt"] and sorted(skipped) == [f".gitignore ({HIDDEN})", f"b.log ({GITIGNORED})"]


# ---- the CLI and the Python API -------------------------------------------------------------------------
def test_prefill_cli_reads_a_project_and_reports_skips_once_per_reason(model_factory, tmp_path):
    docs = ignored_tree(default_tree(tmp_path / "docs"))
    (docs / "img.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    out = tmp_path / "c"
    result = topk(
        "prefill",
        docs,
        "--out",
        out,
        "--model",
        model_factory("llama_gqa"),
        "--device",
        "cpu",
        "--include",
        "build/",
        "--exclude",
        "sub/",
        "--exclude",
        "*.js",
    )
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: skipped")]
    reasons = [w.split("(", 1)[1].split(")", 1)[0] for w in warnings]
    assert sorted(reasons) == sorted([VCS, VENV, NODE_MODULES, PYCACHE, GITIGNORED, EXCLUDED, BINARY, HIDDEN])
    assert "warning: skipped 2 entries (matched by --exclude): sub/, web/app.js" in warnings
    manifest = json.loads((out / "manifest.json").read_text())
    got = [d["name"] for d in manifest["documents"]]
    assert got == ["README.md", "app.py", "build/out.txt", "keep.txt", "other/secret.txt", "pkg/mod.py", "wt/code.py"]


def test_prefill_cli_refuses_a_bad_pattern_before_the_model_loads(tmp_path):
    docs = write_tree(tmp_path / "docs", {"a.txt": "a\n"})
    result = topk("prefill", docs, "--out", tmp_path / "c", "--model", tmp_path / "no-model", "--include", "\\")
    assert result.exit_code != 0
    assert result.stderr.strip().splitlines() == [
        "error: --include '\\\\' is not a valid pattern (Invalid git pattern: '\\\\')"
    ]
    assert not (tmp_path / "c").exists()


def test_kvstore_build_applies_the_same_rules(model_factory, tmp_path):
    from topk_decode.api import KVStore

    docs = ignored_tree(default_tree(tmp_path / "docs"))
    store = KVStore.build(
        docs,
        tmp_path / "c",
        model_factory("llama_gqa"),
        device="cpu",
        include=["*.log"],
        exclude=["sub/", ".gitignore"],
        strategy="flat",
        compile=False,
    )
    assert [d["name"] for d in store.documents] == [
        "README.md",
        "app.py",
        "keep.txt",
        "other/secret.txt",
        "pkg/mod.py",
        "run.log",
        "web/app.js",
        "wt/code.py",
    ]


# ---- rich formats (item 2): PDF and DOCX with the [docs] extra, HTML always --------------------------------
def minimal_pdf(pages: list[str]) -> bytes:
    """A small valid PDF: one Helvetica text line per page; an empty string makes a page with no text layer."""
    n = len(pages)
    objs = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [" + b" ".join(b"%d 0 R" % (4 + 2 * i) for i in range(n)) + b"] /Count %d >>" % n,
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    for i, text in enumerate(pages):
        stream = b"BT /F1 12 Tf 72 720 Td (%s) Tj ET" % text.encode("latin-1") if text else b""
        objs.append(
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >> "
            b"/Contents %d 0 R >>" % (5 + 2 * i)
        )
        objs.append(b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream))
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, obj in enumerate(objs, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (i, obj)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objs) + 1, xref)
    return bytes(out)


def test_html_is_read_as_its_visible_text(tmp_path):
    docs = write_tree(
        tmp_path / "docs",
        {
            "page.html": (
                "<html><head><title>Harbour</title><style>p {color: red}</style><script>var x = 1;</script></head>"
                "<body><h1>Kelorn &amp; harbour</h1><p>The tide   turns at noon.</p><ul><li>one</li><li>two</li></ul>"
                "</body></html>"
            )
        },
    )
    found, skipped = collect_documents(docs)
    assert found[0].text == "Harbour\n\nKelorn & harbour\n\nThe tide turns at noon.\n\none\n\ntwo\n"
    assert skipped == []


def test_pdf_text_layer_is_read_page_by_page(tmp_path):
    pytest.importorskip("pypdf")
    docs = write_tree(
        tmp_path / "docs",
        {
            "report.pdf": minimal_pdf(["First page text", "Second page text"]),
            "scan.pdf": minimal_pdf(["", ""]),
            "broken.pdf": b"%PDF-1.4\nnot a pdf\n",
        },
    )
    found, skipped = collect_documents(docs)
    assert names(found) == ["report.pdf"]
    assert found[0].text == "[page 1]\nFirst page text\n\n[page 2]\nSecond page text\n"
    assert f"scan.pdf ({NO_TEXT_LAYER})" in skipped
    assert any(s.startswith("broken.pdf (unreadable PDF: ") for s in skipped)


def test_without_the_docs_extra_the_skip_reason_names_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pypdf", None)  # `import pypdf` now raises ImportError
    monkeypatch.setitem(sys.modules, "docx", None)
    docs = write_tree(tmp_path / "docs", {"a.pdf": minimal_pdf(["x"]), "b.docx": b"PK\x03\x04", "c.txt": "c\n"})
    found, skipped = collect_documents(docs)
    assert names(found) == ["c.txt"]
    assert skipped == [f"a.pdf (PDF: needs the docs extra, {EXTRA})", f"b.docx (DOCX: needs the docs extra, {EXTRA})"]
    assert summarize_skipped(skipped) == [
        f"1 file (PDF: needs the docs extra, {EXTRA}): a.pdf",
        f"1 file (DOCX: needs the docs extra, {EXTRA}): b.docx",
    ]


def test_docx_paragraphs_and_tables_are_read(tmp_path):
    docx = pytest.importorskip("docx")
    docs = tmp_path / "docs"
    docs.mkdir()
    d = docx.Document()
    d.add_paragraph("The ledger opens in spring.")
    table = d.add_table(rows=1, cols=2)
    table.rows[0].cells[0].text, table.rows[0].cells[1].text = "cod", "12"
    d.save(docs / "ledger.docx")
    found, _ = collect_documents(docs)
    assert found[0].text == "The ledger opens in spring.\ncod\t12\n"


def test_hidden_files_and_folders_are_skipped_unless_included(tmp_path):
    docs = write_tree(
        tmp_path / "docs",
        {
            "app.py": "x = 1\n",
            ".env": "API_KEY=secret\n",
            ".github/workflows/ci.yml": "on: push\n",
            ".gitignore": "build/\n",
        },
    )
    found, skipped = collect_documents(docs)
    assert names(found) == ["app.py"]
    assert sorted(skipped) == sorted([f".env ({HIDDEN})", f".github/ ({HIDDEN})", f".gitignore ({HIDDEN})"])
    found, _ = collect_documents(docs, include=[".env"])
    assert names(found) == [".env", "app.py"]
