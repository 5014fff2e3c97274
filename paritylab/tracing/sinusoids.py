"""The angular frequencies a sinusoid table is built from, read from its values.

A rotary or sinusoidal position table ``[positions, width]`` holds in each column ``sin(p * f)`` or ``cos(p * f)``
for positions ``p = 0, 1, ...`` (GPT-J's ``embed_positions`` is ``sin | cos``, TransformerLens' ``rotary_sin``
repeats each sine twice, Whisper's encoder positions are ``sin | cos`` of its timescales). A port that builds its
table another way (from ``inv_freq``, in another layout) holds no tensor with the same values, so fingerprints cannot
pair the two; the frequencies can. They are read here, once, where the values are at hand (the weight ledger sees
fingerprints only), and kept beside the fingerprint (:attr:`~paritylab.tracing.structure.ParamPrint.frequencies`).

Only float32 and float64 tables are read: a bfloat16 table rounds ``sin(f)`` by 2**-9 and the frequencies read back
would be no better, so a comparison against them would be one of rounding.
"""

from __future__ import annotations

import math

import numpy
import torch

_WIDE = (torch.float32, torch.float64)
MAX_ELEMENTS = 1 << 24
"""Tables read at most this large (131,072 positions of width 128); larger ones are left unread."""
_FIT = 1.2
"""Radians ``p * f`` up to which a column's row ``p`` reads its frequency back well (``asin`` and ``acos`` are
steep near pi/2 and 0, and a sine's row ``p`` carries ``p`` times the frequency's precision)."""
_SAME = 1e-2
"""Frequencies read back this near (relative) are one: a sine and a cosine column of one frequency (rotary
frequencies a base apart differ by several per cent even at a width of 256)."""
_READ = 1e-4
"""The relative precision a cosine column's frequency must be read with: ``eps / (a sin a)`` at its angle ``a``."""
_TOLERANCE = 64 * float(torch.finfo(torch.float32).eps)
"""How far (times ``1 + p * f``) a float32 table's values may lie from ``sin(p * f)`` and ``cos(p * f)`` of the
frequencies read back: the producer rounded each angle ``p * f`` and each value."""


def sinusoid_frequencies(values: torch.Tensor) -> bytes:
    """The distinct angular frequencies (float64, little-endian, falling) of a 2-D float32/64 table every column of
    which is ``sin(p * f)`` or ``cos(p * f)`` at positions ``p = 0 ..`` with ``0 < f <= 1``; ``b""`` for anything
    else. Weights fail at their first rows (a sine table's first row is zeros and ones, its third follows from its
    second), so only tables are read whole."""
    if values.dim() != 2 or values.dtype not in _WIDE or values.shape[0] < 3 or not values.shape[1]:
        return b""
    if values.numel() > MAX_ELEMENTS or not _sinusoid(values[:3].detach().to("cpu", torch.float64).numpy()):
        return b""
    table = values.detach().to("cpu", torch.float64).numpy()
    cosine = table[0] == 1
    estimate = _refined(table, cosine, _first(table))
    if not _sinusoid(table, estimate):
        return b""
    eps = float(torch.finfo(values.dtype).eps)
    distinct = _distinct(table, cosine, estimate, eps)
    return b"" if distinct is None else numpy.asarray(distinct, dtype="<f8").tobytes()


def _distinct(table: numpy.ndarray, cosine: numpy.ndarray, estimate: numpy.ndarray, eps: float) -> list[float] | None:
    """The frequencies of a table's columns, each once, falling. A sine reads a frequency best (a cosine's rows
    change by ``p**2 f**2 / 2`` only): a cosine column that a sine column's frequency also explains is that one; one
    no sine explains is read from its last row within :data:`_FIT` radians, and where that reads it no better than
    :data:`_READ` (a short table of small frequencies) the table has no frequencies."""
    sines = sorted({*estimate[~cosine].tolist()}, reverse=True)
    distinct: list[float] = []
    for frequency in sines:
        if all(abs(kept - frequency) > _SAME * kept for kept in distinct):
            distinct.append(frequency)
    for column in numpy.flatnonzero(cosine):
        nearest = min(distinct, key=lambda kept: abs(kept - estimate[column]), default=None)
        if nearest is not None and _sinusoid(table[:, column : column + 1], numpy.array([nearest])):
            continue
        angle = min(_FIT, (table.shape[0] - 1) * estimate[column])
        if eps / max(angle * math.sin(angle), 1e-300) > _READ:
            return None
        if all(abs(kept - estimate[column]) > _SAME * kept for kept in distinct):
            distinct.append(float(estimate[column]))
    return sorted(distinct, reverse=True)


def _first(table: numpy.ndarray) -> numpy.ndarray:
    """Each column's frequency read from its second row (``asin`` of a sine's, ``acos`` of a cosine's)."""
    second = numpy.clip(table[1], -1, 1)
    return numpy.where(table[0] == 1, numpy.arccos(second), numpy.arcsin(second))


def _sinusoid(table: numpy.ndarray, estimate: numpy.ndarray | None = None) -> bool:
    """Whether every column of ``table`` (its first rows, or all) starts at 0 or 1 and follows ``sin(p * f)`` or
    ``cos(p * f)`` with ``0 < f <= 1`` (``estimate``, else read from its second row) within :data:`_TOLERANCE`."""
    first = table[0]
    if not bool(numpy.all((first == 0) | (first == 1))):
        return False
    frequency = _first(table) if estimate is None else estimate
    # a cosine's second row reads a small frequency as none at all: only its later rows tell it (_refined)
    lowest = numpy.where((first == 1) & (estimate is None), 0.0, 1e-12)
    if not bool(numpy.all((frequency >= lowest) & (frequency <= 1.0 + 1e-6))):
        return False
    angles = numpy.arange(table.shape[0], dtype=numpy.float64)[:, None] * frequency
    expected = numpy.where(first == 1, numpy.cos(angles), numpy.sin(angles))
    return bool(numpy.all(numpy.abs(table - expected) <= _TOLERANCE * (1 + angles)))


def _refined(table: numpy.ndarray, cosine: numpy.ndarray, estimate: numpy.ndarray) -> numpy.ndarray:
    """Each column's frequency read again at the last row whose angle is at most :data:`_FIT` radians (the first
    row's estimate picks that row): ``asin`` or ``acos`` of the value, over the position."""
    rows = table.shape[0] - 1
    at = numpy.clip(numpy.floor(_FIT / numpy.maximum(estimate, 1e-12)), 1, rows).astype(numpy.int64)
    picked = table[at, numpy.arange(table.shape[1])]
    clipped = numpy.clip(picked, -1, 1)
    return numpy.where(cosine, numpy.arccos(clipped), numpy.arcsin(clipped)) / at
