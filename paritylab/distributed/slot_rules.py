"""The rules that combine one slot's pieces into one value, and the record of what was decided (:class:`SlotMerge`).

:mod:`.merge` walks the ranks' calls and hands each tensor slot's pieces here: :class:`SlotRules` applies the first
rule that fits (placements, equal values, a concatenation the reference's shape proves, a declared partial sum, ranks
that disagree) and judges each rank's piece against the reference's matching part, which :mod:`.localise` reads to
name the rank. The rules and their order are described in :mod:`.merge`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from paritylab.comparison.metrics import Tolerance, divergence, within
from paritylab.distributed.placements import SlotPlacement

REDUCTIONS = ("sum", "avg", "max", "min")
"""The ``Partial`` reductions merged by placement."""
MAX_ORDER_RANKS = 16
"""Above this many ranks, a concatenation's pieces are not tested against every other rank's part."""


@dataclass
class SlotMerge:
    """How one tensor slot of one call was reassembled, and the evidence for it."""

    call: str
    slot: str
    rule: str
    """See :mod:`.merge`: ``shard``, ``replicate``, ``partial``, ``replicated``, ``concat``, ``rows``, ``disagree``,
    ``unresolved``, ``missing``."""
    shapes: list[list[int]]
    """Each rank's shape, in rank order."""
    refs: list[str | None]
    """Each rank's tensor reference in its own trace (:meth:`MergedTrace.rank_value` reads it)."""
    ranks: list[int] | None = None
    """The ranks that hold the slot when not every rank does (a pipeline stage's); ``errors``, ``agrees`` and
    ``holds`` are then in the order of these ranks. ``None``: every rank."""
    reference_shape: list[int] | None = None
    dim: int | None = None
    """The concatenation dimension (``shard``, ``concat``)."""
    errors: list[float] | None = None
    """Each rank's relative L2 error against the reference's matching part (its slice for a concatenation, the
    whole for the others); ``None`` when the reference has no value here."""
    agrees: list[bool] | None = None
    """Each rank's piece within the comparison's tolerance of the reference's matching part."""
    sum_error: float | None = None
    """``disagree``: the ranks' sum against the reference (a missing all-reduce makes it agree)."""
    sum_agrees: bool | None = None
    parts: list[int] | None = None
    """For a concatenation of replicated shards (a 2-D mesh): the part of the reference each rank's piece is;
    ``None``: rank ``r``'s is part ``r``."""
    holds: list[int | None] | None = None
    """For a concatenation whose pieces fail: the reference part each rank's piece does equal (its own index when
    in place; another when the shards are out of order; ``None`` when none)."""
    chosen: int | None = None
    """``disagree``: the rank whose value the merged trace holds."""
    note: str = ""

    @property
    def holders(self) -> list[int]:
        """The ranks whose pieces ``errors``, ``agrees`` and ``holds`` describe, in their order."""
        return list(self.ranks) if self.ranks is not None else list(range(len(self.shapes)))

    def to_json(self) -> dict[str, Any]:
        return {key: value for key, value in vars(self).items() if value is not None and value != ""}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SlotMerge:
        return cls(**{key: data[key] for key in cls.__dataclass_fields__ if key in data})


class SlotRules:
    """Applies the merge rules to one slot's pieces (described in :mod:`.merge`), filling in ``record``."""

    def __init__(
        self,
        record: SlotMerge,
        values: list[torch.Tensor],
        expected: torch.Tensor | None,
        tolerance: Tolerance,
        placement: list[SlotPlacement] | None,
        declared_partial: bool,
    ) -> None:
        self.record = record
        self.values = values
        self.expected = expected
        self.tolerance = tolerance
        self.placement = placement
        self.declared_partial = declared_partial

    def apply(self) -> torch.Tensor | None:
        """The merged value (``None``: none can be made); the record says which rule and why."""
        if self.record.ranks is not None and len(self.values) == 1:
            self.record.rule = "stage"
            self.record.note = f"rank {self.record.ranks[0]} alone holds this value"
            self._judge_whole()
            return self.values[0]
        if self.placement is not None:
            placed = self._by_placement(self.placement)
            if placed is not None:
                return placed
            unmerged, self.record.note = self.record.note, ""
            value = self._by_values()
            self.record.note = "; ".join(filter(None, [unmerged + ", so merged by values", self.record.note]))
            return value
        return self._by_values()

    def by_rows(self, positions: list[list[int]], note: str) -> torch.Tensor:
        """Every rank's features put at the merged positions the weights' row map gives them (``positions``, per
        rank: one per feature of its last dimension), each rank's piece judged against the reference's features
        there (``expected`` is the reference's whole value in that order)."""
        record, values, expected = self.record, self.values, self.expected
        record.rule, record.dim, record.note = "rows", values[0].dim() - 1, note
        width = sum(len(where) for where in positions)
        merged = values[0].new_zeros((*values[0].shape[:-1], width))
        for value, where in zip(values, positions, strict=True):
            merged.index_copy_(-1, torch.tensor(where, device=merged.device), value.to(merged.dtype))
        if expected is not None and list(expected.shape) == list(merged.shape):
            record.reference_shape = list(expected.shape)
            judged = [
                self._judge(expected[..., torch.tensor(where, device=expected.device)], value)
                for value, where in zip(values, positions, strict=True)
            ]
            record.errors = [error for error, _ in judged]
            record.agrees = [agrees for _, agrees in judged]
        return merged

    def _by_values(self) -> torch.Tensor:
        values, record = self.values, self.record
        shapes = [list(value.shape) for value in values]
        same = all(shape == shapes[0] for shape in shapes)
        reference_shape = record.reference_shape
        if reference_shape is not None and not (same and shapes[0] == reference_shape):
            dim = concat_dim(shapes, reference_shape)
            if dim is not None:
                return self._concat(dim, "concat")
            replicas = self._replicated_shards(shapes, reference_shape)
            if replicas is not None:
                return replicas
        if same and all(same_values(values[0], value) for value in values[1:]):
            record.rule = "replicated"
            self._judge_whole()
            return values[0]
        if same and self.declared_partial:
            return self._reduce("sum", "partial", "declared a partial sum (partial_outputs): summed")
        if same and (reference_shape is None or shapes[0] == reference_shape):
            return self._disagree()
        record.rule = "unresolved"
        record.note = f"rank shapes {shapes} against the reference's {reference_shape}: no layout fits; rank 0's value"
        return values[0]

    def _by_placement(self, placement: list[SlotPlacement]) -> torch.Tensor | None:
        """The value its DTensor placement makes; ``None`` (with the reason in the note) when the placement is
        not one this merges (a 2-D mesh, ranks that disagree on it, a strided shard, an unknown reduction)."""
        record = self.record
        kinds = placement[0].get("placements") or []
        if any(item != placement[0] for item in placement[1:]):
            record.note = "the ranks recorded different placements"
            return None
        if len(kinds) != 1:
            record.note = f"placed on a {len(kinds)}-D mesh (only 1-D meshes are merged by placement)"
            return None
        size = math.prod(int(item) for item in placement[0].get("mesh") or [len(self.values)])
        if size != len(self.values):
            record.note = (
                f"placed on a mesh of {size} ranks and held by {len(self.values)} (a sub-mesh: replicas along "
                "another mesh dimension)"
            )
            return None
        kind = kinds[0]
        if kind.get("kind") == "shard":
            dim = int(kind["dim"]) % max(1, self.values[0].dim())
            merged = self._concat(dim, "shard")
            if list(merged.shape) != list(placement[0].get("shape", merged.shape)):
                record.note = f"the pieces make {list(merged.shape)}, the DTensor said {placement[0]['shape']}"
            return merged
        if kind.get("kind") == "replicate":
            if all(same_values(self.values[0], value) for value in self.values[1:]):
                record.rule = "replicate"
                self._judge_whole()
                return self.values[0]
            value = self._disagree()
            record.note = "placed Replicate, but the ranks hold different values; " + record.note
            return value
        if kind.get("kind") == "partial" and str(kind.get("op", "sum")) in REDUCTIONS:
            return self._reduce(str(kind.get("op", "sum")), "partial", "")
        record.note = f"placement {kind.get('repr') or kind.get('op') or kind} is not merged by placement"
        return None

    def _concat(self, dim: int, rule: str) -> torch.Tensor:
        record, values = self.record, self.values
        record.rule, record.dim = rule, dim
        merged = torch.cat(values, dim=dim)
        self._judge_parts(dim, [value.shape[dim] for value in values], list(range(len(values))), merged.shape)
        return merged

    def _judge_parts(self, dim: int, sizes: list[int], layout: list[int], shape: Sequence[int]) -> bool:
        """Judge each rank's piece against the reference's part ``layout[rank]`` (the reference cut along ``dim``
        into pieces of ``sizes``): ``errors``, ``agrees`` and, when some fail, ``holds``. ``False`` (nothing
        judged) when the reference has no value of the whole's ``shape``."""
        expected, record = self.expected, self.record
        if expected is None or list(expected.shape) != list(shape):
            return False
        starts = [sum(sizes[:part]) for part in range(len(sizes))]
        parts = [expected.narrow(dim, start, size) for start, size in zip(starts, sizes, strict=True)]
        pieces = list(zip(layout, self.values, strict=True))
        judged = [self._judge(parts[part], value) for part, value in pieces]
        record.errors = [error for error, _ in judged]
        record.agrees = [agrees for _, agrees in judged]
        if not all(record.agrees) and len(self.values) <= MAX_ORDER_RANKS:
            record.holds = [self._which_part(value, parts, part) for part, value in pieces]
        return True

    def _replicated_shards(self, shapes: list[list[int]], reference_shape: list[int]) -> torch.Tensor | None:
        """The value of ranks that are replicas of one sharding (:mod:`.merge`, ``concat``), else ``None``."""
        values, count = self.values, len(self.values)
        best: tuple[int, int, list[int]] | None = None
        for pieces in range(2, count):
            if count % pieces:
                continue
            for layout in (
                [rank % pieces for rank in range(count)],
                [rank // (count // pieces) for rank in range(count)],
            ):
                firsts = [layout.index(part) for part in range(pieces)]
                if any(shapes[rank] != shapes[firsts[part]] for rank, part in enumerate(layout)):
                    continue
                dim = concat_dim([shapes[first] for first in firsts], reference_shape)
                if dim is None:
                    continue
                equal = sum(same_values(values[rank], values[firsts[part]]) for rank, part in enumerate(layout))
                if best is None or equal > best[0]:
                    best = (equal, dim, layout)
        if best is None:
            return None
        _, dim, layout = best
        record = self.record
        pieces = max(layout) + 1
        firsts = [layout.index(part) for part in range(pieces)]
        record.rule, record.dim, record.parts = "concat", dim, layout
        record.note = (
            f"{count} ranks as {count // pieces} replicas of {pieces} shards (rank r holds shard "
            f"{'r % ' + str(pieces) if layout[1] == 1 else 'r // ' + str(count // pieces)}): "
        )
        chosen = list(firsts)
        if self._judge_parts(dim, [values[first].shape[dim] for first in firsts], layout, reference_shape):
            errors = record.errors or []
            for part in range(pieces):  # each part from the replica furthest from the reference, as ``disagree``
                holders = [rank for rank, own in enumerate(layout) if own == part]
                chosen[part] = max(holders, key=lambda rank: (_sortable(errors[rank]), -rank))
            record.note += "each shard from the replica furthest from the reference"
        else:
            record.note += "the first replica's shards concatenated"
        return torch.cat([values[rank] for rank in chosen], dim=dim)

    def _which_part(self, value: torch.Tensor, parts: list[torch.Tensor], rank: int) -> int | None:
        """The index of the reference part ``value`` equals (its own first), or ``None``."""
        order = [rank, *(index for index in range(len(parts)) if index != rank)]
        for index in order:
            if parts[index].shape == value.shape and self._judge(parts[index], value)[1]:
                return index
        return None

    def _reduce(self, op: str, rule: str, note: str) -> torch.Tensor:
        """The ranks' values reduced by ``op`` (one of :data:`REDUCTIONS`)."""
        record, values = self.record, self.values
        record.rule, record.note = rule, note
        merged = values[0].clone() if op != "avg" else values[0].double()
        for value in values[1:]:
            if op == "sum":
                merged = merged + value
            elif op == "avg":
                merged = merged + value.double()
            elif op == "max":
                merged = torch.maximum(merged, value)
            else:
                merged = torch.minimum(merged, value)
        if op == "avg":
            merged = (merged / len(values)).to(values[0].dtype)
        if self.expected is not None and list(self.expected.shape) == list(merged.shape):
            record.sum_error, record.sum_agrees = self._judge(self.expected, merged)
        return merged

    def _disagree(self) -> torch.Tensor:
        """Ranks that should hold one value hold several: keep the one furthest from the reference."""
        record, values, expected = self.record, self.values, self.expected
        record.rule = "disagree"
        if expected is None or list(expected.shape) != list(values[0].shape):
            record.chosen = 0
            record.note = "ranks disagree and the reference has no value here to tell which is right: rank 0's value"
            return values[0]
        judged = [self._judge(expected, value) for value in values]
        record.errors = [error for error, _ in judged]
        record.agrees = [agrees for _, agrees in judged]
        total = values[0].clone()
        for value in values[1:]:
            total = total + value
        record.sum_error, record.sum_agrees = self._judge(expected, total)
        worst = max(range(len(values)), key=lambda rank: (_sortable(record.errors[rank]), -rank))  # type: ignore[index]
        record.chosen = worst
        record.note = f"ranks disagree: rank {worst}'s value (furthest from the reference) stands for them"
        return values[worst]

    def _judge_whole(self) -> None:
        """Every rank holds the same value: its one error, for every rank."""
        expected = self.expected
        if expected is None or list(expected.shape) != list(self.values[0].shape):
            return
        error, agrees = self._judge(expected, self.values[0])
        self.record.errors = [error] * len(self.values)
        self.record.agrees = [agrees] * len(self.values)

    def _judge(self, expected: torch.Tensor, value: torch.Tensor) -> tuple[float, bool]:
        if not (expected.is_floating_point() or value.is_floating_point()):
            same = bool(torch.equal(expected.to(value.dtype), value))
            return (0.0 if same else 1.0), same
        metrics = divergence(expected, value, self.tolerance)
        return float(metrics["rel_l2"]), within(metrics)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit the same tensor, NaN at the same places counting as equal (``torch.equal`` says a tensor
    holding NaN differs from itself)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    if not a.is_floating_point():
        return False
    holes = torch.isnan(a)
    return bool(torch.equal(holes, torch.isnan(b))) and torch.equal(a.masked_fill(holes, 0), b.masked_fill(holes, 0))


def concat_dim(shapes: Sequence[Sequence[int]], reference: Sequence[int]) -> int | None:
    """The one dimension along which ``shapes`` (one per rank) concatenate to ``reference``, else ``None``:
    every shape has the reference's rank, equals it in every other dimension, and the sizes along it add up.
    With one rank there is nothing to concatenate."""
    if len(shapes) < 2 or any(len(shape) != len(reference) for shape in shapes):
        return None
    differing = {d for shape in shapes for d in range(len(reference)) if shape[d] != reference[d]}
    if len(differing) != 1:
        return None
    (dim,) = differing
    return dim if sum(shape[dim] for shape in shapes) == reference[dim] else None


def _sortable(value: float) -> float:
    return math.inf if value != value else value  # NaN is the furthest of all
