"""The duo strategy (retrieval vs streaming heads from a DuoAttention pattern) and `topk calibrate-duo`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import typer
from conftest import hf_greedy
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from topk_decode import KVStore
from topk_decode.calibrate.duo import DuoCalibrationConfig, calibrate_duo, calibrate_duo_to_file
from topk_decode.errors import TopkError
from topk_decode.index import artifact_dir, get_strategy, prepare_artifacts
from topk_decode.index.duo import PATTERN_FILE, DuoStrategy, parse_pattern, retrieval_mask, write_pattern
from topk_decode.index.flat import FlatStrategy
from topk_decode.store import open_cache

# The built_cache model (llama_gqa): 2 layers, 2 KV heads. Half of the heads stream at sparsity 0.5.
GATES = [[0.9, 0.1], [0.2, 0.8]]
RETRIEVAL = {(0, 0), (1, 1)}


def write_tsv(path: Path, rows: list[list]) -> Path:
    path.write_text("\n".join("\t".join(str(v) for v in row) for row in rows) + "\n")
    return path


@pytest.fixture()
def pattern(tmp_path) -> Path:
    return write_tsv(tmp_path / PATTERN_FILE, GATES)


def open_duo(cache: Path, pattern: Path, sparsity: float = 0.5, **opts) -> DuoStrategy:
    """A prepared duo strategy over the cache, searchable range [4, N - 16)."""
    ckv = open_cache(cache)
    strat = DuoStrategy(ckv, 4, ckv.n_tokens - 16, dict(pattern=str(pattern), sparsity=sparsity, **opts))
    strat.prepare()
    return strat


# ---- pattern parsing -----------------------------------------------------------------------------
def test_parse_pattern_reads_duoattention_tsv_including_scientific_notation(tmp_path):
    p = write_tsv(tmp_path / "p.tsv", [["1.000000000000000000e+00", "2.5e-01", "0"], ["0.5", "1", "0.125"]])
    gates = parse_pattern(p, n_layers=2, n_kv_heads=3)
    assert gates.shape == (2, 3)
    assert gates.tolist() == [[1.0, 0.25, 0.0], [0.5, 1.0, 0.125]]


@pytest.mark.parametrize(
    "rows, message",
    [
        ([[0.5, 0.5]], "has 1 rows, the model has 2 layers"),
        ([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]], "has 3 rows, the model has 2 layers"),
        ([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]], "row 1 has 3 columns, the model has 2 KV heads"),
        ([[0.5, 0.5], [0.5]], "row 2 has 1 columns"),
        ([[0.5, "abc"], [0.5, 0.5]], "non-numeric"),
        ([[0.5, 0.5], [1.5, 0.5]], "outside [0, 1]"),
        ([[0.5, -0.1], [0.5, 0.5]], "outside [0, 1]"),
        ([[0.5, "nan"], [0.5, 0.5]], "outside [0, 1]"),
    ],
)
def test_malformed_pattern_raises_one_line_topk_error(tmp_path, rows, message):
    p = write_tsv(tmp_path / "bad.tsv", rows)
    with pytest.raises(TopkError) as err:
        parse_pattern(p, n_layers=2, n_kv_heads=2)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_pattern_file_raises_topk_error(tmp_path):
    with pytest.raises(TopkError, match="not found"):
        parse_pattern(tmp_path / "nope.tsv", 2, 2)


def test_write_pattern_round_trips_through_parse(tmp_path):
    gates = torch.tensor([[0.123456, 1.0], [0.0, 0.5]])
    back = parse_pattern(write_pattern(tmp_path / "g.tsv", gates), 2, 2)
    torch.testing.assert_close(back, gates, atol=1e-6, rtol=0)


# ---- sparsity → heads ----------------------------------------------------------------------------
def test_sparsity_quantile_picks_heads_at_or_above_it_on_hand_made_table():
    gates = torch.tensor([[0.9, 0.1, 0.5], [0.3, 0.7, 0.2]])
    # sorted: 0.1 0.2 0.3 0.5 0.7 0.9; quantile(0.5) = 0.4 → 0.9, 0.5, 0.7 are retrieval heads
    assert retrieval_mask(gates, 0.5).tolist() == [[True, False, True], [False, True, False]]
    # quantile(0.8) = 0.7 → gates ≥ 0.7 (at-or-above keeps the tie)
    assert retrieval_mask(gates, 0.8).tolist() == [[True, False, False], [False, True, False]]
    assert retrieval_mask(gates, 0.0).all()
    assert not retrieval_mask(gates, 1.0).any()


def test_sparsity_outside_unit_interval_raises_topk_error():
    with pytest.raises(TopkError, match="sparsity"):
        retrieval_mask(torch.ones(2, 2), 1.5)


# ---- head routing --------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["faiss", "torch"])
def test_streaming_heads_are_never_searched_and_return_only_empty_ids(built_cache, pattern, backend, monkeypatch):
    cache, _ = built_cache
    strat = open_duo(cache, pattern, backend=backend, threads=1)
    searched: list[tuple[int, int]] = []
    if backend == "torch":
        real = FlatStrategy.torch_search

        def spy(self, layer, h, q, k):
            searched.append((layer, h))
            return real(self, layer, h, q, k)

        monkeypatch.setattr(FlatStrategy, "torch_search", spy)
    else:
        assert set(strat.head_index) == RETRIEVAL  # no index was built for a streaming head

        class Spy:
            def __init__(self, key, index):
                self.key, self.index = key, index

            def search(self, q, k):
                searched.append(self.key)
                return self.index.search(q, k)

        strat.head_index = {key: Spy(key, idx) for key, idx in strat.head_index.items()}
    torch.manual_seed(0)
    for layer in range(2):
        sel = strat.select(layer, torch.randn(2, 2, 16), k=5)
        for h in range(2):
            if (layer, h) in RETRIEVAL:
                assert (sel.ids[h] >= 4).all() and sel.ids.shape[-1] == 5
            else:
                assert (sel.ids[h] == -1).all()
    assert sorted(searched) == sorted(RETRIEVAL)
    assert strat.stats.searches == 2
    assert strat.stats.extra["streaming_heads"] == 2


def test_layer_of_only_streaming_heads_returns_no_slots(built_cache, tmp_path):
    cache, _ = built_cache
    strat = open_duo(cache, write_tsv(tmp_path / "p.tsv", [[0.0, 0.0], [1.0, 1.0]]))
    sel = strat.select(0, torch.randn(2, 2, 16), k=5)
    assert sel.ids.shape == (2, 2, 0) and not sel.searched
    assert strat.stats.searches == 0


def test_retrieval_heads_select_exactly_what_flat_selects(built_cache, pattern):
    cache, _ = built_cache
    duo = open_duo(cache, pattern, sparsity=0.0)
    flat = FlatStrategy(duo.ckv, duo.lo, duo.hi, {})
    flat.prepare()
    q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1))
    for layer in range(2):
        a, b = duo.select(layer, q, 7), flat.select(layer, q, 7)
        assert torch.equal(a.ids, b.ids)
        torch.testing.assert_close(a.scores, b.scores)


def test_open_without_any_pattern_raises_topk_error(built_cache):
    cache, _ = built_cache
    ckv = open_cache(cache)
    with pytest.raises(TopkError, match="needs a head pattern"):
        DuoStrategy(ckv, 4, ckv.n_tokens - 16, {}).prepare()


def test_pattern_stored_as_cache_artifact_is_the_default(built_cache, pattern, tmp_path):
    import shutil

    cache = tmp_path / "cache"
    shutil.copytree(built_cache[0], cache)
    ckv = open_cache(cache)
    prepare_artifacts(ckv, ["duo"], {"pattern": str(pattern)})
    assert (artifact_dir(cache, "duo") / PATTERN_FILE).read_text() == pattern.read_text()
    strat = get_strategy("duo")(ckv, 4, ckv.n_tokens - 16, {"sparsity": 0.5})
    strat.prepare()
    assert strat.retrieval.tolist() == [[True, False], [False, True]]


def test_all_retrieval_heads_with_covering_k_reproduce_hf_generate(built_cache, pattern):
    cache, model_dir = built_cache
    store = KVStore.open(
        cache, k=100_000, strategy="duo", device="cpu", strategy_options={"pattern": str(pattern), "sparsity": 0.0}
    )
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = tok("Question: what does the report say?", add_special_tokens=False).input_ids
    ours = store.generate_ids(prompt, max_new_tokens=16)
    assert ours == hf_greedy(model_dir, store.context_ids + prompt, 16)


def test_decoding_with_streaming_heads_counts_skipped_heads_and_retrieves_less(built_cache, pattern):
    cache, _ = built_cache
    runs = {}
    for sparsity in (0.0, 0.5):
        store = KVStore.open(
            cache,
            k=8,
            strategy="duo",
            device="cpu",
            n_sink=4,
            n_tail=16,
            strategy_options={"pattern": str(pattern), "sparsity": sparsity},
        )
        session = store.session()
        session.ask("what?", max_new_tokens=4)
        runs[sparsity] = (session.stats["retrieved_per_step"], store.decoder.strategy.stats)
    assert runs[0.0][1].extra["streaming_heads"] == 0
    assert runs[0.5][1].extra["streaming_heads"] > 0 and runs[0.5][1].searches > 0
    assert runs[0.5][0] == pytest.approx(runs[0.0][0] / 2)  # half the heads retrieve nothing


# ---- calibration ---------------------------------------------------------------------------------
CAL = dict(steps=4, length=96, sink=4, recent=16, lr=0.05)


@pytest.fixture(scope="module")
def cal_model(model_factory):
    model_dir = model_factory("llama_gqa")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model_dir, model, AutoTokenizer.from_pretrained(model_dir)


def test_calibration_writes_a_tsv_the_duo_strategy_reads(cal_model, built_cache, tmp_path):
    model_dir, _, _ = cal_model
    out = tmp_path / "gates.tsv"
    result = calibrate_duo_to_file(model_dir, out, DuoCalibrationConfig(l1=0.5, **CAL), device="cpu")
    gates = parse_pattern(out, 2, 2)
    assert gates.shape == (2, 2) and ((gates >= 0) & (gates <= 1)).all()
    assert len(result.distill_loss) == CAL["steps"]
    strat = open_duo(built_cache[0], out, sparsity=0.5)
    assert int(strat.retrieval.sum()) >= 2


def test_l1_penalty_pushes_mean_gate_below_the_unpenalised_run(cal_model):
    _, model, tok = cal_model
    free = calibrate_duo(model, tok, DuoCalibrationConfig(l1=0.0, **CAL))
    penalised = calibrate_duo(model, tok, DuoCalibrationConfig(l1=1.0, **CAL))
    assert penalised.mean_gate[-1] < free.mean_gate[-1]
    assert float(penalised.gates.mean()) < float(free.gates.mean())


def test_calibration_rejects_a_length_within_the_streaming_window(cal_model):
    _, model, tok = cal_model
    with pytest.raises(TopkError, match="must exceed --sink"):
        calibrate_duo(model, tok, DuoCalibrationConfig(steps=1, length=32, sink=4, recent=32))


def test_calibrate_duo_command_writes_gates_and_prints_summary(cal_model, tmp_path):
    from topk_decode.cli.duo_cmd import calibrate_duo_command

    app = typer.Typer()
    app.command()(calibrate_duo_command)
    out = tmp_path / "cli.tsv"
    res = CliRunner().invoke(
        app,
        [
            str(cal_model[0]),
            "--out",
            str(out),
            "--steps",
            "2",
            "--length",
            "96",
            "--sink",
            "4",
            "--recent",
            "16",
            "--device",
            "cpu",
        ],
    )
    assert res.exit_code == 0, res.output
    assert parse_pattern(out, 2, 2).shape == (2, 2)
    assert "2 layers × 2 KV heads" in res.output


def test_topk_calibrate_duo_with_length_inside_the_window_exits_2_with_one_line(cal_model, tmp_path):
    from topk_decode.cli.app import app

    res = CliRunner().invoke(
        app,
        [
            "calibrate-duo",
            str(cal_model[0]),
            "--out",
            str(tmp_path / "g.tsv"),
            "--length",
            "100",
            "--sink",
            "64",
            "--recent",
            "256",
        ],
    )
    assert res.exit_code == 2
    assert "must exceed --sink + --recent" in res.output
    assert not (tmp_path / "g.tsv").exists()


def test_covering_budget_gives_streaming_heads_nothing_and_retrieval_heads_every_token(built_cache, pattern):
    """k ≥ searchable range: retrieval heads get the whole range with exact scores, streaming heads none."""
    duo = open_duo(built_cache[0], pattern, sparsity=0.5)
    q = torch.randn(duo.ckv.n_kv_heads, 3, duo.ckv.head_dim)
    for layer in range(duo.ckv.n_layers):
        sel = duo.select(layer, q, 100_000)
        full = duo.all_tokens(q, layer)  # every head, the plain path
        heads = duo.retrieval_heads[layer]
        for h in range(duo.ckv.n_kv_heads):
            if h in heads:
                assert torch.equal(sel.ids[h], full.ids[h])
                torch.testing.assert_close(sel.scores[h], full.scores[h])
            else:
                assert (sel.ids[h] == -1).all()
