"""What differs between a tensor and its near twin, in words: one element, rows, a scale, a geometric table's base."""

from __future__ import annotations

import math

import numpy

from paritylab.comparison.weights._near import (
    _distance,
    _transposed,
)
from paritylab.comparison.weights._records import (
    MAX_LISTED,
    ROUNDING,
    Held,
)
from paritylab.tracing.structure import ParamPrint


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


def _describe_reordered(ours: Held, theirs: Held, axis: int) -> tuple[str, float, tuple[int, ...]]:
    """What differs between a candidate tensor holding the reference's rows (``axis`` 0) or columns (1) in another
    order and that reference tensor, compared in the reference's order: each of the candidate's lines along ``axis``
    put where the reference holds one hashing alike, the rest by the rank of their sums. With its relative L2 error
    and that order (for each reference line, the candidate's: :attr:`WeightLedger.orders`)."""
    a, b = ours.print, theirs.print
    sums_a, sums_b = a.sums, b.sums
    assert sums_a is not None and sums_b is not None
    name, other = ("rows", "columns")[axis], ("rows", "columns")[1 - axis]
    lines_a, lines_b = (sums_a[0], sums_a[1]), (sums_b[0], sums_b[1])
    order, changed = _line_order(a, b, axis, lines_a[axis], lines_b[axis])
    held = tuple(int(at) for at in order)
    aligned = list(lines_b)
    aligned[axis] = lines_b[axis][order]
    parts = [f"its {name} in another order (compared in the reference's order)"]
    scale = _scale(numpy.concatenate(lines_a), numpy.concatenate(aligned))
    if scale is not None:
        parts.append(f"scaled by {scale:.4g}")
        return ", ".join([*parts, f"rel_l2 {abs(scale - 1.0):.3g}"]), abs(scale - 1.0), held
    kept = lines_a[1 - axis]
    apart = numpy.abs(aligned[1 - axis] - kept)  # the lines kept in place: most agree to their sums' rounding
    tolerance = max(8.0 * float(numpy.median(apart)), 1e-6 * float(numpy.abs(kept).max(initial=0.0)))
    across = numpy.flatnonzero(apart > tolerance)
    total = math.prod(a.shape)
    rel_l2: float | None = None
    if len(changed) == 1 and len(across) == 1:
        at = [0, 0]
        at[axis], at[1 - axis] = int(changed[0]), int(across[0])
        parts.append(f"1 of {total} elements, at [{at[0]}, {at[1]}] in the reference's order")
        if sums_a[2] > 0:
            rel_l2 = abs(float(aligned[1 - axis][at[1 - axis]] - kept[at[1 - axis]])) / sums_a[2]
    else:
        parts.append(f"{name} {_listed(changed)} and {other} {_listed(across)} differ")
    if rel_l2 is None:
        rel_l2 = float(numpy.linalg.norm(numpy.concatenate(aligned) - numpy.concatenate(lines_a)))
        rel_l2 /= float(numpy.linalg.norm(numpy.concatenate(lines_a))) or 1.0
        parts.append(f"rel_l2 ~{rel_l2:.3g} (from row and column sums)")
    else:
        parts.append(f"rel_l2 {rel_l2:.3g}")
    return ", ".join(parts), rel_l2, held


def _line_order(
    ours: ParamPrint, theirs: ParamPrint, axis: int, ref_sums: numpy.ndarray, cand_sums: numpy.ndarray
) -> tuple[numpy.ndarray, numpy.ndarray]:
    """For each of the reference's lines along ``axis``, the candidate's line standing for it: the one hashing alike,
    else the next by rank of sums among those left; and the reference positions no candidate line hashes alike."""
    mine = numpy.frombuffer((ours.row_bytes, ours.col_bytes)[axis], dtype="<u8")
    held = numpy.frombuffer((theirs.row_bytes, theirs.col_bytes)[axis], dtype="<u8")
    size = ours.shape[axis]
    if len(mine) != size or len(held) != size:
        mine = held = numpy.zeros(0, dtype="<u8")
    where = {int(value): position for position, value in enumerate(held.tolist())}
    order = numpy.full(size, -1)
    for position, value in enumerate(mine.tolist()):
        found = where.pop(int(value), None)
        if found is not None:
            order[position] = found
    used = set(order[order >= 0].tolist())
    left = [position for position in numpy.argsort(cand_sums, kind="stable").tolist() if position not in used]
    missing = numpy.flatnonzero(order < 0)
    for position, found in zip(missing[numpy.argsort(ref_sums[missing], kind="stable")].tolist(), left, strict=False):
        order[position] = found
    return order, missing


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
