"""Parts of fused outputs: a module whose weight is part of a fused one on the other side (q of qkv, gate of
gate+up), located by the row and column hashes of 2-D parameters."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy

from paritylab.comparison.alignment._pairs import Pair, Part
from paritylab.comparison.alignment._shapes import _shape
from paritylab.tracing.structure import ModulePrint
from paritylab.tracing.tracefile import CallRecord


def _by_parts(
    ref_calls: list[CallRecord],
    cand_calls: list[CallRecord],
    open_ref: list[int],
    taken: set[int],
    ref_prints: dict[str, ModulePrint],
    cand_prints: dict[str, ModulePrint],
) -> list[tuple[int, int, Pair]]:
    """Modules whose weight is part of a fused one on the other side (q of qkv, gate of gate+up), and the
    positions of the output's last dimension that part computes, found from row and column hashes."""
    cand_paths = {call.path for j, call in enumerate(cand_calls) if j not in taken}
    cand_index = _axis_index(cand_prints, cand_paths)
    cand_by_key = {call.key: j for j, call in enumerate(cand_calls) if j not in taken}
    cand_widths = _widths(cand_calls[j] for j in cand_by_key.values())
    found: list[tuple[int, int, Pair]] = []
    for i in open_ref:
        call = ref_calls[i]
        located = _locate(ref_prints.get(call.path), _shape(call), cand_index, cand_prints, cand_widths)
        if located is None:
            continue
        path, part = located
        j = cand_by_key.get(f"{path}#{call.call_index}")
        if j is None:
            continue
        found.append((i, j, Pair(call.key, cand_calls[j].key, "structure", 1.0, candidate_part=part)))
    ref_paths = {ref_calls[i].path for i in open_ref}
    ref_index = _axis_index(ref_prints, ref_paths)
    ref_by_key = {ref_calls[i].key: i for i in open_ref}
    ref_widths = _widths(ref_calls[i] for i in open_ref)
    paired = {i for i, _, _ in found}
    for j, call in enumerate(cand_calls):
        if j in taken:
            continue
        located = _locate(cand_prints.get(call.path), _shape(call), ref_index, ref_prints, ref_widths)
        if located is None:
            continue
        path, part = located
        found_at = ref_by_key.get(f"{path}#{call.call_index}")
        if found_at is None or found_at in paired:
            continue
        paired.add(found_at)
        found.append((found_at, j, Pair(ref_calls[found_at].key, call.key, "structure", 1.0, reference_part=part)))
    return found


@dataclass(frozen=True)
class _AxisIndex:
    """Every row and column hash of the 2-D parameters of some modules, sorted, with where each sits: ``owners``
    indexes ``keys`` (module path, parameter name, axis), ``positions`` is the row or column. Built from the hashes'
    bytes with numpy: llava-bench's 150,000 rows and columns took 0.29 s as a dict of Python lists."""

    hashes: numpy.ndarray
    owners: numpy.ndarray
    positions: numpy.ndarray
    keys: list[tuple[str, str, int]]

    def find(self, values: numpy.ndarray) -> dict[tuple[str, str, int], list[int]]:
        """For each (path, parameter, axis) holding any of ``values``: the positions there of the values it holds,
        in the order of ``values``; owners in the order they are first met."""
        left = numpy.searchsorted(self.hashes, values, "left")
        counts = numpy.searchsorted(self.hashes, values, "right") - left
        total = int(counts.sum())
        if not total:
            return {}
        ends = numpy.cumsum(counts)
        at = numpy.repeat(left - (ends - counts), counts) + numpy.arange(total)  # every match, value by value
        owners, positions = self.owners[at], self.positions[at]
        unique, first = numpy.unique(owners, return_index=True)
        return {
            self.keys[int(owner)]: positions[owners == owner].tolist()
            for owner in unique[numpy.argsort(first, kind="stable")]
        }


def _axis_index(prints: dict[str, ModulePrint], paths: set[str]) -> _AxisIndex:
    hashes: list[numpy.ndarray] = []
    owners: list[numpy.ndarray] = []
    positions: list[numpy.ndarray] = []
    keys: list[tuple[str, str, int]] = []
    for path in sorted(paths):
        item = prints.get(path)
        if item is None:
            continue
        for param in item.params:
            for axis, raw in ((0, param.row_bytes), (1, param.col_bytes)):
                if not raw:
                    continue
                values = numpy.frombuffer(raw, dtype="<u8")
                hashes.append(values)
                owners.append(numpy.full(len(values), len(keys), dtype=numpy.int64))
                positions.append(numpy.arange(len(values), dtype=numpy.int64))
                keys.append((path, param.name, axis))
    if not keys:
        empty = numpy.zeros(0, dtype=numpy.int64)
        return _AxisIndex(numpy.zeros(0, dtype="<u8"), empty, empty, keys)
    every = numpy.concatenate(hashes)
    order = numpy.argsort(every, kind="stable")  # equal hashes keep the order of their owners
    return _AxisIndex(every[order], numpy.concatenate(owners)[order], numpy.concatenate(positions)[order], keys)


def _widths(calls: Iterable[CallRecord]) -> dict[str, set[int]]:
    """Module path -> the sizes of its outputs' last dimension."""
    widths: dict[str, set[int]] = {}
    for call in calls:
        shape = _shape(call)
        if shape:
            widths.setdefault(call.path, set()).add(shape[-1])
    return widths


def _locate(
    item: ModulePrint | None,
    shape: tuple[int, ...] | None,
    index: _AxisIndex,
    prints: dict[str, ModulePrint],
    widths: Mapping[str, set[int]],
) -> tuple[str, Part] | None:
    """Where the output features of ``item`` (a module with a 2-D weight) sit in a fused module's output.
    The fused weight's axis must be its module's output features too (``widths``: a ``Linear``'s rows are;
    an ``Embedding``'s rows are table entries, and a table holding another's entries plus more, such as
    positions with an offset, computes the same features, not a part of them)."""
    if item is None or not shape:
        return None
    for param in item.params:
        for raw in (param.row_bytes, param.col_bytes):
            hashes = numpy.frombuffer(raw, dtype="<u8")
            if len(hashes) != shape[-1] or len(numpy.unique(hashes)) != len(hashes):
                continue
            for (path, name, axis), positions in index.find(hashes).items():
                other = next(p for p in prints[path].params if p.name == name)
                if path == item.path or len(positions) != len(hashes) or len(positions) == other.shape[axis]:
                    continue  # not a strict part (equal weights are paired by fingerprint)
                if other.shape[axis] not in widths.get(path, ()):
                    continue  # that axis is not what the fused module outputs
                return path, _part_of(positions)
    return None


def _part_of(positions: list[int]) -> Part:
    if positions == list(range(positions[0], positions[0] + len(positions))):
        return Part(start=positions[0], stop=positions[0] + len(positions))
    return Part(indices=tuple(positions))
