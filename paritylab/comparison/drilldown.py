"""Operation-level drill-down: inside the module named as the origin, the first operation whose output diverges.

Both sides run again with one call of that module recorded operation by operation (a ``TorchFunctionMode``
sees every ``torch`` function and tensor method the module's code calls, in its children too): the reference
as it ran, the candidate teacher-forced (every aligned call upstream returns the reference's value, see
:func:`paritylab.comparison.replay.teacher_forcing`), so both start from the same inputs.

Every tensor the candidate's call touched (its inputs, parameters and buffers, every operation's outputs) is
then looked up among the values the reference's call touched, in any position and, at full precision, in any
layout (a ``[batch, heads, tokens, dim]`` query matches a ``[batch, tokens, heads * dim]`` one). A value with no
match is not an error by itself: implementations differ in intermediates (a fused qkv projection, a query
scaled before the product). It is one when nothing computed from it matches again. The culprit is the earliest
such value whose operation's inputs are all clean: the first operation (or parameter, or buffer) where the
candidate's computation leaves the reference's for good. Fused functions (``scaled_dot_product_attention``,
``layer_norm``, ``rms_norm``) are recorded as the operations they perform
(:mod:`paritylab.comparison.expansions`), so their intermediates have counterparts on a written-out side.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from paritylab.comparison.op_matching import (
    Distance,
    flat,
    mark_slices,
    mark_stacked,
    match_values,
    value_shapes,
    with_siblings,
)
from paritylab.comparison.operations import Op, Recording, Value, record_call, split_key

_TOLERANCE = {"float64": (1e-9, 1e-5), "float32": (1e-6, 1e-4), "bfloat16": (1e-2, 3e-2), "float16": (2e-3, 5e-3)}
"""Per candidate dtype, the (smallest, largest) relative L2 distance under which two values are one value. The
tolerance used lies between them: an eighth of the module's own error, so a small error is still seen."""
_MOVES = frozenset(
    {"view", "reshape", "transpose", "permute", "contiguous", "expand", "expand_as", "unsqueeze", "squeeze"}
    | {"flatten", "unflatten", "t", "narrow", "select", "__getitem__", "split", "chunk", "unbind", "clone", "detach"}
    | {"movedim", "swapaxes", "repeat", "to", "type_as", "float", "dropout"}
)
"""Operations that move values without computing new ones (named as culprits only if nothing else is)."""


@dataclass
class Drilldown:
    """Where the candidate's computation leaves the reference's, inside one module call."""

    reference: str
    candidate: str
    tolerance: float
    value: Value | None
    """The candidate value where it leaves (``None``: no operation differs beyond the tolerance)."""
    operations: list[Op]
    """The candidate operations from there to the first value the reference also forms (the first is the
    culprit); empty when the culprit is a parameter, buffer or other value from outside the call."""
    counterparts: list[Op]
    """The reference operations doing the same job (consuming the same inputs)."""
    distance: float | None
    """Relative L2 distance between the two sides' results of that stretch."""
    message: str
    reference_ops: int
    candidate_ops: int
    notes: list[str] = field(default_factory=list)

    @property
    def culprit(self) -> Op | None:
        return self.operations[0] if self.operations else None

    @property
    def operation(self) -> str:
        """A short name for tags and tables: ``mlp.act: gelu``, ``ln_2: mean .. add (9 operations)``."""
        if self.value is None:
            return "none"
        if self.value.op is None or not self.operations:  # a parameter, buffer or tensor attribute
            return self.value.origin
        first, last = self.operations[0], self.operations[-1]
        where = f"{first.module}: " if first.module else ""
        if len(self.operations) == 1:
            return f"{where}{first.name}" + (f" in {first.within}" if first.within else "")
        return f"{where}{first.name} .. {last.name} ({len(self.operations)} operations)"

    def to_dict(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "candidate": self.candidate,
            "operation": self.operation,
            "message": self.message,
            "tolerance": self.tolerance,
            "distance": self.distance,
            "value": asdict(self.value) if self.value else None,
            "operations": [asdict(op) for op in self.operations],
            "counterparts": [asdict(op) for op in self.counterparts],
            "reference_ops": self.reference_ops,
            "candidate_ops": self.candidate_ops,
            "notes": self.notes,
        }


def drill_down(
    reference: Recording,
    candidate: Recording,
    dtype: torch.dtype | str,
    own_error: float | None = None,
    siblings: Mapping[str, torch.Tensor] | None = None,
) -> Drilldown:
    """Compare two recordings of one module call and name where the candidate leaves the reference.

    ``own_error`` (the module's own relative error, from isolated replay) sets the tolerance under which two
    values are one: an eighth of it, within the dtype's bounds (:data:`_TOLERANCE`). ``siblings``: the reference
    parameters and buffers beside the recorded module (its parent's, by full name), where the rest of a fused
    weight's rows are found (a port's gate/up ``w13`` against the reference's ``gate_proj``: the up rows are in
    ``up_proj``). They only complete a fused weight: a candidate value never matches one of them whole.
    """
    low, high = _TOLERANCE.get(str(dtype).removeprefix("torch."), _TOLERANCE["float32"])
    tolerance = min(high, max(low, (own_error or high) / 8))
    notes = [text for text in (reference.truncated, candidate.truncated) if text]
    notes += [f"{side.key} was never called" for side in (reference, candidate) if not side.called]
    layout_free = tolerance <= _TOLERANCE["float32"][1]
    equals = match_values(reference, candidate, tolerance, layout_free)
    mark_stacked(with_siblings(reference, siblings or {}), candidate, tolerance)
    mark_slices(reference, candidate, tolerance)
    value = _frontier(candidate)
    if value is None:
        message = (
            f"no operation in {candidate.key} differs beyond {tolerance:.1g} (relative L2) from the reference's "
            "values: the difference lies below what single operations show"
        )
        return Drilldown(reference.key, candidate.key, tolerance, None, [], [], None, message,
                         len(reference.ops), len(candidate.ops), notes)  # fmt: skip
    anchor = candidate.ops[value.op] if value.op is not None else _first_use(candidate, value.index)
    counterparts = _counterparts(reference, anchor, equals) if anchor is not None else []
    direct = (
        anchor is not None
        and value.op is not None
        and bool(counterparts)
        and all(_same_call(candidate, anchor, op, equals) for op in counterparts)
    )
    operations, distance = _stretch(reference, candidate, value, counterparts, layout_free, direct)
    indices = _other_indices(reference, candidate, anchor, counterparts) if anchor is not None else None
    message = _describe(candidate, value, operations, counterparts, distance, indices)
    return Drilldown(reference.key, candidate.key, tolerance, value, operations, counterparts, distance, message,
                     len(reference.ops), len(candidate.ops), notes)  # fmt: skip


def _consumers(recording: Recording) -> dict[int, list[Op]]:
    consumers: dict[int, list[Op]] = {}
    for op in recording.ops:
        for number in op.inputs:
            consumers.setdefault(number, []).append(op)
    return consumers


def _live(recording: Recording) -> list[bool]:
    """Per value: whether the call's output depends on it (a child output replaced, or a value never used,
    cannot be where the call goes wrong)."""
    live = [False] * len(recording.values)
    for number in recording.outputs:
        live[number] = True
    for op in reversed(recording.ops):
        if any(live[number] for number in op.outputs):
            for number in op.inputs:
                live[number] = True
    return live


def _clean(recording: Recording) -> list[bool]:
    """Per value: it equals a reference value, or something computed from it does (an intermediate the
    reference never forms), or it is what the call was given (the reference's own values)."""
    values = recording.values
    recovers = [False] * len(values)
    for op in reversed(recording.ops):  # a value recovers when a consumer's output matches or recovers
        if any(values[out].match is not None or recovers[out] for out in op.outputs):
            for number in op.inputs:
                recovers[number] = True
    clean = [
        value.origin.startswith(("input ", "forced "))
        or recording.tensors[value.index] is None
        or value.match is not None
        or bool(value.parts)
        or recovers[value.index]
        or _integral(value)
        for value in values
    ]
    for op in recording.ops:  # moving clean values (a transpose, a cast) makes clean values
        if op.name in _MOVES and all(clean[number] for number in op.inputs):
            for number in op.outputs:
                clean[number] = True
    return clean


def _frontier(candidate: Recording) -> Value | None:
    """The earliest value the call's output depends on that is not clean while everything it was computed
    from is (for a value from outside the call, its first use). A computing operation is preferred over one
    that only moves values."""
    clean, live = _clean(candidate), _live(candidate)
    found: list[tuple[int, int, int]] = []
    for value in candidate.values:
        if clean[value.index] or not live[value.index]:
            continue
        if value.op is None:
            first = _first_use(candidate, value.index)
            if first is not None:
                found.append((first.index, 0, value.index))
            continue
        op = candidate.ops[value.op]
        if all(clean[number] for number in op.inputs):
            found.append((op.index, 1 if op.name in _MOVES else 0, value.index))
    if not found:
        return None
    computing = [item for item in found if item[1] == 0]
    return candidate.values[min(computing or found)[2]]


def _first_use(recording: Recording, number: int) -> Op | None:
    return next((op for op in recording.ops if number in op.inputs), None)


def _integral(value: Value) -> bool:
    return not value.dtype.startswith(("float", "bfloat", "complex"))


def _counterparts(reference: Recording, anchor: Op, equals: dict[int, set[int]]) -> list[Op]:
    """The reference operations that take what ``anchor``'s inputs equal and make something no candidate
    value equals: what the reference does where the candidate goes its own way."""
    wanted = set().union(*(equals.get(n, set()) for n in anchor.inputs))
    seen = set().union(*equals.values())
    live = _live(reference)
    consuming = [
        op
        for op in reference.ops
        if wanted & set(op.inputs) and any(live[n] and not _integral(reference.values[n]) for n in op.outputs)
    ]
    found = [op for op in consuming if any(n not in seen for n in op.outputs)]
    # The same operation on the same inputs is the counterpart even when a candidate value happens to equal its
    # result (an eps of 1e-5 added to a variance near 1 is below the tolerance).
    same = [op for op in found if op.name == anchor.name] or [op for op in consuming if op.name == anchor.name]
    return (same or found)[:4]


def _same_call(candidate: Recording, anchor: Op, other: Op, equals: dict[int, set[int]]) -> bool:
    """``other`` (a reference operation) is ``anchor``'s function applied to what each of its floating-point
    tensor inputs equals: only the constants can differ (an eps, a scale)."""
    floats = [n for n in anchor.inputs if not _integral(candidate.values[n])]
    return other.name == anchor.name and bool(floats) and all(equals.get(n, set()) & set(other.inputs) for n in floats)


def _stretch(
    reference: Recording, candidate: Recording, value: Value, counterparts: list[Op], layout_free: bool, direct: bool
) -> tuple[list[Op], float | None]:
    """The candidate operations from ``value`` to the value nearest a counterpart's result, and that distance
    (``direct``: the counterparts are the operation that made ``value``, which is then the stretch alone)."""
    targets = [
        (n, *flat(tensor))
        for op in counterparts
        for n in op.outputs
        if (tensor := reference.tensors[n]) is not None and tensor.numel()
    ]
    downstream = _descendants(candidate, value.index)
    if direct:
        downstream = {value.index}
    distance = Distance(layout_free, value_shapes(reference, candidate))
    best, end = math.inf, None
    for number in sorted(downstream):
        tensor = candidate.tensors[number]
        if tensor is None or not tensor.numel() or _integral(candidate.values[number]):
            continue
        data, norm = flat(tensor)
        for key, other, other_norm in targets:
            found, _ = distance(-1 - number, data, norm, key, other, other_norm, math.inf)
            if found < best:
                best, end = found, number
    if end is None:
        first = candidate.ops[value.op] if value.op is not None else None
        return ([first] if first is not None else []), value.distance
    best = candidate.values[end].distance or best  # its distance to the nearest reference value: the error
    path = _ancestors(candidate, end) & downstream
    operations = sorted({op for n in path if (op := candidate.values[n].op) is not None})
    if value.op is None:  # a parameter or buffer: the stretch starts at its first use
        return [candidate.ops[i] for i in operations], best
    return [candidate.ops[i] for i in operations if i >= value.op], best


def _descendants(recording: Recording, start: int) -> set[int]:
    reached = {start}
    for op in recording.ops:
        if reached & set(op.inputs):
            reached.update(op.outputs)
    return reached


def _ancestors(recording: Recording, end: int) -> set[int]:
    reached = {end}
    for op in reversed(recording.ops):
        if reached & set(op.outputs):
            reached.update(op.inputs)
    return reached


def _other_indices(reference: Recording, candidate: Recording, anchor: Op, counterparts: list[Op]) -> str | None:
    """Where the candidate's operation reads integers (indices, positions, buckets) other than its counterpart's
    (the same operation, the same place among its inputs and shape): which input, and how many of its elements
    differ; integer values are never matched, so without this an embedding given other indices looks as if its
    own arithmetic differed."""
    for op in counterparts:
        if op.name != anchor.name or len(op.inputs) != len(anchor.inputs):
            continue
        for ours, theirs in zip(anchor.inputs, op.inputs, strict=True):
            mine, other = candidate.tensors[ours], reference.tensors[theirs]
            if not _integral(candidate.values[ours]) or mine is None or other is None or mine.shape != other.shape:
                continue
            differing = int((mine != other.to(mine.device)).sum())
            if differing:
                shown = candidate.values[ours]
                what = "its input" if shown.origin.startswith("input ") else shown.origin
                kind = "entries" if mine.dtype == torch.bool else "integers"  # a mask, or indices
                return f"{differing} of the {mine.numel()} {kind} of {what} {shown.shape} differ"
    return None


def _describe(
    candidate: Recording,
    value: Value,
    operations: list[Op],
    counterparts: list[Op],
    distance: float | None,
    indices: str | None = None,
) -> str:
    off = f"{distance:.3g}" if distance is not None and math.isfinite(distance) else "no value of its size"
    theirs = "; ".join(op.arguments + (f" in {op.within}" if op.within else "") for op in counterparts)
    if not operations:
        use = _first_use(candidate, value.index)
        read = f", read by {use.arguments}" if use is not None else ""
        return f"{value.origin} {value.shape} matches no reference value (nearest: {off}){read}"
    first = operations[0]
    where = f" in {first.module}" if first.module else ""
    if first.within:
        where += f" ({first.within}, written out)"
    if value.op is None:
        text = f"{value.origin} {value.shape}{where} matches no reference value: "
    else:
        text = f"the floating-point inputs agree{where}, then "
        if indices is not None:  # the integers it reads are not the reference's: what computed them differs
            text = f"the floating-point inputs agree{where} but {indices} from the reference's, so "
    if len(operations) == 1:
        text += f"{first.arguments} differs from the reference's result by {off}"
    else:
        shown = " -> ".join(op.arguments for op in operations[:8]) + (" -> ..." if len(operations) > 8 else "")
        text += f"{len(operations)} operations ({shown}) differ from the reference's result by {off}"
    if not counterparts:
        return text + "; the reference has no operation on the same inputs"
    if all(op.name != first.name for op in counterparts):  # not one operation done otherwise: another way
        return text + f"; the two sides compute this differently (on the same inputs the reference computes {theirs})"
    text += f"; the reference computes {theirs}"
    ours = [item for op in operations for item in op.scalars if item != "None"]  # an absent bias, said or not
    reference = [item for op in counterparts for item in op.scalars if item != "None"]
    comparable = [op.name for op in operations] == [op.name for op in counterparts]  # step for step, else not
    if ours != reference and comparable:  # (q and k scaled by d**-0.25 each against q by d**-0.5: not comparable)
        text += f" (constants: {', '.join(ours) or 'none'} vs the reference's {', '.join(reference) or 'none'})"
    return text


def sibling_tensors(model: nn.Module, path: str) -> dict[str, torch.Tensor]:
    """The floating-point parameters and buffers of the module holding ``path`` (by full name), except those of
    ``path`` itself; none when they are many times the module's own (a top-level module's parent is the whole
    model: hashing every row of a 7 B model is not what a fused projection needs)."""
    parent, _, own = path.rpartition(".")
    try:
        holder = model.get_submodule(parent)
    except AttributeError:
        return {}
    named = [(name, tensor) for name, tensor in (*holder.named_parameters(), *holder.named_buffers())]
    mine = sum(t.numel() * t.element_size() for name, t in named if name.startswith(f"{own}."))
    beside = {
        f"{parent}.{name}" if parent else name: tensor
        for name, tensor in named
        if not name.startswith(f"{own}.") and tensor is not None and tensor.is_floating_point()
    }
    size = sum(t.numel() * t.element_size() for t in beside.values())
    return beside if size <= max(_SIBLING_SHARE * mine, _SIBLING_FLOOR) else {}


_SIBLING_SHARE, _SIBLING_FLOOR = 16, 64 * 2**20
"""The siblings a drill-down reads: at most 16 times the drilled module's own bytes, or 64 MiB."""


def drill_into(
    reference: nn.Module,
    reference_run: Callable[[nn.Module], Any],
    reference_key: str,
    candidate: nn.Module,
    candidate_run: Callable[[nn.Module], Any],
    candidate_key: str,
    forcing: Callable[[nn.Module], Any],
    dtype: torch.dtype | str,
    own_error: float | None = None,
) -> Drilldown:
    """Record call ``reference_key`` of the reference as it runs, and call ``candidate_key`` of the candidate
    under ``forcing(candidate)`` (a context manager feeding it the reference's values, such as
    :func:`paritylab.comparison.replay.teacher_forcing`), and compare them (:func:`drill_down`).

    A compiled candidate is recorded through its eager module: the operations its source calls, which the
    compiled graph may fuse or reorder (a note says so).
    """
    notes = []
    eager = getattr(candidate, "_orig_mod", None)
    compiled = isinstance(eager, nn.Module)
    if isinstance(eager, nn.Module):
        notes.append("compiled candidate: operations recorded on its eager module (the compiled graph fuses them)")
        candidate = eager
    reference_recording = record_call(reference, *split_key(reference_key), reference_run)
    with forcing(candidate):
        candidate_recording = record_call(candidate, *split_key(candidate_key), candidate_run)
    siblings = sibling_tensors(reference, split_key(reference_key)[0])
    result = drill_down(reference_recording, candidate_recording, dtype, own_error, siblings)
    result.notes[:0] = notes
    if compiled and result.value is None and candidate_recording.called:
        result.message = (
            f"every operation of {candidate_key}'s eager code agrees with the reference: the divergence is made by "
            "the compiled graph itself (graph capture, fusion or lowering), which operations recorded on eager "
            "code cannot show; candidate.backend=aot_eager tells capture from lowering"
        )
    return result
