"""Prefill → disk → open returns exactly the KV an HF forward computes."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from topk_decode.prefill.build import build_cache
from topk_decode.prefill.documents import collect_documents, layout_context, prompt_format
from topk_decode.store import open_cache


def _hf_kv(model_dir, ids):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    return [(layer.keys[0], layer.values[0]) for layer in out.past_key_values.layers]


@pytest.mark.parametrize("chunk_size", [1000, 64, 37])  # one chunk; divides nothing; small odd chunks
def test_round_trip_kv_equals_hf_forward(tmp_path, model_factory, docs_dir, chunk_size):
    model_dir = model_factory("qwen2")
    out = tmp_path / "cache"
    build_cache(docs_dir, out, model_dir, chunk_size=chunk_size, device="cpu")
    ckv = open_cache(out, verify=True)
    assert ckv.n_tokens % chunk_size != 0 or chunk_size >= ckv.n_tokens
    ref = _hf_kv(model_dir, ckv.tokens)
    assert len(ref) == ckv.n_layers
    for layer, (k, v) in enumerate(ref):
        torch.testing.assert_close(ckv.keys[layer], k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ckv.values[layer], v, rtol=1e-5, atol=1e-5)


def test_open_maps_files_instead_of_reading_them(built_cache, monkeypatch):
    """Opening must not read the KV files (a 1M-token cache is ~100 GiB): only numpy.memmap touches them."""
    import numpy as np

    cache, _ = built_cache
    read_paths = []
    real_fromfile = np.fromfile
    monkeypatch.setattr(np, "fromfile", lambda f, *a, **kw: read_paths.append(str(f)) or real_fromfile(f, *a, **kw))
    ckv = open_cache(cache, verify=False)
    assert all("/kv/" not in p for p in read_paths)
    assert isinstance(ckv.keys[0], torch.Tensor) and ckv.keys[0].shape[1] == ckv.n_tokens


def test_document_table_spans_the_context(built_cache):
    cache, _ = built_cache
    manifest = json.loads((cache / "manifest.json").read_text())
    docs = manifest["documents"]
    assert [d["name"] for d in docs] == ["alpha.txt", "gamma.txt", "notes/beta.md"]
    assert docs[0]["start"] >= 1 and docs[-1]["end"] == manifest["n_tokens"]
    assert all(a["end"] == b["start"] for a, b in zip(docs, docs[1:]))
    assert any("image.png" in s for s in manifest["skipped"])


def test_chat_template_prefix_is_cached_and_question_closes_the_turn(model_factory, docs_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_factory("llama_gqa", chat=True))
    fmt = prompt_format(tok)
    assert fmt.kind == "chat"
    layout = layout_context(collect_documents(docs_dir)[0], tok)
    text = tok.decode(layout.ids) + fmt.question_text("Why?", first_turn=True)
    whole = tok.apply_chat_template([{"role": "user", "content": text.split("<|user|>\n", 1)[1].split("<|end|>")[0]}],
                                    tokenize=False, add_generation_prompt=True)
    assert text == whole


def test_raw_tokenizer_gets_plain_question_format(tokenizer_dir):
    from transformers import AutoTokenizer

    fmt = prompt_format(AutoTokenizer.from_pretrained(tokenizer_dir))
    assert fmt.kind == "raw"
    assert fmt.question_text("Who?", first_turn=True) == "\nQuestion: Who?\nAnswer:"


def test_weight_offloaded_prefill_writes_the_same_kv(tmp_path, model_factory, docs_dir):
    """offload_weights (one decoder layer on the device at a time) must not change a single value."""
    model_dir = model_factory("llama_gqa")
    resident, offloaded = tmp_path / "resident", tmp_path / "offloaded"
    build_cache(docs_dir, resident, model_dir, chunk_size=50, device="cpu")
    build_cache(docs_dir, offloaded, model_dir, chunk_size=50, device="cpu", offload_weights=True)
    a, b = open_cache(resident, verify=True), open_cache(offloaded, verify=True)
    assert a.tokens == b.tokens
    for layer in range(a.n_layers):
        assert torch.equal(a.keys[layer], b.keys[layer])
        assert torch.equal(a.values[layer], b.values[layer])


def test_prefill_names_partial_directories_left_by_a_killed_prefill(tmp_path, model_factory, docs_dir):
    from topk_decode.errors import TopkWarning

    leftover = tmp_path / ".cache.partial-abc123"
    (leftover / "kv").mkdir(parents=True)
    (leftover / "kv" / "keys.000.bin").write_bytes(b"\0" * 4096)
    with pytest.warns(TopkWarning, match=r"\.cache\.partial-abc123 .*interrupted prefill"):
        build_cache(docs_dir, tmp_path / "cache", model_factory("llama_gqa"), device="cpu")
    assert leftover.exists()          # never deleted behind the user's back
    assert open_cache(tmp_path / "cache").n_tokens > 0
