"""Comparing traces: verdicts, localisation of a planted bug, replay, bf16, ports with other module names."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from experiments.llava_port import ALIGNMENT, from_reference
from paritylab.comparison.alignment import AlignmentError, Part, Rule, align, load_rules, parse_rules
from paritylab.comparison.attribution import attach_replay
from paritylab.comparison.metrics import Tolerance, Tolerances, divergence, within
from paritylab.comparison.replay import isolated_replay
from paritylab.comparison.report import compare_traces, noise_floor
from paritylab.reports.render import headline
from paritylab.run.references import llava
from paritylab.run.weights import weight_parity
from paritylab.tracing.values import iter_tensors
from tests.helpers import llava_inputs, planted, traced
from tests.tiny import tiny_llama, token_ids

IDS = token_ids(batch=2, length=7)


def forward(model: nn.Module) -> object:
    return model(IDS)


def test_identical_models_pass_every_row_with_zero_error(tmp_path):
    reference = traced(tiny_llama(), forward, tmp_path)
    candidate = traced(tiny_llama(), forward, tmp_path)
    report = compare_traces(reference, candidate)
    assert report.passed and report.first_divergence is None
    assert len(report.rows) == len(reference.calls)
    assert all(row.verdict == "pass" and row.source == "identity" for row in report.rows)
    assert all(row.metrics["max_abs"] == 0 and row.metrics["cosine"] == 1 for row in report.rows)
    assert report.summary()["output_rel_l2"] == 0


PLANTS = [
    "model.embed_tokens",
    "model.layers.0.self_attn.k_proj",
    "model.layers.0.input_layernorm",
    "model.layers.1.mlp.act_fn",
    "model.layers.1.mlp.down_proj",
    "model.norm",
]


@pytest.mark.parametrize("plant", PLANTS)
def test_planted_bug_is_localised_and_replay_isolates_it(tmp_path, plant):
    reference = traced(tiny_llama(), forward, tmp_path)
    model = tiny_llama()
    with planted(model, plant, scale=1.02):
        candidate = traced(model, forward, tmp_path)
        report = compare_traces(reference, candidate)
        replay = isolated_replay(model, forward, reference, candidate, report.alignment, tmp_path / "replay")
    report = attach_replay(report, reference, replay)
    assert not report.passed
    assert report.first_divergence.path == plant
    assert [row.path for row in report.origins] == [plant]
    planted_row = next(row for row in report.rows if row.path == plant)
    assert planted_row.cause == "origin"
    assert planted_row.rel_l2 == pytest.approx(0.02, rel=1e-3)
    downstream = [row for row in report.rows if row.index > planted_row.index and row.diverged]
    assert downstream and all(row.cause in ("inherited", "contains-origin") for row in downstream)
    assert [row.path for row in report.replay_origins] == [plant]
    assert planted_row.local["local_rel_l2"] == pytest.approx(0.02, rel=1e-3)
    others = [row.local["local_rel_l2"] for row in report.rows if row.local and row.path != plant]
    assert max(others) < 1e-6


class Residual(nn.Module):
    """A block whose bug is in its own code between its children (the residual add)."""

    def __init__(self, broken: bool) -> None:
        super().__init__()
        self.broken = broken
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(self.norm(x))
        h = x + (h * 1.5 if self.broken else h)
        return self.out(h)


class Net(nn.Module):
    def __init__(self, broken: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Residual(False), Residual(broken), Residual(False)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_bug_in_a_parents_own_code_is_blamed_on_the_parent(tmp_path):
    x = torch.randn(3, 8)
    reference = traced(Net(), lambda m: m(x), tmp_path)
    candidate = traced(Net(broken=True), lambda m: m(x), tmp_path)
    report = compare_traces(reference, candidate)
    assert report.first_divergence.path == "blocks.1"
    rows = {row.path: row for row in report.rows}
    assert rows["blocks.1.proj"].verdict == "pass"
    assert rows["blocks.1.out"].cause == "inherited"
    assert rows[""].cause == "contains-origin"


def test_bf16_candidate_passes_bf16_tolerances_and_fails_fp32_ones(tmp_path):
    reference = traced(tiny_llama(), forward, tmp_path)
    candidate = traced(tiny_llama().to(torch.bfloat16), forward, tmp_path)
    loose = compare_traces(reference, candidate)
    assert loose.passed, [row.path for row in loose.failing]
    assert loose.rows[0].tolerance == Tolerance(rtol=1.6e-2, atol=1e-5)
    strict = compare_traces(reference, candidate, tolerances=Tolerances(rtol=1.3e-6, atol=1e-5))
    assert not strict.passed
    assert strict.first_divergence is not None


def test_noise_floor_scales_the_verdict(tmp_path):
    exact = traced(tiny_llama().double(), forward, tmp_path)
    low = traced(tiny_llama().to(torch.bfloat16), forward, tmp_path)
    floors = noise_floor(exact, low)
    assert floors and all(value > 1e-4 for key, value in floors.items() if "rotary" not in key)
    reference = traced(tiny_llama(), forward, tmp_path)
    strict = Tolerances(rtol=1.3e-6, atol=1e-5)
    report = compare_traces(reference, low, tolerances=strict, noise_floor=floors)
    assert report.passed
    assert all(row.floor_ratio is not None and row.floor_ratio < 4 for row in report.rows if row.floor)
    model = tiny_llama().to(torch.bfloat16)
    with planted(model, "model.layers.1.mlp.up_proj", scale=1.5):
        buggy = traced(model, forward, tmp_path)
    report = compare_traces(reference, buggy, tolerances=strict, noise_floor=floors)
    assert not report.passed and report.first_divergence.path == "model.layers.1.mlp.up_proj"


def llava_pair(tmp_path, rules=()):
    reference = llava()
    port = from_reference(reference)
    inputs = llava_inputs(reference)
    ref_trace = traced(reference, lambda m: m(**inputs), tmp_path)
    port_trace = traced(port, lambda m: m(inputs["input_ids"], inputs["pixel_values"]), tmp_path)
    return reference, port, inputs, ref_trace, port_trace


def test_hand_written_port_aligns_automatically_and_passes(tmp_path):
    _, _, _, reference, candidate = llava_pair(tmp_path)
    report = compare_traces(reference, candidate)
    assert report.passed, [row.path for row in report.failing]
    pairs = {p.reference.rsplit("#")[0]: p.candidate.rsplit("#")[0] for p in report.alignment.pairs}
    assert pairs["model.vision_tower.encoder.layers.0.self_attn.out_proj"] == "vit.blocks.0.attn.wo"
    assert pairs["model.language_model.layers.1.post_attention_layernorm"] == "llm.layers.1.ffn_norm"
    assert pairs["model.language_model.embed_tokens"] == "llm.tok_embeddings"  # run in another order
    assert pairs["lm_head"] == "llm.output"
    assert "model.vision_tower" not in pairs  # no counterpart in the port: left unmatched, not forced
    by_reference = report.alignment.by_reference()
    for index, name in enumerate(("q_proj", "k_proj", "v_proj")):  # fused qkv found from the weights alone
        pair = by_reference[f"model.language_model.layers.0.self_attn.{name}#0"]
        assert (pair.candidate, pair.source) == ("llm.layers.0.attention.wqkv#0", "structure")
        assert pair.candidate_part == Part(start=32 * index, stop=32 * (index + 1))
    up = by_reference["model.language_model.layers.1.mlp.up_proj#0"]
    assert up.candidate == "llm.layers.1.feed_forward.w13#0" and up.candidate_part == Part(start=88, stop=176)
    assert report.summary()["output_rel_l2"] < 1e-6


def test_port_rules_align_fused_projections_by_chunk(tmp_path):
    _, _, _, reference, candidate = llava_pair(tmp_path)
    report = compare_traces(reference, candidate, rules=load_rules(ALIGNMENT))
    rows = {row.path: row for row in report.rows}
    for name in ("q_proj", "k_proj", "v_proj"):
        row = rows[f"model.language_model.layers.1.self_attn.{name}"]
        assert row.candidate.key == "llm.layers.1.attention.wqkv#0" and row.source == "rule"
        assert row.verdict == "pass" and row.candidate.shape == [2, 10, 32]
    assert report.passed
    assert "model.language_model.layers.0.mlp.up_proj#0" not in report.alignment.unmatched_reference


def test_check_is_the_pipeline_from_python_and_no_phase_changes_an_earlier_phases_report(tmp_path):
    from paritylab.run.parity import check

    plant = "model.layers.1.mlp.down_proj"
    model = tiny_llama()
    with planted(model, plant, scale=1.02):
        result = check(tiny_llama(), model, tmp_path, reference_call=forward)
    assert (result.verdict, result.exit_code, result.passed) == ("fail", 1, False)
    assert result.report.first_divergence.path == plant
    assert [row.path for row in result.report.replay_origins] == [plant]
    assert next(r for r in result.report.rows if r.path == plant).local["local_rel_l2"] == pytest.approx(0.02, 1e-3)
    free_run = result.free_run  # the comparison before replay, as the compare phase returned it
    assert free_run.replay_origins == [] and not any(row.local for row in free_run.rows)
    assert free_run.first_divergence.path == plant and free_run.first_divergence is not result.report.first_divergence
    assert result.reference.calls[0].path == "" and Path(result.directory, "candidate", "trace.json").is_file()
    clean = check(tiny_llama(), tiny_llama(), tmp_path / "clean", reference_call=forward)
    assert (clean.verdict, clean.exit_code, clean.report.first_divergence) == ("pass", 0, None)


def test_port_bug_is_localised_across_implementations(tmp_path):
    _, port, inputs, ref_trace, _ = llava_pair(tmp_path)
    run = lambda m: m(inputs["input_ids"], inputs["pixel_values"])  # noqa: E731
    with planted(port, "llm.layers.1.attention.wo", scale=1.01):
        candidate = traced(port, run, tmp_path)
        report = compare_traces(ref_trace, candidate, rules=load_rules(ALIGNMENT))
        replay = isolated_replay(port, run, ref_trace, candidate, report.alignment)
    report = attach_replay(report, ref_trace, replay)
    assert report.first_divergence.path == "model.language_model.layers.1.self_attn.o_proj"
    assert [row.path for row in report.replay_origins] == ["model.language_model.layers.1.self_attn.o_proj"]


def test_weight_parity_reports_mismatches_and_unmapped(tmp_path):
    from experiments.llava_port import WEIGHT_MAP
    from paritylab.run.weights import load_weight_map

    reference = llava()
    port = from_reference(reference)
    mapping = load_weight_map(WEIGHT_MAP)
    clean = weight_parity(port, reference, mapping)
    assert clean.ok and clean.compared == len(port.state_dict())
    assert "model.vision_tower.post_layernorm.weight" in clean.unused_reference
    with torch.no_grad():
        port.llm.layers[0].attention.wqkv.weight[5, 3] += 0.25
    broken = weight_parity(port, reference, mapping)
    assert broken.mismatched == [("llm.layers.0.attention.wqkv.weight", pytest.approx(0.25))]
    partial = {k: v for k, v in mapping.items() if not k.startswith("mm_projector")}
    assert "mm_projector.0.weight" in weight_parity(port, reference, partial).unmapped_candidate


def test_max_abs_difference_spans_chunks_and_keeps_nan():
    from paritylab.run.weights import max_abs_difference

    first = torch.zeros(3 << 20)
    second = first.clone()
    assert max_abs_difference(first, second) == 0.0
    second[(5 << 20) // 2] = -0.5  # in the third chunk
    second[7] = 0.25
    assert max_abs_difference(first, second) == 0.5
    second[-1] = float("nan")
    assert math.isnan(max_abs_difference(first, second))


class Shapes(nn.Module):
    def __init__(self, out: int, extra: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, out)
        self.extra = nn.Linear(out, out) if extra else None

    def forward(self, x):
        y = self.b(self.a(x))
        return self.extra(y) if self.extra is not None else y


def test_shape_mismatch_and_missing_modules_are_rows_not_crashes(tmp_path):
    x = torch.randn(2, 4)
    torch.manual_seed(0)
    reference = traced(Shapes(4), lambda m: m(x), tmp_path)
    torch.manual_seed(0)
    candidate = traced(Shapes(5, extra=True), lambda m: m(x), tmp_path)
    report = compare_traces(reference, candidate)
    rows = {row.path: row for row in report.rows}
    assert rows["b"].status == "shape-mismatch" and rows["b"].verdict == "fail"
    assert "[2, 4] vs [2, 5]" in rows["b"].note
    assert rows["a"].verdict == "pass"
    assert report.alignment.unmatched_candidate == ["extra#0"]
    assert report.first_divergence.path in ("b", "")


def test_nan_mismatch_fails_and_metrics_stay_finite():
    reference = torch.tensor([1.0, 2.0, 3.0, float("nan")])
    candidate = torch.tensor([1.0, float("nan"), 3.0, float("nan")])
    metrics = divergence(reference, candidate, Tolerance(1e-6, 1e-6))
    assert metrics["nan_mismatch"] == 1 and not within(metrics)
    assert metrics["max_abs"] == 0 and math.isfinite(metrics["rel_l2"])


def test_divergence_values_across_chunks_dtypes_and_bools():
    torch.manual_seed(0)
    reference = torch.randn(600_000, dtype=torch.float64)  # three chunks
    candidate = reference + 1e-3 * torch.randn_like(reference)
    r, c = reference.float().double(), candidate.float().double()
    exact = {
        "rel_l2": ((c - r).norm() / r.norm()).item(),
        "cosine": torch.nn.functional.cosine_similarity(r, c, dim=0).item(),
        "max_abs": (c - r).abs().max().item(),
        "frac_outside": ((c - r).abs() > 1e-5 + 1e-5 * r.abs()).double().mean().item(),
        "scale_err": (r @ (c - r) / (r @ r)).item(),
    }
    wide = divergence(r, c, Tolerance(1e-5, 1e-5))  # float64 tensors: float64 throughout
    narrow = divergence(reference.float(), candidate.float(), Tolerance(1e-5, 1e-5))  # float32: in float32
    assert wide["rel_l2"] == pytest.approx(exact["rel_l2"], rel=1e-9)
    assert narrow["rel_l2"] == pytest.approx(exact["rel_l2"], rel=1e-6)  # WORK_FLOAT32: about 1e-7 of itself
    for metrics in (wide, narrow):
        assert metrics["cosine"] == pytest.approx(exact["cosine"], abs=1e-12)
        assert metrics["max_abs"] == pytest.approx(exact["max_abs"], rel=1e-12)  # c - r is exact in float32 here
        assert metrics["frac_outside"] == exact["frac_outside"]
        assert metrics["scale_err"] == pytest.approx(exact["scale_err"], rel=1e-3, abs=1e-9)
    mixed = divergence(reference.float(), reference.bfloat16(), Tolerance(1e-2, 1e-5))
    assert 0 < mixed["rel_l2"] < 4e-3 and within(mixed)
    masks = divergence(torch.tensor([True, False, True]), torch.tensor([True, True, True]), Tolerance(0, 0))
    assert masks["max_abs"] == 1 and masks["frac_outside"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("size", [1e20, 1e-20])
def test_float32_squares_that_overflow_or_underflow_are_compared_in_float64(size):
    """Squares of float32 values of 1e20 overflow in float32 and those of 1e-20 underflow: the float64 pass runs
    instead, so the values are the float64 ones (not inf, not 0/0) and the verdict is right."""
    torch.manual_seed(0)
    reference = size * torch.randn(1000)
    candidate = reference * 1.01
    metrics = divergence(reference, candidate, Tolerance(1e-5, 0.0))
    assert metrics["rel_l2"] == pytest.approx(0.01, rel=1e-5) and not within(metrics)
    assert metrics["cosine"] == pytest.approx(1.0, abs=1e-9) and metrics["scale_err"] == pytest.approx(0.01, rel=1e-4)


def test_first_nonfinite_module_is_reported(tmp_path):
    x = torch.randn(2, 4)
    torch.manual_seed(0)
    reference = traced(Shapes(4), lambda m: m(x), tmp_path)
    torch.manual_seed(0)
    model = Shapes(4)
    with torch.no_grad():
        model.b.weight[0, 0] = float("nan")
    candidate = traced(model, lambda m: m(x), tmp_path)
    report = compare_traces(reference, candidate)
    assert report.first_nonfinite == {"reference": None, "candidate": "b#0"}
    assert report.first_divergence.path == "b"
    row = next(row for row in report.rows if row.path == "b")
    assert row.metrics["nan_mismatch"] == 2 and math.isfinite(row.metrics["rel_l2"])


def test_stats_only_traces_are_inconclusive_never_a_pass(tmp_path):
    reference = traced(tiny_llama(), forward, tmp_path, save_tensors=False)
    same = traced(tiny_llama(), forward, tmp_path, save_tensors=False)
    report = compare_traces(reference, same)
    assert not report.passed and report.verdict == "inconclusive" and not report.failing
    assert len(report.not_compared) == sum(row.status == "stats-only" for row in report.rows) > 0
    assert headline(report).startswith("INCONCLUSIVE:") and "not a pass" in headline(report)
    model = tiny_llama()
    with planted(model, "model.layers.0.mlp", scale=1.1):
        buggy = traced(model, forward, tmp_path, save_tensors=False)
    report = compare_traces(reference, buggy)
    assert {row.status for row in report.rows} == {"stats-only"}
    assert report.first_divergence.path == "model.layers.0.mlp"
    assert report.verdict == "fail"  # statistics alone prove this divergence


def test_empty_traces_are_inconclusive(tmp_path):
    from paritylab.tracing.tracefile import Trace

    report = compare_traces(Trace(), Trace())
    assert report.verdict == "inconclusive" and headline(report).startswith("INCONCLUSIVE: no aligned module")


def test_rules_patterns_null_and_round_trip(tmp_path):
    rules = parse_rules(
        {
            "rules": [
                {"reference": "model.layers.{}.mlp", "candidate": "blocks.{}.ffn", "candidate_index": 0},
                {"reference": "re:model\\.norm", "candidate": None},
                {"reference": "lm_head", "candidate": "head", "candidate_slice": [0, 8]},
            ]
        }
    )
    assert rules[0].match("model.layers.12.mlp") == "blocks.12.ffn"
    assert rules[1].match("model.norm") is None and rules[1].match("model.normx") is False
    assert rules[2].candidate_part.bounds(32) == (0, 8)
    with pytest.raises(AlignmentError, match="unknown keys"):
        parse_rules([{"reference": "a", "candidate": "b", "candidate_slise": [0, 1]}])
    with pytest.raises(AlignmentError, match="0 <= index < count"):
        parse_rules([{"reference": "a", "candidate": "b", "candidate_chunk": [3, 3]}])
    for order in ([0, 2], [1, 1, 0], ["a", 0], [True, False], "0,1", [*range(39, -1, -1), 40, 40]):
        with pytest.raises(AlignmentError, match=r"rule #0: candidate_order must list each position 0..n-1 once"):
            parse_rules([{"reference": "a", "candidate": "b", "candidate_order": order}])
    with pytest.raises(AlignmentError, match=r"rule #1: candidate_input_order must list"):
        parse_rules(
            [{"reference": "a", "candidate": "b"}, {"reference": "c", "candidate": "d", "candidate_input_order": [1]}]
        )
    assert parse_rules([{"reference": "a", "candidate": "b", "candidate_order": [1, 0]}])[0].candidate_part.whole
    assert parse_rules({"a.{}": "b.{}", "c": None})[1] == Rule("c", None)


def test_written_alignment_reproduces_itself(tmp_path):
    _, _, _, reference, candidate = llava_pair(tmp_path)
    first = align(reference, candidate, load_rules(ALIGNMENT))
    path = tmp_path / "alignment.yaml"
    path.write_text(first.to_yaml())
    text = path.read_text()
    assert "model.language_model.layers.{}.mlp.down_proj" in text and "llm.layers.{}.feed_forward.w2" in text
    again = align(reference, candidate, load_rules(path))
    assert [(p.reference, p.candidate) for p in again.pairs] == [(p.reference, p.candidate) for p in first.pairs]
    assert all(p.source == "rule" for p in again.pairs if p.reference != "#0")


def test_systematic_z_finds_offsets_below_bf16_rounding_and_ignores_rounding_shared_along_rows():
    """Two bf16 computations of one thing differ by unbiased rounding: small z. A 0.1 % offset (a quarter of
    one bf16 rounding step) is many standard errors out. A per-row gain from a normalisation rounded once per
    token is shared by a whole row: clustering by row keeps it from passing for evidence."""
    from paritylab.comparison.metrics import systematic_z

    generator = torch.Generator().manual_seed(0)
    reference = torch.randn(32, 128, generator=generator, dtype=torch.float64)
    floor = reference.to(torch.bfloat16)
    other_rounding = (reference + 1e-4 * torch.randn(32, 128, generator=generator, dtype=torch.float64)).bfloat16()
    clean = systematic_z(reference, floor, other_rounding)
    assert abs(clean["gain_z"]) < 4 and abs(clean["offset_z"]) < 4
    offset = systematic_z(reference, floor, (reference + 1e-3 * reference.std()).bfloat16())
    assert offset["offset_z"] > 8 and offset["offset"] == pytest.approx(1e-3, rel=0.3)
    signs = torch.tensor([1.0] * 20 + [-1.0] * 12, dtype=torch.float64).reshape(32, 1)
    shared = systematic_z(reference, floor, (reference * (1 + 2e-2 * signs)).bfloat16())  # one gain per row
    assert abs(shared["gain_z"]) < 3  # 32 rows of evidence: values taken one by one would say 10 standard errors
    assert systematic_z(reference[:1, :8], floor[:1, :8], floor[:1, :8] * 2)["gain_z"] == 0.0  # too few values


def test_elements_outside_tolerance_are_counted_exactly_across_chunks():
    """``frac_outside`` counts ``|c − r| > atol + rtol·|r|`` exactly, in every chunk of a long tensor, whether or
    not a chunk's largest difference is within ``atol`` (where the count is known to be 0 without a pass)."""
    import paritylab.comparison.metrics as metrics

    tolerance = Tolerance(rtol=1e-2, atol=1e-3)
    reference = torch.linspace(-4, 4, 3 * metrics._CHUNK + 17, dtype=torch.float64).to(torch.float32)
    candidate = reference.clone()
    candidate[: metrics._CHUNK] += 5e-4  # first chunk: every difference within atol
    outside = torch.arange(2 * metrics._CHUNK, reference.numel(), 997)  # later chunks: some beyond the bound
    candidate[outside] += 1e-3 + 2e-2 * reference[outside].abs()
    within_bound = torch.arange(2 * metrics._CHUNK + 5, reference.numel(), 991)  # ... and some just inside it
    within_bound = within_bound[~torch.isin(within_bound, outside)]
    candidate[within_bound] += 0.5e-3 + 0.5e-2 * reference[within_bound].abs()
    expected = (candidate.double() - reference.double()).abs() > 1e-3 + 1e-2 * reference.double().abs()
    result = divergence(reference, candidate, tolerance)
    assert int(expected.sum()) == outside.numel()
    assert result["frac_outside"] == pytest.approx(outside.numel() / reference.numel(), rel=1e-12)
    assert divergence(reference, reference + 5e-4, tolerance)["frac_outside"] == 0.0
    assert divergence(reference, reference + 2e-3, tolerance)["frac_outside"] == pytest.approx(
        float(((1e-3 + 1e-2 * reference.double().abs() < 2e-3).sum()) / reference.numel()), rel=1e-6
    )


def test_load_mapped_fills_fused_rows_in_place_and_lists_what_does_not_fit():
    """Each part is copied into its rows of the candidate's own tensor (no concatenated copy is made); a map that
    does not fit names every problem in one line."""
    from paritylab.run.weights import WeightMapError, load_mapped

    torch.manual_seed(0)
    reference = nn.ModuleDict({"gate": nn.Linear(4, 3), "up": nn.Linear(4, 3), "down": nn.Linear(3, 4)})
    candidate = nn.ModuleDict({"w13": nn.Linear(4, 6), "w2": nn.Linear(3, 4)})
    held = candidate["w13"].weight
    mapping = {
        "w13.weight": ["gate.weight", "up.weight"], "w13.bias": ["gate.bias", "up.bias"],
        "w2.weight": "down.weight", "w2.bias": "down.bias",
    }  # fmt: skip
    load_mapped(candidate, reference, mapping)
    assert candidate["w13"].weight is held  # filled in place
    assert torch.equal(held, torch.cat([reference["gate"].weight, reference["up"].weight]))
    assert torch.equal(candidate["w13"].bias, torch.cat([reference["gate"].bias, reference["up"].bias]))
    assert torch.equal(candidate["w2"].weight, reference["down"].weight)
    wrong = {**mapping, "w13.weight": ["gate.weight", "down.weight"], "w2.weight": "missing.weight"}
    with pytest.raises(WeightMapError) as refused:
        load_mapped(candidate, reference, wrong)
    message = str(refused.value)
    assert "\n" not in message
    assert "w13.weight: parts that cannot be concatenated from the reference, (6, 4) expected" in message
    assert "w2.weight: reference has no missing.weight" in message


class _NormOnce(nn.Module):
    """A norm computed once and used for queries, keys and values alike (three projections)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(8)
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = self.norm(x)
        return self.q(normed) + self.k(normed) * self.v(normed)


class _NormThrice(_NormOnce):
    """The same, computing the norm again for each projection (TransformerLens' ``ln1`` for q, k and v), after
    code with no module (nothing the replay can replace) adds a ramp along the features (a norm would undo a
    constant)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shifted = x + 0.5 * torch.arange(x.shape[-1], dtype=x.dtype)
        return self.q(self.norm(shifted)) + self.k(self.norm(shifted)) * self.v(self.norm(shifted))


def test_the_replay_forces_every_repeat_of_a_paired_call_given_the_same_inputs(tmp_path):
    """The candidate normalises the same value three times where the reference does it once: only its first
    call is paired, but the isolated replay forces all three (the same computation), so the key and value
    projections are fed the reference's value too and their own error is none, though code with no module
    shifted the norm's input."""
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    reference = traced(_NormOnce(), lambda model: model(x), tmp_path / "reference")
    model = _NormThrice()
    candidate = traced(model, lambda model: model(x), tmp_path / "candidate")
    report = compare_traces(reference, candidate)
    assert {(p.reference, p.candidate) for p in report.alignment.pairs} >= {("norm#0", "norm#0"), ("k#0", "k#0")}
    assert "norm#1" not in {p.candidate for p in report.alignment.pairs}
    replay = isolated_replay(model, lambda model: model(x), reference, candidate, report.alignment, tmp_path / "r")
    made = reference.tensor(reference.call("norm#0").outputs or {})
    for key in ("q#0", "k#0", "v#0"):  # each fed what its norm call returned: the reference's value, forced
        (_, node), *_ = iter_tensors(replay.call(key).inputs, "inputs")
        fed = replay.tensor(node)
        assert made is not None and fed is not None and torch.equal(fed, made), key
    report = attach_replay(report, reference, replay)
    for path in ("k", "v"):
        row = next(row for row in report.rows if row.path == path)
        assert row.local["local_rel_l2"] < 1e-6, (path, row.local)


def test_cosine_of_a_candidate_whose_accumulated_square_cancels_below_zero_is_zero():
    """Found by the fuzzed-trace test: ``cand2`` summed as ``ref2 + 2 r·d + d²`` came out at -1e-12 for a candidate of
    zeros, and the square root of the product raised a math domain error instead of a verdict."""
    from paritylab.comparison.metrics import _cosine

    assert _cosine(1.0, 4.0, -1e-12) == 0.0
    assert _cosine(0.0, -1e-15, -1e-15) == 1.0
    assert _cosine(2.0, 4.0, 1.0) == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_same_shape_weights_exchanged_are_named_by_the_data_flow_not_the_activation(tmp_path, dtype):
    """A conversion that swaps an MLP's gate and up weights: each projection pairs with the other's counterpart by
    its weights and agrees, so only the data flow shows the bug (the activation is handed up's output). It was
    blamed on the MLP's own code before; now the crossed module is named, with the one it was exchanged with."""
    from paritylab.run.parity import check

    reference = tiny_llama(num_hidden_layers=2)
    candidate = tiny_llama(num_hidden_layers=2).to(dtype)
    candidate.load_state_dict(reference.state_dict())
    mlp = candidate.model.layers[1].mlp
    with torch.no_grad():
        gate = mlp.gate_proj.weight.clone()
        mlp.gate_proj.weight.copy_(mlp.up_proj.weight)
        mlp.up_proj.weight.copy_(gate)
    result = check(reference, candidate, tmp_path, reference_call=forward, echo=None)
    first = result.report.first_divergence
    assert not result.report.passed and first is not None, result.report.summary()
    assert first.path == "model.layers.1.mlp.up_proj"
    assert first.candidate is not None and first.candidate.key == "model.layers.1.mlp.gate_proj#0"
    assert (
        "the candidate's model.layers.1.mlp.gate_proj computes the reference's model.layers.1.mlp.up_proj "
        "(it holds its weights), and the candidate hands its output to model.layers.1.mlp.act_fn, where the "
        "reference hands model.layers.1.mlp.act_fn model.layers.1.mlp.gate_proj's"
    ) in (first.note or "")
    gate_row = next(row for row in result.report.rows if row.path == "model.layers.1.mlp.gate_proj")
    assert gate_row.candidate is not None and gate_row.candidate.key == "model.layers.1.mlp.up_proj#0"
    assert gate_row.verdict == "pass"  # it computes the reference's gate projection exactly: the pairing is right


class _SeparateAttention(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, -1)).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x))
        mixed = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v
        return self.o(mixed.transpose(1, 2).flatten(-2))


class _FusedAttention(_SeparateAttention):
    """One qkv projection, split by position in its own code."""

    def __init__(self, reference: _SeparateAttention) -> None:
        super().__init__()
        del self.q, self.k, self.v
        self.qkv = nn.Linear(16, 48)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([reference.q.weight, reference.k.weight, reference.v.weight]))
            self.qkv.bias.copy_(torch.cat([reference.q.bias, reference.k.bias, reference.v.bias]))
            self.o.load_state_dict(reference.o.state_dict())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (self._split(part) for part in self.qkv(x).split(16, dim=-1))
        mixed = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v
        return self.o(mixed.transpose(1, 2).flatten(-2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_projection_whose_parts_lie_out_of_order_is_named_not_the_code_that_splits_it(tmp_path, dtype):
    """A conversion that exchanges the two halves of a fused qkv weight: q, k and v each pair with the rows they
    occupy and agree, and the attention's code, splitting the output by position, hands each another part. Named
    at the fused module's first part, with where each part lies; the clean fused port passes."""
    from paritylab.run.parity import check

    torch.manual_seed(0)
    reference = _SeparateAttention().eval()
    x = torch.randn(2, 5, 16)
    call = lambda model: model(x.to(next(model.parameters()).dtype))  # noqa: E731
    clean = check(reference, _FusedAttention(reference).to(dtype).eval(), tmp_path / "clean", reference_call=call)
    assert clean.report.passed, clean.report.summary()
    swapped = _FusedAttention(reference).to(dtype).eval()
    with torch.no_grad():
        swapped.qkv.weight.copy_(torch.cat([swapped.qkv.weight[24:], swapped.qkv.weight[:24]]))
        swapped.qkv.bias.copy_(torch.cat([swapped.qkv.bias[24:], swapped.qkv.bias[:24]]))
    result = check(reference, swapped, tmp_path / "swapped", reference_call=call, echo=None)
    first = result.report.first_divergence
    assert not result.report.passed and first is not None, result.report.summary()
    assert first.path == "q" and first.candidate is not None and first.candidate.key == "qkv#0"
    assert "qkv holds the reference's q at rows 24-39, k at rows 40-47, 0-7, v at rows 8-23" in (first.note or "")
