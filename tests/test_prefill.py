"""Prefill → disk → open returns exactly the KV an HF forward computes."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from topk_decode.errors import TopkError
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
    whole = tok.apply_chat_template(
        [{"role": "user", "content": text.split("<|user|>\n", 1)[1].split("<|end|>")[0]}],
        tokenize=False,
        add_generation_prompt=True,
    )
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
    assert leftover.exists()  # never deleted behind the user's back
    assert open_cache(tmp_path / "cache").n_tokens > 0


# ---- the KV drain: on_layer in a worker thread, in layer order, its errors surfaced ----------------------
def _deep_model(n_layers: int = 5):
    """A tiny random Llama with more layers than the saved fixtures (layer order matters here)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(cfg).eval()


def _threaded(monkeypatch, piece_bytes: int = 1000) -> None:
    """Run the drain's worker thread on the CPU, with small pieces so a layer spans many of them."""
    from topk_decode.prefill import drain

    monkeypatch.setattr(drain.KVDrain, "threaded_on_cpu", True)
    monkeypatch.setattr(drain, "PIECE_BYTES", piece_bytes)


def test_copy_to_host_goes_piece_by_piece_through_two_buffers():
    from topk_decode.prefill.drain import copy_to_host

    a, b = torch.randn(3, 5, 7), torch.randn(2, 11)  # 105 and 22 elements: ragged pieces
    da, db = torch.empty_like(a), torch.empty_like(b)
    staging = [torch.full((13,), float("nan")) for _ in range(2)]
    copy_to_host([(a, da), (b, db)], staging, stream=None)
    assert torch.equal(da, a) and torch.equal(db, b)


def test_threaded_drain_calls_on_layer_in_order_with_owned_tensors(monkeypatch):
    import threading

    from topk_decode.prefill.layerwise import prefill_layers

    model, ids = _deep_model(), torch.randint(3, 97, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    ref: list = []
    ref_logits, _ = prefill_layers(
        model, ids, lambda layer, k, v: ref.append((layer, k.clone(), v.clone())), chunk_size=37
    )
    _threaded(monkeypatch)
    got: list = []
    logits, _ = prefill_layers(
        model, ids, lambda layer, k, v: got.append((layer, k, v, threading.current_thread())), chunk_size=37
    )
    assert [g[0] for g in got] == list(range(5))
    assert all(g[3] is not threading.main_thread() and g[3].name.startswith("kv-drain") for g in got)
    # kept without cloning: a tensor reused by a later layer (a staging buffer) would have changed
    for (_, k, v), (_, gk, gv, _) in zip(ref, got):
        assert torch.equal(gk, k) and torch.equal(gv, v)
    assert len({t.untyped_storage().data_ptr() for g in got for t in g[1:3]}) == 10
    assert torch.equal(logits, ref_logits)


def test_an_error_in_the_main_thread_waits_for_the_drain_in_flight(monkeypatch):
    """The caller (build_cache) deletes the partial cache on error: no on_layer may still be writing it."""
    import time

    from topk_decode.prefill.layerwise import prefill_layers

    _threaded(monkeypatch)
    finished: list[int] = []

    def slow_on_layer(layer, k, v):
        time.sleep(0.3)
        finished.append(layer)

    done = [0]

    def progress(n):  # fails in layer 1, while layer 0 drains
        done[0] += n
        if done[0] > 100:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        prefill_layers(_deep_model(), [3 + i % 90 for i in range(100)], slow_on_layer, chunk_size=30, progress=progress)
    assert finished == [0]


@pytest.mark.parametrize("threaded", [False, True], ids=["sync", "threaded"])
@pytest.mark.parametrize(
    "error", [OSError(28, "No space left on device"), KeyboardInterrupt()], ids=["disk-full", "ctrl-c"]
)
def test_an_error_in_on_layer_surfaces_and_leaves_no_cache(
    tmp_path, model_factory, docs_dir, monkeypatch, threaded, error
):
    from topk_decode.store.cache_dir import CacheWriter

    if threaded:
        _threaded(monkeypatch)
    handed: list[int] = []

    def failing_write_layer(self, layer, keys, values):
        handed.append(layer)
        raise error

    monkeypatch.setattr(CacheWriter, "write_layer", failing_write_layer)
    out = tmp_path / "caches" / "cache"
    if isinstance(error, OSError):  # a full disk is the user's problem: one clear TopkError
        with pytest.raises(TopkError, match="no space left on the device .* partial cache was removed"):
            build_cache(docs_dir, out, model_factory("llama_gqa"), chunk_size=50, device="cpu")
    else:
        with pytest.raises(type(error)) as info:
            build_cache(docs_dir, out, model_factory("llama_gqa"), chunk_size=50, device="cpu")
        assert info.value is error
    assert handed == [0]  # nothing more was handed over once a layer had failed
    assert list(out.parent.iterdir()) == []  # neither a cache nor a partial directory is left


@pytest.mark.gpu
@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offloaded"])
def test_cuda_drain_hands_over_the_same_kv(monkeypatch, offload):
    """CUDA: side-stream drain through small pinned pieces == a plain .cpu() of the layer's KV."""
    import threading

    from topk_decode.prefill import drain, layerwise

    model, ids = _deep_model(), torch.randint(3, 97, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    ref: list = []
    real_submit = drain.KVDrain.submit

    def submit_and_copy(self, layer, keys, values):  # the old synchronous copy, as the reference
        ref.append((keys.cpu(), values.cpu()))
        real_submit(self, layer, keys, values)

    monkeypatch.setattr(drain, "PIECE_BYTES", 1000)
    monkeypatch.setattr(drain.KVDrain, "submit", submit_and_copy)
    places = []
    real_residual = layerwise._residual_stream
    monkeypatch.setattr(
        layerwise, "_residual_stream", lambda *a: places.append(real_residual(*a).device) or real_residual(*a)
    )
    if not offload:
        model = model.cuda()
    got: list = []
    layerwise.prefill_layers(
        model,
        ids,
        lambda layer, k, v: got.append((layer, k, v, threading.current_thread())),
        chunk_size=64,
        offload_weights=offload,
        device="cuda",
    )
    assert places and all(p.type == "cuda" for p in places)  # a few KiB: the residual stays on the GPU
    assert [g[0] for g in got] == list(range(5))
    assert all(g[3].name.startswith("kv-drain") and not g[1].is_cuda and not g[1].is_pinned() for g in got)
    for (k, v), (_, gk, gv, _) in zip(ref, got):
        assert torch.equal(gk, k) and torch.equal(gv, v)


def test_whole_layer_attention_pass_equals_chunked_attention(monkeypatch):
    # On a GPU with room the layer's attention is one causal SDPA call between a projection pass and
    # an output pass; forced here on the CPU, it must give the chunked path's KV and logits.
    from topk_decode.prefill import layerwise

    model, ids = _deep_model(), torch.randint(3, 97, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    runs = []
    for whole in (False, True):
        monkeypatch.setattr(layerwise, "whole_layer_attention_fits", lambda *a, w=whole: w)
        kv: list = []
        logits, _ = layerwise.prefill_layers(model, ids, lambda layer, k, v: kv.append((k, v)), chunk_size=37)
        runs.append((logits, kv))
    (l0, kv0), (l1, kv1) = runs
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
    for (k0, v0), (k1, v1) in zip(kv0, kv1):
        torch.testing.assert_close(k1, k0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-5)
    assert len(kv1) == len(model.model.layers)


@pytest.mark.parametrize(
    "where",
    [
        "cpu",
        "cpu-threaded",
        pytest.param("cuda", marks=pytest.mark.gpu),
        pytest.param("cuda-offloaded", marks=pytest.mark.gpu),
    ],
)
def test_prefill_resumed_from_a_checkpoint_equals_an_uninterrupted_one(monkeypatch, where):
    """Checkpoints hand over the residual stream entering a layer once the layers below it are written;
    continuing from one gives the same KV and logits, bit for bit."""
    from topk_decode.prefill.layerwise import prefill_layers

    if where == "cpu-threaded":
        _threaded(monkeypatch)
    model, ids = _deep_model(), torch.randint(3, 97, (130,), generator=torch.Generator().manual_seed(4)).tolist()
    offload = where == "cuda-offloaded"
    if where == "cuda":
        model = model.cuda()
    device = "cuda" if where.startswith("cuda") else None
    written: dict[int, tuple] = {}
    checkpoints: dict[int, tuple[list[int], torch.Tensor]] = {}

    def on_layer(layer, k, v):
        written[layer] = (k, v)

    def checkpoint(next_layer, hidden):
        assert not hidden.is_cuda
        checkpoints[next_layer] = (sorted(written), hidden.clone())

    logits, _ = prefill_layers(
        model,
        ids,
        on_layer,
        chunk_size=37,
        offload_weights=offload,
        device=device,
        checkpoint=checkpoint,
        checkpoint_every=0,
    )
    reference = dict(written)
    assert sorted(checkpoints) == [1, 2, 3, 4]  # never after the last layer
    assert all(done == list(range(layer)) for layer, (done, _) in checkpoints.items())
    written.clear()
    resumed, stats = prefill_layers(
        model,
        ids,
        on_layer,
        chunk_size=37,
        offload_weights=offload,
        device=device,
        start_layer=3,
        hidden=checkpoints[3][1],
    )
    assert sorted(written) == [3, 4] and stats.resumed_at_layer == 3
    assert torch.equal(resumed, logits)
    for layer in (3, 4):
        assert all(torch.equal(a, b) for a, b in zip(written[layer], reference[layer]))
