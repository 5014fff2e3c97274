"""Exact matches beyond fingerprints: rows of fused, split or cut tensors (each reference row counted once), and the
layout a same-valued tensor is in."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy

from paritylab.comparison.weights._records import (
    MAX_LISTED,
    Held,
)
from paritylab.comparison.weights._views import views


def _row_index(items: Iterable[Held]) -> dict[tuple[int, int], int]:
    """(fiber length, fiber hash) -> how many reference fibers of that length hash so: the rows and columns of 2-D
    tensors, the fibers of larger ones along each axis (:mod:`._views`). A tensor held by several modules (a head
    tied to its token embedding) counts once: a candidate's copy of it holding one row twice does not hold it."""
    index: dict[tuple[int, int], int] = {}
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for item in items:
        key = (item.print.digest, item.print.shape)
        if key in seen:
            continue
        seen.add(key)
        for view in views(item):
            length = view.length
            for value in view.hashes.tolist():
                index[(length, value)] = index.get((length, value), 0) + 1
    return index


def _all_rows_held(item: Held, rows: Mapping[tuple[int, int], int]) -> bool:
    """Every fiber of a candidate tensor along one axis (every row, every column, every ``W_Q[h, :, e]``) is a fiber
    some reference tensor holds, each at most as often as the reference holds it: a fused projection against separate
    ones, a part of a fused one, a per-head or per-expert tensor against a fused one, a table cut to some of its rows.
    (A block of rows overwritten with a copy of another block holds every row, one of them twice: not this.)"""
    for view in views(item):
        length = view.length
        values = [value for value in view.hashes.tolist() if value]
        counts: dict[int, int] = {}
        for value in values:
            counts[value] = counts.get(value, 0) + 1
        if values and all(rows.get((length, value), 0) >= count for value, count in counts.items()):
            return True
    return False


TURNED = "the same values, transposed, with its lines in another order"
"""The layout of a weight a port holds transposed in an order of its own (or a conversion transposed)."""


def _layout(ours: Held, theirs: Held) -> str | None:
    """How a candidate tensor holding exactly the reference tensor's values lays them out, when it differs."""
    a, b = ours.print, theirs.print
    if not a.row_bytes or not b.row_bytes or a.row_bytes == b.row_bytes:
        return None
    if a.shape == b.shape[::-1] and a.row_bytes == b.col_bytes and a.col_bytes == b.row_bytes:
        return "the same values, transposed"
    if a.shape == b.shape[::-1] and _same_lines(a.row_bytes, b.col_bytes) and _same_lines(a.col_bytes, b.row_bytes):
        return TURNED
    if a.shape == b.shape and a.col_bytes == b.col_bytes:
        ref_rows = numpy.frombuffer(a.row_bytes, dtype="<u8")
        cand_rows = numpy.frombuffer(b.row_bytes, dtype="<u8")
        if sorted(ref_rows.tolist()) == sorted(cand_rows.tolist()):
            return "the same rows in another order: " + _row_runs(ref_rows, cand_rows)
    return None


def line_order(theirs: numpy.ndarray, ours: numpy.ndarray) -> tuple[int, ...] | None:
    """For each of ``theirs`` (line hashes, unique), the position of the line hashing alike in ``ours``; ``None``
    where one is missing."""
    if len(ours) != len(theirs):
        return None
    order = numpy.argsort(ours, kind="stable")
    at = numpy.clip(numpy.searchsorted(ours[order], theirs), 0, len(ours) - 1)
    if not numpy.array_equal(ours[order][at], theirs):
        return None
    return tuple(int(position) for position in order[at])


def _same_lines(ours: bytes, theirs: bytes) -> bool:
    """Two axes' line hashes hold the same lines, in any order."""
    return sorted(numpy.frombuffer(ours, dtype="<u8").tolist()) == sorted(
        numpy.frombuffer(theirs, dtype="<u8").tolist()
    )


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
    text = [f"row {start} holds the reference's row {source}" if size == 1 else
            f"rows {start}-{start + size - 1} hold the reference's rows {source}-{source + size - 1}"
            for start, source, size in moved[:MAX_LISTED]]  # fmt: skip
    more = f" and {len(moved) - MAX_LISTED} more runs" if len(moved) > MAX_LISTED else ""
    return ", ".join(text) + more
