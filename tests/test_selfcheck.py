"""The alignment checks what it proposed against the traces, and reads weight-proven pairs the way their weights
say: rows in another order, norms stored as ``w - 1``, pairs by order that their users refute (the layouts of
x-transformers' Llama, whose whole pair is ``tests/pairs.py::xtransformers_llama``)."""

from __future__ import annotations

import pytest
import torch
import yaml
from torch import nn

import paritylab
from paritylab.comparison.alignment import parse_rules

X = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(3))


class Norm(nn.Module):
    """An RMS norm holding its scale as ``w`` (``offset=0``) or as ``g = w - 1`` (``offset=1``: Gemma's layout)."""

    def __init__(self, width: int, offset: float = 0.0) -> None:
        super().__init__()
        self.scale, self.offset = nn.Parameter(torch.ones(width)), offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (self.scale + self.offset)


class Table(nn.Module):
    """Per-position angles, or (``cosine``) their cosines: the same shape either way."""

    def __init__(self, cosine: bool) -> None:
        super().__init__()
        self.cosine = cosine
        self.register_buffer("frequencies", torch.linspace(0.1, 1.0, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        angles = torch.arange(x.shape[1], dtype=x.dtype)[:, None] * self.frequencies
        return angles.cos() if self.cosine else angles


class Block(nn.Module):
    """norm -> projection (times a positional table's cosines) -> GELU -> head."""

    def __init__(self, offset: float = 0.0, cosine: bool = True, norm: str = "norm") -> None:
        super().__init__()
        self.norm_name = norm
        setattr(self, norm, Norm(8, offset))
        setattr(self, "table" if cosine else "positions", Table(cosine))  # another layout, another name
        self.proj, self.head = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = self.table(x) if hasattr(self, "table") else self.positions(x)
        cosines = table.cos() if hasattr(self, "positions") else table
        # the activation a function: a layout the projection's rows set holds until the head reads it
        return self.head(nn.functional.gelu(self.proj(getattr(self, self.norm_name)(x)) * cosines))


def _pair(permuted: bool = False, offset: bool = False, angles: bool = False) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    reference = Block().eval()
    with torch.no_grad():
        reference.norm.scale.add_(0.1 * torch.randn(8))
    candidate = Block(offset=1.0 if offset else 0.0, cosine=not angles, norm="ln" if offset else "norm").eval()
    state = reference.state_dict()
    if offset:  # another name too: only its weights can pair it
        state["ln.scale"] = state.pop("norm.scale") - 1
    if permuted:  # the projection's rows in another order, the head's columns to match: the same function
        order = torch.randperm(16, generator=torch.Generator().manual_seed(1))
        state["proj.weight"], state["proj.bias"] = state["proj.weight"][order], state["proj.bias"][order]
        state["head.weight"] = state["head.weight"][:, order]
        state["table.frequencies"] = state["table.frequencies"][order]  # the table follows (its rows: angles here)
    if angles:
        state["positions.frequencies"] = state.pop("table.frequencies")
    candidate.load_state_dict(state)
    return reference, candidate


def _check(tmp_path, reference, candidate, name):
    return paritylab.check(reference, candidate, tmp_path / name, reference_call=lambda m: m(X))


def _pair_of(result, path):
    return result.report.alignment.by_reference().get(f"{path}#0")


def test_rows_in_another_order_pair_with_the_reordering_and_a_bug_there_is_named(tmp_path):
    reference, candidate = _pair(permuted=True, angles=True)
    clean = _check(tmp_path, reference, candidate, "clean")
    assert clean.verdict == "pass", clean.report.first_divergence
    part = _pair_of(clean, "proj").candidate_part
    assert part is not None and part.whole and sorted(part.indices) == list(range(16))
    assert clean.report.rows[[r.path for r in clean.report.rows].index("proj")].metrics["rel_l2"] < 1e-6
    candidate.proj.register_forward_hook(lambda _m, _a, out: out * 1.01)
    bug = _check(tmp_path, reference, candidate, "bug")
    assert bug.verdict == "fail" and bug.report.first_divergence.path == "proj"


def test_a_norm_stored_as_w_minus_one_pairs_with_its_counterpart(tmp_path):
    reference, candidate = _pair(offset=True)
    clean = _check(tmp_path, reference, candidate, "clean")
    assert clean.verdict == "pass", clean.report.first_divergence
    assert _pair_of(clean, "norm").candidate == "ln#0" and _pair_of(clean, "norm").source == "structure"  # weights
    candidate.ln.register_forward_hook(lambda _m, _a, out: out + 0.01 * out.std())
    bug = _check(tmp_path, reference, candidate, "bug")
    assert bug.verdict == "fail" and bug.report.first_divergence.path == "norm"


@pytest.mark.parametrize("planted", [None, "head"])
def test_a_pair_by_order_whose_users_do_not_feel_its_difference_is_undone(tmp_path, planted):
    """The candidate's table returns angles where the reference's returns their cosines: paired by order and
    shape, they differ by O(1) while the block that uses them agrees; the pair is undone with a note instead of
    being named the origin, and a bug elsewhere is still named where it is."""
    reference, candidate = _pair(angles=True)
    if planted:
        candidate.get_submodule(planted).register_forward_hook(lambda _m, _a, out: out * 1.01)
    result = _check(tmp_path, reference, candidate, planted or "clean")
    row = next(r for r in result.report.rows if r.path == "table")
    assert row.status == "unmatched" and "paired by order and shape only" in row.note and "does not" in row.note
    assert _pair_of(result, "table") is None
    if planted is None:
        assert result.verdict == "pass", result.report.first_divergence
    else:
        assert result.verdict == "fail" and result.report.first_divergence.path == planted


@pytest.mark.parametrize("planted", [None, "blocks.1"])
def test_a_pair_by_path_whose_users_do_not_feel_its_difference_is_undone(tmp_path, planted):
    """A port that kept the original's module names: its ``rotary``, of its own class, returns the angles where
    the reference's returns their cosine and sine. Paired by the equal path, they differ by O(1) while the
    attention that uses them agrees: not one computation, undone with a note, so the clean port passes (it
    failed, naming ``rotary``), and a bug elsewhere is still named where it is. (Modules of one class under one
    path are the same model's, as in a sharded run, and are not doubted: ``tests/test_distributed.py``.)"""
    from tests.test_lifted import RotaryTower

    torch.manual_seed(0)
    reference, candidate = RotaryTower().eval(), RotaryTower(angles=True).eval()
    candidate.load_state_dict(reference.state_dict())
    if planted:
        candidate.get_submodule(planted).register_forward_hook(lambda _m, _a, out: out * 1.01)
    x = torch.randn(1, 12, 16)
    result = paritylab.check(reference, candidate, tmp_path / (planted or "clean"), reference_call=lambda m: m(x))
    row = next(r for r in result.report.rows if r.path == "rotary")
    assert row.status == "unmatched" and "paired by its path only" in row.note and "blocks.0, which uses it" in row.note
    if planted is None:
        assert result.verdict == "pass", result.report.first_divergence
    else:
        assert result.verdict == "fail" and result.report.first_divergence.path == planted


def test_columns_in_another_order_compare_the_input_in_the_reference_order_and_a_bug_there_is_named(tmp_path):
    """The head reads the projection's features in the candidate's order (its weight's columns permuted to match):
    what it is fed is compared in the reference's order, so a bug in the head is the head's, not its parent's."""
    reference, candidate = _pair(permuted=True, angles=True)
    clean = _check(tmp_path, reference, candidate, "clean")
    assert clean.verdict == "pass", clean.report.first_divergence
    order = _pair_of(clean, "head").candidate_input_part
    assert order is not None and sorted(order.indices) == list(range(16))
    head = clean.report.rows[[r.path for r in clean.report.rows].index("head")]
    assert head.input_metrics["rel_l2"] < 1e-6  # fed alike, once read in the reference's order
    pinned = {rule.reference: rule for rule in parse_rules(yaml.safe_load(clean.report.alignment.to_yaml()))}
    assert pinned["head"].candidate_input_order == order  # a frozen alignment keeps both orders, as orders
    assert (
        pinned["proj"].candidate_part == _pair_of(clean, "proj").candidate_part and pinned["proj"].candidate_part.whole
    )
    candidate.head.register_forward_hook(lambda _m, _a, out: out * 1.01)
    bug = _check(tmp_path, reference, candidate, "bug")
    assert bug.verdict == "fail" and bug.report.first_divergence.path == "head"


class GatedMLP(nn.Module):
    """transformers' layout: ``down(act(gate(x)) * up(x))``, the product in the MLP's own code."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.act, self.down = nn.Linear(8, 16), nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x)) * self.up(x))


class GLU(nn.Module):
    """x-transformers' layout: gate and up fused in one projection, the product returned by a module of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.act = nn.Linear(8, 32), nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, gate = self.proj(x).chunk(2, dim=-1)
        return up * self.act(gate)


class FusedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.glu, self.down = GLU(), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.glu(x))


def _mlps() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    reference, candidate = nn.Sequential(GatedMLP(), GatedMLP()).eval(), nn.Sequential(FusedMLP(), FusedMLP()).eval()
    state = reference.state_dict()
    converted = {}
    for i in range(2):
        for kind in ("weight", "bias"):
            converted[f"{i}.glu.proj.{kind}"] = torch.cat([state[f"{i}.up.{kind}"], state[f"{i}.gate.{kind}"]])
            converted[f"{i}.down.{kind}"] = state[f"{i}.down.{kind}"]
    candidate.load_state_dict(converted)
    return reference, candidate


@pytest.mark.parametrize("planted", [None, "0.glu", "1.glu"])
def test_a_refuted_pair_is_repaired_with_the_call_inside_that_computes_its_value(tmp_path, planted):
    """The activation, paired by order and shape with the GLU (which returns the gated product), is refuted by
    its users and re-paired with the GLU's own activation, whose output is its value; in every block alike. A bug
    in the product is then the reference MLP's own code's, not the activation's. Values choose the repair: where
    they agree to rounding, or, past a bug (the blocks after the planted one), to within a few times what the
    activation was handed, which is far from the O(1) of the wrong pair (x-transformers' first block named the
    activation for a bug in its GLU's product: its second block, past the bug, was not repaired, so neither was
    the first, which follows it). The alignment now pairs the activation with the ``act`` itself: a weightless
    module is never paired with one holding weights (``tests/test_weightless_pairs.py``), and the one weightless
    call of its shape in its parent's counterpart is its pair; the pairs checked here are the same."""
    reference, candidate = _mlps()
    if planted:
        candidate.get_submodule(planted).register_forward_hook(lambda _m, _a, out: out * 1.01)
    result = _check(tmp_path, reference, candidate, planted or "clean")
    for i in range(2):
        pair = _pair_of(result, f"{i}.act")
        assert (pair.candidate if pair else None) == f"{i}.glu.act#0"
    if planted is None:
        assert result.verdict == "pass", result.report.first_divergence
    else:
        assert result.verdict == "fail" and result.report.first_divergence.path == planted.split(".")[0]
