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

_GENERIC = frozenset({"weight", "bias"})
"""Parameter names every layer of a kind holds: two tensors so named are namesakes only in modules of one name (a
fused projection's weight and an embedding table of one shape are not), where ``inv_freq`` or ``rotary_sin`` are."""


def _last(path: str) -> str:
    """A module path's last name, lower-cased (``blocks.0.Inner`` -> ``inner``)."""
    return path.rsplit(".", 1)[-1].lower()


@dataclasses.dataclass(frozen=True)
class Near:
    """The reference tensor a candidate tensor is a near copy of, and how it lies."""

    twin: Held
    distance: float
    flipped: bool = False
    """Transposed: the candidate's rows against the reference's columns."""
    reordered: int | None = None
    """The axis the candidate holds in another order (0: rows, 1: columns), its values near the reference's in that
    order: a layout a port's code reads so (x-transformers' output projection takes its heads in its own order), with
    a defect on top."""


def _shared_tail(one: str, other: str) -> int:
    """How many trailing names two module paths share (``norm_f`` and ``backbone.norm_f``: 1)."""
    count = 0
    for mine, theirs in zip(reversed(one.split(".")), reversed(other.split(".")), strict=False):
        if mine != theirs:
            break
        count += 1
    return count


def _nearest(ours: list[Held], theirs: list[Held], claimed: frozenset[int] = frozenset()) -> dict[int, Near]:
    """Candidate tensor id -> the reference tensor it is nearest (:class:`Near`), for the candidate tensors that lie
    near one reference tensor and clearly nearer it than any other; each reference tensor taken once, nearest
    first. Where the reference holds the nearest values several times (untrained norms), the copy taken is one no
    exact copy ``claimed`` (by id) if any, then the one whose module's path ends as the candidate's does."""
    by_shape: dict[tuple[int, ...], list[Held]] = {}
    for item in ours:
        by_shape.setdefault(item.print.shape, []).append(item)
    proposals: list[tuple[float, int, list[Near], Held]] = []
    prepared: dict[int, _Lines] = {}  # by id, or -1 - id for a candidate tensor's transpose

    def lines(item: Held, flipped: bool = False) -> _Lines:
        key = -1 - id(item) if flipped else id(item)
        if key not in prepared:
            prepared[key] = _Lines.of(_transposed(item.print) if flipped else item.print)
        return prepared[key]

    for order, item in enumerate(theirs):
        if not item.print.sketch:
            continue
        shape = item.print.shape
        scored: list[Near] = []
        for twin in by_shape.get(shape, ()):
            distance = _distance(twin.print, item.print, False)
            in_place = _mostly_in_place(twin.print, item.print)
            if in_place:  # most rows and columns as they were: a defect in a few
                distance = min(distance, NEAR * _differing_share(twin.print, item.print))
            scored.append(_placed(twin, distance, in_place, lines(twin), lines(item), flipped=False))
        if len(shape) == 2:
            turned = _transposed(item.print)
            for twin in by_shape.get(shape[::-1], ()):
                distance = _distance(twin.print, item.print, True)
                in_place = _mostly_in_place(twin.print, turned)
                if in_place:  # a transposed layout (an unembedding against embeddings)
                    distance = min(distance, NEAR * _differing_share(twin.print, turned))
                scored.append(_placed(twin, distance, in_place, lines(twin), lines(item, flipped=True), flipped=True))
        scored = [entry for entry in scored if math.isfinite(entry.distance)]
        if not scored:
            continue
        scored.sort(key=lambda entry: (entry.distance, entry.twin.print.name != item.print.name))
        best = scored[0]
        others = [entry for entry in scored[1:] if entry.twin.print.digest != best.twin.print.digest]  # copies: one
        second = others[0].distance if others else math.inf
        namesake = (
            not others
            and best.twin.print.name == item.print.name
            and (item.print.name not in _GENERIC or _last(item.module) == _last(best.twin.module))
            and _only(item, theirs)
        )
        if (best.distance < NEAR or (namesake and best.distance < NEAR_NAMESAKE)) and best.distance <= UNIQUE * second:
            copies = [
                entry for entry in scored
                if entry.twin.print.digest == best.twin.print.digest and entry.flipped == best.flipped
                and entry.distance == best.distance
            ]  # fmt: skip
            copies.sort(key=lambda entry: (id(entry.twin) in claimed, -_shared_tail(entry.twin.module, item.module)))
            proposals.append((best.distance, order, copies, item))
    taken: set[int] = set()
    found: dict[int, Near] = {}
    for _, _, copies, item in sorted(proposals, key=lambda entry: entry[:2]):
        near = next((entry for entry in copies if id(entry.twin) not in taken), None)
        if near is not None:
            taken.add(id(near.twin))
            found[id(item)] = near
    return found


def _placed(twin: Held, distance: float, in_place: bool, ours: _Lines, theirs: _Lines, flipped: bool) -> Near:
    """How a candidate tensor (``theirs``: its lines, transposed where ``flipped``) lies against ``twin`` (``ours``),
    at ``distance`` compared in place: with one axis in another order where hashes prove it and that explains more, or
    where no hash says where but the sums say so clearly (a port's own head order, then a defect; a transposed
    conversion of such a weight: an output projection whose heads x-transformers takes in its own order)."""
    by_sums, apart = _reordered_distance(ours, theirs)
    moved = _moved_lines(ours, theirs)
    if moved is not None:  # hashes prove one axis reordered, explaining more than comparing in place
        axis, share = moved
        moved_distance = min(apart if by_sums == axis else math.inf, NEAR * share)
        return Near(twin, moved_distance, flipped=flipped, reordered=axis)
    if not in_place and apart < UNIQUE * distance:  # no hash says where; the sums say reordered, clearly
        return Near(twin, apart, flipped=flipped, reordered=by_sums)
    return Near(twin, distance, flipped=flipped)


@dataclasses.dataclass(frozen=True)
class _Lines:
    """A 2-D tensor's fingerprint prepared once for the comparisons that set an axis's order aside (each tensor meets
    every other of its shape): per axis its lines' hashes, as an array and as a set, its sums and its sums sorted."""

    shape: tuple[int, ...]
    hashes: tuple[numpy.ndarray, numpy.ndarray] | None
    held: tuple[frozenset[int], frozenset[int]]
    sums: tuple[numpy.ndarray, numpy.ndarray] | None
    ordered: tuple[numpy.ndarray, numpy.ndarray] | None
    scale: float

    @classmethod
    def of(cls, item: ParamPrint) -> _Lines:
        hashes: tuple[numpy.ndarray, numpy.ndarray] | None = None
        if item.row_bytes and len(item.shape) == 2:
            rows, cols = (numpy.frombuffer(raw, dtype="<u8") for raw in (item.row_bytes, item.col_bytes))
            if (len(rows), len(cols)) == item.shape:
                hashes = (rows, cols)
        sums = item.sums
        lines = (sums[0], sums[1]) if sums is not None and len(item.shape) == 2 else None
        return cls(
            shape=item.shape,
            hashes=hashes,
            held=(frozenset(hashes[0].tolist()), frozenset(hashes[1].tolist())) if hashes else (frozenset(),) * 2,
            sums=lines,
            ordered=(numpy.sort(lines[0]), numpy.sort(lines[1])) if lines else None,
            scale=float(numpy.linalg.norm(numpy.concatenate(lines))) if lines else 0.0,
        )


def _moved_lines(ours: _Lines, theirs: _Lines) -> tuple[int, float] | None:
    """The axis two same-shape 2-D tensors hold in another order, proven by hashes, where that explains their
    difference with fewer changed elements than comparing them in place: a line's hash is the sum of its elements'
    hashes, so columns reordered leave every row's hash as it was and move the columns' hashes. With the lines kept
    in place differing at ``k`` positions and ``m`` of the moved axis's lines found nowhere in the other, ``k * m``
    elements at most changed, against rows times columns differing in place. The axis, and the share of its lines
    found nowhere."""
    if ours.hashes is None or theirs.hashes is None or ours.shape != theirs.shape:
        return None
    shared = [not mine.isdisjoint(other) for mine, other in zip(ours.held, theirs.held, strict=True)]
    if not any(shared):
        return None  # no line of either axis found anywhere in the other: nothing moved
    in_place = [int(numpy.count_nonzero(a != b)) for a, b in zip(ours.hashes, theirs.hashes, strict=True)]
    best: tuple[int, float] | None = None
    bound = in_place[0] * in_place[1]
    for axis in (0, 1):
        if not shared[axis]:
            continue
        a, b = ours.hashes[axis], theirs.hashes[axis]
        missing = int(numpy.count_nonzero(~numpy.isin(a, b)))
        moved_here = in_place[axis] - missing  # lines found elsewhere than where the reference holds them
        if moved_here <= 0 or missing * 2 >= len(a):
            continue
        cost = in_place[1 - axis] * missing
        if cost < bound:
            best, bound = (axis, missing / len(a)), cost
    return best


def _reordered_distance(ours: _Lines, theirs: _Lines) -> tuple[int | None, float]:
    """The relative distance of two same-shape 2-D tensors' sums with one axis's order set aside: that axis's sums
    compared sorted, the other axis's in place (each row's sum does not depend on the order of its columns). The
    axis of the smaller distance, and it; ``(None, inf)`` where the sums are missing or the shapes are not 2-D. Two
    unrelated weights of one shape differ on the axis kept in place as much as anywhere, so only a tensor whose
    values were put in another order along one axis, then changed a little, comes out near."""
    a, b = ours.sums, theirs.sums
    if a is None or b is None or ours.ordered is None or theirs.ordered is None or ours.shape != theirs.shape:
        return None, math.inf
    if ours.scale == 0.0:
        return None, math.inf
    found: tuple[int | None, float] = (None, math.inf)
    for axis in (0, 1):
        kept = 1 - axis
        apart = numpy.concatenate([b[kept] - a[kept], theirs.ordered[axis] - ours.ordered[axis]])
        distance = float(numpy.linalg.norm(apart)) / ours.scale
        if distance < found[1]:
            found = (axis, distance)
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
