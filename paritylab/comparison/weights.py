"""The weight ledger: every candidate parameter and buffer matched to the reference's, before any activation.

The commonest porting bug lives in a weight: a conversion that scales, slices, transposes or maps a tensor wrongly,
a table built from a wrong constant. Fingerprints (:mod:`paritylab.tracing.structure`) say which tensors hold the
same values; this module says what the others are: for each candidate tensor whose values no reference tensor
holds, the reference tensor it is nearest (from the row and column sums each fingerprint keeps), and what differs
(one element, a scale, rows, a table's ratio). No map is written: tensors are matched on values alone, so a port
with other names, fused or split projections, or a transposed layout is read as it is.

The ledger feeds the alignment (a module whose weights are near the reference's is paired with it, however its
code names it: the bug its weights carry must not cost it its pair) and the report (the finding is printed where
divergence starts).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy

from paritylab.tracing.structure import ModulePrint, ParamPrint

NEAR = 0.5
"""A candidate tensor whose sketch lies within this relative distance of a reference tensor's holds that tensor
with a defect (two unrelated tensors of one shape lie about ``sqrt(2)`` apart)."""
NEAR_NAMESAKE = 1.0
"""The same for a tensor of the same name, and the only one of its shape left open on either side: a table built
from a wrong constant (rotary frequencies from base 500000 against 10000 lie 0.7 apart)."""
UNIQUE = 0.5
"""A near match must be at most this fraction of the distance to the second-nearest reference tensor."""
ROUNDING = 2.0**-7
"""Two values closer than this (relative) are equal up to a low-precision copy's rounding."""
MAX_LISTED = 4


@dataclass(frozen=True)
class Held:
    """One parameter or buffer of one side: the module holding it and its fingerprint."""

    module: str
    print: ParamPrint
    buffer: bool = False

    @property
    def name(self) -> str:
        return _named(self.module, self.print)


@dataclass(frozen=True)
class WeightFinding:
    """A candidate tensor that holds a reference tensor with a defect, or in another layout."""

    candidate: str
    reference: str
    candidate_module: str
    reference_module: str
    kind: str
    """``differs`` (the values differ beyond rounding) or ``layout`` (the same values, in another order: transposed
    or rows reordered; a port may mean it, so it is printed only where divergence starts)."""
    detail: str
    rel_l2: float | None = None

    def line(self) -> str:
        verb = "differs from" if self.kind == "differs" else "holds"
        return f"{self.candidate} {verb} the reference's {self.reference}: {self.detail}"

    def to_json(self) -> dict[str, Any]:
        return {
            "candidate": self.candidate,
            "reference": self.reference,
            "candidate_module": self.candidate_module,
            "reference_module": self.reference_module,
            "kind": self.kind,
            "detail": self.detail,
            "rel_l2": self.rel_l2,
        }


@dataclass
class WeightLedger:
    """What every candidate tensor is, against the reference's."""

    matched: int = 0
    """Candidate tensors holding a reference tensor's values exactly (up to layout and rounding)."""
    findings: list[WeightFinding] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)
    """Candidate tensors near no reference tensor (a port's own tables, extra parameters)."""
    part_pairs: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    """Reference module -> (candidate module, first, last + 1 output feature): a fused candidate weight one of whose
    row blocks is the reference module's weight with a defect (the k rows of a ``[q; k; v]`` projection)."""
    module_pairs: dict[str, str] = field(default_factory=dict)
    """Reference module -> candidate module, for modules whose own tensors match one to one with at least one
    differing: the alignment pairs them whatever their names and classes."""

    @property
    def differing(self) -> list[WeightFinding]:
        return [finding for finding in self.findings if finding.kind == "differs"]

    def at(self, *modules: str) -> list[WeightFinding]:
        """The findings held by any of ``modules`` (paths on either side)."""
        wanted = set(modules)
        return [
            finding
            for finding in self.findings
            if finding.reference_module in wanted or finding.candidate_module in wanted
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "matched": self.matched,
            "findings": [finding.to_json() for finding in self.findings],
            "unmatched": list(self.unmatched),
        }


def held(prints: Mapping[str, ModulePrint]) -> list[Held]:
    """Every parameter and floating-point buffer a side's modules hold directly (each once)."""
    found: list[Held] = []
    for path, item in prints.items():
        found += [Held(path, param) for param in item.params]
        found += [Held(path, buffer, buffer=True) for buffer in item.buffers]
    return found


def weight_ledger(reference: Mapping[str, ModulePrint], candidate: Mapping[str, ModulePrint]) -> WeightLedger:
    """Match every candidate tensor to the reference's: exactly (fingerprints, rows of fused or cut tables), else by
    nearness of values; describe each near match and each same-valued tensor in another layout."""
    ledger = WeightLedger()
    ours, theirs = held(reference), held(candidate)
    if not ours or not theirs:
        return ledger
    digests: dict[int, list[Held]] = {}
    for item in ours:
        digests.setdefault(item.print.digest, []).append(item)
        if item.print.shifted:
            digests.setdefault(item.print.shifted, []).append(item)
    rows = _row_index(ours)
    open_theirs: list[Held] = []
    claimed: set[int] = set()
    for item in theirs:
        same = [twin for twin in digests.get(item.print.digest, ()) if _numel(twin) == _numel(item)]
        same += [
            twin for twin in digests.get(item.print.shifted, ()) if item.print.shifted and _numel(twin) == _numel(item)
        ]
        if same:
            ledger.matched += 1
            claimed.update(id(twin) for twin in same)
            layout = _layout(same[0], item) if len(same) == 1 else None
            if layout:
                ledger.findings.append(_finding(same[0], item, "layout", layout))
            continue
        if _all_rows_held(item, rows):
            ledger.matched += 1
            continue
        open_theirs.append(item)
    open_ours = [item for item in ours if id(item) not in claimed and item.print.sketch]
    near = _nearest(open_ours, open_theirs)
    for item in open_theirs:
        match = near.get(id(item))
        if match is None:
            blocks = _by_blocks(item, ours) if len(item.print.shape) == 2 else _by_tiles(item, ours)
            if blocks is None:
                ledger.unmatched.append(item.name)
                continue
            ledger.matched += not blocks.findings and not blocks.unmatched
            ledger.findings += blocks.findings
            ledger.unmatched += blocks.unmatched
            for finding, start, stop in blocks.parts:
                ledger.part_pairs[finding.reference_module] = (finding.candidate_module, start, stop)
            continue
        twin, _, flipped = match
        detail, rel_l2 = _describe(twin, item, flipped)
        ledger.findings.append(_finding(twin, item, "differs", detail, rel_l2))
    ledger.module_pairs = _module_pairs(ledger, reference, candidate)
    return ledger


def _finding(ours: Held, theirs: Held, kind: str, detail: str, rel_l2: float | None = None) -> WeightFinding:
    return WeightFinding(theirs.name, ours.name, theirs.module, ours.module, kind, detail, rel_l2)


def _numel(item: Held) -> int:
    return math.prod(item.print.shape)


def _row_index(items: Iterable[Held]) -> dict[tuple[int, int], int]:
    """(row width, row hash) -> how many reference rows of that width hash so (2-D tensors keeping row hashes)."""
    index: dict[tuple[int, int], int] = {}
    for item in items:
        if item.print.row_bytes and len(item.print.shape) == 2:
            width = item.print.shape[1]
            for value in numpy.frombuffer(item.print.row_bytes, dtype="<u8").tolist():
                index[(width, value)] = index.get((width, value), 0) + 1
    return index


def _all_rows_held(item: Held, rows: Mapping[tuple[int, int], int]) -> bool:
    """Every row of a 2-D candidate tensor is a row some reference tensor holds, each at most as often as the
    reference holds it: a fused projection against separate ones, a part of a fused one, a table cut to some of its
    rows. (A block of rows overwritten with a copy of another block holds every row, one of them twice: not this.)"""
    if not item.print.row_bytes or len(item.print.shape) != 2:
        return False
    width = item.print.shape[1]
    values = [value for value in numpy.frombuffer(item.print.row_bytes, dtype="<u8").tolist() if value]
    counts: dict[int, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return bool(values) and all(rows.get((width, value), 0) >= count for value, count in counts.items())


def _layout(ours: Held, theirs: Held) -> str | None:
    """How a candidate tensor holding exactly the reference tensor's values lays them out, when it differs."""
    a, b = ours.print, theirs.print
    if not a.row_bytes or not b.row_bytes or a.row_bytes == b.row_bytes:
        return None
    if a.shape == b.shape[::-1] and a.row_bytes == b.col_bytes and a.col_bytes == b.row_bytes:
        return "the same values, transposed"
    if a.shape == b.shape and a.col_bytes == b.col_bytes:
        ref_rows = numpy.frombuffer(a.row_bytes, dtype="<u8")
        cand_rows = numpy.frombuffer(b.row_bytes, dtype="<u8")
        if sorted(ref_rows.tolist()) == sorted(cand_rows.tolist()):
            return "the same rows in another order: " + _row_runs(ref_rows, cand_rows)
    return None


def _row_runs(ref_rows: numpy.ndarray, cand_rows: numpy.ndarray) -> str:
    """Which reference rows each run of candidate rows holds: ``rows 0-63 hold the reference's rows 64-127``."""
    where: dict[int, list[int]] = {}
    for position, value in enumerate(ref_rows.tolist()):
        where.setdefault(value, []).append(position)
    sources = [where[value].pop(0) for value in cand_rows.tolist()]
    runs: list[tuple[int, int, int]] = []  # (first candidate row, first reference row, length)
    for position, source in enumerate(sources):
        if runs and runs[-1][1] + runs[-1][2] == source and runs[-1][0] + runs[-1][2] == position:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((position, source, 1))
    moved = [run for run in runs if run[0] != run[1]]
    text = [f"rows {start}-{start + size - 1} hold the reference's rows {source}-{source + size - 1}"
            for start, source, size in moved[:MAX_LISTED]]  # fmt: skip
    more = f" and {len(moved) - MAX_LISTED} more runs" if len(moved) > MAX_LISTED else ""
    return ", ".join(text) + more


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
            return None if position == 0 or not exact else _tail(result, item, position, len(values))
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


def _tail(result: _Blocks, item: Held, start: int, stop: int) -> _Blocks:
    result.unmatched.append(f"{item.name} [{start}:{stop}]")
    return result


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


def _describe(ours: Held, theirs: Held, flipped: bool) -> tuple[str, float | None]:
    """What differs between a candidate tensor and the reference tensor it is nearest, and its relative L2 error
    where the fingerprints tell it (else the sketch's distance)."""
    a, b = ours.print, _transposed(theirs.print) if flipped else theirs.print  # b in the reference's layout
    parts = ["transposed (positions in the reference's layout)"] if flipped else []
    sums_a, sums_b = a.sums, b.sums
    assert sums_a is not None and sums_b is not None
    rel_l2: float | None = None
    if len(a.shape) <= 1:
        ref_values, cand_values = sums_a[0], sums_b[0]
        text, rel_l2 = _values_differ(ref_values, cand_values)
        parts.append(text)
    else:
        located = _located(a, b)
        if located is not None:
            text, element = located
            parts.append(text)
            if element is not None and sums_a[2] > 0:
                row = element[0]
                rel_l2 = abs(float(sums_b[0][row] - sums_a[0][row])) / sums_a[2]
        scale = _scale(numpy.concatenate(sums_a[:2]), numpy.concatenate(sums_b[:2]))
        if scale is not None:
            parts.append(f"scaled by {scale:.4g}")
            rel_l2 = abs(scale - 1.0)
    if rel_l2 is None:
        rel_l2 = _distance(a, b, False)  # the sums' own distance (a match by rows in place may have scored less)
        parts.append(f"rel_l2 ~{rel_l2:.3g} (from row and column sums)")
    else:
        parts.append(f"rel_l2 {rel_l2:.3g}")
    return ", ".join(parts), rel_l2


def _located(ours: ParamPrint, theirs: ParamPrint) -> tuple[str, tuple[int, int] | None] | None:
    """Where two same-shape 2-D tensors differ, from their row and column hashes."""
    if not ours.row_bytes or not theirs.row_bytes or ours.shape != theirs.shape:
        return None
    rows = numpy.flatnonzero(
        numpy.frombuffer(ours.row_bytes, dtype="<u8") != numpy.frombuffer(theirs.row_bytes, dtype="<u8")
    )
    cols = numpy.flatnonzero(
        numpy.frombuffer(ours.col_bytes, dtype="<u8") != numpy.frombuffer(theirs.col_bytes, dtype="<u8")
    )
    total = math.prod(ours.shape)
    if len(rows) == 1 and len(cols) == 1:
        element = (int(rows[0]), int(cols[0]))
        return f"1 of {total} elements, at [{element[0]}, {element[1]}]", element
    if len(rows) == ours.shape[0] and len(cols) == ours.shape[1]:
        return f"every row and column of {total} elements", None
    for axis, (differ, mine, other) in enumerate(
        ((rows, ours.row_bytes, theirs.row_bytes), (cols, ours.col_bytes, theirs.col_bytes))
    ):
        if len(differ) and len(differ) < ours.shape[axis] and len((cols, rows)[axis]) == ours.shape[1 - axis]:
            name = ("rows", "columns")[axis]
            text = f"{name} {_listed(differ)} of {ours.shape[axis]} differ"
            held = numpy.frombuffer(mine, dtype="<u8")
            moved = [numpy.flatnonzero(held == value) for value in numpy.frombuffer(other, dtype="<u8")[differ]]
            if all(len(found) for found in moved):  # a block loaded from the wrong place
                text += f": they hold the reference's {name} {_listed(numpy.array([found[0] for found in moved]))}"
            return text, None
    where = f"in rows {_listed(rows)} and columns {_listed(cols)}"
    return f"at most {len(rows) * len(cols)} of {total} elements, {where}", None


def _listed(positions: numpy.ndarray) -> str:
    """Indices as runs: ``3, 64-95``."""
    runs: list[list[int]] = []
    for position in positions.tolist():
        if runs and runs[-1][1] + 1 == position:
            runs[-1][1] = position
        else:
            runs.append([position, position])
    text = [str(a) if a == b else f"{a}-{b}" for a, b in runs[:MAX_LISTED]]
    return ", ".join(text) + (f" and {len(runs) - MAX_LISTED} more" if len(runs) > MAX_LISTED else "")


def _scale(ref: numpy.ndarray, cand: numpy.ndarray) -> float | None:
    """The factor the candidate's values are the reference's scaled by, when one factor explains them."""
    energy = float(ref @ ref)
    if energy == 0.0:
        return None
    factor = float(ref @ cand) / energy
    residual = float(numpy.linalg.norm(cand - factor * ref))
    if residual > ROUNDING * float(numpy.linalg.norm(cand)) or abs(factor - 1.0) < ROUNDING:
        return None
    return factor


def _values_differ(ref: numpy.ndarray, cand: numpy.ndarray) -> tuple[str, float]:
    """A 1-D tensor's values against the reference's: how many differ, where, by what rule."""
    norm = float(numpy.linalg.norm(ref))
    rel_l2 = float(numpy.linalg.norm(cand - ref)) / norm if norm else float(numpy.linalg.norm(cand))
    differ = numpy.flatnonzero(~numpy.isclose(cand, ref, rtol=ROUNDING, atol=ROUNDING * (norm / max(1, len(ref)))))
    table = _geometric(ref, cand)
    if table is not None:
        return table, rel_l2
    scale = _scale(ref, cand)
    if scale is not None:
        return f"scaled by {scale:.4g}", rel_l2
    if len(differ) == 1:
        at = int(differ[0])
        return f"1 of {len(ref)} values, at [{at}]: {cand[at]:.6g} against {ref[at]:.6g}", rel_l2
    return f"{len(differ)} of {len(ref)} values, at {_listed(differ)}", rel_l2


def _geometric(ref: numpy.ndarray, cand: numpy.ndarray) -> str | None:
    """Both tables geometric (each value the one before times ``q``): the two ratios, and the base they stand for as
    ``x[i] = x[0] * base ** (-i / n)`` (rotary frequencies: ``n`` is the table's length)."""
    ratios = []
    for values in (ref, cand):
        if len(values) < 3 or numpy.any(values <= 0):
            return None
        steps = values[1:] / values[:-1]
        if not numpy.allclose(steps, steps[0], rtol=2 * ROUNDING):
            return None
        slope = numpy.polyfit(numpy.arange(len(values)), numpy.log(values), 1)[0]  # every entry: rounding averages out
        ratios.append(float(numpy.exp(slope)))
    if math.isclose(ratios[0], ratios[1], rel_tol=1e-4) or not all(0 < q < 1 for q in ratios):
        return None
    n = len(ref)
    bases = [q ** (-n) for q in ratios]
    return (
        f"a geometric table with ratio {ratios[1]:.6g} against {ratios[0]:.6g} "
        f"(as x[0] * base ** (-i / {n}): built from base {bases[1]:.6g} against {bases[0]:.6g})"
    )


def _module_pairs(
    ledger: WeightLedger, reference: Mapping[str, ModulePrint], candidate: Mapping[str, ModulePrint]
) -> dict[str, str]:
    """Modules whose own tensors match one to one, one at least differing: reference path -> candidate path."""
    near: dict[str, set[str]] = {}
    for finding in ledger.differing:
        near.setdefault(finding.candidate_module, set()).add(finding.reference_module)
    pairs: dict[str, str] = {}
    taken: set[str] = set()
    for cand_path, ref_paths in near.items():
        if len(ref_paths) != 1:
            continue
        ref_path = next(iter(ref_paths))
        ours, theirs = reference.get(ref_path), candidate.get(cand_path)
        if ours is None or theirs is None or ref_path in taken or not _one_to_one(ours, theirs, ledger):
            continue
        pairs[ref_path] = cand_path
        taken.add(ref_path)
    return pairs


def _one_to_one(ours: ModulePrint, theirs: ModulePrint, ledger: WeightLedger) -> bool:
    """Every value the candidate module holds is one the reference module holds, or a near copy of one of them, and
    every distinct value the reference module holds is held so (a copy it keeps twice, as transformers keeps
    ``inv_freq`` and ``original_inv_freq``, counts once)."""
    near = {
        finding.candidate: finding.reference
        for finding in ledger.differing
        if finding.candidate_module == theirs.path and finding.reference_module == ours.path
    }
    ref_values = {_value_key(param): param.name for param in (*ours.params, *ours.buffers)}
    covered: set[tuple[int, int]] = set()
    for param in (*theirs.params, *theirs.buffers):
        name = f"{theirs.path}.{param.name}" if theirs.path else param.name
        if name in near:
            twin = next(p for p in (*ours.params, *ours.buffers) if _named(ours.path, p) == near[name])
            covered.add(_value_key(twin))
        elif _value_key(param) in ref_values:
            covered.add(_value_key(param))
        else:
            return False
    return covered == set(ref_values)


def _value_key(param: ParamPrint) -> tuple[int, int]:
    return param.digest, math.prod(param.shape)


def _named(path: str, param: ParamPrint) -> str:
    return f"{path}.{param.name}" if path else param.name
