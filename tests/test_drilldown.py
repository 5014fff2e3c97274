"""Operation-level drill-down on two attention implementations written differently: the reference projects q,
k and v apart and calls ``scaled_dot_product_attention``; the candidate fuses the projection, splits heads in
another layout and writes the softmax out. (Third-party pairs: ``tests/test_pairs.py``.)"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paritylab.comparison.drilldown import drill_down, drill_into
from paritylab.comparison.operations import record_call

DIM, HEADS = 32, 4


class FusedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, HEADS, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, DIM))


class WrittenOutAttention(nn.Module):
    def __init__(self, reference: FusedAttention, scale: float | None = None) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([reference.q.weight, reference.k.weight, reference.v.weight]))
            self.qkv.bias.copy_(torch.cat([reference.q.bias, reference.k.bias, reference.v.bias]))
            self.out.load_state_dict(reference.o.state_dict())
        self.scale = scale if scale is not None else (DIM // HEADS) ** -0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        weights = ((q @ k.transpose(-1, -2)) * self.scale).softmax(dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(b, t, DIM))


def _pair(**candidate):
    torch.manual_seed(0)
    reference = FusedAttention()
    return reference, WrittenOutAttention(reference, **candidate), torch.randn(2, 6, DIM)


def _drill(reference, candidate, x):
    run = lambda model: model(x)  # noqa: E731
    return drill_into(reference, run, "#0", candidate, run, "#0", lambda _: nullcontext(), torch.float32)


def test_a_correct_rewrite_names_no_operation():
    """Fused projection, another head layout, the softmax written out: intermediates the reference never forms
    are not errors, because what is computed from them agrees again."""
    found = _drill(*_pair())
    assert found.value is None and found.operations == [], found.message
    assert "no operation" in found.message
    assert found.reference_ops >= 10 and found.candidate_ops >= 10


def test_a_softmax_scale_is_named_at_the_multiplication_with_its_constant():
    scale = 1.1 * (DIM // HEADS) ** -0.5
    found = _drill(*_pair(scale=scale))
    # The reference computes q @ k^T, the scaling and the softmax inside one fused call, recorded written out:
    # the one operation that differs is named, beside the fused call's own, with both constants.
    assert [op.name for op in found.operations] == ["mul"], found.message
    assert found.operation == "mul" and found.operations[0].scalars == [f"{scale:.6g}"]
    (theirs,) = found.counterparts
    assert theirs.name == "mul" and theirs.within == "scaled_dot_product_attention"
    assert theirs.scalars == [f"{(DIM // HEADS) ** -0.5:.6g}"]
    assert f"constants: {scale:.6g} vs the reference's 0.353553" in found.message
    assert "mul(matmul[2, 4, 6, 6], 0.353553) in scaled_dot_product_attention" in found.message


def test_a_wrong_scale_passed_to_the_fused_call_is_named_inside_it():
    """Both sides call ``scaled_dot_product_attention``; the candidate passes another scale."""
    reference, _, x = _pair()

    class Scaled(FusedAttention):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = (proj(x).view(b, t, HEADS, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
            out = F.scaled_dot_product_attention(q, k, v, scale=0.3)
            return self.o(out.transpose(1, 2).reshape(b, t, DIM))

    scaled = Scaled()
    scaled.load_state_dict(reference.state_dict())
    found = _drill(reference, scaled, x)
    assert found.operation == "mul in scaled_dot_product_attention", found.message
    assert "constants: 0.3 vs the reference's 0.353553" in found.message
    assert "(scaled_dot_product_attention, written out)" in found.message


@pytest.mark.parametrize("function", ["layer_norm", "rms_norm"])
def test_an_eps_written_out_is_named_at_its_addition_against_the_fused_norm(function):
    """The reference calls the fused norm; the candidate writes it out with another eps."""
    torch.manual_seed(0)
    x, weight = torch.randn(2, 5, DIM), torch.randn(DIM)

    class Fused(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if function == "layer_norm":
                return F.layer_norm(x, (DIM,), weight, None, 1e-5)
            return F.rms_norm(x, (DIM,), weight, 1e-6)

    class WrittenOut(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if function == "layer_norm":
                x = x - x.mean(-1, keepdim=True)
            return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 0.01) * weight

    run = lambda model: model(x)  # noqa: E731
    found = drill_into(Fused(), run, "#0", WrittenOut(), run, "#0", lambda _: nullcontext(), torch.float32)
    assert found.operation == "add", found.message
    assert found.operations[0].scalars == ["0.01"] and found.counterparts[0].within == function
    reference_eps = "1e-05" if function == "layer_norm" else "1e-06"
    assert f"constants: 0.01 vs the reference's {reference_eps}" in found.message


def test_where_the_reference_writes_it_out_too_the_operation_itself_is_named():
    reference, candidate, x = _pair()
    plain = WrittenOutAttention(reference)
    candidate.scale *= 1.1
    found = _drill(plain, candidate, x)
    assert found.operation == "mul" and found.counterparts[0].name == "mul", found.message
    assert f"{candidate.scale:.6g} vs the reference's {plain.scale:.6g}" in found.message


def test_a_wrong_weight_is_named_as_the_parameter():
    reference, candidate, x = _pair()
    with torch.no_grad():
        candidate.out.weight[0, 0] += 0.5
    found = _drill(reference, candidate, x)
    assert found.value is not None and found.value.origin == "parameter out.weight", found.message
    assert found.operation == "parameter out.weight"
    assert "linear" in found.message  # where it is read


def test_a_hook_that_changes_the_output_is_part_of_the_call():
    reference, candidate, x = _pair()
    candidate.register_forward_hook(lambda _module, _args, output: output * 1.01)
    found = _drill(reference, candidate, x)
    assert found.culprit is not None and found.culprit.name == "mul" and "1.01" in found.culprit.scalars


def test_a_chosen_call_of_a_module_called_twice_is_recorded_alone():
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    recording = record_call(model, "0", 1, lambda m: m(torch.randn(3, 4)))
    assert recording.called and recording.key == "0#1"
    assert [op.name for op in recording.ops] == ["linear"]
    first_input = recording.values[0]
    assert first_input.origin == "input 0.0" and first_input.shape == [3, 4]
    assert recording.outputs == recording.ops[0].outputs
    again = record_call(model, "0", 5, lambda m: m(torch.randn(3, 4)))  # never reached
    assert not again.called and again.ops == []
    assert "was never called" in " ".join(drill_down(again, again, torch.float32).notes)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_low_precision_tolerates_rounding_but_not_a_wrong_scale(dtype):
    reference, candidate, x = _pair()
    run = lambda model: model(x.to(dtype))  # noqa: E731
    candidate.to(dtype)
    clean = drill_into(reference.to(dtype), run, "#0", candidate, run, "#0", lambda _: nullcontext(), dtype)
    assert clean.value is None, clean.message
    candidate.scale *= 1.5
    found = drill_into(reference, run, "#0", candidate, run, "#0", lambda _: nullcontext(), dtype)
    assert "mul" in [op.name for op in found.operations] and "constants: 0.53033" in found.message, found.message


class TransposedScores(WrittenOutAttention):
    """Scores formed as ``k @ q^T`` (keys by queries, the transpose of the reference's), softmax over keys."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        weights = ((k @ q.transpose(-1, -2)) * self.scale).softmax(dim=-2)
        return self.out((weights.transpose(-1, -2) @ v).transpose(1, 2).reshape(b, t, DIM))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_wrong_scale_on_transposed_scores_is_named_in_any_precision(dtype):
    """In low precision, values are matched in another layout through permutations of their dimensions (sorted
    values, used at full precision, are too alike at bf16's tolerance): the transposed scores are the
    reference's, so the scaling is named."""
    reference, _, x = _pair()
    run = lambda model: model(x.to(dtype))  # noqa: E731
    clean = TransposedScores(reference).to(dtype)
    found = drill_into(reference.to(dtype), run, "#0", clean, run, "#0", lambda _: nullcontext(), dtype)
    assert found.value is None, found.message
    clean.scale *= 1.5
    found = drill_into(reference, run, "#0", clean, run, "#0", lambda _: nullcontext(), dtype)
    assert found.operation == "mul", found.message
    assert found.operations[0].scalars == [f"{clean.scale:.6g}"] and found.counterparts[0].name == "mul"


def test_a_difference_only_the_compiled_graph_makes_is_said_to_be_the_graph():
    """The eager code agrees; under torch.compile the module computes something else (here on purpose, as a
    compiler bug would): the drill-down says the compiled graph made it, not an operation of the code."""

    class CompilerSensitive(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.inner(x)
            return out * 1.01 if torch.compiler.is_compiling() else out

    reference, candidate, x = _pair()
    compiled = torch.compile(CompilerSensitive(candidate), backend="eager")
    assert not torch.allclose(compiled(x), reference(x))  # the compiled candidate does diverge
    wrapped_reference = CompilerSensitive(reference)
    run = lambda model: model(x)  # noqa: E731
    found = drill_into(wrapped_reference, run, "#0", compiled, run, "#0", lambda _: nullcontext(), torch.float32)
    assert found.value is None and "made by the compiled graph itself" in found.message
    assert any("compiled candidate" in note for note in found.notes)


def test_constants_are_compared_only_between_operations_that_match_step_for_step():
    """q and k each scaled by d**-0.25 on one side, q alone by d**-0.5 on the other: no constant of one stands
    for one of the other, so the line names no constants; a single ``mul`` against a ``mul`` does."""
    from paritylab.comparison.drilldown import _describe
    from paritylab.comparison.operations import Op, Recording, Value

    recording = Recording("attn#0", values=[Value(0, "op 0", [2, 4], "float32", op=0)])

    def mul(index: int, scale: float) -> Op:
        return Op(index, "mul", "", f"mul(tensor[2, 4], {scale})", [f"{scale}"], [index], [index + 1])

    split = _describe(recording, recording.values[0], [mul(0, 0.5), mul(1, 0.5)], [mul(0, 0.25)], 1e-2)
    assert "constants" not in split and "the reference computes mul(tensor[2, 4], 0.25)" in split
    single = _describe(recording, recording.values[0], [mul(0, 0.3)], [mul(0, 0.25)], 1e-2)
    assert "(constants: 0.3 vs the reference's 0.25)" in single


class SeparateMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(DIM, 64), nn.Linear(DIM, 64), nn.Linear(64, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class FusedMlp(nn.Module):
    """gate and up as one projection (``w13``, 128 rows), as ports write it; ``scale`` plants a bug in its output."""

    def __init__(self, reference: SeparateMlp, scale: float = 1.0) -> None:
        super().__init__()
        self.w13, self.w2 = nn.Linear(DIM, 128), nn.Linear(64, DIM)
        with torch.no_grad():
            self.w13.weight.copy_(torch.cat([reference.gate_proj.weight, reference.up_proj.weight]))
            self.w13.bias.copy_(torch.cat([reference.gate_proj.bias, reference.up_proj.bias]))
            self.w2.load_state_dict(reference.down_proj.state_dict())
        if scale != 1.0:
            self.w13.register_forward_hook(lambda _, __, output: output * scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


@pytest.mark.parametrize("scale", [1.0, 1.01])
def test_a_fused_projection_drilled_at_one_of_its_parts_is_read_as_its_parts(scale):
    """Drilled at the reference's ``gate_proj`` (paired with the port's ``w13``), the fused weight's up rows are
    the sibling ``up_proj``'s and its output's first half is gate's: neither is called a mismatch; a bug after the
    projection is named as the operation it is."""
    torch.manual_seed(0)
    reference = SeparateMlp()
    candidate, x = FusedMlp(reference, scale), torch.randn(2, 6, DIM)
    run = lambda model: model(x)  # noqa: E731
    forcing = lambda _: nullcontext()  # noqa: E731
    found = drill_into(reference, run, "gate_proj#0", candidate, run, "w13#0", forcing, torch.float32)
    assert "matches no reference value" not in found.message
    if scale == 1.0:
        assert found.value is None, found.message
    else:
        assert found.operation == "mul" and found.operations[0].scalars == ["1.01"], found.message
