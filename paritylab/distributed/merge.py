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
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from paritylab.comparison.metrics import Tolerance, Tolerances, divergence, within
from paritylab.distributed.placements import SlotPlacement, read_placements
from paritylab.tracing.files import write_json
from paritylab.tracing.stats import cpu_stats, stats_dict, supports_stats
from paritylab.tracing.storage import TensorStore
from paritylab.tracing.tracefile import CallRecord, Trace
from paritylab.tracing.values import Node, first_tensor_slot, iter_tensors

MERGE_FILE = "merge.json"
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
    """See the module docstring: ``shard``, ``replicate``, ``partial``, ``replicated``, ``concat``, ``disagree``,
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


@dataclass
class MergedTrace:
    """The merged candidate trace and how each of its slots was made."""

    trace: Trace
    slots: dict[tuple[str, str], SlotMerge]
    rank_directories: list[Path]
    notes: list[str] = field(default_factory=list)
    """Whole-run findings (calls missing on a rank, a rank's tracing hook error)."""
    _ranks: list[Trace] | None = field(default=None, repr=False)

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
        return cls(trace, slots, ranks, list(document.get("notes", [])))


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
    merger = _Merger(ranks, [read_placements(path) for path in rank_directories], reference, directory,
                     tolerances or Tolerances(), tuple(partial_outputs), order)  # fmt: skip
    try:
        calls = [merger.call(key) for key in order]
    finally:
        merger.store.close()
    merger.note_partial_calls()
    trace = Trace(calls=calls, meta=merger.meta(), captures=merger.captures(), directory=directory)
    trace.files = {ref: (name, ref) for ref, name in merger.store.files.items()}
    trace.save(directory)
    merged = MergedTrace(Trace.load(directory), merger.slots, list(rank_directories), merger.notes, ranks)
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
    ) -> None:
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
            new_leaf, slot_record = self._slot(record, slot, nodes, wanted.get(slot))
            leaf.clear()
            leaf.update(new_leaf)
            self.slots[(record.key, slot)] = slot_record
            if "ref" in new_leaf:
                self.refs[(record.key, slot)] = new_leaf["ref"]
        return merged

    # -- slots -------------------------------------------------------------------------------------------

    def _slot(
        self, call: CallRecord, slot: str, nodes: list[Node | None], wanted: Node | None
    ) -> tuple[Node, SlotMerge]:
        """The merged leaf of one slot (written to the store) and its record; a slot whose pieces and reference
        were merged before (the same tensors under another call, as a module's output is its parent's) reuses
        that merge."""
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
        memo_key = (tuple(refs), wanted_ref, wanted_shape, tolerance, json.dumps(placement), declared)
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
        value = _Rules(record, values, expected, tolerance, placement, declared).apply()  # type: ignore[arg-type]
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


class _Rules:
    """Applies the merge rules to one slot's pieces (see the module docstring), filling in ``record``."""

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
        """The value of ranks that are replicas of one sharding (module docstring, ``concat``), else ``None``."""
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


def _count_rules(slots: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for merge in slots:
        counts[merge.rule] = counts.get(merge.rule, 0) + 1
    return dict(sorted(counts.items()))
