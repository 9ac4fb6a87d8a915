"""Sources with places (issue 29, item 3): the document table records where a document's pages, slides, sheets
... start (token positions), the source tracker names the place that drew the most attention (`report.pdf p. 2`),
and caches written before places existed still open and answer with sources."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.test_documents import minimal_pdf
from topk_decode.decode.sources import SourceTracker, citation
from topk_decode.errors import TopkError
from topk_decode.index import Selection
from topk_decode.prefill.documents import Document, layout_context, place_tokens
from topk_decode.store.manifest import CHECKSUM_FIELD, manifest_checksum, validate_manifest


def tokenizer_of(model_dir: Path):
    from topk_decode.model.loading import load_tokenizer

    return load_tokenizer(model_dir)


PAGES = "[page 1]\nThe harbour opens at dawn.\n\n[page 2]\nThe amber fox hides under the pier.\n"


def pdf_like() -> Document:
    return Document("report.pdf", PAGES, [(0, "p. 1"), (PAGES.index("[page 2]"), "p. 2")])


def test_places_are_the_token_positions_where_their_markers_start(model_factory):
    tok = tokenizer_of(model_factory("llama_gqa"))
    layout = layout_context([Document("a.txt", "alpha beta\n"), pdf_like()], tok)
    a, report = layout.documents
    assert "places" not in a  # a plain text file has none
    assert [p["label"] for p in report["places"]] == ["p. 1", "p. 2"]
    for place, marker in zip(report["places"], ["[page 1]", "[page 2]"]):
        assert report["start"] < place["start"] < report["end"]
        text = tok.decode(layout.ids[place["start"] : report["end"]])
        before = tok.decode(layout.ids[report["start"] : place["start"]])
        assert text.lstrip().startswith(marker) and marker not in before


def test_a_tokenizer_without_offsets_counts_the_tokens_before_each_place(model_factory):
    tok = tokenizer_of(model_factory("llama_gqa"))

    class Slow:  # the same tokenizer, without the fast tokenizers' offset mapping
        is_fast = False

        def __call__(self, text, **kw):
            return tok(text, **kw)

    text = "### Document: report.pdf\n\n" + PAGES
    chars = [text.index("[page 1]"), text.index("[page 2]")]
    assert place_tokens(Slow(), text, chars) == place_tokens(tok, text, chars)


def test_the_manifest_records_places_and_refuses_malformed_ones(model_factory, tmp_path):
    pytest.importorskip("pypdf")
    from topk_decode.prefill.build import build_cache

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "notes.txt").write_text("The ledger opens in spring.\n")
    (docs / "report.pdf").write_bytes(minimal_pdf(["The harbour opens at dawn", "The amber fox hides"]))
    build_cache(docs, tmp_path / "c", model_factory("llama_gqa"), device="cpu")
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    notes, report = manifest["documents"]
    assert "places" not in notes and [p["label"] for p in report["places"]] == ["p. 1", "p. 2"]
    report["places"][0]["start"] = "12"
    manifest[CHECKSUM_FIELD] = manifest_checksum(manifest)
    with pytest.raises(TopkError, match="places of document 'report.pdf' must be a list of {label, start}"):
        validate_manifest(manifest, tmp_path / "c" / "manifest.json")


def selection(ids, scores) -> Selection:
    return Selection(torch.tensor(ids, dtype=torch.int64), torch.tensor(scores, dtype=torch.float32))


def test_the_tracker_names_the_place_that_drew_the_most_mass():
    docs = [
        {"name": "a.txt", "start": 1, "end": 10},
        {
            "name": "report.pdf",
            "start": 10,
            "end": 40,
            "places": [{"label": "p. 1", "start": 14}, {"label": "p. 2", "start": 25}],
        },
        {"name": "deck.pptx", "start": 40, "end": 50, "places": [{"label": "slide 1", "start": 40}]},
    ]
    tr = SourceTracker(docs, scale=1.0, group_size=1, n_layers=4)
    q = torch.zeros(1, 1, 4)
    # report.pdf: its header (12), page 1 (20) and page 2 (30, 31: the most); deck.pptx at its own start
    tr(3, q, selection([[[12, 20, 30, 31, 42, 5]]], [[[1.0, 1.0, 2.0, 2.0, 1.5, 0.0]]]), None)
    src = {s["document"]: s for s in tr.sources(min_weight=0.0)}
    assert src["report.pdf"]["place"] == "p. 2" and src["deck.pptx"]["place"] == "slide 1"
    assert "place" not in src["a.txt"]
    assert abs(sum(s["weight"] for s in src.values()) - 1) < 1e-3
    assert [citation(s) for s in tr.sources(min_weight=0.0)][:2] == ["report.pdf p. 2", "deck.pptx slide 1"]


def test_a_folder_of_pdf_code_html_and_docx_prefills_and_sources_name_the_pdf_page(tmp_path):
    pytest.importorskip("pypdf")
    docx = pytest.importorskip("docx")
    from topk_decode.api import KVStore
    from topk_decode.demo import DEMO_MODEL_DIR

    docs = tmp_path / "docs"
    docs.mkdir()
    d = docx.Document()
    d.add_heading("Ledger", level=1)
    d.add_paragraph("The ledger opens in spring.")
    d.save(docs / "ledger.docx")
    (docs / "page.html").write_text("<html><body><h1>Harbour</h1><p>Boats leave at dawn.</p></body></html>")
    # the code file comes after the PDF and is longer than the exact window's tail (n_tail=64), so the PDF's
    # tokens are reached through retrieval, where sources are counted
    (docs / "tool.py").write_text("def main():\n    return sum(range(42))\n\n" * 20)
    filler = "The tide turns at noon and the boats come home. " * 4
    (docs / "report.pdf").write_bytes(
        minimal_pdf(
            [
                filler + "The harbour master is called Idris Vale.",
                filler + "The special magic number for amber-fox is 482.",
            ]
        )
    )
    store = KVStore.build(docs, tmp_path / "c", DEMO_MODEL_DIR, device="cpu", strategy="flat", compile=False)
    _, sources = store.ask("What is the special magic number for amber-fox?", max_new_tokens=12, return_sources=True)
    assert [d["name"] for d in store.documents] == ["ledger.docx", "page.html", "report.pdf", "tool.py"]
    by_doc = {s["document"]: s for s in sources}
    assert by_doc["report.pdf"]["place"] in ("p. 1", "p. 2")
    assert citation(by_doc["report.pdf"]) == f"report.pdf {by_doc['report.pdf']['place']}"


def test_a_cache_written_before_places_still_opens_and_answers_with_sources(built_cache, tmp_path):
    import shutil

    from topk_decode.api import KVStore

    cache, _ = built_cache
    old = tmp_path / "old"
    shutil.copytree(cache, old)
    manifest = json.loads((old / "manifest.json").read_text())
    assert all("places" not in d for d in manifest["documents"])  # text files: the table as older versions wrote it
    store = KVStore.open(old, k=32, device="cpu", strategy="flat", compile=False)
    _, sources = store.ask("what is in the notes?", max_new_tokens=4, return_sources=True)
    assert sources and all("place" not in s for s in sources)
