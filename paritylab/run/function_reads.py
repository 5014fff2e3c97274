"""What a function reading an unpaired module's weights was given.

A port may apply a reference module's weights with a function instead of a module (``F.layer_norm(x, (d,),
self.ln2_weight, self.ln2_bias)`` in a flat forward): the reference module then has no counterpart, and where
divergence is first seen just after it, the module is named ("no counterpart, and its output reaches ... changed").
Yet the error may lie before it: a residual the port's code dropped reaches that function already wrong. The
function's own input tells. The candidate runs once more as the isolated replay does (every paired call given the
reference's value), and the first call of a layer function (a norm, a linear map, a convolution, an embedding)
that reads the candidate's copies of the module's weights is recorded: where its input differs from the input the
reference module was given, the code that made that input is named (the module whose output it is, or the code
of the module around it); where its input agrees, the module stays named, now with that evidence.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from paritylab.comparison.attribution import EXACT_LIMIT, REL_MULTIPLE
from paritylab.comparison.judgement import Report, Row, primary_input, producer_row
from paritylab.comparison.localise import name_origin
from paritylab.comparison.metrics import min_floor
from paritylab.comparison.op_matching import relative_distance
from paritylab.comparison.replay import teacher_forcing
from paritylab.tracing.tracefile import Trace

LAYER_FUNCTIONS = frozenset(
    {
        F.layer_norm,
        F.group_norm,
        F.batch_norm,
        F.instance_norm,
        F.linear,
        F.conv1d,
        F.conv2d,
        F.conv3d,
        F.conv_transpose1d,
        F.conv_transpose2d,
        F.conv_transpose3d,
        F.embedding,
        *((F.rms_norm,) if hasattr(F, "rms_norm") else ()),
    }
)
"""Functions that compute a whole layer from its input and its weights: their first argument is the layer's input
(a hand-written norm multiplies a normalised value by the weight: that product's input is not the module's)."""


@dataclass(frozen=True)
class _Read:
    function: str
    given: torch.Tensor


class _Reads(TorchFunctionMode):
    """Records each call of a layer function that reads one of ``weights`` (by identity), its input detached."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        super().__init__()
        self._ids = {id(weight) for weight in weights}
        self.reads: list[_Read] = []

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func in LAYER_FUNCTIONS and args and isinstance(args[0], torch.Tensor):
            rest = [*args[1:], *kwargs.values()]
            if id(args[0]) not in self._ids and any(id(value) in self._ids for value in rest):
                self.reads.append(_Read(getattr(func, "__name__", str(func)), args[0].detach().clone()))
        return func(*args, **kwargs)


def judge_function_reads(
    report: Report,
    reference: nn.Module | None,
    candidate: nn.Module,
    candidate_call: Callable[[nn.Module], Any],
    reference_trace: Trace,
    candidate_trace: Trace,
) -> Report:
    """``report`` with the code before an unpaired module named where that module was named and the function
    reading its weights in the candidate was given a wrong input (:mod:`paritylab.run.function_reads`); ``report``
    itself where nothing was to try or the module's input agrees (then with that noted)."""
    named = report.first_divergence
    if reference is None or named is None or named.status != "unmatched" or named.candidate is not None:
        return report
    weights = _candidate_copies(reference, candidate, named.path)
    given = _reference_input(reference_trace, named.reference.key)
    if not weights or given is None:
        return report
    reads = _Reads(weights)
    try:
        with teacher_forcing(candidate, reference_trace, candidate_trace, report.alignment), torch.no_grad(), reads:
            candidate_call(candidate)
    except Exception:  # a refinement only: the verdict stands as judged without it
        return report
    calls = sum(1 for call in reference_trace.calls if call.path == named.path)
    call_index = int(named.reference.key.rsplit("#", 1)[1])
    if len(reads.reads) != calls or len(reads.reads) <= call_index:
        return report  # the function is called otherwise than the module: which read is which is unknown
    read = reads.reads[call_index]
    if read.given.shape != given.shape:
        return report
    error = relative_distance(read.given, given)
    dtypes = (str(given.dtype).removeprefix("torch."), str(read.given.dtype).removeprefix("torch."))
    limit = max(REL_MULTIPLE * min_floor(*dtypes), *(EXACT_LIMIT.get(dtype, 0.0) for dtype in dtypes))
    if error <= limit:
        report = report.copy()
        row = report.first_divergence
        assert row is not None
        said = f"the {read.function} reading its weights in the candidate was given its input (rel_l2 {error:.3g})"
        row.note = f"{row.note}; {said}" if row.note else said
        return report
    return _named_before(report, reference_trace, named, read.function, error)


def _candidate_copies(reference: nn.Module, candidate: nn.Module, path: str) -> list[torch.Tensor]:
    """The candidate's parameters and buffers that hold one of the reference module ``path``'s own weights, each
    the only copy of a tensor no other reference tensor equals (a random-init norm's ones are everyone's: a read
    of them could be any norm's, so none is taken)."""
    try:
        module = reference.get_submodule(path)
    except AttributeError:
        return []
    own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    own = [tensor for tensor in own if tensor.is_floating_point() and tensor.device.type != "meta"]
    own = [tensor for tensor in own if not _constant(tensor)]
    theirs = [*reference.parameters(), *reference.buffers()]
    held = [*candidate.parameters(), *candidate.buffers()]
    found: list[torch.Tensor] = []
    for tensor in own:
        if any(other is not tensor and _same(tensor, other) for other in theirs):
            return []
        copies = [other for other in held if _same(tensor, other)]
        if len(copies) != 1:
            return []
        found.extend(copies)
    return found


def _constant(tensor: torch.Tensor) -> bool:
    flat = tensor.detach().reshape(-1)
    return flat.numel() < 2 or bool((flat == flat[0]).all())


def _same(one: torch.Tensor, other: torch.Tensor) -> bool:
    """Equal values in the narrower of the two dtypes (a bfloat16 copy of a float32 weight)."""
    if other.shape != one.shape or not other.is_floating_point() or other.device.type == "meta":
        return False
    with torch.no_grad():
        narrow = other.dtype if torch.finfo(other.dtype).bits < torch.finfo(one.dtype).bits else one.dtype
        return bool(torch.equal(one.detach().to(other.device, narrow), other.detach().to(dtype=narrow)))


def _reference_input(trace: Trace, key: str) -> torch.Tensor | None:
    try:
        call = trace.call(key)
    except KeyError:
        return None
    node = primary_input(call)
    value = trace.tensor(node) if node is not None else None
    return value if value is not None and value.is_floating_point() else None


def _named_before(report: Report, reference: Trace, named: Row, function: str, error: float) -> Report:
    """A copy of ``report`` naming the code that made ``named``'s input: the unpaired module whose output it is,
    else the code of the module around ``named``; ``report`` itself where neither is known."""
    report = report.copy()
    by_index = {row.index: row for row in report.rows}
    row = by_index[named.index]
    given = f"the {function} reading {row.path}'s weights in the candidate is given a value that differs (rel_l2"
    replayed = f" {error:.3g}) while every paired module before it was given the reference's values (isolated replay)"
    producer = producer_row(by_index, reference, row)
    if producer is not None and producer.status == "unmatched":
        origin, note = producer, f"no counterpart, and its output is wrong on the way: {given}{replayed}"
    elif row.parent is not None and row.parent in by_index:
        origin = by_index[row.parent]
        note = f"its own code gives {row.path} a value the reference does not: {given}{replayed}"
    else:
        return report
    row.cause, row.diverged = "inherited", True
    kept = f"its input already differs: {given}{replayed}"
    row.note = kept
    name_origin(report, origin, note, replaced=(row,))
    return report
