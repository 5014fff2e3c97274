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
