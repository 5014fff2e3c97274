"""Fused and sharded tensors block by block: a run of rows (or a stretch of a bias) no reference row matches, compared
with the reference block it stands for."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy

from paritylab.comparison.weights._describe import _scale, _values_differ
from paritylab.comparison.weights._records import (
    NEAR,
    ROUNDING,
    UNIQUE,
    Held,
    WeightFinding,
)
from paritylab.tracing.structure import ParamPrint


@dataclass
class _Blocks:
    """What a fused or sharded candidate tensor holds, block by block."""

    findings: list[WeightFinding] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)
    parts: list[tuple[WeightFinding, int, int]] = field(default_factory=list)
    """Findings whose reference is a whole tensor, with the candidate rows ``[start, stop)`` holding it."""


def _by_blocks(item: Held, ours: list[Held]) -> _Blocks | None:
    """A 2-D candidate tensor most of whose rows are reference rows (a fused ``[q; k; v]`` against separate
    projections, a shard's ``[q_r; k_r; v_r]``): each run of rows no reference row matches is compared, by its row
    sums, with each reference block it could stand for (a whole tensor of as many rows none of whose rows the
    candidate holds, or a gap of as many rows in a tensor the candidate holds the rest of). ``None`` where fewer than
    a quarter of its rows are reference rows: not a composite."""
    theirs = item.print
    if not theirs.row_bytes or len(theirs.shape) != 2 or theirs.sums is None:
        return None
    width = theirs.shape[1]
    index: dict[int, list[tuple[Held, int]]] = {}
    candidates = [other for other in ours if len(other.print.shape) == 2 and other.print.shape[1] == width]
    for other in candidates:
        if other.print.row_bytes:
            for row, value in enumerate(numpy.frombuffer(other.print.row_bytes, dtype="<u8").tolist()):
                index.setdefault(value, []).append((other, row))
    hashes = numpy.frombuffer(theirs.row_bytes, dtype="<u8").tolist()
    held_rows = [index.get(value, [])[:1] for value in hashes]
    share = sum(1 for found in held_rows if found) / max(1, len(hashes))
    if share < 0.25 or share == 1.0:
        return None
    used: dict[int, set[int]] = {}
    placed: dict[int, dict[int, int]] = {}  # id of a reference tensor -> its rows -> the candidate rows holding them
    for position, found in enumerate(held_rows):
        for other, row in found:
            used.setdefault(id(other), set()).add(row)
            placed.setdefault(id(other), {}).setdefault(row, position)
    result = _Blocks()
    differing: dict[int, tuple[Held, WeightFinding]] = {}
    for start, stop in _runs([position for position, found in enumerate(held_rows) if not found]):
        options = list(_blocks_of(candidates, used, stop - start))
        scored = sorted(
            ((_rows_distance(theirs, start, stop, other.print, first), other, first) for other, first in options),
            key=lambda entry: entry[0],
        )
        where = f"{item.name} rows {start}-{stop - 1}"
        if not scored or scored[0][0] >= NEAR or (len(scored) > 1 and scored[0][0] > UNIQUE * scored[1][0]):
            result.unmatched.append(where)
            continue
        distance, other, first = scored[0]
        whole = other.print.shape[0] == stop - start
        reference = other.name if whole else f"{other.name} rows {first}-{first + stop - start - 1}"
        sums, ref_sums = theirs.sums[0][start:stop], _row_sums(other.print)[first : first + stop - start]
        scale = _scale(ref_sums, sums)
        detail = (
            f"scaled by {scale:.4g}, rel_l2 {abs(scale - 1):.3g}"
            if scale
            else f"rel_l2 ~{distance:.3g} (from row sums)"
        )
        finding = WeightFinding(
            where, reference, item.module, other.module, "differs", detail, abs(scale - 1) if scale else distance
        )
        result.findings.append(finding)
        placed.setdefault(id(other), {}).update({first + k: start + k for k in range(stop - start)})
        differing.setdefault(id(other), (other, finding))
    for other, finding in differing.values():  # a reference tensor held whole by a run of rows, some of them wrong
        rows = placed.get(id(other), {})
        at = rows.get(0)
        if at is not None and all(rows.get(row) == at + row for row in range(other.print.shape[0])):
            result.parts.append((finding, at, at + other.print.shape[0]))
    return result


def _by_tiles(item: Held, ours: list[Held]) -> _Blocks | None:
    """A 1-D candidate tensor that is reference tensors laid end to end (a fused bias against separate ones), each
    part equal to one, or near one (a defect in one part). ``None`` where its start is no reference tensor's."""
    sums = item.print.sums
    if sums is None or len(item.print.shape) != 1:
        return None
    values = sums[0]
    flat = [other for other in ours if len(other.print.shape) == 1 and other.print.sums is not None]
    result, position, taken, exact = _Blocks(), 0, set(), 0
    while position < len(values):
        scored = []
        for other in flat:
            size = other.print.shape[0]
            if id(other) in taken or size > len(values) - position or size == len(values):
                continue
            part, ref = values[position : position + size], _row_sums(other.print)
            scale = float(numpy.linalg.norm(ref)) or 1.0
            scored.append((float(numpy.linalg.norm(part - ref)) / scale, -size, other))
        scored.sort(key=lambda entry: entry[:2])
        if not scored or scored[0][0] >= NEAR:
            if position == 0 or not exact:
                return None
            result.unmatched.append(f"{item.name} [{position}:{len(values)}]")  # the rest matches nothing
            return result
        distance, _, other = scored[0]
        size = other.print.shape[0]
        taken.add(id(other))
        if distance > ROUNDING:
            detail, rel_l2 = _values_differ(_row_sums(other.print), values[position : position + size])
            where = f"{item.name} [{position}:{position + size}]"
            finding = WeightFinding(
                where, other.name, item.module, other.module, "differs", detail + f", rel_l2 {rel_l2:.3g}", rel_l2
            )
            result.findings.append(finding)
            result.parts.append((finding, position, position + size))
        else:
            exact += 1
        position += size
    return result if exact else None


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    """Sorted positions as ``[start, stop)`` runs."""
    runs: list[list[int]] = []
    for position in positions:
        if runs and runs[-1][1] == position:
            runs[-1][1] += 1
        else:
            runs.append([position, position + 1])
    return [(a, b) for a, b in runs]


def _blocks_of(candidates: list[Held], used: Mapping[int, set[int]], size: int) -> Iterable[tuple[Held, int]]:
    """Reference blocks of ``size`` rows a run of candidate rows may stand for: a whole tensor none of whose rows the
    candidate holds, or a gap of exactly that many rows in a tensor it holds the rest of."""
    for other in candidates:
        rows = other.print.shape[0]
        taken = used.get(id(other), set())
        if not taken:
            if rows == size and other.print.sums is not None:
                yield other, 0
            continue
        for first, last in _runs([row for row in range(rows) if row not in taken]):
            if last - first == size and other.print.sums is not None:
                yield other, first


def _row_sums(item: ParamPrint) -> numpy.ndarray:
    sums = item.sums
    assert sums is not None
    return sums[0]


def _rows_distance(theirs: ParamPrint, start: int, stop: int, ours: ParamPrint, first: int) -> float:
    ref = _row_sums(ours)[first : first + stop - start]
    scale = float(numpy.linalg.norm(ref))
    if scale == 0.0:
        return math.inf
    return float(numpy.linalg.norm(_row_sums(theirs)[start:stop] - ref)) / scale
