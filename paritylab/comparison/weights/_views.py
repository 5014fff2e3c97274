"""A tensor as fibers: the rows and the columns of a 2-D tensor, the fibers of a larger one along each axis.

Two implementations lay one weight out differently: a fused ``[d_model, 3 * d_model]`` projection holds in its
columns what a per-head ``W_Q [heads, d_model, d_head]`` holds along its middle axis; a fused MoE's ``[experts,
2 * inner, d_model]`` holds along its last axis the rows of every expert's gate and up projections. Seen as fibers of
one length (each with its hash and value sum, in the C order of the other axes), the parts of one are runs of the
other's fibers, whatever the dimensions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy

from paritylab.comparison.weights._records import Held


@dataclass(frozen=True)
class View:
    """One tensor's fibers along one axis."""

    item: Held
    axis: int
    hashes: numpy.ndarray
    """uint64, one per fiber."""
    sums: numpy.ndarray | None
    """float64 value sums, one per fiber (``None`` where the fingerprint keeps none)."""

    @property
    def length(self) -> int:
        """Every fiber's number of elements."""
        return self.item.print.shape[self.axis]

    @property
    def rows(self) -> bool:
        """The rows of a 2-D tensor (a Linear's output features)."""
        return len(self.item.print.shape) == 2 and self.axis == 1

    def sums_at(self, start: int, stop: int) -> numpy.ndarray:
        assert self.sums is not None
        return self.sums[start:stop]

    def where(self, start: int, stop: int) -> str:
        """Fibers ``[start, stop)`` in words: ``rows 64-95``, ``column 3``, ``[2, :, 0:16]``."""
        shape = self.item.print.shape
        if len(shape) == 2:
            name = "row" if self.axis == 1 else "column"
            return f"{name} {start}" if stop - start == 1 else f"{name}s {start}-{stop - 1}"
        return _slices(shape, self.axis, start, stop)


def views(item: Held) -> list[View]:
    """The fiber views a fingerprint keeps: a 2-D tensor's rows and columns, a larger one's fibers along each axis
    longer than one (a 1x1 convolution's ``[out, in, 1, 1]`` kernel is seen as its rows and columns)."""
    param = item.print
    sums = param.sums
    if len(param.shape) == 2 and param.row_bytes:
        row_sums, col_sums = (sums[0], sums[1]) if sums is not None else (None, None)
        return [
            View(item, 1, numpy.frombuffer(param.row_bytes, dtype="<u8"), row_sums),
            View(item, 0, numpy.frombuffer(param.col_bytes, dtype="<u8"), col_sums),
        ]
    return [
        View(
            item,
            fibers.axis,
            numpy.frombuffer(fibers.hashes, dtype="<u8"),
            numpy.frombuffer(fibers.sums, dtype="<f4").astype(numpy.float64),
        )
        for fibers in param.fibers
        if param.shape[fibers.axis] > 1  # single elements: any value lies near some other by chance
    ]


def _slices(shape: tuple[int, ...], axis: int, start: int, stop: int) -> str:
    """Fibers ``[start, stop)`` along ``axis`` of a tensor of ``shape`` as an index: ``[3, :, 0:64]`` where they form
    one box (the usual case: a head, an expert, a block of its rows), else their first and last fiber."""
    others = [size for index, size in enumerate(shape) if index != axis]
    first, last = _unravel(start, others), _unravel(stop - 1, others)
    split = next((i for i, (a, b) in enumerate(zip(first, last, strict=True)) if a != b), len(others))
    rest = range(split + 1, len(others))
    if split < len(others) and not all(first[i] == 0 and last[i] == others[i] - 1 for i in rest):
        return f"{_index(first, axis)} to {_index(last, axis)}"
    box = [str(value) for value in first[:split]]
    if split < len(others):
        a, b = first[split], last[split]
        box.append(":" if (a, b) == (0, others[split] - 1) else f"{a}:{b + 1}")
        box += [":"] * len(rest)
    box.insert(axis, ":")
    return "[" + ", ".join(box) + "]"


def _unravel(flat: int, sizes: list[int]) -> list[int]:
    index = []
    for size in reversed(sizes):
        index.append(flat % size)
        flat //= size
    return index[::-1]


def _index(position: list[int], axis: int) -> str:
    parts = [str(value) for value in position]
    parts.insert(axis, ":")
    return "[" + ", ".join(parts) + "]"
