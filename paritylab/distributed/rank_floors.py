"""Per-rank floors: one rank's error found in a low-precision candidate whose dtype tolerance hides it.

A bfloat16 row passes when its relative L2 error is under the dtype's tolerance (1.6e-2): a 1 % error in one rank's
shard of a column-parallel output, or in one rank's copy of an all-reduced value, is inside it, and the merged row
passes (or fails only layers later, where every rank holds the error). But every rank runs the same code in the
same dtype on the same inputs, so the other ranks' errors in the same slot say what precision alone causes there:
that is each rank's floor, never below the dtype's rounding (:func:`~paritylab.comparison.metrics.min_floor`). A
rank whose piece is more than :data:`RANK_MULTIPLE` times its floor is wrong, whatever the dtype's tolerance says;
so is one more than :data:`SYSTEMATIC_MULTIPLE` times its floor whose difference from the reference's part has a
systematic part (a gain along the reference's values or a constant offset, z-score over :data:`SYSTEMATIC_Z`:
:func:`~paritylab.comparison.metrics.systematic_z`): rounding is unbiased, a scaled or shifted rank is not. Against
a float32 reference a bfloat16 candidate's floor is higher (its every value rounded), and a 1 % scale on one rank
is less than 3 times it, but its gain stands out (z-score 25 to 90 against at most 2.6 for clean ranks).

Only candidates narrower than float32 are judged so: in float32 the dtype's tolerance (1.3e-6) is already far
below any defect, and two ranks' rounding can differ by more than the multiple where both are near zero.

:func:`apply_rank_floors` fails the rows whose ranks are beyond their floors and makes the earliest innermost of
them whose inputs are within theirs the report's first divergence (when none comes before it); it returns the
ranks it found per slot, which :mod:`.localise` reads in place of the tolerance's verdict on each rank.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping

from paritylab.comparison.judgement import Report, Row, innermost
from paritylab.comparison.metrics import min_floor, narrower, systematic_z
from paritylab.comparison.report import slot_value
from paritylab.distributed.merge import MergedTrace, SlotMerge, rank_list
from paritylab.tracing.tracefile import Trace

RANK_MULTIPLE = 3.0
"""A rank's piece is beyond its floor when its relative L2 error exceeds this multiple of the floor (clean
bfloat16 ranks measured at most 2.1 times theirs on the tests' ports, a 1 % error on one rank 4 to 5 times)."""
SYSTEMATIC_MULTIPLE = 1.5
"""... or this multiple, with a systematic part (:data:`SYSTEMATIC_Z`)."""
SYSTEMATIC_Z = 8.0
"""The z-score of a gain or offset (:func:`~paritylab.comparison.metrics.systematic_z`) that is a systematic part."""
RULES = ("concat", "shard", "disagree", "replicate")
"""The merge rules whose per-rank errors are each rank's own piece against its part (``rows`` judges a fused
output whose row compares one part of it; ``partial`` pieces have no reference part)."""
REASON = "the earliest innermost module one of whose ranks' pieces is beyond its per-rank floor while its input is not"

Beyond = dict[int, float | None]
"""Rank -> the z-score of its systematic part when that decided (``None``: its error alone did)."""
Floors = dict[tuple[str, str], Beyond]
"""(call key, slot) -> the ranks beyond their floors there."""


def rank_floors(merge: SlotMerge, dtype: str | None) -> list[float] | None:
    """Each holder's floor in ``merge``'s slot: the median of the other ranks' errors, at least the rounding of
    ``dtype``; ``None`` where ranks are not judged so (float32 and wider, fewer than two ranks, other rules)."""
    errors = merge.errors
    if errors is None or len(errors) < 2 or merge.rule not in RULES or not narrower(dtype, "float32"):
        return None
    rounding = min_floor(dtype)
    return [max(rounding, statistics.median(errors[:at] + errors[at + 1 :])) for at in range(len(errors))]


def beyond_floors(merge: SlotMerge, dtype: str | None, systematic: Callable[[int], float] | None = None) -> Beyond:
    """The ranks whose pieces are beyond their floors in ``merge``'s slot (none where :func:`rank_floors` judges
    nothing). ``systematic(at)``: the z-score of the systematic part of the ``at``-th holder's piece."""
    floors = rank_floors(merge, dtype)
    if floors is None or merge.errors is None:
        return {}
    found: Beyond = {}
    for at, (rank, error, floor) in enumerate(zip(merge.holders, merge.errors, floors, strict=True)):
        if error > RANK_MULTIPLE * floor:
            found[rank] = None
        elif systematic is not None and error > SYSTEMATIC_MULTIPLE * floor:
            z = systematic(at)
            if abs(z) > SYSTEMATIC_Z:
                found[rank] = z
    return found


def floor_line(merge: SlotMerge, beyond: Mapping[int, float | None], dtype: str | None) -> str:
    """``rank 1 rel_l2 0.01, 4x its floor 0.0025, what the other ranks show there (the same code in bfloat16)``."""
    floors = rank_floors(merge, dtype) or []
    found = []
    for rank, error, floor in zip(merge.holders, merge.errors or [], floors, strict=False):
        if rank not in beyond:
            continue
        z = beyond[rank]
        part = f" with a systematic gain or offset (z-score {z:.3g})" if z is not None else ""
        found.append(f"rank {rank} rel_l2 {error:.2g}, {error / floor:.1f}x its floor {floor:.2g}{part}")
    return f"{'; '.join(found)}, what the other ranks show there (the same code in {dtype})"


def apply_rank_floors(report: Report, merged: MergedTrace, reference: Trace | None = None) -> Floors:
    """Fail every passing compared row with a rank beyond its floor (module docstring), note it on the row, and make
    the first of them that starts there the first divergence when nothing diverges before it. ``reference``: the
    reference's trace, whose values the systematic parts are measured against (without it, errors alone decide)."""
    found: Floors = {}
    flagged: list[Row] = []
    for row in report.rows:
        if row.status != "compared" or row.candidate is None or row.verdict != "pass":
            continue
        merge = merged.slot(row.candidate.key, row.candidate.slot or "")
        if merge is None:
            continue
        dtype = row.candidate.dtype
        ranks = beyond_floors(merge, dtype, _systematic(merge, merged, reference))
        if not ranks:
            continue
        found[(merge.call, merge.slot)] = ranks
        row.verdict, row.diverged = "fail", True
        line = f"per-rank floor: {rank_list(list(ranks))} beyond it: {floor_line(merge, ranks, dtype)}"
        row.note = "; ".join(filter(None, [row.note, line]))
        flagged.append(row)
    inputs: dict[str, list[SlotMerge]] = {}
    for (key, slot), merge in merged.slots.items():
        if slot.startswith("inputs"):
            inputs.setdefault(key, []).append(merge)
    starts = [row for row in flagged if not _inputs_beyond(row, inputs, found, merged, reference)]
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


def _systematic(merge: SlotMerge, merged: MergedTrace, reference: Trace | None) -> Callable[[int], float] | None:
    """The z-score of the systematic part of each holder's piece against the reference's part it stands for (its
    slice along the concatenation, or the whole), the larger of gain and offset; ``None`` without a reference, or
    for replicas of a sharding (a 2-D mesh)."""
    if reference is None or merge.parts is not None:
        return None

    def score(at: int) -> float:
        whole = slot_value(reference, merge.call, merge.slot)
        piece = merged.rank_value(merge.call, merge.slot, merge.holders[at])
        if whole is None or piece is None:
            return 0.0
        part = whole
        if merge.rule in ("concat", "shard") and merge.dim is not None:
            start = sum(shape[merge.dim] for shape in (merge.shapes[rank] for rank in merge.holders[:at]))
            part = whole.narrow(merge.dim, start, int(piece.shape[merge.dim]))
        if part.shape != piece.shape:
            return 0.0
        found = systematic_z(part, part, piece)
        return max(found["gain_z"], found["offset_z"], key=abs)

    return score


def _inputs_beyond(
    row: Row, inputs: dict[str, list[SlotMerge]], found: Floors, merged: MergedTrace, reference: Trace | None
) -> bool:
    """Whether a rank's piece of one of ``row``'s inputs (``inputs``: each call's input slots) is beyond its floor
    (recorded in ``found`` as well)."""
    assert row.candidate is not None
    beyond = False
    for merge in inputs.get(row.candidate.key, []):
        ranks = beyond_floors(merge, row.candidate.dtype, _systematic(merge, merged, reference))
        if ranks:
            found[(merge.call, merge.slot)] = ranks
            beyond = True
    return beyond
