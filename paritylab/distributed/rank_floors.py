"""Per-rank floors: one rank's error found in a low-precision candidate whose dtype tolerance hides it.

A bfloat16 row passes when its relative L2 error is under the dtype's tolerance (1.6e-2): a 1 % error in one rank's
shard of a column-parallel output, or in one rank's copy of an all-reduced value, is inside it, and the merged row
passes (or fails only layers later, where every rank holds the error). But every rank runs the same code in the
same dtype on the same inputs, so the other ranks' errors in the same slot say what precision alone causes there:
that is each rank's floor, never below the dtype's rounding (:func:`~paritylab.comparison.metrics.min_floor`). A
rank whose piece is more than :data:`RANK_MULTIPLE` times its floor is wrong, whatever the dtype's tolerance says.

Only candidates narrower than float32 are judged so: in float32 the dtype's tolerance (1.3e-6) is already far
below any defect, and two ranks' rounding can differ by more than the multiple where both are near zero.

:func:`apply_rank_floors` fails the rows whose ranks are beyond their floors and makes the earliest innermost of
them whose inputs are within theirs the report's first divergence (when none comes before it); it returns the
ranks it found per slot, which :mod:`.localise` reads in place of the tolerance's verdict on each rank.
"""

from __future__ import annotations

import statistics

from paritylab.comparison.judgement import Report, Row, innermost
from paritylab.comparison.metrics import min_floor, narrower
from paritylab.distributed.merge import MergedTrace, SlotMerge, rank_list

RANK_MULTIPLE = 3.0
"""A rank's piece is beyond its floor when its relative L2 error exceeds this multiple of the floor (clean
bfloat16 ranks measured at most 2.1 times theirs on the tests' ports, a 1 % error on one rank 4 to 5 times)."""
RULES = ("concat", "shard", "disagree", "replicate")
"""The merge rules whose per-rank errors are each rank's own piece against its part (``rows`` judges a fused
output whose row compares one part of it; ``partial`` pieces have no reference part)."""
REASON = "the earliest innermost module one of whose ranks' pieces is beyond its per-rank floor while its input is not"

Floors = dict[tuple[str, str], list[int]]
"""(call key, slot) -> the ranks beyond their floors there."""


def rank_floors(merge: SlotMerge, dtype: str | None) -> list[float] | None:
    """Each holder's floor in ``merge``'s slot: the median of the other ranks' errors, at least the rounding of
    ``dtype``; ``None`` where ranks are not judged so (float32 and wider, fewer than two ranks, other rules)."""
    errors = merge.errors
    if errors is None or len(errors) < 2 or merge.rule not in RULES or not narrower(dtype, "float32"):
        return None
    rounding = min_floor(dtype)
    return [max(rounding, statistics.median(errors[:at] + errors[at + 1 :])) for at in range(len(errors))]


def beyond_floors(merge: SlotMerge, dtype: str | None) -> list[int]:
    """The ranks whose pieces are beyond their floors in ``merge``'s slot (none where :func:`rank_floors` judges
    nothing)."""
    floors = rank_floors(merge, dtype)
    if floors is None or merge.errors is None:
        return []
    pieces = zip(merge.holders, merge.errors, floors, strict=True)
    return [rank for rank, error, floor in pieces if error > RANK_MULTIPLE * floor]


def floor_line(merge: SlotMerge, ranks: list[int], dtype: str | None) -> str:
    """``rank 1 rel_l2 0.01, 4x its floor 0.0025, what the other ranks show there (the same code in bfloat16)``."""
    floors = rank_floors(merge, dtype) or []
    found = [
        f"rank {rank} rel_l2 {error:.2g}, {error / floor:.1f}x its floor {floor:.2g}"
        for rank, error, floor in zip(merge.holders, merge.errors or [], floors, strict=False)
        if rank in ranks
    ]
    return f"{'; '.join(found)}, what the other ranks show there (the same code in {dtype})"


def apply_rank_floors(report: Report, merged: MergedTrace) -> Floors:
    """Fail every passing compared row with a rank beyond its floor (module docstring), note it on the row, and make
    the first of them that starts there the first divergence when nothing diverges before it."""
    found: Floors = {}
    flagged: list[Row] = []
    for row in report.rows:
        if row.status != "compared" or row.candidate is None or row.verdict != "pass":
            continue
        merge = merged.slot(row.candidate.key, row.candidate.slot or "")
        dtype = row.candidate.dtype
        ranks = beyond_floors(merge, dtype) if merge is not None else []
        if not ranks or merge is None:
            continue
        found[(merge.call, merge.slot)] = ranks
        row.verdict, row.diverged = "fail", True
        line = f"per-rank floor: {rank_list(ranks)} beyond it: {floor_line(merge, ranks, dtype)}"
        row.note = "; ".join(filter(None, [row.note, line]))
        flagged.append(row)
    inputs: dict[str, list[SlotMerge]] = {}
    for (key, slot), merge in merged.slots.items():
        if slot.startswith("inputs"):
            inputs.setdefault(key, []).append(merge)
    starts = [row for row in flagged if not _inputs_beyond(row, inputs, found)]
    if not starts:
        return found
    origin = innermost(starts, report.rows)[0]
    origin.input_known, origin.input_diverged = True, False
    first = report.first_divergence
    if first is None or origin.index < first.index:
        origin.cause = "origin"
        report.first_divergence, report.culprit_reason = origin, REASON
        report.origins = [origin, *(row for row in report.origins if row is not origin)]
    return found


def _inputs_beyond(row: Row, inputs: dict[str, list[SlotMerge]], found: Floors) -> bool:
    """Whether a rank's piece of one of ``row``'s inputs (``inputs``: each call's input slots) is beyond its floor
    (recorded in ``found`` as well)."""
    assert row.candidate is not None
    beyond = False
    for merge in inputs.get(row.candidate.key, []):
        ranks = beyond_floors(merge, row.candidate.dtype)
        if ranks:
            found[(merge.call, merge.slot)] = ranks
            beyond = True
    return beyond
