"""Tables one side computes from the other's: a rotary ``sin``/``cos`` table (TransformerLens' ``rotary_sin``, vLLM's
``cos_sin_cache``) against the frequencies it is built from (transformers' ``inv_freq``).

No tensor of the reference holds such a table's values, so neither fingerprints nor sketches pair it; but its row
sums follow from the frequencies alone: row ``p`` of a sine table sums ``sin(p * f_j)`` over its columns (each
frequency once, or twice where the table repeats them for ``rotate_half`` or interleaved pairs; a ``cos | sin`` cache
sums both). A table whose row sums are those within rounding is the reference's; one near them is the reference's
with a defect (scaled, a wrong constant), and says so.
"""

from __future__ import annotations

import math

import numpy

from paritylab.comparison.weights._describe import _scale
from paritylab.comparison.weights._records import NEAR, ROUNDING, UNIQUE, Held

EXACT = ROUNDING / 2
"""Row sums this near (relative) are the same table up to a low-precision copy's rounding (a bfloat16 table of
TransformerLens' lies 1e-3 from the sums of transformers' float32 frequencies)."""


def _derived(item: Held, ours: list[Held]) -> tuple[Held, str, float, numpy.ndarray, numpy.ndarray] | None:
    """The reference frequency table a candidate 2-D ``[positions, width]`` table is ``sin``, ``cos`` or ``cos | sin``
    of (positions from 0), with the function's name, the distance of its row sums, and the expected and the
    candidate's row sums; ``None`` where none lies within :data:`NEAR` and clearly nearer than any other."""
    sums = item.print.sums
    shape = item.print.shape
    if sums is None or len(shape) != 2:
        return None
    rows = sums[0]
    positions = numpy.arange(shape[0], dtype=numpy.float64)
    scored: list[tuple[float, Held, str, numpy.ndarray]] = []
    for other in ours:
        frequencies = other.print.sums
        if (
            len(other.print.shape) != 1
            or frequencies is None
            or shape[1]
            not in (
                other.print.shape[0],
                2 * other.print.shape[0],
            )
        ):
            continue
        values = frequencies[0]
        if not _frequencies(values):
            continue
        copies = shape[1] // len(values)
        angles = numpy.outer(positions, values)
        options = {"sin": copies * numpy.sin(angles).sum(1), "cos": copies * numpy.cos(angles).sum(1)}
        if copies == 2:
            options["cos | sin"] = (numpy.cos(angles) + numpy.sin(angles)).sum(1)
        for name, expected in options.items():
            scale = float(numpy.linalg.norm(expected))
            if scale > 0:
                scored.append((float(numpy.linalg.norm(rows - expected)) / scale, other, name, expected))
    if not scored:
        return None
    scored.sort(key=lambda entry: entry[0])
    best, other, name, expected = scored[0]
    second = next(  # identical copies (transformers keeps inv_freq and original_inv_freq) are one
        (entry[0] for entry in scored[1:] if entry[1].print.digest != other.print.digest or entry[2] != name), math.inf
    )
    if best >= NEAR or best > UNIQUE * second:
        return None
    return other, name, best, expected, rows


def _derived_detail(name: str, twin: Held, expected: numpy.ndarray, rows: numpy.ndarray, distance: float) -> str:
    """What differs between a derived table and the one its reference frequencies make."""
    scale = _scale(expected, rows)
    what = f"as {name}(position x {twin.print.name}), from row sums"
    if scale is not None:
        return f"{what}: scaled by {scale:.4g}, rel_l2 {abs(scale - 1):.3g}"
    return f"{what}: rel_l2 ~{distance:.3g}"


def _frequencies(values: numpy.ndarray) -> bool:
    """Angular frequencies as rotary tables hold them: positive, at most one radian per position, strictly falling
    (geometric, or scaled in bands as Llama 3's are)."""
    return len(values) >= 2 and bool(
        numpy.all(values > 0) and values[0] <= 1.0 + ROUNDING and numpy.all(numpy.diff(values) < 0)
    )
