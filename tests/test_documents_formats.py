"""Rich formats (issue 29, item 2): PPTX and XLSX through the docs extra, EPUB and Jupyter notebooks with the
standard library; each yields its text and its places (slides, sheets, chapters, cells). The fixtures are made
here: python-pptx and openpyxl write the office files, the EPUB is zipped by hand, the notebook is JSON."""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

import pytest

from topk_decode.prefill.documents import collect_documents, summarize_skipped
from topk_decode.prefill.formats import EXTRA


def only_document(folder: Path):
    docs, skipped = collect_documents(folder)
    assert len(docs) == 1, (docs, skipped)
    return docs[0], skipped


def labels_at(doc) -> list[tuple[str, str]]:
    """Each place's label with the text line it points at."""
    return [(label, doc.text[c:].split("\n", 1)[0]) for c, label in doc.places]


def make_pptx(path: Path) -> None:
    pptx = pytest.importorskip("pptx")
    from pptx.util import Inches

    deck = pptx.Presentation()
    s1 = deck.slides.add_slide(deck.slide_layouts[1])  # title and content
    s1.shapes.title.text = "Harbour report"
    s1.placeholders[1].text = "The tide turns at noon."
    s1.notes_slide.notes_text_frame.text = "Mention the amber fox."
    deck.slides.add_slide(deck.slide_layouts[6])  # blank: no text at all
    s3 = deck.slides.add_slide(deck.slide_layouts[6])
    table = s3.shapes.add_table(2, 2, Inches(1), Inches(1), Inches(4), Inches(1)).table
    for r, row in enumerate([("fish", "count"), ("cod", "12")]):
        for c, value in enumerate(row):
            table.cell(r, c).text = value
    deck.save(path)


def test_pptx_slides_tables_and_notes_are_read_with_a_place_per_slide(tmp_path):
    (tmp_path / "docs").mkdir()
    make_pptx(tmp_path / "docs" / "deck.pptx")
    doc, skipped = only_document(tmp_path / "docs")
    assert skipped == []
    assert doc.text == (
        "[slide 1]\nHarbour report\nThe tide turns at noon.\nNotes: Mention the amber fox.\n\n"
        "[slide 3]\nfish\tcount\ncod\t12\n"
    )
    assert labels_at(doc) == [("slide 1", "[slide 1]"), ("slide 3", "[slide 3]")]  # the empty slide 2: no place


def test_xlsx_sheets_are_read_row_by_row_with_a_place_per_sheet(tmp_path):
    openpyxl = pytest.importorskip("openpyxl")
    (tmp_path / "docs").mkdir()
    book = openpyxl.Workbook()
    ledger = book.active
    ledger.title = "Ledger"
    for row in [("fish", "count", None), ("cod", 12, None), (None, None, None), ("salt", 3.5, "kg")]:
        ledger.append(row)
    book.create_sheet("Empty")
    book.create_sheet("Notes")["B2"] = "opens in spring"
    book.save(tmp_path / "docs" / "book.xlsx")
    doc, _ = only_document(tmp_path / "docs")
    assert doc.text == "[sheet Ledger]\nfish\tcount\ncod\t12\nsalt\t3.5\tkg\n\n[sheet Notes]\n\topens in spring\n"
    assert [label for _, label in doc.places] == ["sheet Ledger", "sheet Notes"]


def make_epub(path: Path, chapters: list[str], spine_order: list[int]) -> None:
    """A minimal EPUB: container.xml → OEBPS/content.opf, whose spine lists the chapters in `spine_order`."""
    items = "".join(
        f'<item id="c{i}" href="text/ch{i}.xhtml" media-type="application/xhtml+xml"/>' for i in range(len(chapters))
    )
    spine = "".join(f'<itemref idref="c{i}"/>' for i in spine_order)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("mimetype", "application/epub+zip")
        z.writestr(
            "META-INF/container.xml",
            '<?xml version="1.0"?><container version="1.0" xmlns="urn:oasis:names:tc:opendocument:xmlns:'
            'container"><rootfiles><rootfile full-path="OEBPS/content.opf" media-type="application/oebps-'
            'package+xml"/></rootfiles></container>',
        )
        z.writestr(
            "OEBPS/content.opf",
            '<?xml version="1.0"?><package xmlns="http://www.idpf.org/2007/opf" version="3.0">'
            f'<manifest>{items}<item id="css" href="style.css" media-type="text/css"/></manifest>'
            f"<spine>{spine}</spine></package>",
        )
        z.writestr("OEBPS/style.css", "p { color: red }")
        for i, body in enumerate(chapters):
            z.writestr(
                f"OEBPS/text/ch{i}.xhtml",
                f'<html xmlns="http://www.w3.org/1999/xhtml"><head><title>t</title>'
                f"<style>p {{}}</style></head><body>{body}</body></html>",
            )


def test_epub_chapters_are_read_in_spine_order_without_a_library(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ebooklib", None)  # not used: zipfile + the HTML parser read it
    (tmp_path / "docs").mkdir()
    make_epub(
        tmp_path / "docs" / "book.epub",
        ["<h1>One</h1><p>The fox &amp; the tide.</p>", "<p>Second</p>", ""],
        spine_order=[1, 0, 2],
    )
    doc, _ = only_document(tmp_path / "docs")
    assert doc.text == "[chapter 1]\nSecond\n\n[chapter 2]\nOne\n\nThe fox & the tide.\n"  # no <title>, no empty page
    assert labels_at(doc) == [("ch. 1", "[chapter 1]"), ("ch. 2", "[chapter 2]")]


def test_a_damaged_epub_or_notebook_is_skipped_with_its_reason(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("a\n")
    with zipfile.ZipFile(docs / "noopf.epub", "w") as z:
        z.writestr("mimetype", "application/epub+zip")
    (docs / "bad.ipynb").write_text('{"cells": 3}')
    found, skipped = collect_documents(docs)
    assert [d.name for d in found] == ["a.txt"]
    assert sorted(skipped) == ["bad.ipynb (unreadable notebook: TypeError)", "noopf.epub (unreadable EPUB: KeyError)"]


def test_a_notebook_reads_markdown_code_and_text_outputs_with_a_place_per_cell(tmp_path):
    nb = {
        "nbformat": 4,
        "nbformat_minor": 5,
        "metadata": {"language_info": {"name": "python"}},
        "cells": [
            {"cell_type": "markdown", "metadata": {}, "source": ["# Catch\n", "Counted at dawn."]},
            {
                "cell_type": "code",
                "metadata": {},
                "execution_count": 1,
                "source": "n = 12\nprint(n)",
                "outputs": [
                    {"output_type": "stream", "name": "stdout", "text": ["12\n"]},
                    {
                        "output_type": "execute_result",
                        "execution_count": 1,
                        "metadata": {},
                        "data": {"text/plain": ["'cod'"], "image/png": "iVBORw0KGgo="},
                    },
                ],
            },
            {"cell_type": "code", "metadata": {}, "execution_count": None, "source": [], "outputs": []},
        ],
    }
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "catch.ipynb").write_text(json.dumps(nb))
    doc, _ = only_document(tmp_path / "docs")
    assert doc.text == (
        "[cell 1]\n# Catch\nCounted at dawn.\n\n[cell 2]\n```python\nn = 12\nprint(n)\n```\nOutput:\n12\n'cod'\n"
    )
    assert [label for _, label in doc.places] == ["cell 1", "cell 2"]


def test_docx_headings_are_places(tmp_path):
    docx = pytest.importorskip("docx")
    (tmp_path / "docs").mkdir()
    d = docx.Document()
    d.add_heading("Spring ledger", level=1)
    d.add_paragraph("The ledger opens in spring.")
    d.add_heading("Autumn", level=2)
    d.add_paragraph("It closes in autumn.")
    d.save(tmp_path / "docs" / "ledger.docx")
    doc, _ = only_document(tmp_path / "docs")
    assert labels_at(doc) == [("§ Spring ledger", "Spring ledger"), ("§ Autumn", "Autumn")]


def test_pdf_pages_are_places(tmp_path):
    pytest.importorskip("pypdf")
    from tests.test_documents import minimal_pdf

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "report.pdf").write_bytes(minimal_pdf(["First page", "", "Third page"]))
    doc, _ = only_document(tmp_path / "docs")
    assert labels_at(doc) == [("p. 1", "[page 1]"), ("p. 3", "[page 3]")]  # page 2 has no text: no place


def test_without_the_docs_extra_pptx_and_xlsx_name_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pptx", None)  # `import pptx` now raises ImportError
    monkeypatch.setitem(sys.modules, "openpyxl", None)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.pptx").write_bytes(b"PK\x03\x04")
    (docs / "b.xlsx").write_bytes(b"PK\x03\x04")
    (docs / "c.txt").write_text("c\n")
    found, skipped = collect_documents(docs)
    assert [d.name for d in found] == ["c.txt"]
    assert skipped == [f"a.pptx (PPTX: needs the docs extra, {EXTRA})", f"b.xlsx (XLSX: needs the docs extra, {EXTRA})"]
    assert summarize_skipped(skipped)[0] == f"1 file (PPTX: needs the docs extra, {EXTRA}): a.pptx"


def test_a_mislabelled_office_file_is_skipped_as_unreadable(tmp_path):
    pytest.importorskip("pptx")
    pytest.importorskip("openpyxl")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "fake.pptx").write_text("not a deck\n")
    (docs / "fake.xlsx").write_bytes(b"PK\x03\x04garbage")
    (docs / "ok.txt").write_text("ok\n")
    found, skipped = collect_documents(docs)
    assert [d.name for d in found] == ["ok.txt"]
    assert [s.split(" (")[1].split(":")[0] for s in sorted(skipped)] == ["unreadable PPTX", "unreadable XLSX"]
