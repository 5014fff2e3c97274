"""Which values of a candidate's recorded call equal which values of the reference's (:mod:`.operations`).

Every candidate value is looked up among the reference's values of its size, in any position and, at full
precision, in any layout (a ``[batch, heads, tokens, dim]`` query matches a ``[batch, tokens, heads * dim]`` one):
:func:`match_values`. A value matching none whole may still hold one: a fused projection's output holds a separate
one's as a slice (:func:`mark_slices`), a fused weight holds separate weights' rows (:func:`mark_stacked`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import replace

import torch

from paritylab.comparison.operations import Recording, Value

_MASKED = 1e30
"""Values at least this large (or infinite) are an attention mask's fill (``-inf``, ``finfo.min``): compared as
zeros, so the positions they mask must agree while the other values are what the distance measures. Left as they
are, one such value outweighs every real one, and scores scaled wrongly would match once masked."""


def flat(tensor: torch.Tensor) -> tuple[torch.Tensor, float]:
    data = tensor.detach().reshape(-1).to(torch.float64)
    masked = data.abs() >= _MASKED  # infinities too; NaN stays NaN and matches nothing
    if bool(masked.any()):
        data = data.masked_fill(masked, 0.0)
    return data, float(torch.linalg.vector_norm(data))


class Distance:
    """Relative L2 distance between flattened values: in element order, then either (``layout_free``) in sorted
    order, which no reshape, transpose or head split changes, or (low precision, where sorted values of any
    two similar tensors are close) through the permutations of dimensions that map one shape onto the other
    (``shapes``: value key -> shape). Sorted copies are made once per value."""

    def __init__(self, layout_free: bool, shapes: Mapping[int, list[int]] | None = None) -> None:
        self.layout_free = layout_free
        self.shapes = shapes or {}
        self.sorted: dict[int, torch.Tensor] = {}

    def __call__(
        self, key: int, data: torch.Tensor, norm: float, other_key: int, other: torch.Tensor, other_norm: float,
        bound: float, tolerance: float = 0.0,
    ) -> tuple[float, bool]:  # fmt: skip
        """(distance, matched only out of order); ``inf`` when it cannot be below ``bound``. Other layouts are
        tried unless the element order is already within ``tolerance``."""
        scale = max(other_norm, 1e-30)
        if data.numel() != other.numel() or abs(norm - other_norm) / scale > bound:  # a lower bound of both
            return math.inf, False
        distance = float(torch.linalg.vector_norm(data - other)) / scale
        if distance <= tolerance:
            return distance, False
        if not self.layout_free:
            views = self._views(key, data, other_key, other)
            moved = min((float(torch.linalg.vector_norm(a - b)) / scale for a, b in views), default=math.inf)
            return (moved, True) if moved < distance else (distance, False)
        by_value = float(torch.linalg.vector_norm(self._sorted(key, data) - self._sorted(other_key, other))) / scale
        return (by_value, True) if by_value < distance else (distance, False)

    def _views(
        self, key: int, data: torch.Tensor, other_key: int, other: torch.Tensor
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Both values flattened after permuting one's dimensions so that its shape groups into the other's
        (``[b, h, t, d]`` read as ``[b, t, h * d]``, or a transposed ``[t, s]``), at most :data:`_VIEWS` of them."""
        mine = [size for size in self.shapes.get(key, []) if size != 1]
        theirs = [size for size in self.shapes.get(other_key, []) if size != 1]
        if not mine or not theirs or max(len(mine), len(theirs)) > 5:
            return
        found = 0
        for order in itertools.permutations(range(len(theirs))):
            if found < _VIEWS and list(order) != sorted(order) and _groups([theirs[i] for i in order], mine):
                found += 1
                yield data, other.reshape(theirs).permute(order).reshape(-1)
        for order in itertools.permutations(range(len(mine))):
            if found < _VIEWS and list(order) != sorted(order) and _groups([mine[i] for i in order], theirs):
                found += 1
                yield data.reshape(mine).permute(order).reshape(-1), other

    def _sorted(self, key: int, data: torch.Tensor) -> torch.Tensor:
        if key not in self.sorted:
            self.sorted[key] = torch.sort(data).values
        return self.sorted[key]


_VIEWS = 8
"""Permuted layouts tried per pair of values in low precision."""


def _groups(fine: list[int], coarse: list[int]) -> bool:
    """Whether ``fine``'s sizes, in order, multiply into ``coarse``'s (``[2, 6, 4, 8]`` into ``[2, 6, 32]``)."""
    position = 0
    for size in coarse:
        product = 1
        while product < size and position < len(fine):
            product *= fine[position]
            position += 1
        if product != size:
            return False
    return position == len(fine)


def value_shapes(reference: Recording, candidate: Recording) -> dict[int, list[int]]:
    """Value shapes under the keys :class:`Distance` is called with (candidate values: ``-1 - index``)."""
    shapes = {value.index: value.shape for value in reference.values}
    shapes.update({-1 - value.index: value.shape for value in candidate.values})
    return shapes


def match_values(
    reference: Recording, candidate: Recording, tolerance: float, layout_free: bool
) -> dict[int, set[int]]:
    """Give each candidate value its nearest reference value of the same size; returns, per candidate value,
    every reference value it equals (within ``tolerance``)."""
    pool: dict[int, list[tuple[int, torch.Tensor, float]]] = {}
    for value, tensor in zip(reference.values, reference.tensors, strict=True):
        if tensor is not None and tensor.numel():
            pool.setdefault(tensor.numel(), []).append((value.index, *flat(tensor)))
    distance = Distance(layout_free, value_shapes(reference, candidate))
    equals: dict[int, set[int]] = {}
    for value, tensor in zip(candidate.values, candidate.tensors, strict=True):
        if tensor is None or not tensor.numel():
            continue
        data, norm = flat(tensor)
        best, best_index, layout = math.inf, None, False
        for index, other, other_norm in pool.get(data.numel(), []):
            found, moved = distance(
                -1 - value.index, data, norm, index, other, other_norm, max(tolerance, best), tolerance
            )
            if found <= tolerance:
                equals.setdefault(value.index, set()).add(index)
            if found < best:
                best, best_index, layout = found, index, moved
        if best_index is None:
            continue
        value.distance = best
        if best <= tolerance:
            value.match, value.layout = best_index, layout
    return equals


def mark_slices(reference: Recording, candidate: Recording, tolerance: float) -> None:
    """Set :attr:`Value.parts` of each candidate operation result that matches no reference value whole but holds
    one as a slice along one axis: a fused projection's output (gate and up side by side, or q, k and v) against the
    reference's separate one. Slices are tried where a part of that width starts in a concatenation: at multiples
    of its width, and at the end."""
    pool: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for value, tensor in zip(reference.values, reference.tensors, strict=True):
        if tensor is not None and tensor.numel() >= _SLICE_MIN and tensor.is_floating_point():
            pool.setdefault(tensor.dim(), []).append((value.index, tensor))
    for value, tensor in zip(candidate.values, candidate.tensors, strict=True):
        if value.op is None or value.match is not None or value.parts or tensor is None:
            continue
        for index, theirs in pool.get(tensor.dim(), []):
            axes = [axis for axis in range(tensor.dim()) if tensor.shape[axis] != theirs.shape[axis]]
            if len(axes) != 1 or theirs.shape[axes[0]] < 2 or theirs.shape[axes[0]] > tensor.shape[axes[0]]:
                continue
            axis, width, size = axes[0], theirs.shape[axes[0]], tensor.shape[axes[0]]
            for start in dict.fromkeys([*range(0, size - width + 1, width), size - width]):
                found = relative_distance(tensor.narrow(axis, start, width), theirs)
                if found <= tolerance:
                    value.parts, value.distance = [index], found
                    break
            if value.parts:
                break


_SLICE_MIN = 16
"""Reference results smaller than this are not looked for as slices (a column of a wide result could equal one
by chance)."""


def with_siblings(reference: Recording, siblings: Mapping[str, torch.Tensor]) -> Recording:
    """``reference`` with ``siblings`` appended as values from outside the call (``parameter <full name>``),
    those the recording already holds left out."""
    held = {id(tensor) for tensor in reference.tensors if tensor is not None}
    extra = [(name, tensor.detach()) for name, tensor in siblings.items() if id(tensor) not in held]
    if not extra:
        return reference
    values = list(reference.values)
    for name, tensor in extra:
        values.append(Value(len(values), f"parameter {name}", list(tensor.shape), str(tensor.dtype)))
    tensors = [*reference.tensors, *(tensor for _, tensor in extra)]
    return replace(reference, values=values, tensors=tensors)


def mark_stacked(reference: Recording, candidate: Recording, tolerance: float) -> None:
    """Set :attr:`Value.parts` of each candidate parameter or buffer that matches no reference value whole but
    whose rows (or columns) are rows of reference parameters and buffers: a fused projection's weight and bias
    (``in_proj_weight``: q, k and v stacked) against separate ones, or a separate one against part of a fused one.
    Rows are located by the hashes that parameter fingerprints and the alignment's fused-row matching use (the
    sum of each row's element hashes, :func:`paritylab.tracing.structure.element_hashes`); what they locate is then
    compared as values, within ``tolerance``."""
    indexes: dict[tuple[torch.dtype, int], _Rows] = {}
    for value, tensor in _held(candidate):
        if value.match is not None or tensor.dim() not in (1, 2):
            continue
        grid = torch.float16 if tensor.dtype == torch.float16 else torch.bfloat16
        if (grid, tensor.dim()) not in indexes:
            indexes[(grid, tensor.dim())] = _Rows(reference, grid, tensor.dim())
        for axis, hashes in enumerate(_row_hashes(tensor, grid)):
            located = indexes[(grid, tensor.dim())].assemble(tensor.movedim(axis, 0), hashes, tolerance)
            if located is not None:
                value.parts, value.distance = located
                break


class _Rows:
    """The row hashes of a recording's ``dim``-D parameters and buffers along each axis (a 1-D value's rows are
    its elements), and where each hash occurs."""

    def __init__(self, recording: Recording, grid: torch.dtype, dim: int) -> None:
        self.recording = recording
        self.hashes: dict[tuple[int, int], list[int]] = {}
        self.where: dict[int, list[tuple[int, int, int]]] = {}
        for value, tensor in _held(recording):
            if tensor.dim() == dim:
                for axis, hashes in enumerate(_row_hashes(tensor, grid)):
                    self.hashes[(value.index, axis)] = hashes
                    for position, digest in enumerate(hashes):
                        self.where.setdefault(digest, []).append((value.index, axis, position))

    def row(self, value: int, axis: int, position: int) -> torch.Tensor:
        tensor = self.recording.tensors[value]
        assert tensor is not None
        return tensor.select(axis, position) if tensor.dim() == 2 else tensor[position]

    def assemble(self, rows: torch.Tensor, hashes: list[int], tolerance: float) -> tuple[list[int], float] | None:
        """The reference values whose rows, in order, make ``rows`` (``rows[i]`` hashing to ``hashes[i]``), and
        the distance between the two; ``None`` when a row is found nowhere or what is found differs as values. The
        row continuing the previous one's value is taken when its hash fits, else the first equal in value."""
        picked: list[tuple[int, int, int]] = []
        for number, digest in enumerate(hashes):
            if picked:
                value, axis, position = picked[-1]
                following = self.hashes[(value, axis)]
                if position + 1 < len(following) and following[position + 1] == digest:
                    picked.append((value, axis, position + 1))
                    continue
            wanted = rows[number]
            found = next(
                (
                    at
                    for at in self.where.get(digest, ())
                    if self.row(*at).numel() == wanted.numel() and relative_distance(wanted, self.row(*at)) <= tolerance
                ),
                None,
            )
            if found is None:
                return None
            picked.append(found)
        distance = relative_distance(rows, torch.stack([self.row(*at) for at in picked]).to(rows.dtype))
        return (list(dict.fromkeys(at[0] for at in picked)), distance) if distance <= tolerance else None


def _held(recording: Recording) -> Iterator[tuple[Value, torch.Tensor]]:
    """The recording's floating-point parameters and buffers, with their tensors."""
    for value, tensor in zip(recording.values, recording.tensors, strict=True):
        held = value.op is None and value.origin.startswith(("parameter ", "buffer "))
        if held and tensor is not None and tensor.numel() and tensor.is_floating_point():
            yield value, tensor


def _row_hashes(tensor: torch.Tensor, dtype: torch.dtype) -> list[list[int]]:
    """Per axis of a 2-D tensor, the hash of each row along it (a 1-D tensor: of each element), on the grid of
    ``dtype`` (values rounded to float16 first for a float16 side, as :mod:`paritylab.tracing.structure` does)."""
    from paritylab.tracing.structure import element_hashes

    values = tensor.detach()
    if dtype == torch.float16:
        values = values.to(torch.float16)
    hashed = element_hashes(values)
    if hashed.dim() == 1:
        return [hashed.tolist()]
    return [hashed.sum(dim=1, dtype=torch.int64).tolist(), hashed.sum(dim=0, dtype=torch.int64).tolist()]


def relative_distance(value: torch.Tensor, other: torch.Tensor) -> float:
    data, _ = flat(value)
    theirs, other_norm = flat(other)
    return (
        float(torch.linalg.vector_norm(data - theirs)) / max(other_norm, 1e-30)
        if data.numel() == theirs.numel()
        else math.inf
    )
