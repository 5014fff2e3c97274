"""Position tables built from a wrong constant where the reference holds a table, not frequencies: GPT-J keeps its
rotary ``sin | cos`` as one buffer, TransformerLens builds ``rotary_sin`` and ``rotary_cos`` of its own (each sine
twice), a port may hold ``inv_freq``. No tensor of one side holds the other's values; the frequencies the reference's
table is built from, read from its values when it is fingerprinted, pair them, so a table scaled by 1.01 (a PASS in
bf16, under its noise) or built with another base is named at the module holding it."""

from __future__ import annotations

import math
import re

import numpy
import pytest
import torch
from torch import nn

from paritylab.comparison.weights import weight_ledger
from paritylab.reports.render import headline
from paritylab.run.parity import check
from paritylab.tracing.sinusoids import sinusoid_frequencies
from paritylab.tracing.structure import ModulePrint, fingerprint

DIM, POSITIONS, BASE = 16, 32, 10000.0


def frequencies(base: float = BASE, dim: int = DIM) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.int64) / dim)


def angles(base: float = BASE, positions: int = POSITIONS) -> torch.Tensor:
    return torch.arange(positions).float()[:, None] * frequencies(base)


def read(table: torch.Tensor) -> numpy.ndarray:
    return numpy.frombuffer(sinusoid_frequencies(table), dtype="<f8")


@pytest.mark.parametrize(
    "layout",
    [
        lambda a: torch.cat([a.sin(), a.cos()], 1),  # GPT-J
        lambda a: torch.repeat_interleave(a.sin(), 2, 1),  # TransformerLens' rotary_sin
        lambda a: torch.cat([a, a], 1).cos(),  # rotate_half's cos
        lambda a: torch.cat([a.cos(), a.sin()], 1).double(),
    ],
    ids=["sin|cos", "sin interleaved", "cos", "float64"],
)
@pytest.mark.parametrize("positions", [3, 2048])
def test_the_frequencies_a_table_is_built_from_are_read_from_its_values(layout, positions):
    table = layout(angles(positions=positions))
    if positions == 3 and not (table[0] == 0).any():  # a cosine changes by p**2 f**2 / 2: too little to read f by
        assert read(table).size == 0
        return
    found = read(table)
    assert found == pytest.approx(frequencies().double().numpy(), rel=1e-4)  # falling, each once


@pytest.mark.parametrize(
    "values",
    [
        torch.randn(64, 16),
        nn.Embedding(64, 16, padding_idx=0).weight.detach(),  # a zero first row, random after it
        torch.cat([angles().sin(), angles().cos()], 1) * 1.01,  # cos(0) is no longer one
        torch.cat([angles().sin(), angles().cos()], 1).bfloat16(),  # rounding: frequencies no better than 2**-9
        torch.cat([angles().sin(), torch.full((POSITIONS, 8), 0.5)], 1),  # a column that is no sinusoid
        torch.zeros(64, 16),
        torch.ones(64, 16),
        torch.cat([angles().sin()[:2], torch.zeros(1, 8), angles().sin()[3:]]),  # a padding row in the table
    ],
    ids=["random", "padding embedding", "scaled", "bf16", "one column", "zeros", "ones", "padding row"],
)
def test_anything_but_a_wide_sinusoid_table_has_no_frequencies(values):
    assert sinusoid_frequencies(values) == b""


def test_the_frequencies_travel_with_the_fingerprint():
    holder = nn.Module()
    holder.register_buffer("embed_positions", torch.cat([angles().sin(), angles().cos()], 1))
    (table,) = ModulePrint.from_json(fingerprint(holder)[""].to_json()).buffers
    assert table.angular == pytest.approx(frequencies().double().numpy(), rel=1e-6)


class TableRotary(nn.Module):
    """GPT-J's rotary embedding: one ``sin | cos`` table of every position, sliced by the model."""

    def __init__(self, base: float = BASE) -> None:
        super().__init__()
        self.register_buffer("embed_positions", torch.cat([angles(base).sin(), angles(base).cos()], 1))

    def forward(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        sin, cos = self.embed_positions[:length].chunk(2, dim=-1)
        return torch.repeat_interleave(sin, 2, -1), torch.repeat_interleave(cos, 2, -1)


def every_two(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.out = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        return self.out(q * cos.to(q.dtype) + every_two(q) * sin.to(q.dtype))


class Reference(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rotary_emb, self.attn, self.head = TableRotary(), Attention(), nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sin, cos = self.rotary_emb(x.shape[0])
        return self.head(x + self.attn(x, sin, cos))


class OwnTables(nn.Module):
    """TransformerLens' attention: its own ``rotary_sin`` and ``rotary_cos``, each frequency twice."""

    def __init__(self, base: float) -> None:
        super().__init__()
        self.W_Q, self.W_O = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.register_buffer("rotary_sin", torch.repeat_interleave(angles(base).sin(), 2, 1))
        self.register_buffer("rotary_cos", torch.repeat_interleave(angles(base).cos(), 2, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, length = self.W_Q(x), x.shape[0]
        return self.W_O(q * self.rotary_cos[:length].to(q.dtype) + every_two(q) * self.rotary_sin[:length].to(q.dtype))


class OwnFrequencies(nn.Module):
    """A port computing its angles from ``inv_freq`` at every call."""

    def __init__(self, base: float) -> None:
        super().__init__()
        self.W_Q, self.W_O = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.register_buffer("inv_freq", frequencies(base).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.W_Q(x)
        turns = torch.repeat_interleave(torch.arange(x.shape[0]).float()[:, None] * self.inv_freq.float(), 2, -1)
        return self.W_O(q * turns.cos().to(q.dtype) + every_two(q) * turns.sin().to(q.dtype))


class Port(nn.Module):
    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.attention, self.unembed = attention, nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.unembed(x + self.attention(x))


def pair(kind: str, plant: str = "") -> tuple[Reference, Port]:
    torch.manual_seed(0)
    reference = Reference()
    base = 500000.0 if plant == "base" else BASE
    candidate = Port(OwnTables(base) if kind == "tables" else OwnFrequencies(base))
    with torch.no_grad():
        for mine, theirs in (
            (candidate.attention.W_Q, reference.attn.q),
            (candidate.attention.W_O, reference.attn.out),
        ):
            mine.load_state_dict(theirs.state_dict())
        candidate.unembed.load_state_dict(reference.head.state_dict())
        if plant == "scaled":
            table = candidate.attention.rotary_sin if kind == "tables" else candidate.attention.inv_freq
            table.mul_(1.01)
    return reference, candidate


@pytest.mark.parametrize("kind", ["tables", "frequencies"])
def test_a_port_building_the_references_table_another_way_holds_it_exactly(kind):
    reference, candidate = pair(kind)
    ledger = weight_ledger(fingerprint(reference), fingerprint(candidate))
    assert ledger.findings == [] and ledger.unmatched == []
    assert ledger.matched == len(list(candidate.parameters())) + len(list(candidate.buffers()))


SINE = "as sin(position x the frequencies of embed_positions), from row sums"


@pytest.mark.parametrize(
    ("kind", "plant", "tensor", "said"),
    [
        ("tables", "scaled", "rotary_sin", f"{SINE}: scaled by 1.01"),
        ("tables", "base", "rotary_sin", f"{SINE}: built with base 5"),
        ("frequencies", "scaled", "inv_freq", "as the frequencies of embed_positions: scaled by 1.01"),
        ("frequencies", "base", "inv_freq", "as the frequencies of embed_positions: "),
    ],
)  # fmt: skip
def test_a_table_from_a_wrong_constant_differs_from_the_one_the_references_table_is_built_from(
    kind, plant, tensor, said
):
    reference, candidate = pair(kind, plant)
    ledger = weight_ledger(fingerprint(reference), fingerprint(candidate))
    found = {finding.candidate: finding for finding in ledger.differing}
    finding = found.pop(f"attention.{tensor}")
    assert finding.reference == "rotary_emb.embed_positions" and finding.reference_module == "rotary_emb"
    assert finding.detail.startswith(said), finding.detail
    if plant == "base":  # the base it was built with, read back from the values (a grid search: within 1 %)
        built = re.search(r"built (?:with|from) base ([0-9.e+]+)", finding.detail)
        assert built is not None and float(built.group(1)) == pytest.approx(500000, rel=0.01), finding.detail
    assert set(found) <= {"attention.rotary_cos"} and ledger.unmatched == []  # a base changes both tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["tables", "frequencies"])
@pytest.mark.parametrize("plant", ["", "scaled", "base"])
def test_a_table_from_a_wrong_constant_is_never_a_pass(tmp_path, kind, plant, dtype):
    reference, candidate = pair(kind, plant)
    candidate = candidate.to(dtype)
    x = torch.randn(12, DIM, generator=torch.Generator().manual_seed(1))
    report = check(reference, candidate, tmp_path, reference_call=lambda m: m(x.to(next(m.parameters()).dtype))).report
    if not plant:
        assert report.verdict == "pass" and report.first_divergence is None, headline(report)
        assert report.alignment.weights.differing == [] and report.alignment.weights.unmatched == []
        return
    assert report.verdict == "fail", headline(report)
    assert report.origin == "attn", headline(report)
    assert re.search(r"attention\.(rotary_sin|inv_freq) differs from the reference's rotary_emb\.embed_positions",
                     headline(report)), headline(report)  # fmt: skip
    assert not math.isnan(report.summary()["output_rel_l2"])
