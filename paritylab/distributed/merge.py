"""Reassemble the per-rank traces of a distributed candidate into one trace comparable to a one-device reference.

Every rank traced module calls (keys ``path#n``). Under tensor or data parallelism every rank makes the same calls,
each holding its own piece of every activation; under pipeline parallelism a rank makes only its stage's calls
(a module that exists on some ranks only). The merged trace holds the union of the ranks' calls, each call built
from the ranks that made it, in an order every rank's own order agrees with (:func:`call_order`). For each tensor
slot of each call, inputs and outputs alike, the pieces of the ranks that hold the slot are combined by the first
rule that applies (:class:`SlotMerge.rule`):

``stage``
    One rank alone holds the slot (it alone made the call, or the others' call returned no tensor there, as a
    pipeline's root returns nothing on the stages before the last): that rank's value. The other rules below
    apply to the ranks that hold the slot, when several do.

``shard`` / ``replicate`` / ``partial``
    The slot was a DTensor on the ranks (:mod:`.placements`): its placement says how the pieces make the
    whole (concatenation along the sharded dimension in rank order; one copy; the reduction, ``sum`` unless
    the placement says otherwise). A ``replicate`` slot whose ranks hold different values is a defect, merged
    as ``disagree`` is.
``replicated``
    Every rank holds the same value, bit for bit: that value.
``concat``
    Every rank's shape differs from the reference's along one and the same dimension, and the ranks' sizes
    there add up to the reference's: the pieces concatenated in rank order (what ``Shard(d)`` means). On a 2-D
    mesh (tensor parallel inside data or pipeline parallel replicas fed the same inputs) the ranks are several
    replicas of one sharding: ``n`` ranks, ``k`` pieces, rank ``r`` holding piece ``r % k`` (consecutive ranks
    shard: the mesh's last dimension) or ``r // (n / k)``; the layout whose shapes concatenate to the
    reference's and whose replicas agree most is taken, every rank's piece is judged against its part
    (:attr:`SlotMerge.parts`), and each part comes from the replica furthest from the reference (so a check
    passes only if every replica's piece does).
``rows``
    The module's weight rows on every rank are reference rows, together each row of some reference tensors once, in
    another order than one tensor concatenated (a fused ``[q_r; k_r; v_r]`` per rank): each rank's output features
    at their reference positions (:mod:`.row_maps`); the comparison pairs each reference module with its part.
``partial``
    Same shape as the reference on every rank, different values, and the module is declared to return a
    partial sum that its caller reduces (``partial_outputs``): the sum.
``disagree``
    Same shape as the reference on every rank and different values, with nothing that says they are pieces of
    a sum: ranks that should hold the same activation do not. The merged value is the rank that agrees least
    with the reference (a check passes only if every rank's value passes), and each rank's error is kept, as
    is the error of the ranks' sum (so a missing all-reduce, whose ranks hold partial sums adding up to the
    reference, is told apart from a rank that computed something else).
``unresolved`` / ``missing``
    Nothing proves a layout (rank 0's value is kept, and the comparison's shape check speaks), or some rank has
    no value (the slot is left without one, so the comparison says it could not compare it).

Plain-tensor partial sums are not summed unless declared: a module that returns a plain tensor hands it to
code that uses it as whole, so a partial sum there is a missing reduction, not a layout. Every rule's
evidence is recorded per slot, and each rank's piece is compared with the reference's matching part, so
:mod:`.localise` can name the rank.

Memory: one slot at a time: the ranks' pieces of that slot (memory-mapped from their safetensors shards),
the reference's value and the merged value; the merged trace is written as it goes.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from paritylab.comparison.alignment import Rule
from paritylab.comparison.metrics import Tolerances
from paritylab.distributed.placements import SlotPlacement, read_placements
from paritylab.distributed.row_maps import RowMap, row_maps
from paritylab.distributed.slot_rules import SlotMerge, SlotRules, same_values
from paritylab.distributed.slot_rules import concat_dim as concat_dim  # re-exported: merge's public helpers
from paritylab.tracing.files import write_json
from paritylab.tracing.stats import cpu_stats, stats_dict, supports_stats
from paritylab.tracing.storage import TensorStore
from paritylab.tracing.tracefile import CallRecord, Trace
from paritylab.tracing.values import Node, first_tensor_slot, iter_tensors

MERGE_FILE = "merge.json"


@dataclass
class MergedTrace:
    """The merged candidate trace and how each of its slots was made."""

    trace: Trace
    slots: dict[tuple[str, str], SlotMerge]
    rank_directories: list[Path]
    notes: list[str] = field(default_factory=list)
    """Whole-run findings (calls missing on a rank, a rank's tracing hook error)."""
    _ranks: list[Trace] | None = field(default=None, repr=False)
    row_maps: dict[str, RowMap] = field(default_factory=dict)
    """Module path -> how its ranks' output features make the reference's (:mod:`.row_maps`)."""

    def rules(self) -> list[Rule]:
        """The alignment rules the row maps prove: each reference module paired with its part of a merged output."""
        return [rule for row_map in self.row_maps.values() for rule in row_map.rules()]

    @property
    def world_size(self) -> int:
        return len(self.rank_directories)

    def slot(self, key: str, slot: str) -> SlotMerge | None:
        return self.slots.get((key, slot))

    def rank_trace(self, rank: int) -> Trace:
        """Rank ``rank``'s own trace (loaded once, tensors read lazily)."""
        if self._ranks is None:
            self._ranks = [Trace.load(directory) for directory in self.rank_directories]
        return self._ranks[rank]

    def rank_value(self, key: str, slot: str, rank: int) -> torch.Tensor | None:
        """What rank ``rank`` held in ``slot`` of call ``key`` (its local piece), read from its trace."""
        merged = self.slots.get((key, slot))
        ref = merged.refs[rank] if merged is not None and rank < len(merged.refs) else None
        return self.rank_trace(rank).tensor({"ref": ref}) if ref is not None else None

    def save(self) -> Path:
        """Write the slot records beside the merged trace (``merge.json``)."""
        directory = self.trace.directory
        assert directory is not None
        document = {
            "world_size": self.world_size,
            "ranks": [os.path.relpath(path, directory) for path in self.rank_directories],
            "notes": self.notes,
            "slots": [merge.to_json() for merge in self.slots.values()],
            "row_maps": [row_map.to_json() for row_map in self.row_maps.values()],
        }
        write_json(directory / MERGE_FILE, document)
        return directory / MERGE_FILE

    @classmethod
    def load(cls, directory: Path) -> MergedTrace:
        """A merged trace written earlier (its ``trace.json`` and ``merge.json``)."""
        trace = Trace.load(directory)
        document = json.loads((directory / MERGE_FILE).read_text(encoding="utf-8"))
        slots = {}
        for entry in document.get("slots", []):
            merge = SlotMerge.from_json(entry)
            slots[(merge.call, merge.slot)] = merge
        ranks = [(directory / path).resolve() for path in document["ranks"]]  # relative to the merged trace
        maps = [RowMap.from_json(entry) for entry in document.get("row_maps", [])]
        return cls(trace, slots, ranks, list(document.get("notes", [])), row_maps={item.module: item for item in maps})


def merge_ranks(
    rank_directories: Sequence[Path],
    directory: Path,
    reference: Trace | None = None,
    *,
    tolerances: Tolerances | None = None,
    partial_outputs: Sequence[str] = (),
) -> MergedTrace:
    """Merge the traces in ``rank_directories`` (rank order) into a paritylab trace in ``directory``.

    ``reference``: the one-device trace the merged one will be compared with; its shapes prove concatenations
    and its values let each rank's piece be judged (without it only placements and equal values are used).
    ``partial_outputs``: ``fnmatch`` patterns of module paths whose plain-tensor outputs are partial sums by
    design (their caller all-reduces them); they are summed instead of flagged.
    """
    ranks = [Trace.load(path) for path in rank_directories]
    _check_ranks(ranks, rank_directories)
    order = call_order([trace.keys for trace in ranks])
    maps = row_maps(reference, ranks) if reference is not None else {}
    merger = _Merger(ranks, [read_placements(path) for path in rank_directories], reference, directory,
                     tolerances or Tolerances(), tuple(partial_outputs), order, maps)  # fmt: skip
    try:
        calls = [merger.call(key) for key in order]
    finally:
        merger.store.close()
    merger.note_partial_calls()
    trace = Trace(calls=calls, meta=merger.meta(), captures=merger.captures(), directory=directory)
    trace.files = {ref: (name, ref) for ref, name in merger.store.files.items()}
    trace.save(directory)
    merged = MergedTrace(Trace.load(directory), merger.slots, list(rank_directories), merger.notes, ranks, maps)
    merged.save()
    return merged


def _check_ranks(ranks: Sequence[Trace], directories: Sequence[Path]) -> None:
    for position, (trace, path) in enumerate(zip(ranks, directories, strict=True)):
        rank = trace.meta.get("rank")
        if rank is not None and str(rank) != str(position):
            raise ValueError(
                f"{path} holds the trace of rank {rank}, expected rank {position}: pass them in rank order"
            )
        size = trace.meta.get("world_size")
        if size is not None and str(size) != str(len(ranks)):
            raise ValueError(f"{path} was traced with world size {size}, but {len(ranks)} rank traces were given")


class _Merger:
    """The state of one merge: the rank traces, the reference, the output store and what was decided."""

    def __init__(
        self,
        ranks: list[Trace],
        placements: list[dict[str, dict[str, SlotPlacement]]],
        reference: Trace | None,
        directory: Path,
        tolerances: Tolerances,
        partial_outputs: tuple[str, ...],
        order: Sequence[str],
        maps: dict[str, RowMap],
    ) -> None:
        self.row_maps = maps
        self.ranks = ranks
        self.placements = placements
        self.reference = reference
        self.tolerances = tolerances
        self.partial_outputs = partial_outputs
        self.by_key = [{call.key: call for call in trace.calls} for trace in ranks]
        self.position = {key: index for index, key in enumerate(order)}
        """Call key -> its index in the merged trace."""
        self.rank_keys = [{call.index: call.key for call in trace.calls} for trace in ranks]
        """Per rank: its call indices -> keys (a rank's ``parent`` and ``from`` are its own indices)."""
        self.partial_calls: dict[tuple[int, ...], list[str]] = {}
        """Calls some ranks made and others did not, by the ranks that made them."""
        self.reference_keys = {call.key: call for call in reference.calls} if reference is not None else {}
        self.store = TensorStore(directory, pending_bytes=0, metadata={"producer": "paritylab.distributed.merge"})
        self.slots: dict[tuple[str, str], SlotMerge] = {}
        self.refs: dict[tuple[str, str], str] = {}
        """(call key, slot) -> the merged tensor's reference."""
        self.notes: list[str] = []
        self._done: dict[tuple[Any, ...], tuple[Node, SlotMerge]] = {}
        self._count = 0
        self._primary: dict[str, torch.Tensor | None] = {}
        """The current call's merged primary input and output (only those, only while the call is merged)."""

    # -- calls -------------------------------------------------------------------------------------------

    def call(self, key: str) -> CallRecord:
        """The merged call ``key``, built from the ranks that made it."""
        made = [calls.get(key) for calls in self.by_key]
        holders = [rank for rank, call in enumerate(made) if call is not None]
        first = made[holders[0]]
        assert first is not None
        if len(holders) < len(made):
            self.partial_calls.setdefault(tuple(holders), []).append(key)
        record = CallRecord(
            index=self.position[key], path=first.path, call_index=first.call_index, cls=first.cls,
            parent=self._merged_index(holders[0], first.parent), depth=first.depth,
        )  # fmt: skip
        errors = [(rank, call.error) for rank, call in enumerate(made) if call is not None and call.error]
        if errors:
            record.error = "; ".join(f"rank {rank}: {error}" for rank, error in errors)
        reference = self.reference_keys.get(key)
        self._primary = {}
        for side in ("inputs", "outputs"):
            setattr(record, side, self._node(record, made, reference, side))
        flagged = all(call.identity for call in made if call is not None)
        record.identity = flagged and self._returns_its_input(record)
        self._primary = {}
        return record

    def _merged_index(self, rank: int, index: Any) -> int | None:
        """The merged trace's index of the call rank ``rank`` numbers ``index`` (``None`` when there is none)."""
        key = self.rank_keys[rank].get(index) if isinstance(index, int) else None
        return self.position.get(key) if key is not None else None

    def note_partial_calls(self) -> None:
        """One note per set of ranks that alone made some calls (a pipeline's stages), with examples."""
        for holders, keys in sorted(self.partial_calls.items()):
            shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
            only = rank_list(holders)
            calls = f"{len(keys)} call" + ("s" if len(keys) > 1 else "")
            self.notes.append(f"{calls} made on {only} only ({shown}): merged from the ranks that made them")

    def _returns_its_input(self, record: CallRecord) -> bool:
        """Whether the merged call's primary output is its primary input: the same merged tensor, or equal
        values. The ranks' own flag is not enough: a DTensor input and an ``AsyncCollectiveTensor`` output (a
        row-parallel linear's) are both wrapper tensors whose ``data_ptr()`` is 0, which the tracer's identity
        test reads as "the same memory"."""
        slot_in, slot_out = first_tensor_slot(record.inputs, "inputs"), first_tensor_slot(record.outputs, "outputs")
        if slot_in is None or slot_out is None:
            return False
        node_in = dict(iter_tensors(record.inputs, "inputs"))[slot_in]
        node_out = dict(iter_tensors(record.outputs, "outputs"))[slot_out]
        if node_in.get("ref") is not None and node_in.get("ref") == node_out.get("ref"):
            return True
        value_in, value_out = self._primary.get(slot_in), self._primary.get(slot_out)
        return value_in is not None and value_out is not None and same_values(value_in, value_out)

    def _node(
        self, record: CallRecord, made: list[CallRecord | None], reference: CallRecord | None, side: str
    ) -> Node | None:
        """The value tree of the rank holding the most tensors on this side (rank 0's when they hold as many),
        with every tensor leaf replaced by its merged node; ``None`` when no rank has this side."""
        trees = [getattr(call, side) if call is not None else None for call in made]
        pieces = [dict(iter_tensors(tree, side)) if tree is not None else {} for tree in trees]
        candidates = [rank for rank, tree in enumerate(trees) if tree is not None]
        if not candidates:
            return None
        base = max(candidates, key=lambda rank: (len(pieces[rank]), -rank))
        wanted = dict(iter_tensors(getattr(reference, side), side)) if reference is not None else {}
        merged = copy.deepcopy(trees[base])
        primary = first_tensor_slot(merged, side)
        if primary is not None:
            self._primary[primary] = None
        for slot, leaf in iter_tensors(merged, side):
            nodes = [found.get(slot) for found in pieces]
            row_map = self.row_maps.get(record.path) if side == "outputs" and slot == primary else None
            new_leaf, slot_record = self._slot(record, slot, nodes, wanted.get(slot), row_map)
            leaf.clear()
            leaf.update(new_leaf)
            self.slots[(record.key, slot)] = slot_record
            if "ref" in new_leaf:
                self.refs[(record.key, slot)] = new_leaf["ref"]
        return merged

    # -- slots -------------------------------------------------------------------------------------------

    def _slot(
        self, call: CallRecord, slot: str, nodes: list[Node | None], wanted: Node | None, row_map: RowMap | None
    ) -> tuple[Node, SlotMerge]:
        """The merged leaf of one slot (written to the store) and its record; a slot whose pieces and reference
        were merged before (the same tensors under another call, as a module's output is its parent's) reuses
        that merge. ``row_map``: the call's module computes features the weights place (:mod:`.row_maps`)."""
        present = [rank for rank, node in enumerate(nodes) if node is not None]
        holders = present if len(present) < len(nodes) else None
        refs = [node.get("ref") if node is not None else None for node in nodes]
        base: Node = nodes[present[0]] or {}
        own: Node = {key: base[key] for key in ("device",) if key in base}  # this call's data flow, not the memo's
        made = self._merged_index(present[0], base.get("from"))
        if made is not None:
            own["from"] = made
        wanted_dtype = str((wanted or base).get("dtype", "float32"))
        tolerance = self.tolerances.resolve(call.path, str(base.get("dtype", "float32")), wanted_dtype)
        placement = self._placement(call.key, slot, present)
        declared = self._declared_partial(call, slot)
        wanted_ref, wanted_shape = (wanted or {}).get("ref"), tuple((wanted or {}).get("shape") or ())
        memo_key = (tuple(refs), wanted_ref, wanted_shape, tolerance, json.dumps(placement), declared, row_map is None)
        done = self._done.get(memo_key) if all(refs[rank] is not None for rank in present) else None
        if done is not None:
            leaf = {key: value for key, value in done[0].items() if key not in ("from", "device")}
            return {**leaf, **own}, SlotMerge(**{**vars(done[1]), "call": call.key, "slot": slot})
        shapes = [list(node.get("shape", [])) if node is not None else [] for node in nodes]
        record = SlotMerge(call.key, slot, "missing", shapes, refs, holders, list(wanted_shape) if wanted else None)
        leaf = {"t": "tensor", "shape": shapes[present[0]], "dtype": base.get("dtype", "float32"), **own}
        values = [self.ranks[rank].tensor(nodes[rank]) for rank in present]  # type: ignore[arg-type]
        absent = [rank for rank, value in zip(present, values, strict=True) if value is None]
        if absent:
            reasons = sorted({str(nodes[rank].get("skipped")) for rank in absent if nodes[rank].get("skipped")})  # type: ignore[union-attr]
            record.note = f"no value on rank {', '.join(map(str, absent))}"
            record.note += f" ({'; '.join(reasons)})" if reasons else " (the slot is not in its trace)"
            leaf["skipped"] = record.note
            return leaf, record
        expected = self.reference.tensor(wanted) if self.reference is not None and wanted is not None else None
        pieces: list[torch.Tensor] = values  # type: ignore[assignment]
        positions = row_map.positions() if row_map is not None and holders is None else None
        value: torch.Tensor | None
        if row_map is not None and positions is not None and _fits(pieces, positions):
            whole = self._reference_rows(row_map, call)
            note = f"by the weights' row map: {row_map.describe()}"
            value = SlotRules(record, pieces, whole, tolerance, None, False).by_rows(positions, note)
        else:
            value = SlotRules(record, pieces, expected, tolerance, placement, declared).apply()
        if value is None:
            leaf["skipped"] = record.note or "not merged"
            return leaf, record
        if slot in self._primary:
            self._primary[slot] = value
        leaf["shape"] = list(value.shape)
        leaf["dtype"] = str(value.dtype).removeprefix("torch.")
        if supports_stats(value):
            leaf["stats"] = stats_dict(cpu_stats(value))
        stored, skipped = self.store.put(value, f"t{self._count}")
        self._count += 1
        if stored is not None:
            leaf["ref"] = stored
        else:
            leaf["skipped"] = skipped or "not written"
        self._done[memo_key] = (dict(leaf), record)
        return leaf, record

    def _reference_rows(self, row_map: RowMap, call: CallRecord) -> torch.Tensor | None:
        """The reference's value of a row-mapped output: each reference module's output of the same call, laid end
        to end along the features as the map lays their rows (``None`` where one is missing)."""
        if self.reference is None:
            return None
        parts = []
        for module, rows in row_map.segments:
            found = self.reference_keys.get(f"{module}#{call.call_index}")
            slot = first_tensor_slot(found.outputs, "outputs") if found is not None else None
            node = dict(iter_tensors(found.outputs, "outputs")).get(slot) if found is not None and slot else None
            value = self.reference.tensor(node) if node is not None else None
            if value is None or not value.dim() or value.shape[-1] != rows:
                return None
            parts.append(value)
        return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]

    def _placement(self, key: str, slot: str, holders: Sequence[int]) -> list[SlotPlacement] | None:
        """The slot's DTensor placement as every rank holding it recorded it (``None`` unless all did)."""
        found = [self.placements[rank].get(key, {}).get(slot) for rank in holders]
        if any(item is None for item in found):
            return None
        return found  # type: ignore[return-value]

    def _declared_partial(self, call: CallRecord, slot: str) -> bool:
        return slot.startswith("outputs") and any(fnmatch.fnmatchcase(call.path, p) for p in self.partial_outputs)

    # -- the merged trace's meta -------------------------------------------------------------------------

    def meta(self) -> dict[str, Any]:
        first = self.ranks[0].meta
        meta = {key: value for key, value in first.items() if key not in ("structure", "rank", "error", "hook_error")}
        meta["distributed"] = {
            "world_size": len(self.ranks),
            "merged_from": [str(trace.directory) for trace in self.ranks],
            "rules": _count_rules(self.slots.values()),
        }
        meta["status"] = "complete"
        for rank, trace in enumerate(self.ranks):
            error = trace.meta.get("error")
            if isinstance(error, dict) and "error" not in meta:
                meta["error"] = {**error, "message": f"rank {rank}: {error.get('message', '')}", "rank": rank}
                meta["status"] = "error"
            if trace.meta.get("hook_error"):
                self.notes.append(f"rank {rank}: tracing hook failed at {trace.meta['hook_error']}")
            for name in ("inputs_changed", "buffers_changed"):
                if trace.meta.get(name):
                    meta[name] = sorted({*meta.get(name, []), *trace.meta[name]})
        if self.notes:
            meta["distributed"]["notes"] = list(self.notes)
        return meta

    def captures(self) -> dict[str, list[dict[str, str]]]:
        """Rank 0's named captures, pointing at the merged values of the same slots."""
        merged: dict[str, list[dict[str, str]]] = {}
        for name, entries in self.ranks[0].captures.items():
            for entry in entries:
                out = {"call": str(entry.get("call", "")), "slot": str(entry.get("slot", ""))}
                ref = self.refs.get((out["call"], out["slot"]))
                if ref is not None:
                    merged.setdefault(name, []).append({**out, "ref": ref})
        return merged


def rank_list(ranks: Sequence[int]) -> str:
    """``rank 1`` or ``ranks 0, 2``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def call_order(orders: Sequence[Sequence[str]]) -> list[str]:
    """Every rank's call keys in one order that keeps each rank's own: rank 0's calls, then each further
    rank's calls not yet placed, each put just before the next call of that rank that is (at the end when none
    is). A pipeline's stages, whose calls follow one another rank after rank, come out in stage order."""
    merged: list[str] = list(orders[0]) if orders else []
    for order in orders[1:]:
        placed = set(merged)
        before: dict[str, list[str]] = {}
        pending: list[str] = []
        for key in order:
            if key in placed:
                if pending:
                    before.setdefault(key, []).extend(pending)
                    pending = []
            else:
                pending.append(key)
        if not before and not pending:
            continue
        merged = [new for key in merged for new in (*before.get(key, ()), key)] + pending
    return merged


def _fits(values: list[torch.Tensor], positions: list[list[int]]) -> bool:
    """Every rank's last dimension holds as many features as its rows in the row map."""
    return all(
        value.dim() > 0 and value.shape[-1] == len(where) for value, where in zip(values, positions, strict=True)
    )


def _count_rules(slots: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for merge in slots:
        counts[merge.rule] = counts.get(merge.rule, 0) + 1
    return dict(sorted(counts.items()))
