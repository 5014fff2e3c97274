"""Name the rank, and the kind of split defect, at the module where divergence starts.

The comparison (:func:`paritylab.comparison.report.compare_traces`) finds the first module whose merged output
diverges while its input agrees. The merge (:mod:`.merge`) kept, for that module's compared slot, how the ranks'
pieces were combined and how each piece compares with the reference's matching part. Read together:

``error``
    A rank raised: the launch's first failure that is not a consequence of a peer going away.
``partial-sum``
    Ranks that should hold one whole value hold different ones, none matches the reference, and their sum
    does: each rank returned its partial product and nothing summed them (a missing all-reduce).
``shard-order``
    A concatenation whose every piece equals one of the reference's parts, but not its own: the shards are
    in the wrong order (rank r holds part k).
``rank``
    Some ranks' pieces agree with the reference's matching parts and the others' do not (in bfloat16, a rank
    beyond its per-rank floor does not: :mod:`.rank_floors`): those ranks. Or the module ran on one rank alone (a
    pipeline stage's) and its value differs: that rank. Or every rank holds the same wrong value (an all-reduce's
    result) and what some ranks contributed before the reduction is wrong: a piece of the module's input, or of an
    input or output inside it, on which they alone disagree, or the difference being a linear function of their
    input pieces alone (a partial product scaled on one rank before the all-reduce): those ranks.
``handoff``
    The module's output diverges while its input agrees, and inside it, between two calls made on different
    ranks, a child that ran on one rank returned a value that agrees and the next child, on another rank, was
    handed one that does not: the value one pipeline stage sent the next (ranks: sender, then receiver).
``all-ranks``
    Every rank holds the same wrong value (or every piece is wrong), and nothing before the reduction singles out
    ranks: a defect in code every rank runs. When
    the difference is the same vector at every position, it is an offset such as a bias counted once per
    rank (a bias added before a row-parallel all-reduce).
``unattributed``
    The evidence does not single out ranks (values missing, a layout nothing proves, a placed partial sum).
``weight``
    A rank holds a weight that is not the reference's (a shard or a block of one loaded wrong), inside the module
    where divergence starts (:mod:`.rank_weights`): those ranks, whatever the merged outputs single out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from paritylab.comparison.report import Report, Row, slot_value
from paritylab.distributed.launch import LaunchResult
from paritylab.distributed.merge import MergedTrace, SlotMerge, rank_list
from paritylab.distributed.rank_floors import Floors, floor_line, rank_floors
from paritylab.tracing.tracefile import Trace, display_path
from paritylab.tracing.values import first_tensor_slot, iter_tensors

OFFSET_SHARE = 1e-3
"""A difference counts as one constant offset when what varies across positions is under this share of it."""


@dataclass(frozen=True)
class RankFinding:
    """Where a distributed candidate goes wrong: the module, the ranks at fault and the kind of defect."""

    module: str
    """The module path (``""``: the root)."""
    kind: str
    """``error``, ``partial-sum``, ``shard-order``, ``rank``, ``handoff``, ``all-ranks``, ``unattributed`` or
    ``weight`` (module docstring)."""
    ranks: list[int]
    """The ranks at fault; every rank for ``all-ranks`` and ``partial-sum``; empty when none can be named."""
    message: str
    call: str | None = None
    slot: str | None = None
    rule: str | None = None
    """The merge rule of the slot (:class:`~paritylab.distributed.merge.SlotMerge`)."""
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "kind": self.kind,
            "ranks": self.ranks,
            "message": self.message,
            "call": self.call,
            "slot": self.slot,
            "rule": self.rule,
            "evidence": self.evidence,
        }


def localise(
    report: Report,
    merged: MergedTrace,
    launch: LaunchResult | None,
    reference: Trace,
    floors: Floors | None = None,
) -> RankFinding | None:
    """The finding for ``report``'s first divergence (or for a rank's error), ``None`` when parity holds.
    ``floors``: the ranks beyond their per-rank floors per slot (:func:`.rank_floors.apply_rank_floors`), which
    differ there whatever the tolerance says."""
    if report.errors or (launch is not None and not launch.ok):
        return _error_finding(report, launch)
    row = report.first_divergence
    if row is None or row.candidate is None:
        return None
    merge = merged.slot(row.candidate.key, row.candidate.slot or "")
    if merge is None:
        return RankFinding(row.path, "unattributed", [], f"{_where(row)}: no merge record for the compared slot",
                           row.candidate.key, row.candidate.slot)  # fmt: skip
    finding = _handoff(row, report, merged, reference) or _from_merge(row, merge, merged, reference, floors or {})
    row.note = "; ".join(filter(None, [row.note, finding.message]))  # the report and its renderings show it
    return finding


def annotate_ranks(report: Report, merged: MergedTrace, floors: Floors | None = None) -> int:
    """Add to each compared row whose ranks' pieces disagree with one another in how they compare with the
    reference (some agree, some do not) a note with every rank's error, so the report shows per-rank detail
    where ranks differ. Returns how many rows were annotated."""
    count = 0
    for row in report.rows:
        if row.candidate is None or row.status != "compared":
            continue
        merge = merged.slot(row.candidate.key, row.candidate.slot or "")
        agrees = _agrees(merge, floors or {}) if merge is not None else None
        if merge is None or agrees is None or merge.errors is None or len(set(agrees)) < 2:
            continue
        if merge.rule == "rows" and not row.diverged:
            continue  # the ranks' errors are over the whole merged output; the part this row compares agrees
        pieces = zip(merge.holders, agrees, merge.errors, strict=True)
        line = "per rank: " + ", ".join(
            f"rank {rank} {'agrees' if ok else 'differs'} (rel_l2 {error:.2g})" for rank, ok, error in pieces
        )
        if line not in row.note:
            row.note = "; ".join(filter(None, [row.note, line]))
            count += 1
    return count


def _error_finding(report: Report, launch: LaunchResult | None) -> RankFinding:
    culprit = launch.culprit() if launch is not None else None
    if culprit is not None and launch is not None:
        module = culprit.module or ""
        return RankFinding(module, "error", [culprit.rank], launch.error_line(), evidence={"phase": culprit.phase})
    error = report.errors.get("candidate") or report.errors.get("reference") or {}
    rank = error.get("rank")
    ranks = [int(rank)] if isinstance(rank, int) else []
    message = f"{error.get('type', 'error')}: {error.get('message', '')}"
    return RankFinding(str(error.get("module") or ""), "error", ranks, message)


def _from_merge(row: Row, merge: SlotMerge, merged: MergedTrace, reference: Trace, floors: Floors) -> RankFinding:
    where = _where(row)
    base: dict[str, Any] = {"call": merge.call, "slot": merge.slot, "rule": merge.rule}
    evidence: dict[str, Any] = {"rank_errors": merge.errors, "rank_shapes": merge.shapes}
    agrees = _agrees(merge, floors)
    beyond = floors.get((merge.call, merge.slot), {})
    every = merge.holders
    if merge.rule == "stage" and agrees is not None and not any(agrees):
        message = (
            f"{where}: computed on {rank_list(every)} alone (its pipeline stage), and its value differs from the "
            f"reference's ({_errors(merge)})"
        )
        return RankFinding(row.path, "rank", every, message, evidence=evidence, **base)
    if merge.rule == "disagree" and agrees is not None and merge.sum_agrees and not all(agrees):
        evidence["sum_error"] = merge.sum_error
        message = (
            f"{where}: partial sum: missing all-reduce. Every rank's output has the reference's shape, the ranks' "
            f"values differ ({_errors(merge)}), and their sum matches the reference (rel_l2 {merge.sum_error:.2g}): "
            "each rank returned its partial product and nothing summed them"
        )
        return RankFinding(row.path, "partial-sum", every, message, evidence=evidence, **base)
    if merge.rule in ("concat", "shard") and merge.holds is not None and agrees is not None:
        holds = merge.holds
        own = merge.parts or list(range(len(holds)))
        moved = [every[at] for at, part in enumerate(holds) if part is not None and part != own[at]]
        if moved and all(part is not None for part in holds):
            placed = ", ".join(
                f"rank {every[at]} holds part {part}" for at, part in enumerate(holds) if part != own[at]
            )
            message = (
                f"{where}: shards out of order along dim {merge.dim}: {placed} of the reference's "
                f"{len(set(own))} (each piece is right, its place is not)"
            )
            evidence["holds"] = holds
            return RankFinding(row.path, "shard-order", moved, message, evidence=evidence, **base)
    if agrees is not None and any(agrees) and not all(agrees):
        wrong = [rank for rank, ok in zip(every, agrees, strict=True) if not ok]
        right = [rank for rank, ok in zip(every, agrees, strict=True) if ok]
        piece = "shard" if merge.rule in ("concat", "shard", "rows") else "value"
        message = (
            f"{where}: {rank_list(wrong)}'s {piece} differs from the reference's ({_errors(merge, wrong)}); "
            f"{rank_list(right)}'s agrees"
        )
        if beyond:
            dtype = row.candidate.dtype if row.candidate is not None else None
            message += f": within the dtype's tolerance, beyond the per-rank floor: {floor_line(merge, beyond, dtype)}"
            evidence["rank_floors"] = rank_floors(merge, dtype)
        return RankFinding(row.path, "rank", wrong, message, evidence=evidence, **base)
    if agrees is not None and not any(agrees):
        message = f"{where}: every rank's {'shard' if merge.rule in ('concat', 'shard', 'rows') else 'value'} is wrong"
        if merge.rule in ("replicated", "replicate"):
            message = f"{where}: every rank holds the same value, and it differs from the reference ({_errors(merge)})"
        offset = _constant_offset(row, merged, reference)
        if offset is not None:
            evidence["offset_norm"] = offset
            message += (
                "; the difference is the same vector at every position (an offset of norm "
                f"{offset:.3g}): a bias counted more than once, e.g. added on every rank before the all-reduce"
            )
        else:
            before = _before_reduction(row, merge, merged, reference, floors)
            if before is not None:
                wrong, line, more = before
                evidence.update(more)
                return RankFinding(row.path, "rank", wrong, f"{message}; {line}", evidence=evidence, **base)
            message += ": the defect is in code every rank runs"
        return RankFinding(row.path, "all-ranks", every, message, evidence=evidence, **base)
    reason = merge.note or f"merged by rule {merge.rule!r}"
    return RankFinding(row.path, "unattributed", [], f"{where}: no rank can be singled out ({reason})",
                       evidence=evidence, **base)  # fmt: skip


def _agrees(merge: SlotMerge, floors: Floors) -> list[bool] | None:
    """Each holder's piece agrees: within the tolerance, and not beyond its per-rank floor."""
    if merge.agrees is None:
        return None
    beyond = floors.get((merge.call, merge.slot), {})
    return [ok and rank not in beyond for rank, ok in zip(merge.holders, merge.agrees, strict=True)]


def _before_reduction(
    row: Row, merge: SlotMerge, merged: MergedTrace, reference: Trace, floors: Floors
) -> tuple[list[int], str, dict[str, Any]] | None:
    """The ranks whose contribution to a value every rank holds the same (an all-reduce's result) is wrong, a line
    saying why, and the evidence; ``None`` when nothing singles them out. Read in order: a piece of the module's
    input, or of an input or output inside it, on which some ranks agree with the reference and the others do not (what
    those ranks computed before the reduction); else the difference of the output is a linear function of some
    ranks' pieces of the module's input alone (a row-parallel projection whose partial product one rank scaled, or
    computed with a wrong weight, before the all-reduce: :func:`_explained_by`)."""
    assert row.candidate is not None
    for piece in _inner_slots(merged, row.candidate.key):
        agrees = _agrees(piece, floors)
        if agrees is None or all(agrees) or not any(agrees):
            continue
        wrong = [rank for rank, ok in zip(piece.holders, agrees, strict=True) if not ok]
        right = [rank for rank, ok in zip(piece.holders, agrees, strict=True) if ok]
        path = display_path(piece.call.rsplit("#", 1)[0])
        line = (
            f"before the reduction, {rank_list(wrong)}'s piece of {path}'s {piece.slot} differs from the reference's "
            f"({_errors(piece, wrong)}) while {rank_list(right)}'s agrees: what {rank_list(wrong)} contributed is "
            "wrong, not code every rank runs"
        )
        return wrong, line, {"before": {"call": piece.call, "slot": piece.slot, "rank_errors": piece.errors}}
    explained = _explained_by(row, merged, reference)
    if explained is None:
        return None
    wrong, shares = explained
    others = ", ".join(f"rank {rank} {share:.2g}" for rank, share in shares.items() if rank not in wrong)
    line = (
        f"before the all-reduce: the difference is a linear function of {rank_list(wrong)}'s piece of its input "
        f"alone (unexplained share {', '.join(f'{shares[rank]:.2g}' for rank in wrong)}; {others} for the other "
        f"pieces): {rank_list(wrong)}'s partial product is wrong (scaled, or a wrong weight), not code every rank runs"
    )
    return wrong, line, {"unexplained_share": shares}


EXPLAINED = 0.1
"""A rank's input piece explains an output's difference when the least-squares residual of the difference on it is
at most this share of the difference; every other rank's must leave at least :data:`UNEXPLAINED`."""
UNEXPLAINED = 0.25


def _explained_by(row: Row, merged: MergedTrace, reference: Trace) -> tuple[list[int], dict[int, float]] | None:
    """For a module whose output every rank holds the same (``replicated``) and whose input is concatenated from
    the ranks' pieces along its last dimension (a row-parallel projection's): the ranks whose input piece alone
    explains the output's difference from the reference (``difference ≈ piece @ B`` for some ``B``), with each
    rank's unexplained share; ``None`` when no single group of ranks does, or the positions are too few to tell
    (no more than a piece's features)."""
    assert row.candidate is not None
    key = row.candidate.key
    call = merged.trace.call(key)
    slot = first_tensor_slot(call.inputs, "inputs")
    given = merged.slot(key, slot) if slot is not None else None
    if given is None or slot is None or given.rule not in ("concat", "shard") or given.dim is None:
        return None
    expected = slot_value(reference, row.reference.key, row.reference.slot)
    actual = slot_value(merged.trace, key, row.candidate.slot)
    if expected is None or actual is None or expected.shape != actual.shape or expected.dim() < 2:
        return None
    difference = (actual.double() - expected.double()).reshape(-1, expected.shape[-1])
    pieces = [merged.rank_value(key, slot, rank) for rank in given.holders]
    if any(piece is None or piece.dim() != given.dim + 1 for piece in pieces):
        return None  # only a split of the last dimension: the features a projection multiplies
    shares: dict[int, float] = {}
    total = float(torch.linalg.vector_norm(difference))
    for rank, piece in zip(given.holders, pieces, strict=True):
        assert piece is not None
        features = piece.double().reshape(-1, piece.shape[-1])
        if total == 0.0 or features.shape[0] != difference.shape[0] or features.shape[0] <= features.shape[1]:
            return None
        fitted = features @ torch.linalg.lstsq(features, difference).solution
        shares[rank] = float(torch.linalg.vector_norm(difference - fitted)) / total
    wrong = [rank for rank, share in shares.items() if share <= EXPLAINED]
    if (
        not wrong
        or len(wrong) == len(shares)
        or any(shares[rank] < UNEXPLAINED for rank in shares if rank not in wrong)
    ):
        return None
    return wrong, shares


def _inner_slots(merged: MergedTrace, key: str) -> list[SlotMerge]:
    """The merge records of call ``key``'s inputs, then of the inputs and outputs of the calls made inside it, in
    trace order."""
    by_call: dict[str, list[SlotMerge]] = {}
    for merge in merged.slots.values():
        by_call.setdefault(merge.call, []).append(merge)
    inside = {merged.trace.call(key).index}
    found = [merge for merge in by_call.get(key, []) if merge.slot.startswith("inputs")]
    for call in sorted(merged.trace.calls, key=lambda call: call.index):
        if call.parent in inside and call.index not in inside:
            inside.add(call.index)
            found += sorted(by_call.get(call.key, []), key=lambda merge: not merge.slot.startswith("inputs"))
    return found


def _handoff(row: Row, report: Report, merged: MergedTrace, reference: Trace) -> RankFinding | None:
    """The hand-off finding (module docstring) for a first divergence inside which a call on some ranks was
    handed a value that diverges by a call on other ranks whose output agrees, else ``None``. The receiver is
    the first diverging call inside ``row`` whose input diverges; its sender, the call the reference's data
    flow says produced that input."""
    prefix = f"{row.path}." if row.path else ""
    by_key = {inner.reference.key: inner for inner in report.rows}
    producers = {call.index: call for call in reference.calls}
    for inner in report.rows:
        if inner.index <= row.index or inner.candidate is None or not inner.path.startswith(prefix):
            continue
        if not (inner.diverged and inner.input_known and inner.input_diverged):
            continue
        call = reference.call(inner.reference.key)
        slot = first_tensor_slot(call.inputs, "inputs")
        node = dict(iter_tensors(call.inputs, "inputs")).get(slot) if slot is not None else None
        made = producers.get(node.get("from")) if node is not None else None  # type: ignore[arg-type]
        given = by_key.get(made.key) if made is not None else None
        if given is None or given.candidate is None or given.diverged or given.verdict != "pass":
            return None
        senders = _holders(merged, given.candidate.key, given.candidate.slot or "")
        receivers = _holders(merged, inner.candidate.key, inner.candidate.slot or "")
        if senders is None or receivers is None or set(receivers) <= set(senders):
            return None
        error = inner.input_metrics.get("rel_l2")
        shown = f" (rel_l2 {error:.2g})" if error is not None else ""
        message = (
            f"{display_path(row.path)}: the hand-off from {rank_list(senders)} to {rank_list(receivers)}: "
            f"{display_path(given.path)}'s output on {rank_list(senders)} agrees with the reference, "
            f"{display_path(inner.path)}'s input on {rank_list(receivers)} does not{shown}: what was sent is not "
            "what the next stage received, or not the value it should have sent"
        )
        evidence = {"sender": given.path, "receiver": inner.path, "input_rel_l2": error}
        ranks = sorted({*senders, *receivers})
        return RankFinding(row.path, "handoff", ranks, message, inner.candidate.key, inner.candidate.slot,
                           "stage", evidence)  # fmt: skip
    return None


def _holders(merged: MergedTrace, key: str, slot: str) -> list[int] | None:
    merge = merged.slot(key, slot)
    return merge.holders if merge is not None else None


def _constant_offset(row: Row, merged: MergedTrace, reference: Trace) -> float | None:
    """The norm of the difference when it is one vector repeated at every position (last dim), else ``None``."""
    if row.candidate is None:
        return None
    expected = slot_value(reference, row.reference.key, row.reference.slot)
    actual = slot_value(merged.trace, row.candidate.key, row.candidate.slot)
    if expected is None or actual is None or expected.shape != actual.shape or expected.dim() < 2:
        return None
    difference = (actual.double() - expected.double()).reshape(-1, expected.shape[-1])
    if difference.shape[0] < 2:
        return None
    offset = difference.mean(dim=0)
    varying = float(torch.linalg.vector_norm(difference - offset))
    total = float(torch.linalg.vector_norm(difference))
    if total == 0.0 or varying > OFFSET_SHARE * total:
        return None
    return float(torch.linalg.vector_norm(offset))


def _where(row: Row) -> str:
    return f"{display_path(row.path)} ({row.candidate.slot if row.candidate else row.reference.slot})"


def _errors(merge: SlotMerge, ranks: list[int] | None = None) -> str:
    if merge.errors is None:
        return "no reference value"
    pairs = zip(merge.holders, merge.errors, strict=True)
    return ", ".join(f"rank {rank} rel_l2 {error:.2g}" for rank, error in pairs if ranks is None or rank in ranks)
