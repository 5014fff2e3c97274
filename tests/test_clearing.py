"""Evidence that clears: a bf16 candidate whose code rounds more than the reference's (another order of operations)
has an own error beyond the reference's floor, but its code computes the reference's values in float32 with the
same weights. The lifted replay says so: the row passes with a note, and one false origin never hides a real bug
after it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paritylab.comparison.attribution import CLEARED
from paritylab.reports.render import headline
from paritylab.run.parity import check


class Roundabout(nn.Linear):
    """A linear layer that adds 2 and takes it away again: exact in float32 (to 1e-7), several units of bfloat16's
    last place; ``gain`` plants a real bug."""

    def __init__(self, *args: int, detour: float = 2.0, gain: float = 1.0) -> None:
        super().__init__(*args)
        self.detour, self.gain = detour, gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return ((y + self.detour) - self.detour) * self.gain


class Net(nn.Module):
    def __init__(self, b: nn.Module | None = None, c: nn.Module | None = None) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 64), b or nn.Linear(64, 64), c or nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def run(tmp_path, b: nn.Module | None = None, c: nn.Module | None = None):
    torch.manual_seed(0)
    reference = Net()
    candidate = Net(b, c)
    candidate.load_state_dict(reference.state_dict())
    candidate = candidate.to(torch.bfloat16)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    return check(reference, candidate, tmp_path, reference_call=lambda m: m(x.to(next(m.parameters()).dtype))).report


def test_an_own_error_the_lifted_replay_clears_passes_with_a_note(tmp_path):
    report = run(tmp_path, b=Roundabout(64, 64))
    assert report.verdict == "pass", headline(report)
    row = next(row for row in report.rows if row.path == "b")
    assert row.local[CLEARED] == 1.0
    assert row.local["local_rel_l2"] > 4.5 * row.local["local_floor"]  # beyond the floor: failed before
    assert row.local["lifted_rel_l2"] == pytest.approx(0.0, abs=1e-5)
    assert "the two implementations round differently, not a bug" in row.note


def test_a_real_bug_in_the_same_module_is_not_cleared(tmp_path):
    report = run(tmp_path, b=Roundabout(64, 64, gain=1.01))
    assert report.verdict == "fail"
    assert report.first_divergence is not None and report.first_divergence.path == "b"


def test_a_later_independent_bug_is_named_after_a_cleared_origin(tmp_path):
    report = run(tmp_path, b=Roundabout(64, 64), c=Roundabout(64, 8, detour=0.0, gain=1.01))
    assert report.verdict == "fail"
    assert report.first_divergence is not None and report.first_divergence.path == "c", headline(report)
    assert next(row for row in report.rows if row.path == "b").verdict == "pass"


def test_an_excess_beyond_a_few_units_of_the_last_place_is_not_cleared(tmp_path):
    report = run(tmp_path, b=Roundabout(64, 64, detour=4.0))
    assert report.verdict == "fail"
    assert report.first_divergence is not None and report.first_divergence.path == "b"


def test_two_real_bugs_are_both_origins_ranked_earliest_first(tmp_path):
    """A bug in ``b`` and another in ``c`` (each ×1.01, neither cleared): both are origins, ``b`` first, and ``c``
    is no mere heir of ``b``'s error: its own replay, fed the reference's input, fails on its own."""
    report = run(tmp_path, b=Roundabout(64, 64, detour=0.0, gain=1.01), c=Roundabout(64, 8, detour=0.0, gain=1.01))
    assert report.verdict == "fail"
    assert [row.path for row in report.origins] == ["b", "c"], headline(report)
    assert report.first_divergence is not None and report.first_divergence.path == "b"
    c = next(row for row in report.rows if row.path == "c")
    assert c.cause == "origin" and c.local["local_rel_l2"] == pytest.approx(0.01, rel=0.2)
