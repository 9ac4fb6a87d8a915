"""Documents that are not plain text — PDF (text layer), DOCX, PPTX, XLSX, EPUB, HTML and Jupyter notebooks —
turned into the text the model reads, with the places (pages, slides, sheets, chapters, cells, headings)
where their parts start, for citing (`report.pdf p. 12`).

PDF, DOCX, PPTX and XLSX need the optional extra `pip install 'topk-decode[docs]'` (pyproject.toml names
each library and why). HTML, EPUB and notebooks need nothing: the standard library's html.parser drops
markup, scripts and styles; an EPUB is a zip of XHTML pages in the order its OPF spine lists
(zipfile + xml.etree read it); a notebook is JSON.
"""

from __future__ import annotations

import html.parser
import json
import posixpath
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import BinaryIO
from xml.etree import ElementTree

EXTRA = "pip install 'topk-decode[docs]'"
NO_TEXT_LAYER = "PDF without a text layer (scanned?)"


class NotReadable(Exception):
    """A rich document that yields no text; the message is the reason shown in the skip summary."""


@dataclass
class Extracted:
    """A converted document: its text, and where its places start (character offset into `text`, label)."""

    text: str
    places: list[tuple[int, str]] = field(default_factory=list)


def sections(parts: list[tuple[str, str, str]]) -> Extracted:
    """Join (marker line, label, body) parts: each non-empty body after its marker line, a place at the marker.

    The marker (`[page 3]`, `[slide 2]` ...) stays in the text so the model can cite it too.
    """
    text, places = "", []
    for marker, label, body in parts:
        if not body.strip():
            continue
        body = body.rstrip().lstrip("\n")  # leading blanks may be layout (a sheet's empty first column)
        if text:
            text += "\n\n"
        places.append((len(text), label))
        text += f"{marker}\n{body}"
    return Extracted(text + "\n" if text else "", places)


def needs_extra(kind: str, module: str):
    """Import an optional library of the docs extra, or NotReadable naming the extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise NotReadable(f"{kind}: needs the docs extra, {EXTRA}") from None


def read_pdf(f: BinaryIO) -> Extracted:
    """A PDF's text layer, page by page, each page after a `[page N]` line (a place "p. N")."""
    pypdf = needs_extra("PDF", "pypdf")
    try:
        pages = [page.extract_text() or "" for page in pypdf.PdfReader(f).pages]
    except Exception as e:  # pypdf raises many kinds on a damaged file; any of them means "not read"
        raise NotReadable(f"unreadable PDF: {type(e).__name__}") from None
    if not any(p.strip() for p in pages):
        raise NotReadable(NO_TEXT_LAYER)
    return sections([(f"[page {i}]", f"p. {i}", p.strip()) for i, p in enumerate(pages, 1)])


def read_docx(f: BinaryIO) -> Extracted:
    """A Word document's paragraphs, then its tables (cells separated by tabs, one row a line);
    each heading (a Heading or Title style) is a place "§ heading"."""
    docx = needs_extra("DOCX", "docx")
    try:
        d = docx.Document(f)
    except Exception as e:  # a damaged or mislabelled file (python-docx raises zip, XML and its own errors)
        raise NotReadable(f"unreadable DOCX: {type(e).__name__}") from None
    text, places = "", []
    for p in d.paragraphs:
        style = (p.style.name if p.style is not None else "") or ""
        if p.text.strip() and style.startswith(("Heading", "Title")):
            places.append((len(text), "§ " + short(p.text)))
        text += p.text + "\n"
    for table in d.tables:
        text += "".join("\t".join(cell.text for cell in row.cells) + "\n" for row in table.rows)
    return Extracted(text, places)


def short(title: str, limit: int = 40) -> str:
    """A heading as a place label: one line, at most `limit` characters."""
    title = " ".join(title.split())
    return title if len(title) <= limit else title[: limit - 1] + "…"


def shape_text(shape) -> list[str]:
    """The text of one slide shape: its text frame, its table's rows (tab-separated), a group's members."""
    lines = []
    if getattr(shape, "has_text_frame", False) and shape.has_text_frame:
        lines += [p.text for p in shape.text_frame.paragraphs if p.text.strip()]
    if getattr(shape, "has_table", False) and shape.has_table:
        lines += ["\t".join(cell.text for cell in row.cells) for row in shape.table.rows]
    for member in getattr(shape, "shapes", ()):  # a group shape
        lines += shape_text(member)
    return lines


def read_pptx(f: BinaryIO) -> Extracted:
    """A PowerPoint deck slide by slide (text boxes, tables, grouped shapes, then the speaker notes),
    each slide after a `[slide N]` line (a place "slide N")."""
    pptx = needs_extra("PPTX", "pptx")
    try:
        deck = pptx.Presentation(f)
        parts = []
        for i, slide in enumerate(deck.slides, 1):
            lines = [line for shape in slide.shapes for line in shape_text(shape)]
            if slide.has_notes_slide and slide.notes_slide.notes_text_frame is not None:
                notes = slide.notes_slide.notes_text_frame.text.strip()
                if notes:
                    lines.append(f"Notes: {notes}")
            parts.append((f"[slide {i}]", f"slide {i}", "\n".join(lines)))
    except Exception as e:  # a damaged or mislabelled file: zip, XML and python-pptx's own errors
        raise NotReadable(f"unreadable PPTX: {type(e).__name__}") from None
    return sections(parts)


def cell_text(value) -> str:
    """A spreadsheet value as text (None: empty; a whole float without its `.0`)."""
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def read_xlsx(f: BinaryIO) -> Extracted:
    """An Excel workbook sheet by sheet, one row a line, cells separated by tabs (the values Excel last
    computed, not formulas); empty rows dropped; each sheet after a `[sheet NAME]` line (a place "sheet NAME")."""
    openpyxl = needs_extra("XLSX", "openpyxl")
    try:
        book = openpyxl.load_workbook(f, read_only=True, data_only=True)
        parts = []
        for sheet in book.worksheets:
            rows = []
            for row in sheet.iter_rows(values_only=True):
                cells = [cell_text(v) for v in row]
                while cells and not cells[-1]:
                    cells.pop()
                if cells:
                    rows.append("\t".join(cells))
            parts.append((f"[sheet {sheet.title}]", f"sheet {sheet.title}", "\n".join(rows)))
        book.close()
    except Exception as e:  # a damaged or mislabelled file: zip, XML and openpyxl's own errors
        raise NotReadable(f"unreadable XLSX: {type(e).__name__}") from None
    return sections(parts)


def xml_children(elem, local: str) -> list:
    """Children (any depth) of an XML element with this local name, whatever their namespace."""
    return [e for e in elem.iter() if e.tag.rsplit("}", 1)[-1] == local]


def read_epub(f: BinaryIO) -> Extracted:
    """An EPUB book: its XHTML pages in reading order (the OPF spine), as visible text, each after a
    `[chapter N]` line (a place "ch. N", N counting the spine pages that hold text)."""
    try:
        with zipfile.ZipFile(f) as z:
            container = ElementTree.fromstring(z.read("META-INF/container.xml"))
            opf_path = xml_children(container, "rootfile")[0].get("full-path")
            opf = ElementTree.fromstring(z.read(opf_path))
            base = posixpath.dirname(opf_path)
            items = {i.get("id"): i for i in xml_children(opf, "item")}
            pages = []
            for ref in xml_children(opf, "itemref"):
                item = items.get(ref.get("idref"))
                if item is None or "html" not in (item.get("media-type") or ""):
                    continue
                name = posixpath.normpath(posixpath.join(base, item.get("href")))
                pages.append(html_text(z.read(name).decode("utf-8", "replace"), title=False))
    except Exception as e:  # not a zip, no container or OPF, a missing page: the book is not readable
        raise NotReadable(f"unreadable EPUB: {type(e).__name__}") from None
    pages = [p for p in pages if p.strip()]
    return sections([(f"[chapter {i}]", f"ch. {i}", p) for i, p in enumerate(pages, 1)])


def read_ipynb(text: str) -> Extracted:
    """A Jupyter notebook (JSON): markdown cells as they are, code cells in a fenced block followed by
    their text outputs; each cell after a `[cell N]` line (a place "cell N")."""
    try:
        nb = json.loads(text)
        cells = nb["cells"]
        meta = nb.get("metadata") or {}
        lang = (meta.get("language_info") or {}).get("name") or (meta.get("kernelspec") or {}).get("language") or ""
        parts = []
        for i, cell in enumerate(cells, 1):
            src = joined(cell.get("source", ""))
            body = src
            if cell.get("cell_type") == "code" and src.strip():
                body = f"```{lang}\n{src.rstrip()}\n```"
                outs = [
                    joined(o.get("text", ""))
                    if o.get("output_type") == "stream"
                    else joined((o.get("data") or {}).get("text/plain", ""))
                    for o in cell.get("outputs", [])
                ]
                outs = [o.rstrip() for o in outs if o.strip()]
                if outs:
                    body += "\nOutput:\n" + "\n".join(outs)
            parts.append((f"[cell {i}]", f"cell {i}", body))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise NotReadable(f"unreadable notebook: {type(e).__name__}") from None
    return sections(parts)


def joined(source) -> str:
    """A notebook field that is a string or a list of strings (nbformat allows both), as one string."""
    return "".join(source) if isinstance(source, list) else str(source)


class _Text(html.parser.HTMLParser):
    """Collects an HTML page's visible text; block elements end lines, script/style/head are dropped."""

    BLOCKS = {
        "p",
        "div",
        "br",
        "li",
        "tr",
        "h1",
        "h2",
        "h3",
        "h4",
        "h5",
        "h6",
        "pre",
        "section",
        "article",
        "table",
        "ul",
        "ol",
        "blockquote",
        "header",
        "footer",
        "title",
        "dt",
        "dd",
        "hr",
    }
    HIDDEN = {"script", "style", "template", "noscript"}

    def __init__(self, title: bool = True) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.hidden = 0
        self.HIDDEN = self.HIDDEN if title else self.HIDDEN | {"title"}

    def handle_starttag(self, tag, attrs):
        if tag in self.HIDDEN:
            self.hidden += 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in self.HIDDEN:
            self.hidden = max(0, self.hidden - 1)
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self.hidden:
            self.parts.append(data)


def html_text(markup: str, title: bool = True) -> str:
    """The visible text of an HTML page: tags, scripts and styles dropped, blank runs collapsed; its
    <title> first unless `title` is False (an EPUB repeats the book's title on every page)."""
    parser = _Text(title)
    parser.feed(markup)
    parser.close()
    lines = [" ".join(line.split()) for line in "".join(parser.parts).splitlines()]
    out: list[str] = []
    for line in lines:
        if line or (out and out[-1]):
            out.append(line)
    return "\n".join(out).strip() + "\n"


# suffix → reader of the open binary file
BINARY_FORMATS: dict[str, Callable[[BinaryIO], Extracted]] = {
    ".pdf": read_pdf,
    ".docx": read_docx,
    ".pptx": read_pptx,
    ".xlsx": read_xlsx,
    ".epub": read_epub,
}
# suffix → converter of a file first read as UTF-8 text (so a binary file by that name is still turned away)
TEXT_FORMATS: dict[str, Callable[[str], Extracted]] = {
    ".html": lambda t: Extracted(html_text(t)),
    ".htm": lambda t: Extracted(html_text(t)),
    ".xhtml": lambda t: Extracted(html_text(t)),
    ".ipynb": read_ipynb,
}
HTML_SUFFIXES = (".html", ".htm", ".xhtml")
