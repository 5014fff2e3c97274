"""Every output a model returns counts: a wrong second output, a flipped mask or a wrong integer fails the run;
what cannot be paired is counted as not compared (never a PASS); what the candidate does not return is said."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn
from transformers.utils import ModelOutput

import paritylab


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.proj(self.embed(ids))
        return self.head(hidden), hidden


@dataclass
class Output(ModelOutput):
    logits: torch.Tensor | None = None
    scores: torch.Tensor | None = None


class Model(nn.Module):
    """Returns ``kind`` of outputs, with ``fault`` applied to the second one (computed in the model's own code,
    where no module's row would see it)."""

    def __init__(self, kind: str, fault: str = "") -> None:
        super().__init__()
        self.body, self.kind, self.fault = Body(), kind, fault

    def forward(self, ids: torch.Tensor):
        logits, hidden = self.body(ids)
        mask = ids > 7
        scores = hidden.sum(-1) * 2.0
        count = int(mask.sum())
        if self.fault == "mask":
            mask = ~mask
        elif self.fault == "scores":
            scores = scores * 1.01
        elif self.fault == "count":
            count += 1
        if self.kind == "tuple":
            return logits, mask
        if self.kind == "scores":
            return logits, scores
        if self.kind == "dict":
            return {"logits": logits, "extras": {"count": count, "mask": mask}}
        if self.kind == "model_output":
            return Output(logits=logits, scores=scores)
        if self.kind == "logits":
            return logits
        if self.kind == "renamed":  # a field the reference does not have, beside one it has
            return {"logits": logits, "weights": scores}
        if self.kind == "named":
            return {"logits": logits, "scores": scores}
        raise AssertionError(self.kind)


IDS = torch.tensor([[1, 9, 3, 12, 7, 15]])


def check(tmp_path, reference: nn.Module, candidate: nn.Module) -> paritylab.ParityResult:  # type: ignore[name-defined]
    return paritylab.check(reference, candidate, tmp_path, reference_call=lambda m: m(IDS), noise_floor="off")


def root_row(result):
    return next(row for row in result.report.rows if row.depth == 0)


@pytest.mark.parametrize(
    ("kind", "fault", "slot"),
    [
        ("tuple", "mask", "outputs.1"),  # a bool mask flipped: compared exactly
        ("scores", "scores", "outputs.1"),  # a second float output 1 % off
        ("dict", "count", "outputs.extras.count"),  # an int in a nested dict
        ("dict", "mask", "outputs.extras.mask"),
        ("model_output", "scores", "outputs.scores"),  # a ModelOutput's second field
    ],
)
def test_a_wrong_output_beside_the_first_fails_the_run_at_the_model(tmp_path, kind, fault, slot):
    result = check(tmp_path, Model(kind), Model(kind, fault))
    assert result.verdict == "fail" and result.exit_code == 1
    root = root_row(result)
    assert root.verdict == "fail" and root.rel_l2 == 0.0  # the first output agrees exactly
    (failed,) = [check for check in root.outputs if check.verdict == "fail"]
    assert failed.reference == slot and failed.candidate == slot
    assert f"{slot} differs" in root.note
    assert result.report.first_divergence is root  # the module whose own code made the difference
    from paritylab.reports.render import headline

    assert f"divergence starts at <root> ({slot} differs (" in headline(result.report)  # not "own error 0"
    body_rows = [row for row in result.report.rows if row.path.startswith("body")]
    assert body_rows and all(row.verdict == "pass" for row in body_rows)


@pytest.mark.parametrize("kind", ["tuple", "scores", "dict", "model_output", "named"])
def test_correct_copies_pass_with_every_output_compared(tmp_path, kind):
    result = check(tmp_path, Model(kind), Model(kind))
    assert result.verdict == "pass", result.report.summary()
    root = root_row(result)
    assert root.outputs and {check.verdict for check in root.outputs} == {"pass"}
    assert result.report.summary()["not_compared"] == 0


def test_an_output_that_pairs_with_nothing_is_not_compared_and_never_a_pass(tmp_path):
    """The reference returns ``scores``, the candidate ``weights``: which is which cannot be told."""
    result = check(tmp_path, Model("named"), Model("renamed", "scores"))
    assert result.verdict == "inconclusive" and result.exit_code == 3
    verdicts = {(check.reference, check.candidate): check.verdict for check in root_row(result).outputs}
    assert verdicts == {("outputs.scores", None): "not-compared", (None, "outputs.weights"): "extra"}
    assert result.report.summary()["not_compared"] == 1


def test_a_candidate_that_returns_less_is_judged_on_what_it_returns(tmp_path):
    """A port returning only logits does not claim the reference's other outputs: they are listed as absent."""
    result = check(tmp_path, Model("tuple"), Model("logits"))
    assert result.verdict == "pass"
    (absent,) = root_row(result).outputs
    assert (absent.reference, absent.verdict, absent.note) == (
        "outputs.1",
        "absent",
        "the candidate does not return it",
    )


class Pooled(nn.Module):
    """Returns ``(hidden, pooled)``, or (``only_pooled``) the pooled vector alone, made by its own code (a mean, a
    scale) where no module's call made it: data flow cannot pair it, its shape can."""

    def __init__(self, only_pooled: bool = False, scale: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.proj = nn.Embedding(16, 8), nn.Linear(8, 8)
        self.only_pooled, self.scale = only_pooled, scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        hidden = self.proj(self.embed(ids))
        pooled = hidden.mean(1) * self.scale
        return pooled if self.only_pooled else (hidden, pooled)


@pytest.mark.parametrize(("scale", "verdict"), [(1.0, "pass"), (1.01, "fail")])
def test_a_candidate_returning_only_a_later_output_is_compared_with_it(tmp_path, scale, verdict):
    """The reference returns ``(hidden, pooled)``, the port only ``pooled``, made by its own code: the root compares
    it with the reference's second output (the one its shape fits), not the first, so a correct port passes (it
    failed at the root before, "rel_l2 -") and a pooled vector 1 % off fails there; the hidden states are covered
    by the module that made them."""
    result = check(tmp_path, Pooled(), Pooled(only_pooled=True, scale=scale))
    root = root_row(result)
    assert result.verdict == verdict, result.report.summary()
    assert root.reference.slot == "outputs.1" and root.candidate is not None and root.candidate.slot == "outputs"
    assert root.rel_l2 == pytest.approx(0.0 if scale == 1.0 else 0.01, abs=1e-6)
    assert [(check.reference, check.verdict) for check in root.outputs] == [("outputs.0", "covered")]


def test_an_output_made_by_a_compared_module_is_covered_there(tmp_path):
    """``Body`` returns ``hidden`` as ``proj`` made it; the reference's body row compares its first output and
    its second is the very tensor the ``proj`` row compared."""
    result = check(tmp_path, Body(), Body())
    (covered,) = root_row(result).outputs
    assert covered.reference == "outputs.1" and covered.verdict in ("pass", "covered")
    assert result.verdict == "pass"


class Preprocessing(nn.Module):
    """A model whose own code changes its input in place: before computing (``before``) or after (``after``)."""

    def __init__(self, step: str) -> None:
        super().__init__()
        self.body, self.step = Body(), step

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.step == "before":
            ids %= 7
        logits, _ = self.body(ids)
        if self.step == "after":
            ids.zero_()
        return logits


@pytest.mark.parametrize(
    ("reference", "candidate", "verdict", "changed"),
    [
        # the reference preprocesses in place; the candidate lacks the step: it must not be fed the processed ids
        ("before", "", "fail", {"reference": ["inputs.args.0"]}),
        # the reference zeroes its input after computing: an identical copy must still be fed the real ids
        ("after", "", "pass", {"reference": ["inputs.args.0"]}),
        ("", "after", "pass", {"candidate": ["inputs.args.0"]}),
        ("before", "before", "pass", {"reference": ["inputs.args.0"], "candidate": ["inputs.args.0"]}),
    ],
)
def test_each_side_is_fed_its_own_copy_and_an_in_place_change_is_said(tmp_path, reference, candidate, verdict, changed):
    ids = IDS.clone()
    result = paritylab.check(
        Preprocessing(reference), Preprocessing(candidate), tmp_path, reference_call=lambda m: m(ids), noise_floor="off"
    )
    assert result.verdict == verdict
    assert torch.equal(ids, IDS)  # the caller's tensor is never changed
    assert result.report.inputs_changed == changed
    from paritylab.reports.render import headline

    side = next(iter(changed))
    assert f"the {side} changed its input inputs.args.0 in place (each side was fed its own copy)" in headline(
        result.report
    )


def test_a_candidate_that_changes_its_input_before_computing_is_blamed_where_it_does(tmp_path):
    """Its own code changed the ids before its embedding saw them: the run fails, the headline says which side
    changed which input, and the blame lands on the code that changed them (the root's own code), not on the
    embedding it fed: the tracer marks a value passed on after an in-place change, so other integer ids count
    as a wrong input there (and only there: docs/faults.md)."""
    from paritylab.reports.render import headline

    result = check(tmp_path, Preprocessing(""), Preprocessing("before"))
    assert result.verdict == "fail"
    line = headline(result.report)
    assert "the candidate changed its input inputs.args.0 in place" in line
    assert result.report.first_divergence is not None and result.report.first_divergence.path == ""
    assert "gives body.embed a value the reference does not" in line and "own error" not in line
    embed = next(row for row in result.report.rows if row.path == "body.embed")
    assert embed.verdict == "fail" and embed.input_verdict == "fail" and embed.cause != "origin"
    assert [row.path for row in result.report.origins][:1] == [""]
