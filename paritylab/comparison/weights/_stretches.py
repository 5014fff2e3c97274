"""A 1-D tensor made of stretches of the reference's: a shard of a bias (rank ``r``'s rows of it), a shard of a fused
bias (``[q_r; k_r; v_r]``), a table cut to some of its entries.

A 1-D fingerprint keeps every value (its sketch), so stretches are found by value: each run of the candidate's values
equal (within rounding) to a run of one reference tensor's is that stretch; a run equal to none, between two that
are, stands for the stretch its neighbours place (at the offset the stretch before it starts at, in another tensor:
a shard takes the same rows of each part), and is compared with it.
"""

from __future__ import annotations

import math

import numpy

from paritylab.comparison.weights._describe import _values_differ
from paritylab.comparison.weights._records import NEAR, ROUNDING, UNIQUE, Held, WeightFinding

MIN_STRETCH = 2
"""Shorter runs are coincidences (one value equal by chance), not stretches."""
MAX_STARTS = 16
"""Where a value occurs more often than this in a reference tensor (zeros, ones), only the first are tried."""


def _by_stretches(item: Held, ours: list[Held]) -> tuple[bool, list[WeightFinding]] | None:
    """Whether a 1-D candidate tensor is stretches of reference 1-D tensors, and the findings for the stretches that
    differ; ``None`` where some run of it is no stretch (nor one its neighbours place)."""
    sums = item.print.sums
    if sums is None or len(item.print.shape) != 1:
        return None
    values = sums[0]
    flat = [
        (other, other.print.sums[0])
        for other in ours
        if len(other.print.shape) == 1 and other.print.sums is not None and other is not item
    ]
    pieces: list[tuple[int, int, Held | None, int]] = []  # (start, stop, reference tensor, its offset); None: a gap
    position = 0
    while position < len(values):
        found = _longest(values, position, flat)
        if found is None:
            if pieces and pieces[-1][2] is None:
                pieces[-1] = (pieces[-1][0], position + 1, None, 0)
            else:
                pieces.append((position, position + 1, None, 0))
            position += 1
            continue
        other, offset, length = found
        pieces.append((position, position + length, other, offset))
        position += length
    exact = [piece for piece in pieces if piece[2] is not None]
    holder = pieces[0][2]
    whole = len(pieces) == 1 and holder is not None and holder.print.shape == item.print.shape
    if not exact or whole:
        return None  # no stretch, or the whole of one tensor (the fingerprint stages judge that)
    findings: list[WeightFinding] = []
    for index, (start, stop, holder, _) in enumerate(pieces):
        if holder is not None:
            continue
        finding = _placed(item, values, start, stop, pieces[index - 1] if index else None, flat)
        if finding is None:
            return None
        findings.append(finding)
    return not findings, findings


def _longest(
    values: numpy.ndarray, position: int, flat: list[tuple[Held, numpy.ndarray]]
) -> tuple[Held, int, int] | None:
    """The longest run of reference values equal to the candidate's from ``position`` (at least :data:`MIN_STRETCH`)."""
    best: tuple[Held, int, int] | None = None
    for other, ref in flat:
        tolerance = ROUNDING * (abs(values[position]) + ROUNDING * float(numpy.abs(ref).mean() or 1.0))
        starts = numpy.flatnonzero(numpy.abs(ref - values[position]) <= tolerance)[:MAX_STARTS]
        for start in starts.tolist():
            span = min(len(ref) - start, len(values) - position)
            a, b = values[position : position + span], ref[start : start + span]
            close = numpy.abs(a - b) <= ROUNDING * (numpy.abs(b) + ROUNDING * float(numpy.abs(ref).mean() or 1.0))
            length = int(numpy.argmin(close)) if not close.all() else span
            if length >= MIN_STRETCH and (best is None or length > best[2]):
                best = (other, start, length)
    return best


def _placed(
    item: Held,
    values: numpy.ndarray,
    start: int,
    stop: int,
    before: tuple[int, int, Held | None, int] | None,
    flat: list[tuple[Held, numpy.ndarray]],
) -> WeightFinding | None:
    """The finding for candidate values ``[start, stop)`` that are no stretch: compared with each reference tensor's
    stretch at the offset the stretch before them starts at (a shard takes the same rows of each part), the nearest
    within :data:`NEAR` and clearly nearer than any other."""
    if before is None or before[2] is None:
        return None
    offset = before[3]
    size = stop - start
    part = values[start:stop]
    scored: list[tuple[float, Held]] = []
    for other, ref in flat:
        if offset + size > len(ref):
            continue
        window = ref[offset : offset + size]
        scale = float(numpy.linalg.norm(window))
        if scale > 0:
            scored.append((float(numpy.linalg.norm(part - window)) / scale, other))
    scored.sort(key=lambda entry: entry[0])
    if not scored or scored[0][0] >= NEAR:
        return None
    second = scored[1][0] if len(scored) > 1 else math.inf
    if scored[0][0] > UNIQUE * second:
        return None
    other = scored[0][1]
    ref = next(values for held, values in flat if held is other)
    detail, rel_l2 = _values_differ(ref[offset : offset + size], part)
    where = f"{item.name} [{start}:{stop}]"
    reference = f"{other.name} [{offset}:{offset + size}]"
    return WeightFinding(
        where, reference, item.module, other.module, "differs", f"{detail}, rel_l2 {rel_l2:.3g}", rel_l2
    )
