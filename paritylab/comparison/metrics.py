"""Divergence between a reference tensor and a candidate tensor, and the tolerances that judge it."""

from __future__ import annotations

import fnmatch
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

METRIC_NAMES: tuple[str, ...] = (
    "max_abs",
    "mean_abs",
    "rel_l2",
    "cosine",
    "sqnr_db",
    "frac_outside",
    "nan_mismatch",
    "inf_mismatch",
)

# torch.testing.assert_close defaults (rtol, atol) per dtype
_DEFAULTS: dict[str, tuple[float, float]] = {
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
    "float32": (1.3e-6, 1e-5),
    "float64": (1e-7, 1e-7),
    "complex32": (1e-3, 1e-5),
    "complex64": (1.3e-6, 1e-5),
    "complex128": (1e-7, 1e-7),
    "float8_e4m3fn": (1.25e-1, 1e-3),
    "float8_e5m2": (2.5e-1, 1e-3),
}


@dataclass(frozen=True)
class Tolerance:
    """``|c − r| ≤ atol + rtol·|r|`` elementwise, or the same bound in L2 norm over the tensor."""

    rtol: float
    atol: float

    @classmethod
    def for_dtypes(cls, *dtypes: str) -> Tolerance:
        """``assert_close``'s defaults for the loosest of ``dtypes`` (integers and bools: exact)."""
        pairs = [_DEFAULTS.get(dtype, (0.0, 0.0)) for dtype in dtypes]
        return cls(rtol=max(p[0] for p in pairs), atol=max(p[1] for p in pairs))


@dataclass(frozen=True)
class ToleranceOverride:
    """Tolerance for reference module paths matching ``pattern`` (fnmatch); ``None`` keeps the default."""

    pattern: str
    rtol: float | None = None
    atol: float | None = None


class Tolerances:
    """Global tolerance (or dtype defaults) plus per-module-pattern overrides, the last match winning."""

    def __init__(
        self,
        rtol: float | None = None,
        atol: float | None = None,
        overrides: Sequence[ToleranceOverride] = (),
    ) -> None:
        self.rtol = rtol
        self.atol = atol
        self.overrides = list(overrides)

    def resolve(self, path: str, *dtypes: str) -> Tolerance:
        default = Tolerance.for_dtypes(*dtypes)
        rtol = default.rtol if self.rtol is None else self.rtol
        atol = default.atol if self.atol is None else self.atol
        for override in self.overrides:
            if fnmatch.fnmatchcase(path, override.pattern):
                rtol = rtol if override.rtol is None else override.rtol
                atol = atol if override.atol is None else override.atol
        return Tolerance(rtol=rtol, atol=atol)

    @classmethod
    def from_config(cls, data: Mapping[str, object] | None) -> Tolerances:
        """From ``{rtol:, atol:, modules: {pattern: {rtol:, atol:}}}`` (all optional)."""
        data = data or {}
        modules = data.get("modules") or {}
        if not isinstance(modules, Mapping):
            raise ValueError("tolerance 'modules' must map module path patterns to {rtol:, atol:}")
        overrides = [
            ToleranceOverride(str(pattern), _opt_float(values, "rtol"), _opt_float(values, "atol"))
            for pattern, values in modules.items()
        ]
        return cls(_opt_float(data, "rtol"), _opt_float(data, "atol"), overrides)


def _opt_float(data: object, key: str) -> float | None:
    if not isinstance(data, Mapping) or data.get(key) is None:
        return None
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"tolerance {key} must be a number, got {value!r}")
    return float(value)


def divergence(reference: torch.Tensor, candidate: torch.Tensor, tolerance: Tolerance) -> dict[str, float]:
    """All :data:`METRIC_NAMES` for two tensors of the same shape, computed on their device.

    NaN/Inf at the same positions with the same values agree; positions where only one side is
    non-finite count as mismatches and are left out of the other metrics, which stay meaningful.
    On the CPU the work streams through cache-sized chunks in reused buffers (no allocation per tensor),
    which is what makes comparison fast. Floating-point tensors of 32 bits or fewer are compared in float32
    (:data:`WORK_FLOAT32`), everything else in float64.
    """
    r = reference.detach().reshape(-1)
    c = candidate.detach().to(r.device).reshape(-1)
    if c.dtype == torch.bool:  # subtraction is not defined on bool
        c = c.to(torch.uint8)
    work = torch.float32 if _narrow(r) and _narrow(c) else torch.float64
    sums = _accumulate(r, c, tolerance, work)
    if work == torch.float32 and _float32_lost(sums, r.numel()):
        sums = _accumulate(r, c, tolerance)
    nan_mismatch = inf_mismatch = 0
    if not all(math.isfinite(value) for value in sums[:6]):
        r64, c64 = r.to(torch.float64), c.to(torch.float64)
        r64, c64, nan_mismatch, inf_mismatch = _finite_part(r64, c64)
        sums = _accumulate(r64, c64, tolerance)
        r = r64
    count = r.numel()
    if count == 0:
        return _empty(nan_mismatch, inf_mismatch)
    err2, ref2, cand2, cross, max_abs, sum_abs, outside, ref_diff, sum_diff = sums
    return {
        "max_abs": max_abs,
        "mean_abs": sum_abs / count,
        "rel_l2": _ratio(math.sqrt(err2), math.sqrt(ref2)),
        "cosine": _cosine(cross, ref2, cand2),
        "sqnr_db": _sqnr(ref2, err2),
        "frac_outside": outside / count,
        "nan_mismatch": float(nan_mismatch),
        "inf_mismatch": float(inf_mismatch),
        "norm_bound": float(tolerance.atol * math.sqrt(count) + tolerance.rtol * math.sqrt(ref2)),
        "err_l2": math.sqrt(err2),
        "scale_err": _ratio(ref_diff, ref2),
        "offset_err": _ratio(sum_diff / count, math.sqrt(ref2 / count)),
    }


_CHUNK = 1 << 18
_workspace = threading.local()


def _buffer(name: str, size: int, device: torch.device, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    buffers: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = _workspace.__dict__.setdefault("buffers", {})
    found = buffers.get((name, device, dtype))
    if found is None or found.numel() < size:
        found = buffers[(name, device, dtype)] = torch.empty(size, dtype=dtype, device=device)
    return found[:size]


WORK_FLOAT32 = True
"""Compare floating-point tensors of 32 bits or fewer in float32, not float64: half the memory traffic and no
widening copy of the reference (measured 1.9x the throughput on one core, 2026-11-26). What it changes, and why
no verdict moves: ``c - r`` is exact in float32 wherever the two agree within a factor of two (Sterbenz), which
is every element that matters to a tolerance; the sums of a 262,144-element chunk carry a relative error of about
1e-7 (measured: ‖d‖² 2e-7, ‖r‖² 1e-7, ``r·d``, a small cancelling term, 2e-5), added up across chunks in Python
floats; verdicts compare those metrics with thresholds of 4x a tolerance or floor, far from 1e-5 of themselves.
Where float32 would lose what float64 keeps (squares that overflow or underflow), the float64 pass runs instead
(:func:`_float32_lost`)."""


def _narrow(tensor: torch.Tensor) -> bool:
    return WORK_FLOAT32 and tensor.is_floating_point() and tensor.element_size() <= 4


def _float32_lost(sums: tuple[float, ...], count: int) -> bool:
    """A float32 pass whose sums cannot be trusted: non-finite (an overflow: the float64 pass sorts out real
    NaN/Inf), or squares that underflowed (the sum of squared differences below the largest one squared, or a
    reference whose values are all below about 1e-18)."""
    err2, ref2, max_abs = sums[0], sums[1], sums[4]
    if not all(math.isfinite(value) for value in sums[:6]):
        return True
    return err2 < 0.5 * max_abs * max_abs or (count > 0 and ref2 < TINY * count)


TINY = 1e-36
"""A mean square below this (values about 1e-18) is computed in float64: float32's squares lose digits there."""


def _accumulate(
    r: torch.Tensor, c: torch.Tensor, tolerance: Tolerance, work: torch.dtype = torch.float64
) -> tuple[float, ...]:
    """(‖c−r‖², ‖r‖², ‖c‖², r·c, max|c−r|, Σ|c−r|, #outside tolerance, r·(c−r), Σ(c−r)), computed in ``work``
    per chunk and added up in Python floats.

    ``‖c‖²`` and ``r·c`` come from ``‖r‖²``, ``r·d`` and ``‖d‖²`` (``c = r + d``): one pass fewer, and
    exact enough since ``d`` is small wherever it matters.
    """
    device = r.device
    step = _CHUNK if device.type == "cpu" else max(1, r.numel())
    totals = [0.0] * 9
    for start in range(0, r.numel(), step):
        size = min(step, r.numel() - start)
        r64 = r[start : start + size]
        if r64.dtype != work:
            r64 = _buffer("r", size, device, work).copy_(r64)
        diff = torch.sub(c[start : start + size], r64, out=_buffer("d", size, device, work))  # promoted to work
        dots = torch.stack([torch.dot(diff, diff), torch.dot(r64, r64), torch.dot(r64, diff), diff.sum()])
        diff.abs_()
        err2, ref2, ref_diff, sum_diff, max_abs, sum_abs = torch.cat(
            [dots, torch.stack([diff.max(), diff.sum()])]
        ).tolist()
        count = 0.0
        if not max_abs <= tolerance.atol:  # else no element can exceed atol + rtol·|r|: four passes saved
            bound = torch.abs(r64, out=_buffer("t", size, device, work)).mul_(tolerance.rtol).add_(tolerance.atol)
            outside = torch.gt(diff, bound, out=_buffer("g", size, device, torch.bool))
            count = float(torch.count_nonzero(outside))
        totals[0] += err2
        totals[1] += ref2
        totals[2] += ref2 + 2 * ref_diff + err2
        totals[3] += ref2 + ref_diff
        totals[4] = max(totals[4], max_abs) if math.isfinite(max_abs) else max_abs
        totals[5] += sum_abs
        totals[6] += count
        totals[7] += ref_diff
        totals[8] += sum_diff
    return tuple(totals)


MIN_FLOOR = {"bfloat16": 2e-3, "float16": 2.5e-4, "float32": 3e-8}
"""Smallest noise floor (relative L2) assumed per dtype: a quarter of its machine epsilon, what rounding a module's
output to that dtype alone causes (exact reference modules)."""
_WIDTH = {"float64": 64, "float32": 32, "bfloat16": 16, "float16": 16}


def min_floor(*dtypes: str | None) -> float:
    """The smallest floor a pair computed in ``dtypes`` can have: that of the lowest precision among them. A
    reference whose cast keeps a module in float32 (transformers' Mamba keeps its residual and final norm so) has
    a floor of 0 there; a bfloat16 candidate computing it in bfloat16 still rounds, and is judged against that."""
    return max((MIN_FLOOR.get(dtype or "", 0.0) for dtype in dtypes), default=0.0)


def narrower(dtype: str | None, than: str | None) -> bool:
    """``dtype`` holds fewer bits than ``than`` (bfloat16 against float32)."""
    return _WIDTH.get(dtype or "", 0) < _WIDTH.get(than or "", 0) and dtype in _WIDTH


def within(metrics: Mapping[str, float]) -> bool:
    """Pass: no NaN/Inf mismatch, and close elementwise or in L2 norm (``‖c−r‖ ≤ atol·√n + rtol·‖r‖``)."""
    if metrics["nan_mismatch"] or metrics["inf_mismatch"]:
        return False
    return metrics["frac_outside"] == 0 or metrics["err_l2"] <= metrics["norm_bound"]


def _finite_part(r: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    r_nan, c_nan = torch.isnan(r), torch.isnan(c)
    r_inf, c_inf = torch.isinf(r), torch.isinf(c)
    nan_mismatch = int(torch.count_nonzero(r_nan ^ c_nan))
    inf_mismatch = int(torch.count_nonzero((r_inf | c_inf) & ~(r_nan | c_nan) & (r != c)))
    keep = torch.isfinite(r) & torch.isfinite(c)
    return r[keep], c[keep], nan_mismatch, inf_mismatch


def _empty(nan_mismatch: int, inf_mismatch: int) -> dict[str, float]:
    metrics = dict.fromkeys(METRIC_NAMES, 0.0)
    metrics.update(cosine=1.0, sqnr_db=math.inf, nan_mismatch=float(nan_mismatch), inf_mismatch=float(inf_mismatch))
    metrics.update(norm_bound=0.0, err_l2=0.0)
    return metrics


def _ratio(numerator: float, denominator: float) -> float:
    if denominator == 0:
        return 0.0 if numerator == 0 else math.inf
    return numerator / denominator


def _cosine(cross: float, ref2: float, cand2: float) -> float:
    """``cand2`` is accumulated as ``ref2 + 2 r·d + d²``: for a candidate of all but zeros the cancellation can leave it
    a hair below zero, which is zero."""
    if ref2 <= 0 and cand2 <= 0:
        return 1.0
    if ref2 <= 0 or cand2 <= 0:
        return 0.0
    return max(-1.0, min(1.0, cross / math.sqrt(ref2 * cand2)))


def _sqnr(ref2: float, err2: float) -> float:
    if err2 == 0:
        return math.inf
    if ref2 == 0:
        return -math.inf
    return 10 * math.log10(ref2 / err2)


def stats_divergence(reference: Mapping[str, object], candidate: Mapping[str, object]) -> dict[str, float]:
    """What two traces' stats alone say: relative differences of mean, std, norm and max |x|."""
    from paritylab.tracing.tracefile import as_float

    out: dict[str, float] = {}
    for name in ("mean", "std", "norm", "absmax"):
        r, c = as_float(reference.get(name)), as_float(candidate.get(name))
        if math.isfinite(r) and math.isfinite(c):
            scale = max(abs(r), as_float(reference.get("std")) if name == "mean" else 0.0, 1e-12)
            out[f"{name}_rel"] = abs(c - r) / scale
    for name in ("nan", "inf"):
        r, c = as_float(reference.get(name)), as_float(candidate.get(name))
        if math.isfinite(r) and math.isfinite(c):
            out[f"{name}_mismatch"] = abs(c - r)
    return out


def stats_within(metrics: Mapping[str, float], tolerance: Tolerance) -> bool:
    """Pass on stats alone: every available relative difference within ``rtol`` (plus a little slack)."""
    if metrics.get("nan_mismatch") or metrics.get("inf_mismatch"):
        return False
    bound = max(tolerance.rtol, 1e-7) * 4
    return all(value <= bound for key, value in metrics.items() if key.endswith("_rel"))


SYSTEMATIC_MIN_VALUES = 16
"""Fewer values than this give no evidence of a systematic part (a scalar's rounding would look exact)."""


def systematic_z(reference: torch.Tensor, floor: torch.Tensor, candidate: torch.Tensor) -> dict[str, float]:
    """How far the candidate's difference from a low-precision copy of the reference, ``d = candidate − floor``
    (both given the reference's exact input at the same precision), has a systematic part: a gain along the
    reference output, or a constant offset. Returns each as a fraction (``gain``: of the output, ``offset``: of
    its RMS) and as a z-score (``gain_z``, ``offset_z``) against its own standard error.

    Two implementations of one module at one precision differ by rounding, which is unbiased, so both
    z-scores stay small however large the rounding is; a wrong gain, offset or eps gives a large one even
    when it is far below the rounding of a single value (a 0.1 % offset in bfloat16, whose values are
    rounded to 0.4 %). The standard errors are clustered two ways, by row (all but the last dimension) and
    by column (the last dimension), so rounding shared along a row (a per-token normalisation) or a column
    (a per-channel weight or bias) does not pass for evidence.
    """
    r = reference.detach().to(torch.float64)
    d = candidate.detach().to(torch.float64) - floor.detach().to(torch.float64)
    columns = r.shape[-1] if r.dim() else 1
    r, d = r.reshape(-1, columns), d.reshape(-1, columns)
    found = {"gain": 0.0, "gain_z": 0.0, "offset": 0.0, "offset_z": 0.0}
    mask = torch.isfinite(r) & torch.isfinite(d)
    if not bool(mask.all()):
        r, d = r.where(mask, 0.0), d.where(mask, 0.0)
    count = int(mask.sum())
    power = float((r * r).sum())
    if count < SYSTEMATIC_MIN_VALUES or power == 0.0:
        return found
    gain = float((r * d).sum()) / power
    mean = float(d.sum()) / count
    found["gain"], found["offset"] = gain, mean / math.sqrt(power / count)
    found["gain_z"] = _clustered_z(gain, (d - gain * r) * r * mask, power)
    found["offset_z"] = _clustered_z(mean, (d - mean) * mask, count)
    return found


def _clustered_z(estimate: float, scores: torch.Tensor, scale: float) -> float:
    """``estimate`` over its two-way clustered standard error, from per-element scores (rows × columns) whose
    sum over ``scale`` is the estimate's deviation."""
    by_row = float((scores.sum(dim=1) ** 2).sum())
    by_column = float((scores.sum(dim=0) ** 2).sum())
    each = float((scores**2).sum())
    variance = max(by_row + by_column - each, by_row, by_column, each)
    if variance <= 0.0:
        return 0.0 if estimate == 0.0 else math.inf
    return estimate / (math.sqrt(variance) / scale)
