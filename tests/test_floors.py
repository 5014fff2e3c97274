"""The free-run noise floor's exact side: float32 (the reference's own trace), not a float64 copy."""

from __future__ import annotations

import pytest
import torch

from paritylab.comparison.report import noise_floor
from paritylab.run.lifting import cast_call
from paritylab.run.parity import estimate_floors, trace_model
from paritylab.run.resident import converted_copy
from tests.tiny import tiny_llama, token_ids


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_a_float32_exact_side_moves_no_floor_by_more_than_a_percent(tmp_path, low):
    """The floors against the float32 reference equal those against float64 within 1 % at every module (the
    float32 run's own error is 1e-7..1e-5, the floors 1e-4..1e-2), and no copy of the reference is traced:
    the reference's own trace is the exact side."""
    reference, ids = tiny_llama(num_hidden_layers=3), token_ids(length=12)
    call = lambda model: model(ids)  # noqa: E731
    reference_trace = trace_model(reference, call, tmp_path / "reference", capture=None)
    floors = estimate_floors(reference, call, reference_trace, low, tmp_path)
    assert not (tmp_path / "noise-exact").exists()  # the reference's trace served

    wide = trace_model(converted_copy(reference, torch.float64), cast_call(call, torch.float64), tmp_path / "f64")
    low_trace = trace_model(converted_copy(reference, low), cast_call(call, low), tmp_path / "low")
    against_float64, against_float32 = noise_floor(wide, low_trace), floors.free_run
    assert set(against_float64) == set(against_float32) and len(against_float32) > 30
    shifts = {key: abs(against_float32[key] / against_float64[key] - 1) for key in against_float64}
    assert max(shifts.values()) < 0.01, max(shifts.items(), key=lambda item: item[1])
    assert min(against_float64.values()) > 1e-5  # the floors are rounding-sized, not zero


def test_a_reference_traced_without_values_is_run_once_more_as_it_is(tmp_path):
    """Statistics-only reference trace: the exact side is one more forward of the reference itself (no copy)."""
    reference, ids = tiny_llama(num_hidden_layers=1), token_ids()
    call = lambda model: model(ids)  # noqa: E731
    stats_only = trace_model(reference, call, tmp_path / "reference", save_tensors=False, capture=None)
    floors = estimate_floors(reference, call, stats_only, torch.bfloat16, tmp_path)
    assert (tmp_path / "noise-exact").is_dir() and len(floors.free_run) > 5
    assert all(1e-5 < value < 0.1 for value in floors.free_run.values())


def test_the_low_precision_side_runs_in_place_as_its_copy_does(tmp_path, monkeypatch):
    """No bf16 copy of the reference is made: each module's weights are cast while it runs, and the floors are
    bit for bit those of the copy; the reference is unchanged afterwards (weights and plain attributes)."""
    import paritylab.run.parity as parity

    reference, ids = tiny_llama(num_hidden_layers=2), token_ids(length=12)
    call = lambda model: model(ids)  # noqa: E731
    reference_trace = trace_model(reference, call, tmp_path / "reference", capture=None)
    weights = {name: (t, t.clone()) for name, t in reference.state_dict(keep_vars=True).items()}
    attributes = {path: dict(vars(module)) for path, module in reference.named_modules()}

    def copied(*_: object, **__: object) -> None:
        raise AssertionError("a copy was made")

    with monkeypatch.context() as patch:
        patch.setattr(parity, "converted_copy", copied)
        in_place = estimate_floors(reference, call, reference_trace, torch.bfloat16, tmp_path / "in-place")
    for name, tensor in reference.state_dict(keep_vars=True).items():
        assert tensor is weights[name][0] and torch.equal(tensor, weights[name][1]), name
    assert {path: dict(vars(module)) for path, module in reference.named_modules()} == attributes
    monkeypatch.setattr(parity, "cast_in_place", _cannot_run_in_place)
    on_copy = estimate_floors(reference, call, reference_trace, torch.bfloat16, tmp_path / "copy")
    assert in_place.free_run == on_copy.free_run and len(in_place.free_run) > 20
    assert in_place.local_metrics == on_copy.local_metrics and len(in_place.local_metrics) > 20


def _cannot_run_in_place(call, dtype, uncalled=()):
    def run(model):
        raise RuntimeError("as if a module read a weight it does not hold")

    return run


class ReadsAGrandchild(torch.nn.Module):
    """Reads a weight of a module that is not running (a tied head computed as a product with it)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) @ self.inner[0].weight.T


def test_a_weight_read_from_outside_its_module_sends_the_low_precision_side_to_a_copy(tmp_path, monkeypatch):
    """In place, the head would read the float32 weight while the bf16 copy reads bf16: it is stood in for, the
    read raises, and the low-precision side runs on a copy (one made, the floors those of that copy)."""
    import paritylab.run.parity as parity

    torch.manual_seed(0)
    model, x = ReadsAGrandchild().eval(), torch.randn(3, 8)
    call = lambda m: m(x)  # noqa: E731
    reference_trace = trace_model(model, call, tmp_path / "reference", capture=None)
    made = []
    monkeypatch.setattr(parity, "converted_copy", lambda *a, **k: made.append(converted_copy(*a, **k)) or made[-1])
    floors = estimate_floors(model, call, reference_trace, torch.bfloat16, tmp_path / "floors")
    assert len(made) == 1 and made[0].inner[0].weight.dtype == torch.bfloat16
    low = trace_model(converted_copy(model, torch.bfloat16), cast_call(call, torch.bfloat16), tmp_path / "low")
    assert floors.free_run == noise_floor(reference_trace, low) and floors.free_run["#0"] > 1e-4
    assert all(p.dtype == torch.float32 and type(p) is torch.nn.Parameter for p in model.parameters())


def test_a_zero_reference_floor_against_a_bf16_candidate_is_bf16s_rounding_not_zero():
    """transformers' Mamba keeps its final norm in float32 when cast to bfloat16: the reference's own floor there is 0,
    and a candidate computing it in bfloat16 rounds as bfloat16 does. Its own error is judged against that rounding;
    a float32 candidate keeps float32's."""
    from paritylab.comparison.attribution import beyond_floor
    from paritylab.comparison.metrics import min_floor

    rounding = {"rel_l2": 4e-3, "scale_err": 0.0, "offset_err": 0.0}
    zero = {"rel_l2": 0.0, "scale_err": 0.0, "offset_err": 0.0}
    assert beyond_floor(rounding, zero, "float32", candidate_dtype="bfloat16") is None
    assert beyond_floor(rounding, zero, "float32") == "own error 133333.3x its local noise floor"
    assert beyond_floor({**rounding, "rel_l2": 5e-2}, zero, "float32", candidate_dtype="bfloat16") == (
        "own error 25.0x its local noise floor"
    )
    assert min_floor("float32", "bfloat16") == 2e-3 and min_floor("float32") == 3e-8
