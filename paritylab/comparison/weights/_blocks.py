"""Fused, sharded and split tensors block by block: a run of fibers (rows, columns, a head, an expert; or a stretch
of a bias) no reference fiber matches, compared with the reference block it stands for."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy

from paritylab.comparison.weights._describe import _scale, _values_differ
from paritylab.comparison.weights._records import (
    MAX_LISTED,
    NEAR,
    ROUNDING,
    UNIQUE,
    Held,
    WeightFinding,
)
from paritylab.comparison.weights._views import View, views
from paritylab.tracing.structure import MASK, ParamPrint


@dataclass
class _Blocks:
    """What a fused, sharded or split candidate tensor holds, block by block."""

    findings: list[WeightFinding] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)
    parts: list[tuple[WeightFinding, int, int]] = field(default_factory=list)
    """Findings whose reference is a whole tensor, with the candidate rows ``[start, stop)`` holding it."""
    twin_digest: int | None = None
    """The fingerprint the candidate tensor would have with every differing block the reference's (a 2-D or larger
    tensor), so the alignment pairs its modules as if the defect were not there."""


_Held = list[list[tuple[View, int]]]
"""Per candidate fiber: the reference fiber (view, index) it is, or nothing."""


@dataclass
class Fibers:
    """Every fiber of both sides, indexed once for a ledger (a large model holds millions)."""

    views: list[View]
    """The reference's views."""
    index: dict[tuple[int, int], list[tuple[View, int]]]
    """(fiber length, hash) -> the reference fibers hashing so."""
    counts: dict[tuple[int, int], int]
    """(fiber length, hash) -> how many candidate fibers hash so."""

    @classmethod
    def of(cls, ours: list[Held], theirs: list[Held]) -> Fibers:
        every = [view for other in ours for view in views(other)]
        index: dict[tuple[int, int], list[tuple[View, int]]] = {}
        for other in every:
            for fiber, value in enumerate(other.hashes.tolist()):
                index.setdefault((other.length, value), []).append((other, fiber))
        counts: dict[tuple[int, int], int] = {}
        for tensor in theirs:
            for seen in views(tensor):
                for value in seen.hashes.tolist():
                    counts[(seen.length, value)] = counts.get((seen.length, value), 0) + 1
        return cls(every, index, counts)


def _by_blocks(item: Held, fibers: Fibers) -> _Blocks | None:
    """A candidate tensor most of whose fibers along one axis are reference fibers (a fused ``[q; k; v]`` against
    separate projections, a shard's ``[q_r; k_r; v_r]``, a per-head ``W_Q`` one column of which differs): each run of
    fibers no reference fiber matches is compared, by its fiber sums, with each reference block it could stand for (a
    whole tensor's fibers, as many, none of which the candidate holds, a block of one aligned to the run's size, or a
    gap of as many in a tensor it holds the rest of). ``None`` where fewer than a quarter of its fibers along every
    axis are reference fibers: not a composite. A fiber the candidate holds more often than the reference (a block
    loaded from the wrong place leaves two copies) is read each way (every copy, the first or the last standing for
    its reference fiber): the reading that leaves fewest runs unexplained."""
    index, every = fibers.index, fibers.views
    best: tuple[float, View, list[_Held]] | None = None
    for view in views(item):
        if view.sums is None:
            continue
        readings = _readings(view, index)
        share = sum(1 for found in readings[-1] if found) / max(1, len(readings[-1]))
        if 0.25 <= share < 1.0 and (best is None or share > best[0]):
            best = (share, view, readings)
    if best is None:
        return None
    _, view, readings = best
    candidates = [other for other in every if other.length == view.length and other.sums is not None]
    results = [_analysed(item, view, held_rows, candidates, index, fibers.counts) for held_rows in readings]
    return min(  # a copy no neighbour places is the last resort: a reading that places it wins
        results,
        key=lambda result: (
            len(result.unmatched),
            sum(finding.certain for finding in result.findings),
            -len(result.findings),
        ),
    )


def _readings(view: View, index: Mapping[tuple[int, int], list[tuple[View, int]]]) -> list[_Held]:
    """Which reference fiber each candidate fiber is: copies held more often than the reference holds them unread,
    then the first copy read, then the last (the last reading holds the most)."""
    values = view.hashes.tolist()
    positions: dict[int, list[int]] = {}
    for position, value in enumerate(values):
        positions.setdefault(value, []).append(position)
    plain = [index.get((view.length, value), [])[:1] for value in values]
    surplus = {
        value: where for value, where in positions.items() if len(where) > len(index.get((view.length, value), ()))
    }
    if not surplus:
        return [plain]
    readings: list[_Held] = []
    for keep in (None, 0, -1):
        reading = list(plain)
        for where in surplus.values():
            for position in where:
                reading[position] = []
            if keep is not None and plain[where[keep]]:
                reading[where[keep]] = plain[where[keep]]
        readings.append(reading)
    return readings


def _analysed(
    item: Held,
    view: View,
    held_rows: _Held,
    candidates: list[View],
    index: Mapping[tuple[int, int], list[tuple[View, int]]],
    counts: Mapping[tuple[int, int], int],
) -> _Blocks:
    used: dict[tuple[int, int], set[int]] = {}
    placed: dict[tuple[int, int], dict[int, int]] = {}  # a reference view -> its fibers -> the candidate fibers
    for position, found in enumerate(held_rows):
        for other, row in found:
            used.setdefault(_key(other), set()).add(row)
            placed.setdefault(_key(other), {}).setdefault(row, position)
    result = _Blocks()
    shift, exact = 0, True
    differing: dict[tuple[int, int], tuple[View, WeightFinding]] = {}
    for start, stop in _runs([position for position, found in enumerate(held_rows) if not found]):
        size = stop - start
        gaps, aligned = _blocks_of(candidates, used, size)
        for options in (gaps, gaps + aligned):  # a gap the candidate's own fibers leave first
            scored = sorted(
                ((_fibers_distance(view, start, stop, other, first), other, first) for other, first in options),
                key=lambda entry: entry[0],
            )
            if scored and scored[0][0] < NEAR and (len(scored) == 1 or scored[0][0] <= UNIQUE * scored[1][0]):
                break
        where = f"{item.name} {view.where(start, stop)}"
        if scored and scored[0][0] < NEAR and (len(scored) == 1 or scored[0][0] <= UNIQUE * scored[1][0]):
            distance, other, first = scored[0]
            finding = _block_finding(where, item, other, first, size, view.sums_at(start, stop), distance)
        else:
            in_step = _in_step(options, held_rows, start, stop)
            moved = _moved(item, view, start, stop, in_step[0], index) if len(in_step) == 1 else None
            if moved is None:
                copied = _copied(item, view, start, stop, index, counts)
                if copied is None:
                    result.unmatched.append(where)
                else:
                    result.findings.append(copied)
                    exact = False  # what it should hold is not known: no fingerprint stands for it
                continue
            finding, (other, first) = moved, in_step[0]
        result.findings.append(finding)
        shift += int(other.hashes[first : first + size].sum()) - int(view.hashes[start:stop].sum())
        placed.setdefault(_key(other), {}).update({first + k: start + k for k in range(size)})
        if view.rows and other.rows:
            differing.setdefault(_key(other), (other, finding))
    for other, finding in differing.values():  # a reference tensor held whole by a run of rows, some of them wrong
        rows = placed.get(_key(other), {})
        at = rows.get(0)
        if at is not None and all(rows.get(row) == at + row for row in range(len(other.hashes))):
            result.parts.append((finding, at, at + len(other.hashes)))
    if result.findings and exact:
        result.twin_digest = (item.print.digest + shift) & MASK
    return result


def _copied(
    item: Held,
    view: View,
    start: int,
    stop: int,
    index: Mapping[tuple[int, int], list[tuple[View, int]]],
    counts: Mapping[tuple[int, int], int],
) -> WeightFinding | None:
    """A run of candidate fibers that are reference fibers the candidate holds more often than the reference does
    (every one of them again elsewhere in this tensor), while as many fibers of that reference tensor are held by no
    candidate tensor at all: a block loaded from the wrong place, whose neighbours do not tell which block it stands
    for. (A port repeating grouped key heads holds copies too, but leaves no reference fiber unheld.) A finding
    certain whatever its size; ``None`` where the run is not such a copy."""
    values = view.hashes[start:stop].tolist()
    found = [index.get((view.length, value), []) for value in values]
    if not all(found):
        return None
    positions = view.hashes.tolist()
    here = Counter(positions)
    if any(here[value] < 2 or counts.get((view.length, value), 0) <= len(where)
           for value, where in zip(values, found, strict=True)):  # fmt: skip
        return None
    source, first = found[0][0]
    unheld = sum(1 for value in source.hashes.tolist() if not counts.get((view.length, value)))
    if unheld < stop - start:
        return None  # every fiber of the reference tensor is held: copies a port means (repeated key heads)
    twin = next(p for p, value in enumerate(positions) if value == values[0] and not start <= p < stop)
    held = f"{source.item.name} {source.where(first, first + stop - start)}"
    detail = (
        f"a copy of the reference's {held}, which {item.name} {view.where(twin, twin + stop - start)} holds too, "
        f"while {unheld} fibers of {source.item.name} are held by no candidate tensor: a block loaded from the wrong "
        "place"
    )
    where = f"{item.name} {view.where(start, stop)}"
    return WeightFinding(where, source.item.name, item.module, source.item.module, "differs", detail, certain=True)


def _in_step(options: list[tuple[View, int]], held_rows: _Held, start: int, stop: int) -> list[tuple[View, int]]:
    """The blocks a run may stand for, narrowed (where there are several) to those its neighbours place: the block
    that continues the reference fibers just before or after the run in their own view, else a block of another view
    starting where the neighbouring block of the run's size starts in its view (a shard's ``[q_r; k_r; v_r]`` holds
    rows ``r * n`` on of each)."""
    if len(options) <= 1:
        return options
    size = stop - start
    before = held_rows[start - 1][0] if start > 0 and held_rows[start - 1] else None
    after = held_rows[stop][0] if stop < len(held_rows) and held_rows[stop] else None
    continued: set[tuple[tuple[int, int], int]] = set()
    if before is not None:
        continued.add((_key(before[0]), before[1] + 1))
    if after is not None:
        continued.add((_key(after[0]), after[1] - size))
    found = [(other, first) for other, first in options if (_key(other), first) in continued]
    if found:
        return found
    steps = set()
    for position in (start - size, stop):
        if 0 <= position < len(held_rows) and held_rows[position]:
            steps.add(held_rows[position][0][1])
    return [(other, first) for other, first in options if first in steps] or options


def _by_part(item: Held, fibers: Fibers) -> _Blocks | None:
    """A candidate tensor that stands for a block of a larger (or otherwise shaped) reference tensor with a defect: a
    per-head ``W_Q`` against the first columns of a fused projection, one expert's Linear against its block of a fused
    ``[experts, 2 * inner, d_model]``, a separate ``k`` against the middle rows of a fused ``qkv``. Its fibers' sums
    are compared with each run of as many reference fibers of their length that no other candidate tensor holds
    (where a fused tensor's other parts are held elsewhere, the gap they leave; else blocks aligned to its size);
    the nearest, within :data:`NEAR` and clearly nearer than any other, is the finding. ``None`` where none is."""
    own: dict[tuple[int, int], int] = {}
    for seen in views(item):
        for value in seen.hashes.tolist():
            own[(seen.length, value)] = own.get((seen.length, value), 0) + 1
    scored: list[tuple[float, View, View, int, numpy.ndarray | None]] = []
    for view in views(item):
        if view.sums is None:
            continue
        size = len(view.hashes)
        for other in fibers.views:
            if other.length != view.length or other.sums is None or len(other.hashes) < size:
                continue
            if len(other.hashes) == size and other.item.print.shape == item.print.shape:
                continue  # the same shape: the nearest-tensor stage judged it
            length = other.length
            free = [  # fibers no other candidate tensor holds
                fiber
                for fiber, value in enumerate(other.hashes.tolist())
                if fibers.counts.get((length, value), 0) <= own.get((length, value), 0)
            ]
            for first in sorted(_offsets(_runs(free), size)):
                scored.append((_fibers_distance(view, 0, size, other, first), view, other, first, None))
            runs = _runs(free)
            if len(free) == size and len(runs) > 1:  # the gaps the other parts leave, together: a per-head W_Q
                gaps = numpy.array(free)  # against q rows interleaved with k's and v's head by head (GPT-NeoX)
                scored.append((_spread_distance(view, other, gaps), view, other, 0, gaps))
    scored.sort(key=lambda entry: entry[0])
    if not scored or scored[0][0] >= NEAR:
        return None
    distance, view, other, first, spread = scored[0]
    rivals = [  # the same reference tensor seen along another axis holds the same elements: no rival
        entry[0] for entry in scored[1:] if entry[2].item is not other.item or entry[2].axis == other.axis
    ]
    if rivals and distance > UNIQUE * rivals[0]:
        return None
    size = len(view.hashes)
    result = _Blocks()
    sums = view.sums_at(0, size)
    if spread is None:
        result.findings.append(_block_finding(item.name, item, other, first, size, sums, distance))
        result.twin_digest = int(other.hashes[first : first + size].sum()) & MASK
        return result
    assert other.sums is not None
    listed = ", ".join(other.where(a, b) for a, b in _runs(spread.tolist())[:MAX_LISTED])
    more = f" and {len(_runs(spread.tolist())) - MAX_LISTED} more" if len(_runs(spread.tolist())) > MAX_LISTED else ""
    scale = _scale(other.sums[spread], sums)
    detail = f"scaled by {scale:.4g}, rel_l2 {abs(scale - 1):.3g}" if scale else f"rel_l2 ~{distance:.3g} (from sums)"
    reference = f"{other.item.name} {listed}{more}"
    rel_l2 = abs(scale - 1) if scale else distance
    result.findings.append(
        WeightFinding(item.name, reference, item.module, other.item.module, "differs", detail, rel_l2)
    )
    result.twin_digest = int(other.hashes[spread].sum()) & MASK
    return result


def _spread_distance(ours: View, theirs: View, spread: numpy.ndarray) -> float:
    """The relative distance of a candidate view's fiber sums from the reference's at ``spread``, in order."""
    assert ours.sums is not None and theirs.sums is not None
    ref = theirs.sums[spread]
    scale = float(numpy.linalg.norm(ref))
    return float(numpy.linalg.norm(ours.sums - ref)) / scale if scale else math.inf


def _moved(
    item: Held,
    view: View,
    start: int,
    stop: int,
    option: tuple[View, int],
    index: Mapping[tuple[int, int], list[tuple[View, int]]],
) -> WeightFinding | None:
    """A run of candidate fibers standing for the one reference block it can, some of them the block's own and the
    others fibers the reference holds elsewhere (a block loaded from the wrong place, which leaves a copy of it twice
    in the candidate): what the differing ones hold. ``None`` where a differing fiber is no reference fiber."""
    other, first = option
    size = stop - start
    ours, theirs = view.hashes[start:stop], other.hashes[first : first + size]
    differ = numpy.flatnonzero(ours != theirs)
    if not len(differ) or any(not index.get((view.length, int(value))) for value in ours[differ].tolist()):
        return None
    low, high = int(differ[0]), int(differ[-1]) + 1
    sources = [index[(view.length, int(value))][0] for value in ours[low:high].tolist()]
    source_view, source_first = sources[0]
    held = f"{source_view.item.name} {source_view.where(source_first, source_first + high - low)}"
    if any(found != (source_view, source_first + k) for k, found in enumerate(sources)):
        held = f"fibers of the reference's from elsewhere, from {held}"
    where = f"{item.name} {view.where(start + low, start + high)}"
    reference = f"{other.item.name} {other.where(first + low, first + high)}"
    assert other.sums is not None
    rel = other.sums[first + low : first + high]
    scale = float(numpy.linalg.norm(rel)) or 1.0
    distance = float(numpy.linalg.norm(view.sums_at(start + low, start + high) - rel)) / scale
    detail = f"they hold the reference's {held}"
    if len(differ) < high - low:
        detail = f"{len(differ)} of these {high - low} differ: {detail}"
    return WeightFinding(where, reference, item.module, other.item.module, "differs", detail, distance)


def _offsets(runs: list[tuple[int, int]], size: int) -> set[int]:
    """Where a block of ``size`` fibers may start in runs of free fibers: each run's start and every multiple of
    ``size`` inside it, and the block ending at its end."""
    found: set[int] = set()
    for start, stop in runs:
        if stop - start < size:
            continue
        found.update(range(start, stop - size + 1, size))
        found.update(position for position in range(-(-start // size) * size, stop - size + 1, size))
        found.add(stop - size)
    return found


def _block_finding(
    where: str, item: Held, other: View, first: int, size: int, sums: numpy.ndarray, distance: float
) -> WeightFinding:
    """A candidate block (``where``) against ``size`` fibers of a reference view from ``first``."""
    whole = len(other.hashes) == size
    reference = other.item.name if whole else f"{other.item.name} {other.where(first, first + size)}"
    assert other.sums is not None
    scale = _scale(other.sums[first : first + size], sums)
    detail = f"scaled by {scale:.4g}, rel_l2 {abs(scale - 1):.3g}" if scale else f"rel_l2 ~{distance:.3g} (from sums)"
    rel_l2 = abs(scale - 1) if scale else distance
    return WeightFinding(where, reference, item.module, other.item.module, "differs", detail, rel_l2)


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


def _blocks_of(
    candidates: list[View], used: Mapping[tuple[int, int], set[int]], size: int
) -> tuple[list[tuple[View, int]], list[tuple[View, int]]]:
    """Reference blocks of ``size`` fibers a run of candidate fibers may stand for: a gap of exactly that many in a
    view the candidate holds the rest of, or a whole view (as many fibers) none of whose fibers it holds; where there
    is neither, a block aligned to ``size`` of a view none of whose fibers it holds (a shard's rows of a part).
    Returns the gaps and whole views first, the aligned blocks apart (tried only where no gap is near)."""
    gaps: list[tuple[View, int]] = []
    aligned: list[tuple[View, int]] = []
    for other in candidates:
        count = len(other.hashes)
        taken = used.get(_key(other), set())
        if not taken:
            if count == size:
                gaps.append((other, 0))
            elif count % size == 0:
                aligned += [(other, first) for first in range(0, count, size)]
            continue
        for first, last in _runs([fiber for fiber in range(count) if fiber not in taken]):
            if last - first == size:
                gaps.append((other, first))
    return gaps, aligned


def _key(view: View) -> tuple[int, int]:
    return id(view.item), view.axis


def _row_sums(item: ParamPrint) -> numpy.ndarray:
    sums = item.sums
    assert sums is not None
    return sums[0]


def _fibers_distance(ours: View, start: int, stop: int, theirs: View, first: int) -> float:
    """The relative distance of candidate fibers ``[start, stop)``' sums from the reference's from ``first``."""
    assert ours.sums is not None and theirs.sums is not None
    ref = theirs.sums[first : first + stop - start]
    scale = float(numpy.linalg.norm(ref))
    if scale == 0.0:
        return math.inf
    return float(numpy.linalg.norm(ours.sums[start:stop] - ref)) / scale
