"""Documents that are not plain text: PDF (text layer), DOCX and HTML, turned into the text the model reads.

PDF and DOCX need the optional extra `pip install 'topk-decode[docs]'` (pypdf: pure Python and kept up;
python-docx); HTML needs nothing: the standard library's html.parser is enough to drop the markup,
scripts and styles and keep the text, so every install reads the HTML people save.
"""

from __future__ import annotations

import html.parser
from typing import BinaryIO, Callable

EXTRA = "pip install 'topk-decode[docs]'"
NO_TEXT_LAYER = "PDF without a text layer (scanned?)"


class NotReadable(Exception):
    """A rich document that yields no text; the message is the reason shown in the skip summary."""


def read_pdf(f: BinaryIO) -> str:
    """A PDF's text layer, page by page, each page after a `[page N]` line (for citing)."""
    try:
        import pypdf
    except ImportError:
        raise NotReadable(f"PDF: needs the docs extra, {EXTRA}") from None
    try:
        pages = [page.extract_text() or "" for page in pypdf.PdfReader(f).pages]
    except Exception as e:   # pypdf raises many kinds on a damaged file; any of them means "not read"
        raise NotReadable(f"unreadable PDF: {type(e).__name__}") from None
    if not any(p.strip() for p in pages):
        raise NotReadable(NO_TEXT_LAYER)
    return "\n\n".join(f"[page {i}]\n{p.strip()}" for i, p in enumerate(pages, 1) if p.strip()) + "\n"


def read_docx(f: BinaryIO) -> str:
    """A Word document's paragraphs, then its tables (cells separated by tabs, one row a line)."""
    try:
        import docx
    except ImportError:
        raise NotReadable(f"DOCX: needs the docs extra, {EXTRA}") from None
    try:
        d = docx.Document(f)
    except Exception as e:   # a damaged or mislabelled file (python-docx raises zip, XML and its own errors)
        raise NotReadable(f"unreadable DOCX: {type(e).__name__}") from None
    lines = [p.text for p in d.paragraphs]
    for table in d.tables:
        lines += ["\t".join(cell.text for cell in row.cells) for row in table.rows]
    return "\n".join(lines) + "\n"


class _Text(html.parser.HTMLParser):
    """Collects an HTML page's visible text; block elements end lines, script/style/head are dropped."""

    BLOCKS = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "section", "article",
              "table", "ul", "ol", "blockquote", "header", "footer", "title", "dt", "dd", "hr"}
    HIDDEN = {"script", "style", "template", "noscript"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.hidden = 0

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


def html_text(markup: str) -> str:
    """The visible text of an HTML page: tags, scripts and styles dropped, blank runs collapsed."""
    parser = _Text()
    parser.feed(markup)
    parser.close()
    lines = [" ".join(line.split()) for line in "".join(parser.parts).splitlines()]
    out: list[str] = []
    for line in lines:
        if line or (out and out[-1]):
            out.append(line)
    return "\n".join(out).strip() + "\n"


# suffix → reader of the open file (HTML is read as text first, then converted: see documents.py)
BINARY_FORMATS: dict[str, Callable[[BinaryIO], str]] = {".pdf": read_pdf, ".docx": read_docx}
HTML_SUFFIXES = (".html", ".htm", ".xhtml")
