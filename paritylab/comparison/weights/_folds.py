"""Normalisations folded into the layer before them: what a port for inference does to every batch norm.

A batch norm in eval mode is a per-channel affine map, ``y = γ (x − μ) / √(σ² + ε) + β``, so a port may multiply
its scale ``s = γ / √(σ² + ε)`` into the rows of the convolution (or linear layer) whose output it normalises and
fold ``β + (b − μ) s`` into that layer's bias: one module computes what the two compute. The candidate's weight is
then the reference layer's with every output row scaled by its own factor, near no reference tensor and equal to
none. This module reads such a fold from the fingerprints' row sums: :func:`fold_fit` says whether a candidate
weight is a layer's weight with a given norm folded into it, and with which ``ε``; the alignment pairs the module
with the norm's output (:mod:`paritylab.comparison.alignment._folds`), and the ledger records the fold
(:func:`record_fold`) instead of a defect.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy

from paritylab.comparison.weights._records import ROUNDING, WeightFinding, WeightLedger, _named
from paritylab.tracing.structure import MASK, ModulePrint, ParamPrint

RUNNING = ("running_mean", "running_var")
"""The buffers of a norm that normalises with statistics it keeps (``BatchNorm*``, and every port of it)."""


EPSILONS = (0.0, 1e-5, 1e-3)
"""``ε`` values tried beside the one the values imply (PyTorch's default, TensorFlow's)."""


DISTINCT = 4.0
"""A fold explains the rows when one factor for all of them (a weight scaled as a whole: a defect, not a fold)
leaves at least this many times the fold's residual."""


@dataclass(frozen=True)
class RunningNorm:
    """A norm's per-channel scale ``γ``, shift ``β`` and running statistics ``μ``, ``σ²`` (float64)."""

    path: str
    digest: int
    """The fingerprint of its parameters (its ``γ`` and ``β``: running statistics are buffers)."""
    scale: numpy.ndarray
    shift: numpy.ndarray
    mean: numpy.ndarray
    var: numpy.ndarray

    @property
    def channels(self) -> int:
        return len(self.var)

    def factors(self, eps: float) -> numpy.ndarray:
        """``s = γ / √(σ² + ε)``, each output row's factor."""
        return self.scale / numpy.sqrt(numpy.maximum(self.var + eps, 1e-30))


def running_norm(item: ModulePrint) -> RunningNorm | None:
    """``item`` as a norm with running statistics, or ``None``: it keeps 1-D ``running_mean`` and ``running_var`` of one
    length, and holds at most a 1-D ``weight`` and ``bias`` of that length (absent ones: all zeros, which fingerprints
    leave out, for the bias; affine-free, for the weight)."""
    buffers = {buffer.name: _values(buffer) for buffer in item.buffers}
    mean, var = buffers.get("running_mean"), buffers.get("running_var")
    channels = len(var) if var is not None else 0
    if mean is None or var is None or not channels or len(mean) != channels or bool((var < 0).any()):
        return None
    params = {param.name: param for param in item.params}
    if set(params) - {"weight", "bias"}:
        return None
    values = {name: _values(param) for name, param in params.items()}
    if any(value is None or len(value) != channels for value in values.values()):
        return None
    scale, shift = values.get("weight"), values.get("bias")
    return RunningNorm(
        item.path,
        sum(param.digest for param in item.params) & MASK,
        scale if scale is not None else numpy.ones(channels),
        shift if shift is not None else numpy.zeros(channels),
        mean,
        var,
    )


@dataclass(frozen=True)
class Fold:
    """A candidate weight read as a reference layer's with a norm folded into its rows."""

    eps: float
    residual: float
    """Relative L2 distance of the candidate's row sums from the fold's (rounding: a few ``1e-3`` at most)."""
    bias: numpy.ndarray
    """The bias the fold gives: ``β + (b − μ) s``."""


def fold_fit(layer: ParamPrint, layer_bias: ParamPrint | None, norm: RunningNorm, weight: ParamPrint) -> Fold | None:
    """``weight`` (a candidate tensor) as ``layer`` (the reference layer's weight, whose output ``norm`` normalises)
    with the norm's scale folded into its rows, or ``None``. Every row's sum must be the layer's times its factor
    within rounding, for one ``ε``, and no single factor may explain them as well."""
    lines = _lines(layer, norm, weight)
    if lines is None:
        return None
    rows, theirs, size = lines
    best: tuple[float, float] | None = None
    for eps in _epsilons(theirs, rows, norm):  # a usual ε first: the implied one only where it fits far better
        residual = float(numpy.linalg.norm(rows - norm.factors(eps) * theirs)) / size
        if best is None or residual < (best[1] if eps in EPSILONS else best[1] / 2):
            best = (eps, residual)
    if best is None or best[1] > ROUNDING:
        return None
    energy = float(theirs @ theirs)
    uniform = float(numpy.linalg.norm(rows - (float(theirs @ rows) / energy) * theirs)) / size if energy else 1.0
    if uniform < DISTINCT * best[1] or uniform <= ROUNDING:
        return None  # one factor for every row: a weight scaled as a whole
    return Fold(best[0], best[1], _folded_bias(layer_bias, norm, best[0]))


def _lines(
    layer: ParamPrint, norm: RunningNorm, weight: ParamPrint
) -> tuple[numpy.ndarray, numpy.ndarray, float] | None:
    """The candidate weight's row sums, the layer's, and the norm of the former, where both have one per channel."""
    rows, ours = _rows(weight, layer.shape), layer.sums
    if rows is None or ours is None or len(rows) != norm.channels or len(ours[0]) != norm.channels:
        return None
    size = float(numpy.linalg.norm(rows))
    if size == 0.0 or not numpy.isfinite(rows).all():
        return None
    return rows, ours[0], size


def _folded_bias(layer_bias: ParamPrint | None, norm: RunningNorm, eps: float) -> numpy.ndarray:
    """``β + (b − μ) s``: the bias a fold gives (``b``: the layer's bias, zeros where it has none)."""
    bias = _values(layer_bias) if layer_bias is not None else None
    own = bias if bias is not None and len(bias) == norm.channels else numpy.zeros(norm.channels)
    return norm.shift + (own - norm.mean) * norm.factors(eps)


def _epsilons(theirs: numpy.ndarray, rows: numpy.ndarray, norm: RunningNorm) -> list[float]:
    """The ``ε`` values to try: those of :data:`EPSILONS`, and the median the rows imply (``(γ / r)² − σ²`` for each
    row's ratio ``r``, from the rows whose sums are far from zero)."""
    found = list(EPSILONS)
    reliable = numpy.abs(theirs) > 0.1 * float(numpy.abs(theirs).max(initial=0.0))
    ratio = numpy.divide(rows, theirs, out=numpy.zeros_like(rows), where=reliable)
    usable = reliable & (numpy.abs(ratio) > 0)
    if usable.any():
        implied = (norm.scale[usable] / ratio[usable]) ** 2 - norm.var[usable]
        median = float(numpy.median(implied))
        if math.isfinite(median) and median > 0:
            found.append(median)
    return found


def _rows(weight: ParamPrint, shape: tuple[int, ...]) -> numpy.ndarray | None:
    """The candidate weight's sums per output feature, in the layer's layout (a 2-D copy stored transposed: its
    column sums)."""
    sums = weight.sums
    if sums is None:
        return None
    if weight.shape == shape:
        return sums[0]
    if len(shape) == 2 and weight.shape == shape[::-1]:
        return sums[1]
    return None


def _values(item: ParamPrint | None) -> numpy.ndarray | None:
    """A 1-D tensor's values (its sketch keeps them), float64."""
    if item is None or len(item.shape) != 1 or item.sums is None:
        return None
    return item.sums[0]


def defective_fold(
    layer: ParamPrint, layer_bias: ParamPrint | None, norm: RunningNorm, weight: ParamPrint, eps: float
) -> Fold | None:
    """``weight`` read as ``layer`` with ``norm`` folded in with ``ε``, where the rows do not fit (:func:`fold_fit`
    found none): the fold a conversion meant, whose :attr:`Fold.residual` says how far the weight is from it."""
    lines = _lines(layer, norm, weight)
    if lines is None:
        return None
    rows, theirs, size = lines
    residual = float(numpy.linalg.norm(rows - norm.factors(eps) * theirs)) / size
    return Fold(eps, residual, _folded_bias(layer_bias, norm, eps))


def record_fold(
    ledger: WeightLedger,
    candidate: ModulePrint,
    weight: ParamPrint,
    layer: str,
    layer_weight: ParamPrint,
    layer_bias: ParamPrint | None,
    norm: RunningNorm,
    fold: Fold,
) -> None:
    """Write a fold into the ledger: the candidate weight holds the layer's with the norm folded in (a ``folded``
    finding, no defect; a ``differs`` one where its rows do not fit, :func:`defective_fold`); its bias holds the
    fold's (matched), or differs from it (a ``differs`` finding), or is missing where the fold's is not zero. The
    weight is fingerprinted as the layer's and the bias as the norm's parameters (and the layer's bias) for the
    alignment (:attr:`WeightLedger.twin_digests`): a block of folded modules holds what the reference's block does."""
    name = _named(candidate.path, weight)
    reference = _named(layer, layer_weight)
    _forget(ledger, name)
    factor = f"γ/√(var + {fold.eps:.3g})"
    if fold.residual <= ROUNDING:
        ledger.matched += 1
        detail = f"{norm.path} folded into its rows (each scaled by {factor})"
        ledger.findings.append(WeightFinding(name, reference, candidate.path, layer, "folded", detail))
    else:
        detail = f"with {norm.path} folded in (each row scaled by {factor}), its row sums differ by {fold.residual:.3g}"
        finding = WeightFinding(name, reference, candidate.path, layer, "differs", detail, fold.residual)
        ledger.findings.append(finding)
    ledger.folds[candidate.path] = (layer, norm.path)
    ledger.twin_digests[name] = layer_weight.digest  # fingerprinted as the layer's weight, its bias as the norm's
    bias = next((param for param in candidate.params if param is not weight and len(param.shape) == 1), None)
    values = _values(bias)
    expected = fold.bias
    scale = float(numpy.linalg.norm(expected))
    if bias is not None and values is not None and len(values) == len(expected):
        bias_name = _named(candidate.path, bias)
        _forget(ledger, bias_name)
        ledger.twin_digests[bias_name] = (norm.digest + (layer_bias.digest if layer_bias is not None else 0)) & MASK
        error = float(numpy.linalg.norm(values - expected)) / max(scale, float(numpy.linalg.norm(values)), 1e-30)
        if error <= ROUNDING:
            ledger.matched += 1
            return
        detail = f"the shift of {norm.path} folded wrongly: β + (b − μ)·s differs, rel_l2 {error:.3g}"
        finding = WeightFinding(bias_name, f"{norm.path}.bias", candidate.path, norm.path, "differs", detail, error)
        ledger.findings.append(finding)
        ledger.near_modules.setdefault(candidate.path, set()).add(layer)
    elif scale > ROUNDING * (float(numpy.linalg.norm(norm.shift)) + float(numpy.linalg.norm(expected - norm.shift))):
        detail = f"none: the shift of {norm.path} (β + (b − μ)·s, norm {scale:.3g}) is not folded into a bias"
        ledger.findings.append(
            WeightFinding(
                f"{candidate.path}.bias", f"{norm.path}.bias", candidate.path, norm.path, "differs", detail, 1.0
            )
        )


def _forget(ledger: WeightLedger, name: str) -> None:
    """Drop what the ledger said of candidate tensor ``name`` before it was read as a fold."""
    if name in ledger.unmatched:
        ledger.unmatched.remove(name)
    ledger.findings = [finding for finding in ledger.findings if finding.candidate != name]
