"""`topk prefill --kv-dtype int8`: keys and values in 8 bits with their scales (store/quant.py), decoded by flat as
stored; exact against dense attention over the dequantised KV, and within its stated error of the full-precision
cache."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from topk_decode import KVStore
from topk_decode.cli.app import app
from topk_decode.errors import TopkError
from topk_decode.prefill.build import build_cache
from topk_decode.store import open_cache
from topk_decode.store.cache_dir import CacheWriter
from topk_decode.store.quant import dequantize_keys, dequantize_values, quantize_keys, quantize_values

PROMPT = [5, 17, 42, 99]


@pytest.fixture(scope="module")
def caches(tmp_path_factory, model_factory, docs_dir):
    """The same documents prefilled in fp32 and as int8, on the CPU (GQA model: 2 KV heads)."""
    model_dir = model_factory("llama_gqa")
    made = {}
    for kv in ("float32", "int8"):
        out = tmp_path_factory.mktemp(f"kv-{kv}") / "cache"
        build_cache(docs_dir, out, model_dir, chunk_size=61, device="cpu", kv_dtype=None if kv == "float32" else kv)
        made[kv] = out
    return made


@pytest.fixture(scope="module")
def dequantised(caches, tmp_path_factory):
    """An fp32 cache holding the int8 cache's keys and values dequantised: what int8 decoding must equal."""
    src = open_cache(caches["int8"])
    out = tmp_path_factory.mktemp("kv-dequantised") / "cache"
    writer = CacheWriter(out)
    everything = torch.arange(src.n_tokens)
    for layer in range(src.n_layers):
        writer.write_layer(layer, *src.kv_rows(layer, everything))
    writer.write_tokens(src.tokens)
    keep = ("model", "shape", "n_tokens", "documents", "prompt", "skipped")
    writer.commit({**{k: src.manifest[k] for k in keep if k in src.manifest}, "kv_dtype": "float32"})
    return out


def last_logits(cache, k: int, **kw) -> torch.Tensor:
    store = KVStore.open(cache, k=k, device="cpu", **kw)
    return store.decoder.forward(PROMPT, store.decoder.new_conversation())


def test_quantisation_rounds_within_half_a_step():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 200, 16, generator=gen) * torch.logspace(-2, 1, 16)  # channels of very different size
    x[1, :, 4] = 0  # an all-zero channel
    x[2, 7] = 0  # an all-zero token
    k8, sk = quantize_keys(x)
    v8, sv = quantize_values(x)
    assert (k8.dtype, sk.shape, v8.dtype, sv.shape) == (torch.int8, (3, 16), torch.int8, (3, 200))
    assert int(k8.abs().max()) == int(v8.abs().max()) == 127
    assert bool(((dequantize_keys(k8, sk) - x).abs() <= sk[:, None, :] / 2 * (1 + 1e-6)).all())
    assert bool(((dequantize_values(v8, sv) - x).abs() <= sv[..., None] / 2 * (1 + 1e-6)).all())
    assert torch.equal(dequantize_keys(k8, sk)[1, :, 4], torch.zeros(200))
    assert torch.equal(dequantize_values(v8, sv)[2, 7], torch.zeros(16))


def test_int8_cache_stores_one_byte_per_element_and_its_scales(caches):
    full, small = open_cache(caches["float32"], verify=True), open_cache(caches["int8"], verify=True)
    assert small.manifest["kv_dtype"] == "int8" and small.quantized and not full.quantized
    assert small.keys[0].dtype == small.values[0].dtype == torch.int8
    hkv, n, d = small.n_kv_heads, small.n_tokens, small.head_dim
    assert small.key_scales[0].shape == (hkv, d) and small.value_scales[0].shape == (hkv, n)
    files = small.manifest["files"]
    assert files["kv/keys.000.bin"]["bytes"] == hkv * n * d == files["kv/values.000.bin"]["bytes"]
    assert files["kv/key_scales.000.bin"]["bytes"] == 4 * hkv * d
    assert files["kv/value_scales.000.bin"]["bytes"] == 4 * hkv * n
    kv = lambda c: sum(f["bytes"] for rel, f in c.manifest["files"].items() if rel.startswith("kv/"))  # noqa: E731
    assert kv(small) < 0.3 * kv(full)  # a quarter of fp32 (half of bf16) plus 4 bytes per token and head


@pytest.mark.parametrize("k,backend", [(100_000, "torch"), (16, "torch"), (16, "numba")])
def test_int8_decode_equals_dense_over_the_dequantised_kv(caches, dequantised, k, backend):
    """The scales folded into the queries (keys) and the attention weights (values) give what attention over the
    dequantised keys and values gives: every key (k ≥ N), and the exact top-16 of the same scores, scanned by torch
    (widened block by block) or by the compiled scan (as stored)."""
    ours = last_logits(caches["int8"], k, strategy="flat", strategy_options={"backend": backend})
    torch.testing.assert_close(ours, last_logits(dequantised, k), rtol=1e-4, atol=1e-4)


def test_int8_decode_stays_within_its_stated_error_of_full_precision(caches):
    """The error on a real model is measured in docs/history/eval-2026-11.md "KV formats"; on this random model the
    next-token distribution moves by a KL below 1e-3 and the greedy tokens stay full precision's."""
    full, small = last_logits(caches["float32"], 100_000), last_logits(caches["int8"], 100_000)
    p, q = full.log_softmax(-1), small.log_softmax(-1)
    assert float((p.exp() * (p - q)).sum()) < 1e-3
    stores = [KVStore.open(caches[kv], k=100_000, device="cpu") for kv in ("float32", "int8")]
    assert stores[0].generate_ids(PROMPT, 12) == stores[1].generate_ids(PROMPT, 12)


def test_auto_chooses_on_an_int8_cache_as_on_a_float_one_and_the_others_refuse_it(caches, monkeypatch):
    """auto's choice does not depend on the KV format (flat and routed read int8): on a short context the exact scan;
    past the threshold, on a GPU (resolved here on the CPU through `resolve`'s gpu flag), routed with auto's options."""
    from topk_decode.decode import engine
    from topk_decode.index import auto

    store = KVStore.open(caches["int8"], device="cpu")
    assert store.decoder.config.strategy == "flat" and "exact" in store.decoder.strategy_reason
    with pytest.raises(TopkError, match="tokenselect does not read int8 caches yet: decode with --strategy flat"):
        KVStore.open(caches["int8"], strategy="tokenselect", device="cpu")
    from topk_decode.index import prepare_artifacts

    with pytest.raises(TopkError, match="quest does not read int8"):
        prepare_artifacts(open_cache(caches["int8"]), ["quest"])
    monkeypatch.setattr(auto, "EXACT_MAX_TOKENS", 16)
    monkeypatch.setattr(engine.auto, "resolve", lambda name, n, gpu=True: auto.choose(n, gpu=True))
    fast = KVStore.open(caches["int8"], k=8, device="cpu")
    assert fast.decoder.config.strategy == "routed" and fast.decoder.strategy.options.rank == "keys"
    assert fast.decoder.strategy.options.pq_values > 0  # value codes (at most D/2 sub-vectors)
    fast.close()


def test_prefill_command_takes_kv_dtype_int8_and_refuses_what_cannot_read_it(tmp_path, docs_dir, model_factory):
    model = str(model_factory("llama_gqa"))
    more = tmp_path / "more"
    more.mkdir()
    (more / "delta.txt").write_text("A document the cache does not hold yet.")

    def run(*args: str, docs=docs_dir):
        return CliRunner().invoke(app, ["prefill", str(docs), "--model", model, "--device", "cpu", *args])

    ok = run("--out", str(tmp_path / "c"), "--kv-dtype", "int8", "--strategy", "routed")
    assert ok.exit_code == 0, ok.output
    assert json.loads((tmp_path / "c" / "manifest.json").read_text())["kv_dtype"] == "int8"
    info = CliRunner().invoke(app, ["info", str(tmp_path / "c")])
    assert info.exit_code == 0 and "KV stored as int8" in info.output and "flat, routed ready" in info.output
    assert "quest, tokenselect do not read int8 caches yet" in " ".join(info.output.split())
    for args, message in (
        (("--out", str(tmp_path / "d"), "--kv-dtype", "int4"), "--kv-dtype must be int8"),
        (("--out", str(tmp_path / "d"), "--kv-dtype", "int8", "--strategy", "quest"), "quest does not read int8"),
        (("--append", str(tmp_path / "c"), "--kv-dtype", "int8"), "--kv-dtype does not apply to --append"),
    ):
        bad = run(*args)
        assert bad.exit_code != 0 and message in bad.output and "Traceback" not in bad.output, bad.output
    bad = run("--append", str(tmp_path / "c"), docs=more)
    assert bad.exit_code != 0 and "--append does not extend yet" in bad.output and "Traceback" not in bad.output
    assert not (tmp_path / "d").exists()


def test_batched_steps_over_an_int8_cache_equal_each_conversation_alone(caches):
    """The server's batched one-token steps search several conversations' queries in one flat call: the key scales
    are folded into those rows too."""
    from topk_decode.decode.engine import StepRequest, forward_batch

    store = KVStore.open(caches["int8"], k=16, strategy="flat", device="cpu")
    prompts = [[5, 17], [42, 99, 7]]
    alone = [store.decoder.new_conversation() for _ in prompts]
    batched = [store.decoder.new_conversation() for _ in prompts]
    toks = []
    for p, c1, c2 in zip(prompts, alone, batched):
        toks.append(int(torch.argmax(store.decoder.forward(p, c1))))
        store.decoder.forward(p, c2)
    for _ in range(3):
        reqs = [StepRequest(store.decoder, c, [t]) for c, t in zip(batched, toks)]
        forward_batch(reqs)
        want = [store.decoder.forward([t], c) for c, t in zip(alone, toks)]
        for r, w in zip(reqs, want):
            assert r.error is None
            torch.testing.assert_close(r.logits, w, rtol=1e-4, atol=1e-4)
        toks = [int(torch.argmax(w)) for w in want]


# ---- routed on an int8 cache: clustered as the float keys, stored and scanned as int8 (index/routed/layout.py) ----

ROUTED_BUILD = dict(cluster_size=16, iters=6, store_values=True, segment=65536, pq_m=8, pq_values=8)


def test_routed_layout_of_an_int8_cache_is_its_dequantised_copys_in_the_int8_keys_space(caches, dequantised):
    """The same clusters as the float keys it stands for; the int8 rows permuted with the values' scales beside them;
    the centroids and key codebooks divided by the key scales, so that q ⊙ s_k scores them as q scores the float ones."""
    from topk_decode.index.routed.layout import layer_layouts

    small, full = open_cache(caches["int8"]), open_cache(dequantised)
    for layer, (a, b) in enumerate(
        zip(layer_layouts(small, ROUTED_BUILD, None), layer_layouts(full, ROUTED_BUILD, None))
    ):
        ks = small.key_scales[layer]
        assert a.keys.dtype == a.values.dtype == torch.int8 and a.value_scales.shape == a.pos.shape
        assert torch.equal(a.pos, b.pos) and torch.equal(a.offsets, b.offsets)
        assert torch.equal(dequantize_keys(a.keys, ks), b.keys)
        assert torch.equal(dequantize_values(a.values, a.value_scales), b.values)
        torch.testing.assert_close(a.centroids * ks[:, None, :], b.centroids)
        torch.testing.assert_close(a.value_means, b.value_means)
        assert torch.equal(a.codes.codes, b.codes.codes) and torch.equal(a.value_codes.codes, b.value_codes.codes)
        m = a.codes.codebooks.shape[1]
        torch.testing.assert_close(a.codes.codebooks * ks.view(ks.shape[0], m, 1, -1), b.codes.codebooks)


@pytest.mark.parametrize("kernel", ["torch", "numba"])
@pytest.mark.parametrize("rank", ["clusters", "keys"])
def test_routed_reading_every_cluster_of_an_int8_cache_is_dense_over_the_dequantised_kv(
    caches, dequantised, kernel, rank
):
    """probe_fraction = 1 reads every key: the exact top-k, scanned as stored (the compiled path weighs each int8
    value row by its scale), equals flat's over the dequantised keys and values."""
    opts = {"probe_fraction": 1.0, "kernel": kernel, "rank": rank, "max_read_per_k": 0}
    ours = last_logits(caches["int8"], 16, strategy="routed", strategy_options=opts)
    torch.testing.assert_close(ours, last_logits(dequantised, 16, strategy="flat"), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("one_copy", [False, True])
def test_routed_compiled_path_on_an_int8_cache_selects_and_attends_as_its_torch_path(caches, one_copy):
    """Reading a tenth of the keys: the compiled scan of the int8 rows (its value sums times the rows' scales) and the
    torch path (the rows widened) choose the same keys and give the same next-token logits; so they do where the
    layout holds no copy of the KV and both read the cache's int8 rows by position."""
    opts = {"probe_fraction": 0.1, "store_keys": not one_copy, "store_values": not one_copy}
    compiled = last_logits(caches["int8"], 8, strategy="routed", strategy_options=dict(opts, kernel="numba"))
    reference = last_logits(caches["int8"], 8, strategy="routed", strategy_options=dict(opts, kernel="torch"))
    torch.testing.assert_close(compiled, reference, rtol=1e-4, atol=1e-4)


def test_routed_on_an_int8_cache_stays_near_routed_on_its_dequantised_copy(caches, dequantised):
    """auto's fast options (rank=keys, value codes) at k = 8: the int8 cache's layout is its dequantised copy's
    (above); only the tables' precision differs (bf16 centroids there, fp32 here), so the logits stay close."""
    opts = {"rank": "keys", "pq_values": 8, "kernel": "torch"}
    ours = last_logits(caches["int8"], 8, strategy="routed", strategy_options=opts)
    theirs = last_logits(dequantised, 8, strategy="routed", strategy_options=opts)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-2)


def test_routed_keeps_an_int8_caches_layout_tables_in_bf16_once_its_statistics_are_made(caches):
    """The layout's own centroids and mean values (the residual codes' reference, read by the per-key torch path) are
    kept in the tables' precision, bf16, beside the searchable statistics made from them in fp32: half the RAM."""
    from topk_decode.index import get_strategy

    ckv = open_cache(caches["int8"])
    strat = get_strategy("routed")(ckv, 4, ckv.n_tokens - 8, {"rank": "keys", "pq_values": 8, "kernel": "torch"})
    strat.prepare()
    for lay in strat.layouts:
        assert lay.centroids.dtype == lay.value_means.dtype == torch.bfloat16
    q = torch.randn(ckv.n_kv_heads, 3, ckv.head_dim)
    assert strat.approx_scores(0, q).dtype == torch.float32 and strat.rest_values(0)[0].dtype == torch.bfloat16


def test_routed_device_stage_on_an_int8_cache_scales_the_query_as_the_host_does(caches):
    """Routing, per-key ranking and the estimate on the decode device (run here on the CPU device, the same ops the
    captured step runs) score the query scaled by the key scales against tables in the int8 keys' space: the device's
    one-token steps give the torch path's logits."""
    opts = {"probe_fraction": 0.1, "rank": "keys", "pq_values": 8, "kernel": "numba"}
    logits = {}
    for mode in ("true", "false"):
        store = KVStore.open(
            caches["int8"], k=8, device="cpu", strategy="routed", strategy_options=dict(opts, device_route=mode)
        )
        dec = store.decoder
        dec._use_segments = True
        conv = dec.new_conversation()
        logits[mode] = [dec.forward(PROMPT, conv)] + [dec.forward([t], conv) for t in (7, 8, 9)]
        routes = dec.segments.routes
        assert (routes is not None and routes.tables[0].kscale is not None) == (mode == "true")
        store.close()
    for a, b in zip(logits["true"], logits["false"]):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-2)
