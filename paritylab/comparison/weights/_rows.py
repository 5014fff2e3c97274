"""Where each row of a candidate weight sits among the reference's rows: a row-block map.

A Linear's weight rows are its output features. A shard of a column-parallel projection holds some of the reference's
rows; a Megatron-style fused shard ``[q_r; k_r; v_r]`` holds a run of rows of each of three reference projections; a
fused ``[gate; up]`` holds two tensors' rows end to end. Read from the fingerprints' row hashes, every candidate row
the reference holds is placed exactly; a run no reference row matches (a block loaded wrong) is placed by its row
sums (the nearest free block of the reference, clearly nearer than any other) or, where its values are another
block's, by its neighbours (the block that continues the run before or after it, or the block of another tensor at
the same offset: a shard takes the same rows of each part). So the map is known for a defective weight too, and the
module's output features can be put in the reference's order with the defect still in them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from paritylab.comparison.weights._blocks import Fibers, _fibers_distance, _key, _readings, _runs
from paritylab.comparison.weights._records import NEAR, UNIQUE, Held, held
from paritylab.comparison.weights._views import View, views
from paritylab.tracing.structure import ModulePrint


@dataclass(frozen=True)
class RowBlock:
    """A run of candidate rows ``[start, stop)`` standing for the reference tensor ``reference``'s rows from
    ``first`` on."""

    start: int
    stop: int
    reference: str
    """The reference tensor (``blocks.0.attn.k.weight``)."""
    module: str
    """The reference module holding it."""
    first: int
    exact: bool
    """Every row holds the reference row's values; else the run was placed by its sums or its neighbours."""

    @property
    def size(self) -> int:
        return self.stop - self.start

    def to_json(self) -> dict[str, object]:
        return dict(vars(self))


def row_blocks(
    reference: Mapping[str, ModulePrint], candidate: ModulePrint, name: str = "weight"
) -> list[RowBlock] | None:
    """The row-block map of ``candidate``'s 2-D tensor ``name`` onto the reference's 2-D tensors, every row placed;
    ``None`` where it has no row hashes, or a run of its rows can be placed nowhere (or in several places alike).
    Copies of one reference row held more often than the reference holds them (a block loaded from the wrong place)
    are read each way; the reading that places every row with the most rows exact is kept, the earliest on a tie."""
    param = next((param for param in candidate.params if param.name == name), None)
    if param is None or len(param.shape) != 2 or not param.row_bytes:
        return None
    item = Held(candidate.path, param)
    fibers = Fibers.of(held(reference), [item])
    view = next(view for view in views(item) if view.rows)
    best: list[RowBlock] | None = None
    for reading in _readings(view, fibers.index):
        placed = _placed(view, [found[0] if found else None for found in reading], fibers.views)
        if placed is not None and (best is None or _exact(placed) > _exact(best)):
            best = placed
    return best


def _exact(blocks: list[RowBlock]) -> int:
    return sum(block.size for block in blocks if block.exact)


def _placed(view: View, rows: list[tuple[View, int] | None], every: list[View]) -> list[RowBlock] | None:
    """Every candidate row's reference row, the runs no reference row matches placed (module docstring)."""
    rows = list(rows)
    exact = [found is not None for found in rows]
    others = [other for other in every if other.rows and other.length == view.length and other.sums is not None]
    for start, stop in _runs([position for position, found in enumerate(rows) if found is None]):
        where = _place(view, rows, start, stop, others)
        if where is None:
            return None
        other, first = where
        rows[start:stop] = [(other, first + k) for k in range(stop - start)]
    blocks: list[RowBlock] = []
    for position, found in enumerate(rows):
        assert found is not None
        other, row = found
        last = blocks[-1] if blocks else None
        if (
            last is not None
            and last.reference == other.item.name
            and last.first + last.size == row
            and last.exact == exact[position]
        ):
            blocks[-1] = RowBlock(last.start, position + 1, last.reference, last.module, last.first, last.exact)
        else:
            blocks.append(RowBlock(position, position + 1, other.item.name, other.item.module, row, exact[position]))
    return blocks


def _place(
    view: View, rows: list[tuple[View, int] | None], start: int, stop: int, others: list[View]
) -> tuple[View, int] | None:
    """The reference block a run of unplaced rows stands for: the nearest free block by row sums (within
    :data:`NEAR`, clearly nearer than the next), else the one block its neighbours place."""
    size = stop - start
    used: dict[tuple[int, int], set[int]] = {}
    for found in rows:
        if found is not None:
            used.setdefault(_key(found[0]), set()).add(found[1])
    free = [
        (other, first)
        for other in others
        for first in range(0, len(other.hashes) - size + 1)
        if not used.get(_key(other), set()) & set(range(first, first + size))
    ]
    aligned = [(other, first) for other, first in free if first % size == 0 or first + size == len(other.hashes)]
    scored = sorted(
        ((_fibers_distance(view, start, stop, other, first), other, first) for other, first in aligned),
        key=lambda entry: entry[0],
    )
    if scored and scored[0][0] < NEAR and (len(scored) == 1 or scored[0][0] <= UNIQUE * scored[1][0]):
        return scored[0][1], scored[0][2]
    neighbours = _neighbours(rows, start, stop)
    placed = [(other, first) for other, first in free if (_key(other), first) in neighbours["continues"]]
    if not placed:
        placed = [(other, first) for other, first in aligned if first in neighbours["steps"]]
    return placed[0] if len(placed) == 1 else None


def _neighbours(rows: list[tuple[View, int] | None], start: int, stop: int) -> dict[str, set[Any]]:
    """What the rows around a run say of it: the blocks continuing the reference rows just before or after it in
    their own tensor (``continues``), and the offsets at which the neighbouring blocks of its size start (``steps``:
    a shard's ``[q_r; k_r; v_r]`` holds rows ``r * n`` on of each)."""
    size = stop - start
    continues: set[tuple[tuple[int, int], int]] = set()
    before = rows[start - 1] if start > 0 else None
    after = rows[stop] if stop < len(rows) else None
    if before is not None:
        continues.add((_key(before[0]), before[1] + 1))
    if after is not None:
        continues.add((_key(after[0]), after[1] - size))
    steps: set[int] = set()
    for position in (start - size, stop):
        found = rows[position] if 0 <= position < len(rows) else None
        if found is not None:
            steps.add(found[1])
    return {"continues": continues, "steps": steps}
