"""Nearness: which reference tensor a candidate tensor is a near copy of, from row and column sums, or rows and columns
hashing alike in place."""

from __future__ import annotations

import dataclasses
import math

import numpy

from paritylab.comparison.weights._records import (
    NEAR,
    NEAR_NAMESAKE,
    UNIQUE,
    Held,
)
from paritylab.tracing.structure import ParamPrint


def _nearest(ours: list[Held], theirs: list[Held]) -> dict[int, tuple[Held, float, bool]]:
    """Candidate tensor id -> (the reference tensor it is nearest, the distance, whether transposed), for the
    candidate tensors that lie near one reference tensor and clearly nearer it than any other; each reference
    tensor taken once, nearest first."""
    by_shape: dict[tuple[int, ...], list[Held]] = {}
    for item in ours:
        by_shape.setdefault(item.print.shape, []).append(item)
    proposals: list[tuple[float, int, Held, Held, bool]] = []
    for order, item in enumerate(theirs):
        if not item.print.sketch:
            continue
        shape = item.print.shape
        scored: list[tuple[float, Held, bool]] = []
        for twin in by_shape.get(shape, ()):
            distance = _distance(twin.print, item.print, False)
            if _mostly_in_place(twin.print, item.print):  # most rows and columns as they were: a defect in a few
                distance = min(distance, NEAR * _differing_share(twin.print, item.print))
            scored.append((distance, twin, False))
        if len(shape) == 2:
            turned = _transposed(item.print)
            for twin in by_shape.get(shape[::-1], ()):
                distance = _distance(twin.print, item.print, True)
                if _mostly_in_place(twin.print, turned):  # a transposed layout (an unembedding against embeddings)
                    distance = min(distance, NEAR * _differing_share(twin.print, turned))
                scored.append((distance, twin, True))
        scored = [entry for entry in scored if math.isfinite(entry[0])]
        if not scored:
            continue
        scored.sort(key=lambda entry: (entry[0], entry[1].print.name != item.print.name))
        best, twin, flipped = scored[0]
        others = [entry for entry in scored[1:] if entry[1].print.digest != twin.print.digest]  # copies are one
        second = others[0][0] if others else math.inf
        namesake = not others and twin.print.name == item.print.name and _only(item, theirs)
        if (best < NEAR or (namesake and best < NEAR_NAMESAKE)) and best <= UNIQUE * second:
            proposals.append((best, order, twin, item, flipped))
    taken: set[int] = set()
    found: dict[int, tuple[Held, float, bool]] = {}
    for distance, _, twin, item, flipped in sorted(proposals, key=lambda entry: entry[:2]):
        if id(twin) not in taken:
            taken.add(id(twin))
            found[id(item)] = (twin, distance, flipped)
    return found


def _transposed(item: ParamPrint) -> ParamPrint:
    """A 2-D tensor's fingerprint as its transpose's: rows and columns (hashes and sums) exchanged."""
    sums = item.sums
    sketch = b""
    if sums is not None:
        sketch = numpy.concatenate([sums[1], sums[0], [sums[2]]]).astype("<f4").tobytes()
    return dataclasses.replace(
        item, shape=item.shape[::-1], row_bytes=item.col_bytes, col_bytes=item.row_bytes, sketch=sketch
    )


def _mostly_in_place(ours: ParamPrint, theirs: ParamPrint) -> bool:
    """Two same-shape 2-D tensors whose rows hash alike at the same positions for more than half the rows, or whose
    columns do for more than half the columns: one is the other with a few rows, columns or elements changed (a
    block of rows loaded from the wrong place, one element scaled), however far its sums moved."""
    return _differing_share(ours, theirs) < 0.5


def _differing_share(ours: ParamPrint, theirs: ParamPrint) -> float:
    """The smaller of the shares of rows and of columns that differ between two same-shape 2-D tensors (1.0 when
    they keep no row hashes)."""
    if not ours.row_bytes or not theirs.row_bytes or ours.shape != theirs.shape:
        return 1.0
    shares = []
    for a, b in ((ours.row_bytes, theirs.row_bytes), (ours.col_bytes, theirs.col_bytes)):
        left, right = numpy.frombuffer(a, dtype="<u8"), numpy.frombuffer(b, dtype="<u8")
        shares.append(float(numpy.mean(left != right)) if len(left) else 1.0)
    return min(shares)


def _only(item: Held, items: list[Held]) -> bool:
    return sum(1 for other in items if other.print.shape == item.print.shape) == 1


def _distance(ours: ParamPrint, theirs: ParamPrint, flipped: bool) -> float:
    """The relative distance of two tensors' row and column sums (``flipped``: the candidate's rows against the
    reference's columns)."""
    a, b = ours.sums, theirs.sums
    if a is None or b is None:
        return math.inf
    ref = numpy.concatenate([a[0], a[1]])
    cand = numpy.concatenate([b[1], b[0]] if flipped else [b[0], b[1]])
    if ref.shape != cand.shape:
        return math.inf
    scale = float(numpy.linalg.norm(ref))
    if scale == 0.0:
        return 0.0 if not numpy.any(cand) else math.inf
    return float(numpy.linalg.norm(cand - ref)) / scale


def _nearest_shifted(
    ours: list[Held], theirs: list[Held]
) -> dict[int, tuple[Held, float, numpy.ndarray, numpy.ndarray]]:
    """Candidate 1-D tensor id -> (the reference tensor, the distance, the reference's values and the candidate's in
    one convention) for norm scales stored the other way (``g = w - 1`` against ``w``: Gemma's and x-transformers'
    norms multiply by ``1 + g``) that lie near one reference tensor once one side is shifted by one, and clearly
    nearer it than any other; each reference tensor taken once, nearest first."""
    proposals: list[tuple[float, int, Held, Held, numpy.ndarray, numpy.ndarray]] = []
    flat = [item for item in ours if len(item.print.shape) == 1 and item.print.sums is not None]
    for order, item in enumerate(theirs):
        sums = item.print.sums
        if len(item.print.shape) != 1 or sums is None:
            continue
        scored: list[tuple[float, Held, numpy.ndarray, numpy.ndarray]] = []
        for twin in flat:
            twin_sums = twin.print.sums
            if twin.print.shape != item.print.shape or twin_sums is None:
                continue
            for ref, cand in ((twin_sums[0] - 1.0, sums[0]), (twin_sums[0], sums[0] - 1.0)):
                scale = float(numpy.linalg.norm(ref))
                if scale > 0:
                    scored.append((float(numpy.linalg.norm(cand - ref)) / scale, twin, ref, cand))
        scored.sort(key=lambda entry: entry[0])
        if not scored:
            continue
        best, twin, ref, cand = scored[0]
        second = next((entry[0] for entry in scored[1:] if entry[1].print.digest != twin.print.digest), math.inf)
        if best < NEAR and best <= UNIQUE * second:
            proposals.append((best, order, twin, item, ref, cand))
    taken: set[int] = set()
    found: dict[int, tuple[Held, float, numpy.ndarray, numpy.ndarray]] = {}
    for distance, _, twin, item, ref, cand in sorted(proposals, key=lambda entry: entry[:2]):
        if id(twin) not in taken:
            taken.add(id(twin))
            found[id(item)] = (twin, distance, ref, cand)
    return found
