"""Tables one side computes from the other's: a rotary ``sin``/``cos`` table (TransformerLens' ``rotary_sin``, vLLM's
``cos_sin_cache``) against the frequencies it is built from (transformers' ``inv_freq``, or those read from a table
the reference holds itself: GPT-J's ``sin | cos`` ``embed_positions``, :func:`frequency_tables`).

No tensor of the reference holds such a table's values, so neither fingerprints nor sketches pair it; but its row
sums follow from the frequencies alone: row ``p`` of a sine table sums ``sin(p * f_j)`` over its columns (each
frequency once, or twice where the table repeats them for ``rotate_half`` or interleaved pairs; a ``cos | sin`` cache
sums both). A table whose row sums are those within rounding is the reference's; one near them is the reference's
with a defect (scaled, a wrong constant), and says so.
"""

from __future__ import annotations

import math

import numpy

from paritylab.comparison.weights._describe import _scale, _values_differ
from paritylab.comparison.weights._records import NEAR, ROUNDING, UNIQUE, Held
from paritylab.tracing.structure import ParamPrint

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


def frequency_tables(ours: list[Held]) -> list[Held]:
    """The frequencies each reference sinusoid table is built from (its fingerprint's
    :attr:`~paritylab.tracing.structure.ParamPrint.frequencies`), each held as a 1-D tensor of the table's name and
    module: what a port's table in another layout, or its ``inv_freq``, is checked against."""
    found = []
    for item in ours:
        values = item.print.angular
        if values is None or len(values) < 2:
            continue
        sketch = numpy.append(values, numpy.linalg.norm(values)).astype("<f4").tobytes()
        read = ParamPrint(item.print.name, (len(values),), 0, sketch=sketch, frequencies=item.print.frequencies)
        found.append(Held(item.module, read))
    return found


def source(twin: Held) -> str:
    """How a detail names the frequencies ``twin`` holds: its name, or those read from a table."""
    return f"the frequencies of {twin.print.name}" if twin.print.frequencies else twin.print.name


def _from_table(item: Held, tables: list[Held]) -> tuple[Held, float] | None:
    """The reference table whose frequencies a candidate's 1-D frequencies (``inv_freq``) lie nearest, and the
    relative distance; ``None`` where none lies within :data:`NEAR` and clearly nearer than any other."""
    sums = item.print.sums
    if sums is None or len(item.print.shape) != 1 or len(sums[0]) < 2:
        return None
    if not bool(numpy.all(sums[0] > 0) and numpy.all(numpy.diff(sums[0]) < 0)):  # frequencies, whatever their scale
        return None
    scored = []
    for table in tables:
        values = table.print.sums
        if values is not None and table.print.shape == item.print.shape:
            scored.append((float(numpy.linalg.norm(sums[0] - values[0]) / numpy.linalg.norm(values[0])), table))
    scored.sort(key=lambda entry: entry[0])
    if not scored or scored[0][0] >= NEAR:
        return None
    best, table = scored[0]
    second = next((entry[0] for entry in scored[1:] if entry[1].print.frequencies != table.print.frequencies), math.inf)
    return (table, best) if best <= UNIQUE * second else None


def _from_table_detail(item: Held, table: Held) -> tuple[str, float]:
    """What differs between a candidate's frequencies and those a reference table is built from."""
    theirs, ours = item.print.sums, table.print.sums
    assert theirs is not None and ours is not None
    text, distance = _values_differ(ours[0], theirs[0])
    return f"as {source(table)}: {text}, rel_l2 {distance:.3g}", distance


def _derived_detail(name: str, twin: Held, expected: numpy.ndarray, rows: numpy.ndarray, distance: float) -> str:
    """What differs between a derived table and the one its reference frequencies make."""
    scale = _scale(expected, rows)
    what = f"as {name}(position x {source(twin)}), from row sums"
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
