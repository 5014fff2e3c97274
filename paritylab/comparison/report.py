"""Compare two traces: one row per aligned call, a verdict per row, and where divergence starts.

The rows and the report they make are :mod:`.judgement`'s (the bottom of this layer); this module measures each
pair into a row, has :mod:`.verify` check the pairs, and localises.

Verdict: ``torch.testing.assert_close`` semantics per dtype (see :mod:`paritylab.comparison.metrics`), optionally
relaxed to a multiple of the row's numerical noise floor.

Localisation is scale-free, so an error hidden under ``atol`` in small activations is still found where
it starts rather than where a later normalisation magnifies it (:mod:`.localise`: which rows diverge, which
start divergence, the origins).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import Any

import torch

from paritylab.comparison.alignment import (
    Alignment,
    Pair,
    Part,
    Rule,
    align,
    broadcastable,
    merged,
    primary_slot,
    shapes_fit,
    transposed,
)
from paritylab.comparison.feature_order import features_in_order
from paritylab.comparison.judgement import (
    NO_VALUES,
    NOISE_MULTIPLE,
    Report,
    Row,
    Side,
    innermost,
    output_at,
    primary_input,
    relative_error,
)
from paritylab.comparison.localise import (
    REORDERED,
    infer_inputs,
    localise,
    mark_divergence,
    reordered_maker,
    reordered_rows,
)
from paritylab.comparison.metrics import (
    Tolerance,
    Tolerances,
    divergence,
    min_floor,
    stats_divergence,
    stats_within,
    within,
)
from paritylab.comparison.outputs import NOT_COMPARED, check_outputs, named_slot
from paritylab.comparison.verify import verify_pairs
from paritylab.tracing.structure import module_ancestors
from paritylab.tracing.tracefile import CallRecord, Trace
from paritylab.tracing.values import Node, first_tensor_slot, floating, iter_tensors


def compare_traces(
    reference: Trace,
    candidate: Trace,
    *,
    rules: Iterable[Rule] = (),
    alignment: Alignment | None = None,
    tolerances: Tolerances | None = None,
    noise_floor: Mapping[str, float] | None = None,
    noise_multiple: float = NOISE_MULTIPLE,
    pinned: bool = False,
) -> Report:
    """Compare ``candidate`` against ``reference``.

    With ``pinned``, ``rules`` are a frozen alignment: nothing else is paired, and a pinned pair whose
    candidate call no longer exists fails its row (the candidate's structure changed: re-pin on purpose).

    ``noise_floor`` maps reference call keys to the relative L2 error that precision alone causes there
    (see :func:`noise_floor`); a row within ``noise_multiple`` times its floor passes.
    """
    alignment = alignment or align(reference, candidate, rules, pinned=pinned)
    tolerances = tolerances or Tolerances()
    memo: dict[tuple[Any, ...], tuple[str, str, dict[str, float], str]] = {}
    pairs = alignment.by_reference()
    ignored = set(alignment.ignored_reference)
    rows: list[Row] = []
    folded = set(alignment.folded_reference)
    lost = set(alignment.lost) if pinned else set()
    whole: list[tuple[Row, CallRecord, CallRecord]] = []  # rows whose calls are paired whole: other outputs count
    reordering = {finding.candidate_module for finding in alignment.weights.differing}
    partner = {
        reference.call(pair.reference).index: candidate.call(pair.candidate).index
        for pair in alignment.pairs
        if pair.reference_part is None and pair.candidate_part is None
    }
    for call in reference.calls:
        pair = pairs.get(call.key)
        if call.key in folded:
            rows.append(_unmatched_row(call, "returns its input: folded into the call that produced it", "identity"))
            continue
        if pair is None:
            if call.key in lost:
                row = _unmatched_row(call, "paired by the pinned alignment, but that candidate call no longer exists")
                row.verdict = "fail"
                rows.append(row)
                continue
            rows.append(_unmatched_row(call, "ignored by rule" if call.key in ignored else ""))
            continue
        other = candidate.call(pair.candidate)
        row = _compare_pair(
            reference, candidate, call, other, pair, tolerances, memo, partner, reordering, alignment.weights.turned
        )
        _apply_floor(row, (noise_floor or {}).get(call.key), noise_multiple)
        mark_divergence(row, noise_multiple)
        rows.append(row)
        nothing_else = row.status == "missing" and row.note.startswith("no output tensor")  # ints, bools only
        if (
            pair.reference_index is None
            and pair.candidate_index is None
            and (row.status in ("compared", "stats-only") or nothing_else)
        ):
            whole.append((row, call, other))
    _check_other_outputs(whole, rows, reference, candidate, tolerances, memo, partner, noise_floor, noise_multiple)

    def rejudge(call: CallRecord, other: CallRecord, pair: Pair) -> Row:
        row = _compare_pair(
            reference, candidate, call, other, pair, tolerances, memo, partner, reordering, alignment.weights.turned
        )
        _apply_floor(row, (noise_floor or {}).get(call.key), noise_multiple)
        mark_divergence(row, noise_multiple)
        return row

    charged = verify_pairs(rows, reference, candidate, alignment, partner, rejudge)
    infer_inputs(rows, reference)
    origins = localise(rows, reference, reordered_rows(alignment, reference))
    first, reason = None, ""
    if origins and any(row.verdict == "fail" for row in rows):
        first, reason = origins[0], "the earliest module whose output diverges while its input agrees"
        reordered = reordered_maker(first, rows, reference, reordered_rows(alignment, reference))
        if reordered is not None:  # the origin returns what a reordered module made, in that order
            origins = [reordered, *(row for row in origins if row is not first), first]
            first, reason = reordered, reordered.note
        maker = unmatched_maker(first, rows, reference, candidate, alignment) if reordered is None else None
        if maker is not None:  # the origin only hands on what a module with no counterpart made inside it
            maker.diverged, maker.cause, first.cause = True, "origin", "contains-origin"
            origins = [maker, *(row for row in origins if row is not first), first]
            first, reason = maker, f"it made {first.path or '<root>'}'s output, which diverges while its input agrees"
            reason += "; it has no counterpart in the candidate"
        elif first.index in charged:
            reason = charged[first.index]
        elif REORDERED in first.note:
            reason = first.note
        elif first.status == "unmatched":
            reason = "divergence starts inside this module, which has no counterpart in the candidate"
    elif any(row.verdict == "fail" for row in rows):
        first = innermost([row for row in rows if row.verdict == "fail"], rows)[0]
        reason = "the earliest innermost failing module (no row diverges beyond its tolerance margin)"
    report = Report(
        rows=rows,
        alignment=alignment,
        first_divergence=first,
        origins=origins,
        culprit_reason=reason,
        reference_meta=reference.meta,
        candidate_meta=candidate.meta,
        first_nonfinite={"reference": _first_nonfinite(reference), "candidate": _first_nonfinite(candidate)},
    )
    charge_quiet_weights(report)
    return report


QUIET_WEIGHT = 0.1
"""A differing weight this near the reference's (relative) is the reference's tensor with a defect: one element, a
scale, a block (an unrelated tensor lies about ``sqrt(2)`` away). A port may hold a tensor of its own that only
resembles the reference's (a class token with a position folded in): farther than this, agreeing outputs stand."""


def charge_quiet_weights(report: Report) -> None:
    """Every compared output agrees, yet the candidate computes with a weight that is the reference's with a defect
    (the weight ledger's finding, within :data:`QUIET_WEIGHT`): these inputs do not show it, the weight does. The
    innermost compared row whose candidate module holds that weight (the module itself, or the nearest one around
    it that runs) fails, and is where divergence starts."""
    if report.failing or report.errors or report.first_divergence is not None:
        return
    found: list[tuple[int, Row, str]] = []
    for finding in report.alignment.weights.differing:
        if not finding.certain and (finding.rel_l2 is None or finding.rel_l2 > QUIET_WEIGHT):
            continue
        holders = {finding.candidate_module, *module_ancestors(finding.candidate_module)}
        readers = [
            row
            for row in report.rows
            if row.status == "compared" and row.candidate is not None and _call_path(row.candidate.key) in holders
        ]
        if readers:
            reader = max(readers, key=lambda row: (len(_call_path(_key(row))), -row.index))
            found.append((reader.index, reader, finding.line()))
    if not found:
        return
    _, row, line = min(found, key=lambda entry: entry[0])
    reason = (
        "its output agrees within tolerance on these inputs, but it computes with a weight that is not the reference's"
    )
    row.verdict, row.diverged, row.cause = "fail", True, "origin"
    row.note = f"{row.note}; {reason}: {line}" if row.note else f"{reason}: {line}"
    report.origins = [row, *report.origins]
    report.first_divergence, report.culprit_reason = row, reason


def _call_path(key: str) -> str:
    return key.rsplit("#", 1)[0]


def _key(row: Row) -> str:
    return row.candidate.key if row.candidate is not None else ""


def unmatched_maker(row: Row, rows: list[Row], reference: Trace, candidate: Trace, alignment: Alignment) -> Row | None:
    """The reference call inside ``row`` that made the output ``row`` compares (data flow), when it has no
    counterpart and the candidate's output too was made by a call inside its side with none: the two makers
    stand for each other (a model's logits made by ``proj_out`` on one side, inside the decoder on the other).
    Where the candidate's module makes its output in its own code, the whole of ``row`` is its counterpart."""
    if row.status != "compared" or row.reference.slot is None or row.candidate is None or row.candidate.slot is None:
        return None
    node = output_at(reference.calls[row.index], row.reference.slot)
    made = node.get("from") if node is not None else None
    other_call = candidate.call(row.candidate.key)
    other_node = output_at(other_call, row.candidate.slot)
    theirs = other_node.get("from") if other_node is not None else None
    if not isinstance(made, int) or made == row.index or not isinstance(theirs, int) or theirs == other_call.index:
        return None
    if theirs >= len(candidate.calls) or candidate.calls[theirs].key not in set(alignment.unmatched_candidate):
        return None
    maker = next((other for other in rows if other.index == made), None)
    return maker if maker is not None and maker.status == "unmatched" else None


def _check_other_outputs(
    whole: list[tuple[Row, CallRecord, CallRecord]],
    rows: list[Row],
    reference: Trace,
    candidate: Trace,
    tolerances: Tolerances,
    memo: dict[tuple[Any, ...], tuple[str, str, dict[str, float], str]],
    partner: Mapping[int, int],
    noise_floor: Mapping[str, float] | None = None,
    noise_multiple: float = 4.0,
) -> None:
    """Judge every other output of each whole pair (:func:`~paritylab.comparison.outputs.check_outputs`); a
    failing one fails its row, one not compared makes the run inconclusive. In a low-precision run each is
    judged against its own noise floor (:func:`slot_floor`), as the row's first output is."""
    by_index = {row.index: row for row in rows}

    def covered_by(node: Node) -> str | None:
        origin = node.get("from")
        row = by_index.get(origin) if isinstance(origin, int) else None
        if row is None or row.status not in ("compared", "stats-only") or row.reference.slot is None:
            return None
        judged = output_at(reference.calls[row.index], row.reference.slot)
        same = judged is not None and (judged.get("ref") == node.get("ref") or "ref" not in node)
        return row.path if same else None

    for row, call, other in whole:
        if row.candidate is None:
            continue

        slots = {id(node): slot for slot, node in iter_tensors(call.outputs, "outputs")}

        def judge(
            ref_node: Node, cand_node: Node, path: str = call.path, key: str = call.key, slots: dict[int, str] = slots
        ) -> tuple[str, str, dict[str, float], str]:
            tolerance = tolerances.resolve(path, ref_node["dtype"], cand_node["dtype"])
            status, verdict, metrics, note = _judge_once(
                memo, reference, candidate, ref_node, cand_node, None, None, tolerance
            )
            slot = slots.get(id(ref_node))
            floor = (noise_floor or {}).get(slot_floor(key, slot)) if slot is not None else None
            nonfinite = metrics.get("nan_mismatch") or metrics.get("inf_mismatch")
            if (
                verdict == "fail"
                and floor is not None
                and not nonfinite
                and metrics["rel_l2"] <= noise_multiple * floor
            ):
                verdict, note = "pass", f"within {noise_multiple:g}x the noise floor"
            return status, verdict, metrics, note

        root = call.parent is None
        row.outputs = check_outputs(
            call, other, (row.reference.slot, row.candidate.slot), judge, partner, covered_by, root=root,
            by_position=root or row.reference.slot is None,  # a call that returns no tensor: its values by place
        )  # fmt: skip
        telling = [check for check in row.outputs if check.verdict in ("fail", NOT_COMPARED)]
        if any(check.verdict == "fail" for check in telling):
            row.verdict, row.diverged = "fail", True
        if telling:
            row.note = "; ".join(filter(None, [row.note, *(check.describe() for check in telling)]))


def _unmatched_row(call: CallRecord, note: str, status: str = "unmatched") -> Row:
    return Row(
        index=call.index,
        path=call.path,
        reference=Side(call.key),
        candidate=None,
        status=status,
        verdict="skip",
        depth=call.depth,
        parent=call.parent,
        note=note,
    )


def _compare_pair(
    reference: Trace,
    candidate: Trace,
    ref_call: CallRecord,
    cand_call: CallRecord,
    pair: Pair,
    tolerances: Tolerances,
    memo: dict[tuple[Any, ...], tuple[str, str, dict[str, float], str]],
    partner: Mapping[int, int],
    reordering: Collection[str] = (),
    turned_orders: Mapping[tuple[str, str], tuple[int, ...]] | None = None,
) -> Row:
    """One pair's row. ``reordering``: candidate modules holding a weight the ledger found to differ, whose input
    is compared in the order its features arrive in where they arrive in another (:func:`_input_in_order`);
    ``turned_orders``: the orders of weights held transposed in a port's own order
    (:attr:`~paritylab.comparison.weights.WeightLedger.turned`), taken only where the input arrives in exactly one."""
    turned_orders = turned_orders or {}
    ref_slot = primary_slot(ref_call, pair.reference_index)
    cand_slot = primary_slot(cand_call, pair.candidate_index)
    if pair.reference_index is None and pair.candidate_index is None:
        ref_slot, cand_slot = _dataflow_slots(ref_call, cand_call, ref_slot, cand_slot, partner)
    ref_node = output_at(ref_call, ref_slot)
    cand_node = output_at(cand_call, cand_slot)
    row = Row(
        index=ref_call.index,
        path=ref_call.path,
        reference=_side(ref_call.key, ref_slot, ref_node, pair.reference_part),
        candidate=_side(cand_call.key, cand_slot, cand_node, pair.candidate_part),
        status="compared",
        verdict="skip",
        source=pair.source,
        depth=ref_call.depth,
        parent=ref_call.parent,
    )
    if ref_call.error or cand_call.error:
        row.status, row.verdict = "error", "fail"
        row.note = f"raised: {ref_call.error or cand_call.error}"
        return row
    dtypes = [n["dtype"] for n in (ref_node, cand_node) if n is not None]
    row.tolerance = tolerances.resolve(ref_call.path, *dtypes) if dtypes else None
    row.status, row.verdict, row.metrics, row.note = _judge_once(
        memo, reference, candidate, ref_node, cand_node, pair.reference_part, pair.candidate_part, row.tolerance
    )
    ref_input_call = reference.call(pair.reference_input) if pair.reference_input else ref_call
    cand_input_call = candidate.call(pair.candidate_input) if pair.candidate_input else cand_call
    if ref_input_call is not ref_call:  # paired with the last of a run of modules: the run's first's input
        row.input_index = ref_input_call.index
    ref_in, cand_in = primary_input(ref_input_call), primary_input(cand_input_call)
    if ref_in is not None and cand_in is not None and floating(ref_in) != floating(cand_in):
        ref_in = cand_in = None  # token ids against a float mask: another input, not another value of one
    if ref_in is not None and cand_in is not None and row.tolerance is not None:
        _, row.input_verdict, row.input_metrics, _ = _judge_once(
            memo, reference, candidate, ref_in, cand_in, None, pair.candidate_input_part, row.tolerance
        )
        if row.input_verdict == "fail" and pair.candidate_input_part is None and cand_call.path in reordering:
            _input_in_order(row, reference, candidate, ref_in, cand_in)
        turned = turned_orders.get((ref_call.path, cand_call.path))
        if row.input_verdict == "fail" and pair.candidate_input_part is None and turned is not None:
            _input_in_order(row, reference, candidate, ref_in, cand_in, turned)
        for other_ref, other_cand in _inputs_by_dataflow(ref_input_call, cand_input_call, ref_in, partner):
            _, verdict, metrics, _ = _judge_once(
                memo, reference, candidate, other_ref, other_cand, None, None, row.tolerance
            )
            worse = (relative_error(metrics) or 0.0) > (relative_error(row.input_metrics) or 0.0)
            if verdict == "fail" and (row.input_verdict != "fail" or worse):
                row.input_verdict, row.input_metrics = verdict, metrics  # the input that agrees least speaks
    return row


def _input_in_order(
    row: Row, reference: Trace, candidate: Trace, ref_in: Node, cand_in: Node, expected: tuple[int, ...] | None = None
) -> None:
    """A module whose weight differs, whose input differs as compared: where the input's features are the
    reference's in another order (:func:`~paritylab.comparison.feature_order.features_in_order`) and agree so, its
    input agrees (the module is where divergence starts, not the code before it) and the note says so."""
    ref_value, cand_value = reference.tensor(ref_in), candidate.tensor(cand_in)
    if ref_value is None or cand_value is None or row.tolerance is None:
        return
    order = features_in_order(ref_value, cand_value)
    if order is None or (expected is not None and order != expected):
        return  # (``expected``: the order a weight held transposed gives; an input in another order is no layout)
    metrics = divergence(ref_value, cand_value[..., list(order)], row.tolerance)
    if within(metrics):
        row.input_verdict, row.input_metrics = "pass", metrics
        said = "its input agrees with its features in another order (the order its weight's columns are read in)"
        row.note = f"{row.note}; {said}" if row.note else said


def _inputs_by_dataflow(
    ref_call: CallRecord, cand_call: CallRecord, primary: Node, partner: Mapping[int, int]
) -> Iterator[tuple[Node, Node]]:
    """The call's other floating-point inputs whose counterparts are known by data flow: the k-th input the
    reference received from call P against the k-th the candidate received from P's partner (a cross-attention's
    encoder states beside its own hidden states; a rotary module's cos and sin, in order), so "its input agrees"
    means every such input agrees, whatever the order of arguments."""

    def by_producer(call: CallRecord) -> dict[int, list[Node]]:
        made: dict[int, list[Node]] = {}
        for _, node in iter_tensors(call.inputs, "inputs"):
            if isinstance(node.get("from"), int) and floating(node):
                made.setdefault(node["from"], []).append(node)
        return made

    theirs = by_producer(cand_call)
    for origin, nodes in by_producer(ref_call).items():
        others = theirs.get(partner.get(origin, -1), [])
        if len(others) != len(nodes):
            continue  # the two sides take a different number of its outputs: which is which is not known
        for node, other in zip(nodes, others, strict=True):
            if node is not primary and other.get("shape") == node.get("shape"):
                yield node, other


def _dataflow_slots(
    ref_call: CallRecord,
    cand_call: CallRecord,
    ref_slot: str | None,
    cand_slot: str | None,
    partner: Mapping[int, int],
) -> tuple[str | None, str | None]:
    """The output slots to compare, by data flow where the outputs are tensors returned as inner calls made
    them (a model returning its final norm's and its pooler's outputs): the candidate slot holding what the
    partner of the reference slot's producer made, wherever it sits in the candidate's output structure
    (``(pooled, hidden_states)`` against ``last_hidden_state, pooler_output``). The primary slots are kept
    when data flow says nothing and their shapes fit; otherwise the first reference output whose counterpart
    the candidate returns is compared."""
    produced = {item["from"]: slot for slot, item in iter_tensors(cand_call.outputs, "outputs") if "from" in item}
    if not produced:
        return _fitting_slots(ref_call, cand_call, ref_slot, cand_slot)
    if ref_slot == cand_slot and named_slot(ref_slot):  # the same name on both sides: what it names is compared
        ref_node, cand_node = output_at(ref_call, ref_slot), output_at(cand_call, cand_slot)
        if ref_node is not None and cand_node is not None and shapes_fit(ref_node["shape"], cand_node["shape"]):
            return ref_slot, cand_slot

    def counterpart(slot: str | None) -> str | None:
        node = output_at(ref_call, slot)
        origin = node.get("from") if node is not None else None
        target = partner.get(origin) if isinstance(origin, int) else None
        return produced.get(target) if target is not None else None

    found = counterpart(ref_slot)
    if found is not None:
        return ref_slot, found
    ref_node, cand_node = output_at(ref_call, ref_slot), output_at(cand_call, cand_slot)
    if ref_node is not None and cand_node is not None and shapes_fit(ref_node["shape"], cand_node["shape"]):
        return ref_slot, cand_slot
    for slot, _ in iter_tensors(ref_call.outputs, "outputs"):
        found = counterpart(slot)
        if found is not None:
            return slot, found
    return _fitting_slots(ref_call, cand_call, ref_slot, cand_slot)


def _fitting_slots(
    ref_call: CallRecord, cand_call: CallRecord, ref_slot: str | None, cand_slot: str | None
) -> tuple[str | None, str | None]:
    """The primary slots where their shapes fit or data flow cannot help; else the one reference output the
    candidate's primary output fits (the same shape, else one :func:`shapes_fit` allows): a port that returns only
    the pooled vector, made by its own code, of a model returning its hidden states first is compared with that
    vector, and the reference's other outputs are absent, not a failure."""
    ref_node, cand_node = output_at(ref_call, ref_slot), output_at(cand_call, cand_slot)
    if ref_node is None or cand_node is None or shapes_fit(ref_node["shape"], cand_node["shape"]):
        return ref_slot, cand_slot
    shape = cand_node["shape"]
    outputs = list(iter_tensors(ref_call.outputs, "outputs"))
    for fits in (lambda other: list(other) == list(shape), lambda other: shapes_fit(other, shape)):
        found = [slot for slot, node in outputs if fits(node["shape"])]
        if found:
            return (found[0], cand_slot) if len(found) == 1 else (ref_slot, cand_slot)
    return ref_slot, cand_slot


def _judge_once(
    memo: dict[tuple[Any, ...], tuple[str, str, dict[str, float], str]],
    reference: Trace,
    candidate: Trace,
    ref_node: Node | None,
    cand_node: Node | None,
    ref_part: Part | None,
    cand_part: Part | None,
    tolerance: Tolerance | None,
) -> tuple[str, str, dict[str, float], str]:
    """:func:`_judge`, computed once per pair of stored tensors (a layer's output is the next one's input)."""
    refs = (ref_node or {}).get("ref"), (cand_node or {}).get("ref")
    if None in refs:
        return _judge(reference, candidate, ref_node, cand_node, ref_part, cand_part, tolerance)
    key = (*refs, ref_part, cand_part, tolerance)
    if key not in memo:
        memo[key] = _judge(reference, candidate, ref_node, cand_node, ref_part, cand_part, tolerance)
    return memo[key]


def _judge(
    reference: Trace,
    candidate: Trace,
    ref_node: Node | None,
    cand_node: Node | None,
    ref_slice: Part | None,
    cand_slice: Part | None,
    tolerance: Tolerance | None,
) -> tuple[str, str, dict[str, float], str]:
    """(status, verdict, metrics, note) for one pair of tensor nodes."""
    if ref_node is None or cand_node is None or tolerance is None:
        missing = "reference" if ref_node is None else "candidate"
        return "missing", "skip", {}, f"no output tensor on the {missing} side"
    ref_shape = _sliced_shape(ref_node["shape"], ref_slice)
    cand_shape = _sliced_shape(cand_node["shape"], cand_slice)
    order = transposed(ref_shape, cand_shape)  # before broadcasting: [T, 1, E] is [1, T, E] in another order
    broadcast = ref_shape != cand_shape and order is None and broadcastable(ref_shape, cand_shape)
    flattened = merged(ref_shape, cand_shape)
    if ref_shape != cand_shape and not (broadcast or flattened or order):
        note = f"shapes differ: {ref_shape} vs {cand_shape}"
        if _numel(ref_shape) == _numel(cand_shape):
            note += " (same number of elements: a layout difference?)"
        return "shape-mismatch", "fail", {}, note
    ref_value, cand_value = reference.tensor(ref_node), candidate.tensor(cand_node)
    if ref_value is not None and cand_value is not None:
        ref_value, cand_value = _cut(ref_value, ref_slice), _cut(cand_value, cand_slice)
        if broadcast:  # one side kept a size-1 dimension the other repeated (position embeddings)
            ref_value, cand_value = torch.broadcast_tensors(ref_value, cand_value)
        if order is not None:  # a sequence-first candidate: its dimensions in the reference's order
            cand_value = cand_value.permute(order)
        metrics = divergence(ref_value, cand_value, tolerance)  # both flattened: merged leading dims compare as is
        note = f"broadcast {ref_shape} against {cand_shape}" if broadcast else ""
        note = f"compared {ref_shape} as {cand_shape} (leading dimensions merged)" if flattened else note
        note = f"compared {cand_shape} as {ref_shape} (dimensions in another order)" if order else note
        return "compared", "pass" if within(metrics) else "fail", metrics, note
    if ref_node.get("stats") and cand_node.get("stats") and ref_slice is None and cand_slice is None:
        metrics = stats_divergence(ref_node["stats"], cand_node["stats"])
        return "stats-only", "pass" if stats_within(metrics, tolerance) else "fail", metrics, "judged on stats"
    reason = ref_node.get("skipped") or cand_node.get("skipped") or "values were not saved"
    return "missing", "skip", {}, f"{NO_VALUES}: {reason}"


def _apply_floor(row: Row, floor: float | None, multiple: float) -> None:
    if floor is None or row.status != "compared":
        return
    floor = max(floor, min_floor(row.candidate.dtype if row.candidate is not None else None))
    row.floor = floor
    nonfinite = row.metrics["nan_mismatch"] or row.metrics["inf_mismatch"]
    if row.verdict == "fail" and not nonfinite and row.metrics["rel_l2"] <= multiple * floor:
        row.verdict = "pass"
        row.note = f"within {multiple:g}x the noise floor"


def _first_nonfinite(trace: Trace) -> str | None:
    """The first call (in completion order) whose output holds NaN or Inf."""
    hits = []
    for call in trace.calls:
        for _, node in iter_tensors(call.outputs, "outputs"):
            stats = node.get("stats") or {}
            if stats.get("nan") or stats.get("inf"):
                hits.append(call)
                break
    if not hits:
        return None
    ancestors = {call.parent for call in hits}
    innermost = [call for call in hits if call.index not in ancestors]
    return min(innermost, key=lambda call: call.index).key


def _side(key: str, slot: str | None, node: Node | None, cut: Part | None) -> Side:
    if node is None:
        return Side(key, slot)
    return Side(key, slot, node["dtype"], _sliced_shape(node["shape"], cut))


def primary_output(trace: Trace, call: CallRecord) -> torch.Tensor | None:
    """The saved value of ``call``'s primary (first tensor) output, or ``None`` when it was not saved."""
    node = output_at(call, first_tensor_slot(call.outputs, "outputs"))
    return trace.tensor(node) if node is not None else None


def slot_value(trace: Trace, key: str, slot: str | None, part: Part | None = None) -> torch.Tensor | None:
    """The saved value of call ``key``'s output ``slot`` (cut to ``part``), or ``None`` when the call, the
    slot or its value is not in ``trace``."""
    try:
        call = trace.call(key)
    except KeyError:
        return None
    node = output_at(call, slot)
    value = trace.tensor(node) if node is not None else None
    return _cut(value, part) if value is not None else None


def _sliced_shape(shape: list[int], cut: Part | None) -> list[int]:
    if cut is None or not shape:
        return list(shape)
    return [*shape[:-1], cut.size(shape[-1])]


def _cut(value: torch.Tensor, cut: Part | None) -> torch.Tensor:
    return value if cut is None else cut.select(value)


def _numel(shape: list[int]) -> int:
    return math.prod(shape)


def noise_floor(exact: Trace, low_precision: Trace) -> dict[str, float]:
    """Per reference call key: relative L2 error of the reference run at low precision against the same
    reference run in (near) exact arithmetic (e.g. float64). Both traces must come from the same model."""
    floors: dict[str, float] = {}
    low_by_key = {call.key: call for call in low_precision.calls}
    for call in exact.calls:
        other = low_by_key.get(call.key)
        slot = first_tensor_slot(call.outputs, "outputs")
        if other is None or slot is None:
            continue
        for where, node in iter_tensors(call.outputs, "outputs"):
            low = output_at(other, where)
            if low is None:
                continue
            a, b = exact.tensor(node), low_precision.tensor(low)
            if a is None or b is None or a.shape != b.shape or not a.is_floating_point():
                continue
            metrics = divergence(a, b, Tolerance(0.0, 0.0))
            if math.isfinite(metrics["rel_l2"]):
                floors[call.key if where == slot else slot_floor(call.key, where)] = metrics["rel_l2"]
    return floors


def slot_floor(key: str, slot: str) -> str:
    """The key :func:`noise_floor` gives an output other than a call's first (``outputs.last_hidden_state``)."""
    return f"{key} {slot}"
