"""Which reference output features each rank's column-parallel module computes: the merge's row maps.

A rank's Linear computes one output feature per weight row, and the weight ledger's row-block map
(:func:`paritylab.comparison.weights.row_blocks`) says which reference rows those are. Where the ranks' rows together
hold some reference tensors' rows each exactly once, in another order than the ranks' concatenation (a Megatron-style
fused ``[q_r; k_r; v_r]`` on every rank, a fused ``[gate_r; up_r]``), the merge puts every rank's output features at
their reference positions (:class:`RowMap`): the reference tensors laid end to end, in the order the first rank holds
them, each in its own row order (a reference holding one fused tensor at the same path gets its own layout). The
comparison then pairs each reference module with its part of the merged output (:meth:`RowMap.rules`), so the fused
call is compared, not only covered.

Each tensor's rows must lie on the ranks in rank order (rank 0 holds its first rows), as a ``Shard`` lays them out:
ranks holding one tensor's shards in another order have a defect, not a layout, and are merged by concatenation,
which names it (``shard-order``). A rank whose map is missing or does not fit the others' (a block loaded wrong
whose values are another block's) is read in the layout the other ranks share: its blocks, in order, stand for the
same reference tensors, at the rows no other rank holds. So a wrong block is still compared, at its reference
position, and fails there with its rank.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from paritylab.comparison.alignment import Part, Rule
from paritylab.comparison.weights import RowBlock, row_blocks
from paritylab.tracing.structure import ModulePrint, prints_from_meta
from paritylab.tracing.tracefile import Trace


@dataclass(frozen=True)
class RowMap:
    """How the ranks' output features of module ``module`` make the reference's, in the reference's order."""

    module: str
    segments: list[tuple[str, int]]
    """The merged output's features: each reference module's rows (``(module, rows)``), laid end to end."""
    blocks: list[list[tuple[int, int, str, int]]]
    """Per rank, its runs of rows ``(start, stop, reference module, first reference row)``."""
    placed_by_layout: list[int]
    """Ranks whose own weights did not place their rows, read in the layout the other ranks share."""

    def offsets(self) -> dict[str, int]:
        offsets, position = {}, 0
        for module, rows in self.segments:
            offsets[module] = position
            position += rows
        return offsets

    def positions(self) -> list[list[int]]:
        """Per rank: the merged feature index of each of its output features."""
        offsets = self.offsets()
        return [
            [offsets[module] + first + k for start, stop, module, first in blocks for k in range(stop - start)]
            for blocks in self.blocks
        ]

    def rules(self) -> list[Rule]:
        """Each reference module paired with its part of the merged output (none where the reference's module is
        this one: the paths pair it whole)."""
        found = []
        for module, start in self.offsets().items():
            if module != self.module:
                rows = dict(self.segments)[module]
                part = Part(start=start, stop=start + rows)
                found.append(Rule(module, self.module, candidate_part=part, source="weights"))
        return found

    def describe(self) -> str:
        """The map in words: ``rank 0 rows 0-15 = blocks.0.attn.q rows 0-15, ...``."""
        words = []
        for rank, blocks in enumerate(self.blocks):
            runs = ", ".join(
                f"{a}-{b - 1} = {module} rows {first}-{first + b - a - 1}" for a, b, module, first in blocks
            )
            words.append(f"rank {rank} rows {runs}")
        text = "; ".join(words)
        if self.placed_by_layout:
            ranks = ", ".join(map(str, self.placed_by_layout))
            text += f" (rank {ranks} placed by the layout the other ranks share: its weights do not place every row)"
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "segments": [list(item) for item in self.segments],
            "blocks": [[list(run) for run in blocks] for blocks in self.blocks],
            "placed_by_layout": list(self.placed_by_layout),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RowMap:
        return cls(
            str(data["module"]),
            [(str(module), int(rows)) for module, rows in data["segments"]],
            [[(int(a), int(b), str(m), int(f)) for a, b, m, f in blocks] for blocks in data["blocks"]],
            [int(rank) for rank in data.get("placed_by_layout", [])],
        )


def row_maps(reference: Trace, ranks: Sequence[Trace]) -> dict[str, RowMap]:
    """The row map of every module whose ranks hold reference rows in another order than their concatenation of one
    reference tensor at the module's own path (that the ``concat`` rule merges already); none without fingerprints."""
    ref_prints = prints_from_meta(reference.meta)
    rank_prints = [prints_from_meta(trace.meta) for trace in ranks]
    if not ref_prints or len(ranks) < 2 or not all(rank_prints):
        return {}
    rows_of = {
        item.path: param.shape[0] for item in ref_prints.values() for param in item.params if param.name == "weight"
    }
    found: dict[str, RowMap] = {}
    for path in rank_prints[0]:
        held = [prints.get(path) for prints in rank_prints]
        if any(item is None or not _weight_rows(item) for item in held):
            continue
        if len({item.digest for item in held if item is not None}) == 1:
            continue  # replicated: every rank holds the same weights
        mapped = _row_map(path, [_blocks(ref_prints, item) for item in held if item is not None], rows_of)
        if mapped is not None:
            found[path] = mapped
    return found


def _weight_rows(item: ModulePrint) -> int:
    param = next((param for param in item.params if param.name == "weight"), None)
    return param.shape[0] if param is not None and len(param.shape) == 2 and param.row_bytes else 0


def _blocks(reference: Mapping[str, ModulePrint], item: ModulePrint) -> tuple[int, list[RowBlock] | None]:
    return _weight_rows(item), row_blocks(reference, item)


def _row_map(path: str, ranks: list[tuple[int, list[RowBlock] | None]], rows_of: Mapping[str, int]) -> RowMap | None:
    """The map, when the ranks' blocks (or the layout most ranks share, for the others) hold each reference
    module's rows exactly once; else ``None``."""
    layouts = [tuple(_layout(blocks)) if blocks is not None else None for _, blocks in ranks]
    counts = Counter(layout for layout in layouts if layout is not None)
    if not counts:
        return None
    layout = max(counts, key=lambda found: (counts[found], len(found)))  # a wrong block merges runs: fewer
    good = [rank for rank, found in enumerate(layouts) if found == layout and _covers_once(ranks, [rank])]
    runs: list[list[tuple[int, int, str, int]] | None] = [
        [(b.start, b.stop, b.module, b.first) for b in blocks] if rank in good and blocks is not None else None
        for rank, (_, blocks) in enumerate(ranks)
    ]
    modules = list(dict.fromkeys(module for module, _ in layout))
    if any(module not in rows_of for module in modules):
        return None
    for rank, (count, _) in enumerate(ranks):  # the others, in the shared layout at the rows no good rank holds
        if runs[rank] is None:
            runs[rank] = _by_layout(layout, count, runs, rows_of)
    complete = [found for found in runs if found is not None]
    if len(complete) < len(ranks) or not _each_row_once(complete, modules, rows_of):
        return None
    if not all(
        _in_rank_order([[run for run in found if run[2] == module] for found in complete]) for module in modules
    ):
        return None  # a tensor's shards out of rank order: a defect the concatenation names (shard-order), not a layout
    segments = [(module, rows_of[module]) for module in modules]
    if segments == [(path, rows_of.get(path, -1))] and _in_rank_order(complete):
        return None  # a plain column-parallel shard: the concatenation is the reference's order
    placed = [rank for rank in range(len(ranks)) if rank not in good]
    return RowMap(path, segments, complete, placed)


def _layout(blocks: list[RowBlock]) -> list[tuple[str, int]]:
    """The reference module and size of each run, merging runs that continue one another."""
    found: list[tuple[str, int]] = []
    last: RowBlock | None = None
    for block in blocks:
        if found and last is not None and last.module == block.module and last.first + last.size == block.first:
            found[-1] = (block.module, found[-1][1] + block.size)
        else:
            found.append((block.module, block.size))
        last = block
    return found


def _covers_once(ranks: list[tuple[int, list[RowBlock] | None]], chosen: list[int]) -> bool:
    seen: set[tuple[str, int]] = set()
    for rank in chosen:
        for block in ranks[rank][1] or []:
            rows = {(block.module, block.first + k) for k in range(block.size)}
            if rows & seen:
                return False
            seen |= rows
    return True


def _by_layout(
    layout: tuple[tuple[str, int], ...],
    count: int,
    runs: list[list[tuple[int, int, str, int]] | None],
    rows_of: Mapping[str, int],
) -> list[tuple[int, int, str, int]] | None:
    """A rank's runs in ``layout``: each block the one run of the module's rows no placed rank holds."""
    if sum(size for _, size in layout) != count:
        return None
    held: dict[str, set[int]] = {}
    for found in runs:
        for a, b, module, first in found or []:
            held.setdefault(module, set()).update(range(first, first + b - a))
    result, position = [], 0
    for module, size in layout:
        free = [row for row in range(rows_of[module]) if row not in held.get(module, set())]
        starts = [row for row in free if set(range(row, row + size)) <= set(free) and (row - free[0]) % size == 0]
        if not starts:
            return None
        first = starts[0]
        held.setdefault(module, set()).update(range(first, first + size))
        result.append((position, position + size, module, first))
        position += size
    return result


def _each_row_once(runs: list[list[tuple[int, int, str, int]]], modules: list[str], rows_of: Mapping[str, int]) -> bool:
    counts: Counter[tuple[str, int]] = Counter()
    for found in runs:
        for a, b, module, first in found:
            counts.update((module, first + k) for k in range(b - a))
    wanted = {(module, row) for module in modules for row in range(rows_of[module])}
    return set(counts) == wanted and all(value == 1 for value in counts.values())


def _in_rank_order(runs: list[list[tuple[int, int, str, int]]]) -> bool:
    """The runs, rank after rank, hold consecutive reference rows from row 0 (as ``Shard`` lays them out)."""
    position = 0
    for found in runs:
        for a, b, _, first in found:
            if first != position:
                return False
            position += b - a
    return True
