"""A module holding weights and one holding none are not one computation, whatever order and shape say.

transformers' Mixtral runs its experts in one module holding fused 3-D weights and calls its weightless ``act_fn``
once per expert inside it; a per-expert port calls each expert's ``w1``, ``w3`` and ``w2`` instead, and ``w1``'s
output has the activation's shape. Paired by order and shape, the activation stood for ``w1`` and every MoE bug was
named at ``experts.act_fn``. The alignment now refuses such a pair (``_Features.unlike``) and pairs a weightless call
with the one weightless call of its shape inside its paired ancestor's counterpart (x-transformers' GLU ``act``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import paritylab
from paritylab.comparison.alignment._features import _Features
from paritylab.tracing.structure import ModulePrint
from paritylab.tracing.tracefile import CallRecord
from tests.test_selfcheck import _mlps

WIDTH, HIDDEN, EXPERTS = 8, 12, 2
X = torch.randn(2, 5, WIDTH, generator=torch.Generator().manual_seed(5))
ROUTE = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1, 1, 1])
"""The expert each of the ten tokens goes to (fixed: the routing is not what these tests are about)."""


class FusedExperts(nn.Module):
    """Every expert's projections in one 3-D parameter each, and one weightless activation called per expert."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(EXPERTS, 2 * HIDDEN, WIDTH) / WIDTH**0.5)
        self.down = nn.Parameter(torch.randn(EXPERTS, WIDTH, HIDDEN) / HIDDEN**0.5)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(EXPERTS):
            tokens = torch.where(ROUTE.eq(e))[0]
            gate, up = F.linear(x[tokens], self.gate_up[e]).chunk(2, dim=-1)
            out[tokens] = F.linear(self.act_fn(gate) * up, self.down[e])
        return out


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(WIDTH, HIDDEN, bias=False), nn.Linear(WIDTH, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class PerExpert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))
        self.reversed = False
        """A bug: the experts in reverse order (expert ``e``'s tokens sent to the last-but-``e`` expert)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e, expert in enumerate(reversed(self.experts) if self.reversed else self.experts):
            tokens = torch.where(ROUTE.eq(e))[0]
            out[tokens] = expert(x[tokens])
        return out


class Layer(nn.Module):
    """A projection, then the experts: ``moe`` is either layout."""

    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.proj, self.moe = nn.Linear(WIDTH, WIDTH), moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.proj(x).reshape(-1, WIDTH)
        return self.moe(flat).view_as(x)


def _moe_pair() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    reference, candidate = Layer(FusedExperts()).eval(), Layer(PerExpert()).eval()
    state = {"proj.weight": reference.proj.weight.detach(), "proj.bias": reference.proj.bias.detach()}
    for e in range(EXPERTS):
        state[f"moe.experts.{e}.w1.weight"] = reference.moe.gate_up.detach()[e, :HIDDEN]
        state[f"moe.experts.{e}.w3.weight"] = reference.moe.gate_up.detach()[e, HIDDEN:]
        state[f"moe.experts.{e}.w2.weight"] = reference.moe.down.detach()[e]
    candidate.load_state_dict({name: tensor.clone() for name, tensor in state.items()})
    return reference, candidate


def _check(tmp_path, reference, candidate, name):
    return paritylab.check(reference, candidate, tmp_path / name, reference_call=lambda m: m(X), echo=None)


def test_a_weightless_activation_is_not_paired_with_an_experts_projection(tmp_path):
    reference, candidate = _moe_pair()
    with torch.no_grad():
        assert torch.allclose(reference(X), candidate(X), atol=1e-6)  # the same function
    clean = _check(tmp_path, reference, candidate, "clean")
    assert clean.verdict == "pass", clean.report.first_divergence
    alignment = clean.report.alignment
    by_reference = alignment.by_reference()
    # before: moe.act_fn#0 was paired with moe.experts.0.w1#0 (output [5, 12] both) by order and shape, then undone by
    # values here (moe, around it, agrees), but not where a bug makes moe differ by as much (below)
    assert not [key for key in by_reference if key.startswith("moe.act_fn")]
    assert {"moe.act_fn#0", "moe.act_fn#1"} <= set(alignment.unmatched_reference)
    assert {"moe.experts.0.w1#0", "moe.experts.1.w1#0"} <= set(alignment.unmatched_candidate)
    assert by_reference["moe#0"].candidate == "moe#0" and by_reference["proj#0"].candidate == "proj#0"


def test_experts_in_reverse_order_are_named_at_the_experts_module_not_at_the_activation(tmp_path):
    """An O(1) error in the experts' module: the wrong pair's O(1) difference is felt by the module enclosing it, so
    the values do not refute it, and before, the activation (its input, ``proj``'s output, agreeing) was named."""
    reference, candidate = _moe_pair()
    candidate.moe.reversed = True
    result = _check(tmp_path, reference, candidate, "reversed")
    assert result.verdict == "fail"
    report = result.report
    # before: "divergence starts at moe.act_fn (own error 1.932)", paired with moe.experts.1.w1 (called first here)
    assert report.first_divergence is not None and report.first_divergence.path == "moe"
    assert report.first_divergence.rel_l2 is not None and report.first_divergence.rel_l2 > 0.5
    assert not [row for row in report.rows if row.path == "moe.act_fn" and row.status == "compared"]


def test_a_bug_in_one_expert_is_named_at_the_experts_module_with_the_expert(tmp_path):
    reference, candidate = _moe_pair()
    candidate.moe.experts[1].w3.register_forward_hook(lambda _m, _a, out: out * 1.05)
    result = _check(tmp_path, reference, candidate, "bug")
    assert result.verdict == "fail"
    report = result.report
    assert report.first_divergence is not None and report.first_divergence.path == "moe"
    assert report.drilldown is not None and report.drilldown["operation"] == "experts.1.w3: mul"


def _features(path: str, numel: int | None) -> _Features:
    call = CallRecord(
        path=path, cls="Linear" if numel else "SiLU", call_index=0, index=0, parent=None, depth=1,
        inputs=None, outputs={"t": "tensor", "shape": [5, 12], "dtype": "float32"},
    )  # fmt: skip
    item = None if numel is None else ModulePrint(path, 7 if numel else 0, numel, ())
    return _Features.of(call, item)


def test_holding_weights_against_holding_none_scores_nothing():
    weighted, weightless, unknown = _features("w1", 96), _features("act_fn", 0), _features("w1", None)
    assert weighted.unlike(weightless) and weightless.unlike(weighted)
    assert weightless.similarity(weighted) == 0.0 and weighted.similarity(weightless) == 0.0
    assert weightless.similarity(_features("act", 0)) > 0.3  # two weightless modules of one shape still pair
    assert not unknown.unlike(weightless)  # a trace with no fingerprints says nothing about weights


def test_a_weightless_activation_pairs_with_the_weightless_call_inside_its_parents_counterpart(tmp_path):
    """x-transformers' layout: the GLU (holding the fused projection) returns the gated product, its own ``act``
    the activation. The activation is no longer paired with the GLU by order and then repaired by values: it pairs
    with the ``act`` directly, the one weightless call of its shape inside the MLP's counterpart."""
    reference, candidate = _mlps()
    result = _check(tmp_path, reference, candidate, "clean")
    assert result.verdict == "pass"
    for i in range(2):
        pair = result.report.alignment.by_reference()[f"{i}.act#0"]
        assert (pair.candidate, pair.source) == (f"{i}.glu.act#0", "auto")
        row = next(row for row in result.report.rows if row.path == f"{i}.act")
        assert "re-paired" not in row.note and row.rel_l2 is not None and row.rel_l2 < 1e-6
