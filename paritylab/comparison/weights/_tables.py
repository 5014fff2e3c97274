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
        for name, expected in _table_sums(positions, values, shape[1] // len(values)).items():
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


def _table_sums(positions: numpy.ndarray, frequencies: numpy.ndarray, copies: int) -> dict[str, numpy.ndarray]:
    """The row sums of the tables ``frequencies`` make at ``positions``, by the function they hold (each frequency
    ``copies`` times; a ``cos | sin`` cache holds both)."""
    angles = numpy.outer(positions, frequencies)
    options = {"sin": copies * numpy.sin(angles).sum(1), "cos": copies * numpy.cos(angles).sum(1)}
    if copies == 2:
        options["cos | sin"] = (numpy.cos(angles) + numpy.sin(angles)).sum(1)
    return options


_SEARCHED_ROWS = 256
"""Rows of a table the search for its base reads (its row sums depend on the positions alone); all are checked."""
_POWERS = numpy.exp(numpy.linspace(math.log(1 / 64), math.log(64), 1201))
"""Powers of the reference's frequencies tried: a base from ``B**(1/64)`` to ``B**64`` (10,000 -> 1,000,000 is 1.5)."""


def _rebased(item: Held, ours: list[Held]) -> tuple[Held, str, float, float, float] | None:
    """A candidate ``[positions, width]`` table that is the ``sin``, ``cos`` or ``cos | sin`` table of a reference
    tensor's rotary frequencies built with another base: the reference's are geometric, ``B ** (-2j / d)``, and the
    table's row sums are, within rounding, those of the same frequencies raised to one power ``k`` (a base
    ``B ** k``). The reference tensor, the function, the reference's base and the table's, and the relative
    distance of the table's row sums from those the reference's frequencies give; ``None`` where no power fits."""
    sums = item.print.sums
    shape = item.print.shape
    if sums is None or len(shape) != 2 or shape[0] < 2:
        return None
    rows = sums[0]
    searched = min(shape[0], _SEARCHED_ROWS)
    positions = numpy.arange(shape[0], dtype=numpy.float64)
    for other in ours:
        frequencies = other.print.sums
        width = other.print.shape[0] if len(other.print.shape) == 1 else 0
        if not width or frequencies is None or shape[1] not in (width, 2 * width):
            continue
        values = frequencies[0]
        if not _frequencies(values) or not _geometric(values):
            continue
        copies = shape[1] // len(values)
        base = float(values[1] ** (-len(values)))  # values[j] = base ** (-j / len(values))
        for name in _table_sums(positions[:2], values, copies):
            fitted = _best_power(rows[:searched], positions[:searched], values, copies, name)
            if fitted is None or abs(fitted - 1.0) < 1e-3:
                continue
            expected = _table_sums(positions, values**fitted, copies)[name]
            scale = float(numpy.linalg.norm(expected)) or 1.0
            if float(numpy.linalg.norm(rows - expected)) / scale > EXACT:
                continue
            reference = _table_sums(positions, values, copies)[name]
            distance = float(numpy.linalg.norm(rows - reference)) / (float(numpy.linalg.norm(reference)) or 1.0)
            return other, name, base, base**fitted, distance
    return None


def _best_power(
    rows: numpy.ndarray, positions: numpy.ndarray, frequencies: numpy.ndarray, copies: int, name: str
) -> float | None:
    """The power of ``frequencies`` whose table's row sums lie nearest ``rows`` (a grid, then a finer one around its
    best), when they lie within :data:`EXACT`."""
    scale = float(numpy.linalg.norm(rows)) or 1.0

    def distance(power: float) -> float:
        return float(numpy.linalg.norm(rows - _table_sums(positions, frequencies**power, copies)[name])) / scale

    coarse = [distance(float(power)) for power in _POWERS]
    at = int(numpy.argmin(coarse))
    low, high = _POWERS[max(at - 1, 0)], _POWERS[min(at + 1, len(_POWERS) - 1)]
    fine = numpy.linspace(low, high, 201)
    scores = [distance(float(power)) for power in fine]
    best = int(numpy.argmin(scores))
    return float(fine[best]) if scores[best] <= EXACT else None


def _geometric(values: numpy.ndarray) -> bool:
    """Frequencies falling by one ratio, as a rotary base makes them (Llama 3's banded scaling is not)."""
    ratios = values[1:] / values[:-1]
    return bool(numpy.all(numpy.abs(ratios / ratios[0] - 1.0) < 1e-4))
