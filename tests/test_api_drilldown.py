"""``paritylab.check`` from Python says what the command line says: the table, the verdict line and, when parity
fails, the drill-down's "inside <module>: ..." line naming the first operation that differs (``drilldown=False``
skips it); ``echo=None`` prints nothing."""

from __future__ import annotations

import torch
from torch import nn

import paritylab
from paritylab.reports.render import operation_line, to_console


class Block(nn.Module):
    def __init__(self, scale: float = 0.5) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x)) * self.scale


class Model(nn.Module):
    def __init__(self, scale: float = 0.5) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.block = Block(scale)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.inp(x)))


X = torch.linspace(-1, 1, 12).reshape(3, 4)


def pair(scale: float) -> tuple[Model, Model]:
    torch.manual_seed(0)
    reference = Model()
    candidate = Model(scale)
    candidate.load_state_dict(reference.state_dict())
    return reference, candidate


def test_check_prints_and_returns_the_drill_down_like_the_command_line(tmp_path):
    said: list[str] = []
    reference, candidate = pair(0.51)  # the block's constant is off by 2%
    result = paritylab.check(reference, candidate, tmp_path / "bug", reference_call=lambda m: m(X), echo=said.append)
    assert result.verdict == "fail" and result.report.first_divergence.path == "block"
    found = result.report.drilldown
    assert found is not None and found["operation"] == "mul", found
    inside = operation_line(result.report)
    assert inside is not None and inside.startswith("  inside block: ")
    assert "constants: 0.51 vs the reference's 0.5" in inside
    assert said == [to_console(result.report)]  # the command line's findings, the drill-down included
    assert said[0].splitlines()[-1] == inside

    quiet: list[str] = []
    plain = paritylab.check(
        reference, candidate, tmp_path / "plain", reference_call=lambda m: m(X), drilldown=False, echo=quiet.append
    )
    assert plain.verdict == "fail" and plain.report.drilldown is None
    assert not any("inside" in line for line in quiet[0].splitlines())


def test_a_passing_check_opens_nothing_and_echo_none_prints_nothing(tmp_path, capsys):
    reference, candidate = pair(0.5)
    result = paritylab.check(reference, candidate, tmp_path, reference_call=lambda m: m(X), echo=None)
    assert result.verdict == "pass" and result.report.drilldown is None
    assert capsys.readouterr().out == ""
