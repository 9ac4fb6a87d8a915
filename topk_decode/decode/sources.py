"""Which documents an answer drew on: retrieved attention mass per document, from the decoder's own selections.

At every answer step and layer the strategy hands the decoder the context ids each query head attends
to with their exact scores. Softmax over those scores is that head's attention over what it retrieved;
summing it over heads, steps and the last quarter of the layers, per document of the cache's document
table, gives each document's share; where the table records places (a PDF's pages, a deck's slides ...),
the place inside the document that drew the most of that mass is named too (`report.pdf p. 12`). Early layers are left out: on the demo model they attend by
position (the most recent document) or almost uniformly whatever the question, while the last
layer's heads point at the document the answer copies from (docs/SERVE.md shows the measurement).
Only the retrieved context part counts: the exact window (attention sinks, the
last `n_tail` context tokens and the conversation itself) is left out, so a fact inside the last
`n_tail` tokens of the context is not credited to its document.
"""

from __future__ import annotations

import torch

from topk_decode.index import Selection


class SourceTracker:
    """A `Conversation.observer` that accumulates retrieved attention mass per document.

    Args:
        documents: the cache's document table ({"name", "start", "end"} token spans, in order).
        scale: the attention scale (head_dim ** -0.5); selection scores are unscaled q·k.
        group_size: query heads per KV head (G), to find the last query position of a step.
        n_layers: the model's layers; mass is counted in layers ≥ first_layer.
        first_layer: default n_layers - max(1, n_layers // 4), the last quarter.
    """

    def __init__(
        self, documents: list[dict], scale: float, group_size: int, n_layers: int, first_layer: int | None = None
    ) -> None:
        self.names = [d["name"] for d in documents]
        # Segments: each document from its start, cut at its places (pages, slides ...) where the table has them.
        starts, self.segment_doc, self.segment_label = [], [], []
        for i, d in enumerate(documents):
            starts.append(d["start"])
            self.segment_doc.append(i)
            self.segment_label.append(None)
            for place in d.get("places", []):
                if not d["start"] <= place["start"] < d["end"] or place["start"] < starts[-1]:
                    continue  # outside its document, or out of order: not a cut
                if place["start"] == starts[-1]:
                    self.segment_label[-1] = place["label"]
                else:
                    starts.append(place["start"])
                    self.segment_doc.append(i)
                    self.segment_label.append(place["label"])
        # bucket b of torch.bucketize(ids, starts, right=True) is segment b-1 (bucket 0: before the first)
        self.starts = torch.tensor(starts, dtype=torch.int64)
        self.scale = scale
        self.first_layer = n_layers - max(1, n_layers // 4) if first_layer is None else first_layer
        self.group_size = group_size
        self.mass = torch.zeros(len(starts) + 1, dtype=torch.float64)  # [0]: before the first document
        self.steps = 0

    def reset(self) -> None:
        """Forget what was accumulated (a new answer starts)."""
        self.mass.zero_()
        self.steps = 0

    def __call__(self, layer: int, q: torch.Tensor, sel: Selection, conv) -> None:
        """Observer signature: (layer, q (Hkv, G·T, D), selection, conversation)."""
        if layer == self.first_layer:
            self.steps += 1
        if layer < self.first_layer:
            return
        hkv, n_q, k = sel.ids.shape
        t = n_q // self.group_size
        # only the step's last position predicts an answer token (a prompt's earlier positions do not)
        ids = sel.ids.view(hkv, self.group_size, t, k)[:, :, -1]  # (Hkv, G, K)
        scores = sel.scores.view(hkv, self.group_size, t, k)[:, :, -1].float()  # (Hkv, G, K)
        valid = ids >= 0
        if not bool(valid.any()):
            return
        w = torch.softmax(torch.where(valid, scores * self.scale, float("-inf")), dim=-1)
        w = torch.nan_to_num(w, nan=0.0)  # a head with no valid slot has no retrieved mass
        bucket = torch.bucketize(ids.clamp_min(0).contiguous(), self.starts, right=True)  # (Hkv, G, K)
        self.mass.index_add_(0, bucket[valid].reshape(-1), w[valid].reshape(-1).double())

    def sources(self, min_weight: float = 0.01) -> list[dict]:
        """Documents by share of the retrieved attention mass, largest first: {"document", "weight"}, and
        "place" (e.g. "p. 12") where the document table records places: the one that drew the most mass.

        Args:
            min_weight: leave out documents below this share (shares are of all the mass, before that cut).
        """
        per_segment = self.mass[1:].tolist()
        total = sum(per_segment)
        if total <= 0:
            return []
        per_doc = [0.0] * len(self.names)
        best: dict[int, tuple[float, str]] = {}
        for m, doc, label in zip(per_segment, self.segment_doc, self.segment_label):
            per_doc[doc] += m
            if label is not None and m > 0 and m > best.get(doc, (0.0, ""))[0]:
                best[doc] = (m, label)
        out = []
        for i, (name, m) in enumerate(zip(self.names, per_doc)):
            if m / total >= min_weight:
                out.append({"document": name, "weight": round(m / total, 4)})
                if i in best:
                    out[-1]["place"] = best[i][1]
        return sorted(out, key=lambda s: -s["weight"])


def citation(source: dict) -> str:
    """A source as people cite it: `report.pdf p. 12`, or the document name alone."""
    return f"{source['document']} {source['place']}" if source.get("place") else source["document"]
