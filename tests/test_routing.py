"""Discrete decisions (a router's top-k): a near tie that rounding flips is a note and the module is judged again
with the reference's decisions; a wrong routing rule or a wrong expert still fails, named where it is.

The pair is transformers' Mixtral (experts as fused 3-D parameters) against our per-expert port
(``tests/moe_port.py``), two layers of eight experts, random weights (``tests/pairs.py``: ``mixtral``). With weight
seed 1 in bfloat16 one token of 24 picks another second expert in the first layer: its second and third router
logits differ by 8.9e-4, below one unit of bfloat16's rounding at their magnitude.
"""

from __future__ import annotations

from types import MethodType

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paritylab
from paritylab.comparison.decisions import (
    captured,
    compare_decisions,
    decision_dim,
    everywhere,
    forced_decisions,
    pair_decisions,
)
from paritylab.comparison.operations import record_call
from paritylab.reports.render import headline
from paritylab.run.parity import compare_and_replay, match_weight_grids, trace_model
from tests.moe_port import MoeLayer
from tests.pairs import reference_side, seeded

FLIPS = 1
"""The weight seed whose bfloat16 pair flips one token's routing in the first layer."""


def _judge(case, directory, decisions=True):
    reference_trace, floors = reference_side(case, directory)
    candidate_trace = trace_model(case.candidate, case.candidate_call, directory / "candidate")
    match_weight_grids(case.reference, case.candidate, reference_trace, candidate_trace)
    return compare_and_replay(
        reference_trace, candidate_trace, case.candidate, case.candidate_call, directory, floors=floors,
        reference=case.reference, reference_call=case.reference_call, decisions=decisions,
    )  # fmt: skip


def test_a_near_tie_flip_is_a_note_and_the_pair_passes(tmp_path):
    case = seeded("mixtral", torch.bfloat16, FLIPS)
    alone = _judge(case, tmp_path / "alone", decisions=False)
    assert not alone.passed  # the flip alone fails the clean pair without teacher-forced decisions
    assert alone.first_divergence is not None and alone.first_divergence.path == "model.layers.0.mlp"

    report = _judge(case, tmp_path / "forced")
    assert report.passed, headline(report)
    [found] = report.decisions
    assert found["module"] == "model.layers.0.mlp.gate" and found["near_tie"]
    assert (found["differing"], found["rows"]) == (1, 24)
    [margin], [resolution] = found["margins"], found["resolutions"]
    assert 5e-4 < margin < resolution  # 8.9e-4 against one unit of bfloat16 at those logits (1.4e-3)
    assert "routing flipped for 1 of 24 tokens" in headline(report)
    noted = [row for row in report.rows if "teacher-forced" in row.note]
    assert noted and all("routing flipped for 1 of 24 tokens" in row.note for row in noted)


def _softmax_before_top_k(self: MoeLayer, x: torch.Tensor) -> torch.Tensor:
    """Every logit softmaxed in the model's dtype, the top-k of those probabilities kept as the weights, never
    renormalised: a routing rule of its own (Mixtral softmaxes the top-k logits alone)."""
    flat = x.reshape(-1, x.shape[-1])
    weights, chosen = torch.topk(F.softmax(self.gate(flat), dim=-1), self.top_k, dim=-1)
    results = torch.zeros_like(flat)
    for number, expert in enumerate(self.experts):
        tokens, slot = torch.where(chosen == number)
        if tokens.numel():
            results[tokens] += weights[tokens, slot, None] * expert(flat[tokens])
    return results.view_as(x)


def test_softmax_before_top_k_still_fails_with_the_reference_decisions(tmp_path):
    case = seeded("mixtral", torch.bfloat16, FLIPS)
    for layer in case.candidate.layers:
        layer.feed_forward.forward = MethodType(_softmax_before_top_k, layer.feed_forward)
    report = _judge(case, tmp_path)
    assert not report.passed
    forced = [found for found in report.decisions if found["near_tie"]]
    assert forced, report.decisions  # the near tie was fed the reference's choice, and the run fails all the same
    assert any(row.path.endswith("mlp") and row.verdict == "fail" for row in report.rows)


@pytest.mark.parametrize(("dtype", "seed", "factor"), [(torch.float32, 0, 1.01), (torch.bfloat16, FLIPS, 1.1)])
def test_a_wrong_expert_weight_is_named_at_the_expert(dtype, seed, factor, tmp_path):
    case = seeded("mixtral", dtype, seed)
    with torch.no_grad():
        case.candidate.layers[0].feed_forward.experts[3].w2.weight.mul_(factor)
    result = paritylab.check(
        case.reference, case.candidate, tmp_path, reference_call=case.reference_call,
        candidate_call=case.candidate_call, echo=None,
    )  # fmt: skip
    report = result.report
    assert not report.passed
    assert report.first_divergence is not None and report.first_divergence.path == "model.layers.0.mlp"
    assert report.drilldown is not None
    assert report.drilldown["operation"] == "parameter experts.3.w2.weight", report.drilldown["message"]
    # before: the dispatch's ``results[tokens] += ...`` was lost to the recording, and every MoE bug was named
    # ``zeros_like(...)`` against an unrelated reference operation
    assert "zeros_like" not in report.drilldown["message"]


def test_an_expert_output_plant_is_named_inside_that_expert(tmp_path):
    case = seeded("mixtral", torch.float32, 0)
    expert = case.candidate.layers[1].feed_forward.experts[5]
    expert.register_forward_hook(lambda module, args, output: output * 1.01)
    report = paritylab.check(
        case.reference, case.candidate, tmp_path, reference_call=case.reference_call,
        candidate_call=case.candidate_call, echo=None,
    ).report  # fmt: skip
    assert report.first_divergence is not None and report.first_divergence.path == "model.layers.1.mlp"
    assert report.drilldown is not None and report.drilldown["operation"] == "experts.5: mul"
    assert "(constants: 1.01 vs the reference's none)" in report.drilldown["message"]


# -- the parts, on values made by hand ----------------------------------------------------------------------------


class _Router(nn.Module):
    """Top-2 of four scores, on the scores themselves or on their softmax."""

    def __init__(self, softmax: bool) -> None:
        super().__init__()
        self.softmax = softmax

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        ranked = F.softmax(scores.float(), dim=-1) if self.softmax else scores
        weights, chosen = torch.topk(ranked, 2, dim=-1)
        return weights.sum(-1) + chosen.sum(-1).to(weights.dtype)


def test_margins_are_measured_on_the_scores_before_the_softmax():
    reference_scores = torch.tensor([[1.0, 0.5, 0.501, -1.0], [2.0, 1.0, -1.0, 0.0], [0.0, 3.0, 2.0, 2.25]])
    candidate_scores = reference_scores.clone()
    candidate_scores[0, 1] = 0.502  # the first row's second and third swap: a 1e-3 tie at 0.5 (a near tie in bf16)
    candidate_scores[2, 3] = 1.5  # the third row's swap by 0.25: no rounding does that
    reference = record_call(_Router(softmax=True), "", 0, lambda m: m(reference_scores))
    candidate = record_call(_Router(softmax=False), "", 0, lambda m: m(candidate_scores))
    [(theirs, ours)] = pair_decisions(reference, candidate)
    assert (theirs.op.name, ours.op.name) == ("topk", "topk")
    [found] = compare_decisions(reference, candidate, torch.bfloat16)
    assert (found.differing, found.rows) == (2, 3)
    assert found.margins == pytest.approx([0.001, 0.25], rel=1e-4)  # logits, not probabilities
    assert found.resolutions == pytest.approx([2**-8 * 1.0, 2**-8 * 3.0])
    assert not found.near_tie  # the second swap, 0.25, is beyond TIE units of 3 * 2**-8
    candidate_scores[2, 3] = 2.25 - 1e-4  # now only rounding-sized swaps: a near tie
    candidate = record_call(_Router(softmax=False), "", 0, lambda m: m(candidate_scores))
    [found] = compare_decisions(reference, candidate, torch.bfloat16)
    assert found.differing == 1 and found.near_tie


def test_forced_decisions_substitute_the_reference_choices_in_call_order():
    scores = torch.tensor([[1.0, 0.5, 0.501, -1.0], [2.0, 1.0, -1.0, 0.0]])
    model = _Router(softmax=False)
    reference_choice = torch.tensor([[0, 1], [0, 1]])
    plan = {"#0": {0: {"*": reference_choice}}}
    with forced_decisions(model, plan) as replaced:
        forced = model(scores)
    assert replaced == {"#0": 1}
    # the selected scores follow the substituted indices: 1.0 + 0.5 and 2.0 + 1.0, plus the indices' sum 1
    assert forced.tolist() == pytest.approx([1.5 + 1, 3.0 + 1])
    assert model(scores).tolist() == pytest.approx([1.501 + 2, 3.0 + 1])  # unforced: its own choice again
    choices = captured(model, lambda m: m(scores))
    assert [c.tolist() for c in choices] == [[[0, 2], [0, 1]]]
    assert everywhere(lambda m: m(scores), [reference_choice])(model).tolist() == pytest.approx(forced.tolist())


def test_the_dimension_of_a_selection_is_read_from_its_shapes_and_values():
    scores = torch.tensor([[3.0, 1.0], [4.0, 2.0]])  # along 0: rows 1, 0; along 1: columns 0, 0
    values, indices = torch.max(scores, dim=0)
    assert decision_dim(scores, indices, values) == 0
    values, indices = torch.max(scores, dim=1)
    assert decision_dim(scores, indices, values) == 1
    assert decision_dim(scores, torch.argmax(scores)) is None


def _reorder_router(moe: MoeLayer, order: list[int], experts_too: bool) -> None:
    """The router's rows (one per expert) put in ``order``; with ``experts_too``, the experts reordered alike: a port
    that numbers its experts otherwise and computes the same thing."""
    with torch.no_grad():
        moe.gate.weight.copy_(moe.gate.weight[order].clone())
    if experts_too:
        moe.experts = nn.ModuleList(moe.experts[i] for i in order)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_router_whose_rows_are_exchanged_is_named_with_its_layout(dtype, tmp_path):
    """A conversion that swaps the two halves of a router's rows sends every token to other experts. Compared with
    its features put back in the reference's order, the router's logits agree (a layout other code may well read in
    its own order); the top-k reads them as expert numbers, so the router is where divergence starts: named there,
    with its weight's rows and how many choices flipped, not as a routing rule that differs at the MoE block."""
    case = seeded("mixtral", dtype, 0)
    _reorder_router(case.candidate.layers[0].feed_forward, [4, 5, 6, 7, 0, 1, 2, 3], experts_too=False)
    report = _judge(case, tmp_path)
    line = headline(report)
    assert report.first_divergence is not None and report.first_divergence.path == "model.layers.0.mlp.gate", line
    assert "a choice takes their positions as indices (routing flipped for 21 of 24 tokens)" in line
    assert "rows 0-3 hold the reference's rows 4-7, rows 4-7 hold the reference's rows 0-3" in line
    assert "the decision rule differs" not in line and "the scores it chose from are in another order" in line
    block = next(row for row in report.rows if row.path == "model.layers.0.mlp")
    assert block.cause == "contains-origin"


def test_a_router_and_its_experts_reordered_alike_is_a_layout_not_a_bug(tmp_path):
    """The same rows exchanged, with the experts renumbered to match: the MoE block computes what the reference's does.
    The run passes; with a bug planted in the second layer's attention, that bug is named, never the first router,
    whose choices (expert numbers) differ from the reference's on every token."""
    case = seeded("mixtral", torch.float32, 0)
    _reorder_router(case.candidate.layers[0].feed_forward, [4, 5, 6, 7, 0, 1, 2, 3], experts_too=True)
    report = _judge(case, tmp_path / "clean")
    assert report.passed, headline(report)
    case.candidate.layers[1].attention.register_forward_hook(lambda _m, _a, out: out * 1.01)
    report = _judge(case, tmp_path / "planted")
    assert report.first_divergence is not None and report.first_divergence.path == "model.layers.1.self_attn"


def _experts_reversed(self: MoeLayer, x: torch.Tensor) -> torch.Tensor:
    """The experts in reverse order: the tokens the router sends to expert ``e`` are computed by expert ``7 - e``."""
    flat = x.reshape(-1, x.shape[-1])
    weights, chosen = torch.topk(self.gate(flat), self.top_k, dim=-1)
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(x.dtype)
    results = torch.zeros_like(flat)
    for number, expert in enumerate(reversed(self.experts)):
        tokens, slot = torch.where(chosen == number)
        if tokens.numel():
            results[tokens] += weights[tokens, slot, None] * expert(flat[tokens])
    return results.view_as(x)


@pytest.mark.parametrize(
    ("bug", "layer", "own"), [(_experts_reversed, 0, (1.2, 1.5)), (_softmax_before_top_k, 1, (0.6, 0.8))]
)
def test_a_wrong_routing_rule_is_named_at_the_moe_block_not_at_the_experts_activation(bug, layer, own, tmp_path):
    """transformers' Mixtral calls its weightless ``act_fn`` once per expert inside the fused experts module; paired
    by order and shape with the port's ``experts.N.w1`` (a module holding weights), the activation was named for
    every O(1) MoE bug in the first layer (``divergence starts at model.layers.0.mlp.experts.act_fn``). A module
    holding weights never pairs with one holding none: the bug is named at the MoE block whose code routes."""
    case = seeded("mixtral", torch.float32, 0)
    moe = case.candidate.layers[layer].feed_forward
    moe.forward = MethodType(bug, moe)
    report = paritylab.check(
        case.reference, case.candidate, tmp_path, reference_call=case.reference_call,
        candidate_call=case.candidate_call, echo=None,
    ).report  # fmt: skip
    assert not report.passed
    origin = report.first_divergence
    assert origin is not None and origin.path == f"model.layers.{layer}.mlp", headline(report)
    assert own[0] < origin.local["local_rel_l2"] < own[1]  # 1.37 and 0.706: the block's own error, O(1)
    paired = report.alignment.by_reference()
    assert not [key for key in paired if ".experts.act_fn" in key]
    assert not [row for row in report.rows if "act_fn" in row.path and row.status == "compared"]
