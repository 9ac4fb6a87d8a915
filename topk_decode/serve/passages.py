"""Where in a document an answer drew from, and that passage's text: the web page's sources you can open.

`PassageTracker` is the server's `SourceTracker` (decode/sources.py): the same shares per document, and beside them
each context token's share of the same retrieved attention mass (the same softmax over the same selections, last
quarter of the layers). Each source then carries `span`, the window of `PASSAGE_TOKENS` context tokens of its
document (of its place, when one is named) that drew the most mass. `passage` reads a bounded span of a cache's
document text around such a span, for GET /v1/passage.
"""

from __future__ import annotations

import torch

from topk_decode.decode.sources import SourceTracker
from topk_decode.serve.schemas import APIError

PASSAGE_TOKENS = 48  # the window a source's `span` covers: a sentence or two
AROUND_TOKENS = 192  # GET /v1/passage: context tokens shown on each side of the span by default
MAX_AROUND = 1024  # ... and at most
MAX_SPAN = 1024  # the longest span a passage request may name


class PassageTracker(SourceTracker):
    """A SourceTracker that also keeps each context token's retrieved mass, to name the passage of each source.

    Args:
        documents: the cache's document table.
        scale, group_size, n_layers: as SourceTracker's.
        n_tokens: the context's length (the per-token mass: 4 bytes a token, per answer in progress).
    """

    def __init__(self, documents: list[dict], scale: float, group_size: int, n_layers: int, n_tokens: int) -> None:
        super().__init__(documents, scale, group_size, n_layers)
        self.documents = documents
        self.index = {}
        for i, d in enumerate(documents):
            self.index.setdefault(d["name"], i)
        self.token_mass = torch.zeros(n_tokens, dtype=torch.float32)

    def reset(self) -> None:
        super().reset()
        self.token_mass.zero_()

    def __call__(self, layer: int, q: torch.Tensor, sel, conv) -> None:
        super().__call__(layer, q, sel, conv)
        if layer < self.first_layer:
            return
        hkv, n_q, k = sel.ids.shape
        t = n_q // self.group_size
        ids = sel.ids.view(hkv, self.group_size, t, k)[:, :, -1]  # the step's last position, as the shares
        scores = sel.scores.view(hkv, self.group_size, t, k)[:, :, -1].float()
        valid = ids >= 0
        if not bool(valid.any()):
            return
        w = torch.softmax(torch.where(valid, scores * self.scale, float("-inf")), dim=-1)
        w = torch.nan_to_num(w, nan=0.0)
        valid &= ids < self.token_mass.numel()
        self.token_mass.index_add_(0, ids[valid].reshape(-1).long(), w[valid].reshape(-1))

    def sources(self, min_weight: float = 0.01) -> list[dict]:
        """SourceTracker's sources, each with "span": [start, end), the context tokens of its passage."""
        out = super().sources(min_weight)
        for s in out:
            s["span"] = list(self.hot_span(self.documents[self.index[s["document"]]], s.get("place")))
        return out

    def hot_span(self, doc: dict, place: str | None) -> tuple[int, int]:
        """The PASSAGE_TOKENS-token window of `doc` (of its place `place`, if named) holding the most mass."""
        start, end = doc["start"], doc["end"]
        if place is not None:
            places = doc.get("places", [])
            for i, p in enumerate(places):
                if p["label"] == place and start <= p["start"] < end:
                    start = p["start"]
                    end = min([end] + [q["start"] for q in places[i + 1 :] if q["start"] > start])
                    break
        if end - start <= PASSAGE_TOKENS:
            return start, end
        sums = torch.cumsum(torch.cat([torch.zeros(1), self.token_mass[start:end].double()]), 0)
        windows = sums[PASSAGE_TOKENS:] - sums[:-PASSAGE_TOKENS]  # windows[i]: tokens start+i .. start+i+W
        best = int(torch.argmax(windows))
        return start + best, start + best + PASSAGE_TOKENS


def passage(store, tokenizer, document: str, start: int | None, end: int | None, around: int) -> dict:
    """A bounded span of a cache's document text, with the text around it (APIError on bad input).

    Args:
        store: the KVStore.
        tokenizer: a tokenizer of the store's model (decodes the context's tokens).
        document: the document's name, as the document table (and the sources) spell it.
        start, end: the span's context token positions [start, end), inside the document (a source's `span`);
            None: the document's first PASSAGE_TOKENS tokens.
        around: context tokens shown on each side of the span, cut at the document's ends.
    """
    doc = next((d for d in store.documents if d["name"] == document), None)
    if doc is None:
        raise APIError(404, f"the document {document!r} is not in this cache", param="document", code="not_found")
    lo, hi = doc["start"], doc["end"]
    start = lo if start is None else start
    end = min(hi, start + PASSAGE_TOKENS) if end is None else end
    if not lo <= start < end <= hi:
        raise APIError(
            400,
            f"start and end must satisfy {lo} <= start < end <= {hi} (the document's tokens), got {start} and {end}",
            param="start",
        )
    if end - start > MAX_SPAN:
        raise APIError(400, f"a passage spans at most {MAX_SPAN} tokens, got {end - start}", param="end")
    ids = store.context_ids
    before, after = max(lo, start - around), min(hi, end + around)

    def text(a: int, b: int) -> str:
        return tokenizer.decode(list(ids[a:b])) if b > a else ""

    place = None
    for p in doc.get("places", []):
        if p["start"] <= start:
            place = p["label"]
    return {
        "object": "passage",
        "document": document,
        "place": place,
        "start": start,
        "end": end,
        "before": text(before, start).lstrip("\ufffd"),
        "text": text(start, end),
        "after": text(end, after).rstrip("\ufffd"),
        "document_start": before == lo,
        "document_end": after == hi,
    }
