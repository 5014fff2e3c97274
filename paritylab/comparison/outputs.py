"""Every output counts: the values a call returns beside the one slot its row compares.

A row compares one output slot per side (the first tensor, or the one data flow names). A model that returns
``(logits, mask)`` or a ``ModelOutput`` with several fields returns more, and a bug in a second field must not
pass unseen. Here every other leaf of a compared call's output (tensors, and ints, bools and floats) is paired
with the candidate's and judged:

- **same key**: the same dict key or dataclass field path on both sides (any compared call), first: a name is a
  promise, so two named outputs swapped fail where data flow alone would pair each with the other's value;
- **data flow**: the candidate's leaf was made by the partner of the call that made the reference's;
- **same position**: the same tuple position with shapes that fit (the model's own outputs only: inside a
  model, two implementations may return different auxiliaries at one position).

For the model's own outputs (a root call) nothing may stay unexamined: a reference leaf with no counterpart is
**covered** when it is the very tensor an inner call made and that call's row compared it; **absent** when the
candidate returns nothing more (a port that returns only logits does not claim the reference's other fields);
and otherwise **not compared** (the candidate returns leaves that pair with nothing: which is which cannot be
told), which makes the run inconclusive, never a PASS. Leaves only the candidate returns are listed as
**extra**. Objects (a KV cache object, a config) are not values to compare.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from paritylab.tracing.tracefile import CallRecord
from paritylab.tracing.values import Node

NOT_COMPARED = "not-compared"
Judge = Callable[[Node, Node], tuple[str, str, dict[str, float], str]]
"""(reference node, candidate node) -> (status, verdict, metrics, note), as a row's comparison judges."""


@dataclass
class OutputCheck:
    """One more output leaf of a compared call, and what became of it."""

    reference: str | None
    """The reference's slot (``outputs.mask``); ``None`` for a leaf only the candidate returns."""
    candidate: str | None
    verdict: str
    """``pass``, ``fail``, ``covered`` (compared where it was made), ``absent`` (the candidate returns nothing
    more), ``not-compared`` or ``extra`` (the candidate's only)."""
    how: str = ""
    """How the two were paired (``data flow``, ``same key``, ``same position``) or where it was covered."""
    metrics: dict[str, float] = field(default_factory=dict)
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"reference": self.reference, "candidate": self.candidate, "verdict": self.verdict}
        for key in ("how", "note"):
            if getattr(self, key):
                data[key] = getattr(self, key)
        if self.metrics:
            data["metrics"] = {key: self.metrics[key] for key in ("rel_l2", "max_abs") if key in self.metrics}
        return data

    def describe(self) -> str:
        where = self.reference or self.candidate
        if self.verdict == "fail":
            detail = self.note or ", ".join(f"{key} {value:.3g}" for key, value in self.metrics.items()
                                            if key in ("rel_l2", "max_abs"))  # fmt: skip
            return f"{where} differs ({detail})"
        if self.verdict == NOT_COMPARED:
            return f"{where} was not compared ({self.note})"
        return f"{where}: {self.verdict}"


def leaves(node: Node | None, prefix: str) -> Iterator[tuple[str, Node]]:
    """``(slot, node)`` for every tensor and scalar leaf below ``node``, depth first."""
    if node is None:
        return
    kind = node.get("t")
    if kind in ("tensor", "scalar"):
        yield prefix, node
    elif kind in ("tuple", "list"):
        for index, item in enumerate(node["items"]):
            yield from leaves(item, f"{prefix}.{index}")
    elif kind == "dict":
        for key, item in node["items"].items():
            yield from leaves(item, f"{prefix}.{key}")


def check_outputs(
    ref_call: CallRecord,
    cand_call: CallRecord,
    primary: tuple[str | None, str | None],
    judge: Judge,
    partner: Mapping[int, int],
    covered_by: Callable[[Node], str | None],
    *,
    root: bool,
    by_position: bool | None = None,
) -> list[OutputCheck]:
    """The checks of every output leaf of ``ref_call``/``cand_call`` beside the ``primary`` slots.

    ``partner`` maps reference call indices to their candidate counterparts (data flow); ``covered_by`` says
    which compared row already judged a reference tensor (its module's path), or ``None``. ``by_position``
    (default: ``root``) also pairs leaves at the same tuple position.
    """
    positional = root if by_position is None else by_position
    ref_all, cand_all = list(leaves(ref_call.outputs, "outputs")), list(leaves(cand_call.outputs, "outputs"))
    ref_leaves = [(slot, node) for slot, node in ref_all if slot != primary[0]]
    cand_left = {slot: node for slot, node in cand_all if slot != primary[1]}
    made_by = {node["from"]: slot for slot, node in cand_left.items() if isinstance(node.get("from"), int)}
    ordinal = _ordinals(ref_all, cand_all, primary) if positional else {}
    checks: list[OutputCheck] = []
    unpaired: list[tuple[str, Node]] = []
    for slot, node in ref_leaves:
        target, how = _counterpart(slot, node, cand_left, made_by, partner, positional)
        if target is None and ordinal.get(slot) in cand_left and _fits(node, cand_left[ordinal[slot]]):
            target, how = ordinal[slot], "same position"
        if target is not None:
            checks.append(_judged(slot, node, target, cand_left.pop(target), how, judge))
        elif root:
            unpaired.append((slot, node))
    for slot, node in unpaired:
        where = covered_by(node) if node.get("t") == "tensor" else None
        if where is not None:
            checks.append(OutputCheck(slot, None, "covered", f"compared at {where}"))
        elif cand_left:  # the candidate returns something unpaired too: it may be this, judged by nobody
            checks.append(OutputCheck(slot, None, NOT_COMPARED, note="no compared module made it, and the "
                                      f"candidate's {', '.join(cand_left)} does not pair with it"))  # fmt: skip
        else:
            checks.append(OutputCheck(slot, None, "absent", note="the candidate does not return it"))
    if root:
        checks += [OutputCheck(None, slot, "extra", note="returned by the candidate only") for slot in cand_left]
    return checks


def _ordinals(
    ref_all: list[tuple[str, Node]], cand_all: list[tuple[str, Node]], primary: tuple[str | None, str | None]
) -> dict[str, str]:
    """Reference slot -> the candidate's leaf at the same place in order, where one side names its outputs and the
    other returns them by position (a ``ModelOutput`` against a port's tuple, in the order ``to_tuple()`` gives), and
    the two compared slots stand at the same place."""
    ref_slots, cand_slots = [slot for slot, _ in ref_all], [slot for slot, _ in cand_all]
    if len(ref_slots) != len(cand_slots) or primary[0] not in ref_slots or primary[1] not in cand_slots:
        return {}
    if ref_slots.index(primary[0]) != cand_slots.index(primary[1]):
        return {}
    named = [named_slot(slot) for slot in ref_slots], [named_slot(slot) for slot in cand_slots]
    if not (all(named[0]) and not any(named[1])) and not (all(named[1]) and not any(named[0])):
        return {}
    return dict(zip(ref_slots, cand_slots, strict=True))


def _fits(node: Node, other: Node) -> bool:
    """Leaves of one kind that could hold the same values (tensors of as many elements)."""
    if other.get("t") != node.get("t"):
        return False
    return node.get("t") != "tensor" or _numel(node["shape"]) == _numel(other["shape"])


def _counterpart(
    slot: str,
    node: Node,
    cand: Mapping[str, Node],
    made_by: Mapping[int, str],
    partner: Mapping[int, int],
    positional: bool,
) -> tuple[str | None, str]:
    other = cand.get(slot)
    fits = other is not None and _fits(node, other)
    if fits and named_slot(slot):  # a named output is what its name says, wherever data flow finds its value
        return slot, "same key"
    origin = node.get("from")
    if isinstance(origin, int) and origin in partner and made_by.get(partner[origin]) in cand:
        return made_by[partner[origin]], "data flow"
    return (slot, "same position") if fits and positional else (None, "")


def named_slot(slot: str | None) -> bool:
    """A slot reached through a dict key or a dataclass field (``outputs.logits``), not positions alone: the two sides
    returning the same name promise the same value under it, and a candidate handing another value there (two
    named outputs swapped) is wrong however its values were made."""
    return slot is not None and any(not part.lstrip("-").isdigit() for part in slot.split(".")[1:])


def _judged(slot: str, node: Node, target: str, other: Node, how: str, judge: Judge) -> OutputCheck:
    if node.get("t") == "scalar":
        same = _same_scalar(node.get("v"), other.get("v"))
        note = "" if same else f"{node.get('v')!r} vs {other.get('v')!r}"
        return OutputCheck(slot, target, "pass" if same else "fail", how, note=note)
    status, verdict, metrics, note = judge(node, other)
    if status not in ("compared", "shape-mismatch") and verdict != "fail":
        return OutputCheck(slot, target, NOT_COMPARED, how, metrics, note or status)
    return OutputCheck(slot, target, verdict, how, metrics, note)


def _same_scalar(a: object, b: object) -> bool:
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, int | float) or not isinstance(b, int | float):
        return a == b
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return math.isclose(a, b, rel_tol=1.3e-6, abs_tol=1e-5)


def _numel(shape: list[int]) -> int:
    return math.prod(shape)
