"""Hook points (identity modules that hand a value on, as in TransformerLens) and code with no module between
them: a bug planted at one is named at the reference module that computes the value it hands on, never one
module before or after (:mod:`paritylab.comparison.verify`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paritylab


class HookPoint(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class ReferenceMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc_in, self.act, self.fc_out = nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.act(self.fc_in(x)))


class HookedMLP(nn.Module):
    """The activation is a plain function between two hook points."""

    def __init__(self, activation: Callable[[torch.Tensor], torch.Tensor] = F.gelu) -> None:
        super().__init__()
        self.W_in, self.hook_pre, self.hook_post, self.W_out = (
            nn.Linear(16, 64),
            HookPoint(),
            HookPoint(),
            nn.Linear(64, 16),
        )
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.W_out(self.hook_post(self.activation(self.hook_pre(self.W_in(x)))))


class Cubic(nn.Module):
    """An activation module that is almost the identity: a wrong one where GELU belongs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1e-3 * x**3


class ModuleMLP(HookedMLP):
    def __init__(self) -> None:
        super().__init__()
        self.act = Cubic()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.W_out(self.hook_post(self.act(self.hook_pre(self.W_in(x)))))


class Model(nn.Module):
    def __init__(self, mlp: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        self.blocks = nn.ModuleList(mlp() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _pair(mlp: Callable[[], nn.Module] = HookedMLP) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    reference, candidate = Model(ReferenceMLP), Model(mlp)
    renamed = {k.replace("fc_in", "W_in").replace("fc_out", "W_out"): v for k, v in reference.state_dict().items()}
    candidate.load_state_dict(renamed)
    return reference, candidate


X = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))


def _named(tmp_path, candidate: nn.Module, reference: nn.Module, site: str | None) -> paritylab.ParityResult:
    if site is not None:
        candidate.get_submodule(site).register_forward_hook(lambda _m, _a, out: out * 1.01)
    return paritylab.check(reference, candidate, tmp_path, reference_call=lambda m: m(X))


@pytest.mark.parametrize(
    ("site", "expected"),
    [
        ("blocks.1.hook_post", "blocks.1.act"),  # after the activation: the value act computes
        ("blocks.1.hook_pre", "blocks.1.fc_in"),  # before it: the value fc_in computes, changed after it
        ("blocks.0.hook_pre", "blocks.0.fc_in"),
        ("blocks.1.W_in", "blocks.1.fc_in"),  # the module itself
        ("blocks.0.W_out", "blocks.0.fc_out"),
    ],
)
def test_a_bug_at_a_hook_point_is_named_at_the_module_that_computes_its_value(tmp_path, site, expected):
    reference, candidate = _pair()
    result = _named(tmp_path, candidate, reference, site)
    assert result.verdict == "fail"
    assert result.report.first_divergence.path == expected
    from paritylab.reports.render import headline

    line = headline(result.report)
    assert "own error 0 " not in line and "(rel_l2 0)" not in line  # never a number that contradicts the blame
    if site.endswith("hook_pre"):
        assert f"the candidate changes its value after it: {site} returns it with relative error 0.01" in line


def test_a_clean_hooked_port_passes_and_its_hook_points_stay_folded(tmp_path):
    reference, candidate = _pair()
    result = _named(tmp_path, candidate, reference, None)
    assert result.verdict == "pass"
    folded = {key.rsplit("#", 1)[0] for key in result.report.alignment.folded_candidate}
    assert {f"blocks.{i}.hook_{p}" for i in (0, 1) for p in ("pre", "post")} <= folded


def test_a_wrong_activation_module_that_is_almost_the_identity_is_named_itself(tmp_path):
    """A module whose kind computes something (no call of its class hands its input on) stays paired with its
    counterpart however close to the identity it is: its own difference is the bug, named at act."""
    reference, candidate = _pair(ModuleMLP)
    result = _named(tmp_path, candidate, reference, None)
    assert result.verdict == "fail" and result.report.first_divergence.path == "blocks.0.act"


class ReferenceBlock(nn.Module):
    """A pre-norm block whose MLP is three modules called from the block's own code."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc_in, self.act, self.fc_out = nn.LayerNorm(16), nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc_out(self.act(self.fc_in(self.norm(x))))


class WrappedBlock(nn.Module):
    """The same block with its MLP inside an ``nn.Sequential`` the reference does not have (no module there
    holds exactly its weights: it stays unmatched, its children paired)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(16), nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def _wrapped(dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    reference, candidate = Model(ReferenceBlock), Model(WrappedBlock)
    names = {"fc_in": "mlp.0", "fc_out": "mlp.2"}
    renamed = {}
    for key, value in reference.state_dict().items():
        for old, new in names.items():
            key = key.replace(f".{old}.", f".{new}.")
        renamed[key] = value
    candidate.load_state_dict(renamed)
    return reference, candidate.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_bug_in_a_wrapper_only_one_side_has_is_named_at_the_module_whose_value_it_changes(tmp_path, dtype):
    """The Sequential stays unmatched; its other call hands its last child's output on exactly, so a 1 % change
    at this one is named at the reference's ``fc_out``, whose value it changes (before: at the enclosing block
    in fp32, and a PASS in bf16); the clean pair passes."""
    reference, candidate = _wrapped(dtype)
    call = {"reference_call": lambda m: m(X), "candidate_call": lambda m: m(X.to(dtype))}
    clean = paritylab.check(reference, candidate, tmp_path / "clean", **call)
    assert clean.verdict == "pass", clean.report.first_divergence
    assert "blocks.1.mlp#0" in clean.report.alignment.unmatched_candidate
    candidate.blocks[1].mlp.register_forward_hook(lambda _m, _a, out: out * 1.01)
    result = paritylab.check(reference, candidate, tmp_path / "bug", **call)
    assert result.verdict == "fail" and result.report.first_divergence.path == "blocks.1.fc_out"
    assert "blocks.1.mlp returns it with relative error" in result.report.first_divergence.note


@pytest.mark.parametrize(
    ("site", "expected", "said"),
    [
        ("blocks.1.hook_pre", "blocks.1.fc_in", "blocks.1.hook_pre returns it with relative error 0.001"),
        ("blocks.0.hook_post", "blocks.0.act", "1.00e-03 relative error"),  # paired with act, handed its output
    ],
)
def test_a_hook_point_bug_that_bf16_rounds_away_is_named_by_the_lifted_replay(tmp_path, site, expected, said):
    """×1.001 at a hook point of a bf16 candidate changes no value the candidate computes (it rounds back), yet the
    code is wrong: the float32 copy with the same weights sees the hook change its input, and names the module
    whose value it hands on (before: the enclosing block; or the right module with an error of 1.08, the hook
    point having been fed act's input in the replay)."""
    reference, candidate = _pair()
    candidate = candidate.to(torch.bfloat16)
    call = {"reference_call": lambda m: m(X), "candidate_call": lambda m: m(X.to(torch.bfloat16))}
    assert paritylab.check(reference, candidate, tmp_path / "clean", **call).verdict == "pass"
    with torch.no_grad():
        before = candidate(X.to(torch.bfloat16))
        handle = candidate.get_submodule(site).register_forward_hook(lambda _m, _a, out: out * 1.001)
        assert torch.equal(candidate(X.to(torch.bfloat16)), before)  # no value of the candidate's run changed
    result = paritylab.check(reference, candidate, tmp_path / "bug", **call)
    handle.remove()
    assert result.verdict == "fail" and result.report.first_divergence.path == expected
    note = result.report.first_divergence.note
    assert said in note and "computed in float32" in note


def test_a_wrapper_change_that_bf16_rounds_away_is_named_by_the_lifted_replay(tmp_path):
    """×1.001 at the wrapper only the candidate has (a Sequential around the MLP), in bf16, changes no value the
    candidate computes; in the float32 replay the wrapper returns another value than its last child made, while
    its other call returns it exactly: named at the reference's ``fc_out`` (before: the enclosing block)."""
    reference, candidate = _wrapped(torch.bfloat16)
    call = {"reference_call": lambda m: m(X), "candidate_call": lambda m: m(X.to(torch.bfloat16))}
    with torch.no_grad():
        before = candidate(X.to(torch.bfloat16))
        candidate.blocks[1].mlp.register_forward_hook(lambda _m, _a, out: out * 1.001)
        assert torch.equal(candidate(X.to(torch.bfloat16)), before)  # no value of the candidate's run changed
    result = paritylab.check(reference, candidate, tmp_path, **call)
    assert result.verdict == "fail" and result.report.first_divergence.path == "blocks.1.fc_out"
    assert "blocks.1.mlp returns it with relative error 0.001" in result.report.first_divergence.note
