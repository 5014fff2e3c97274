"""Where divergence starts: each diverging row marked origin, contains-origin or inherited, and the origins.

A row *diverges* when its relative L2 error exceeds ``DIVERGENCE_MARGIN x rtol`` (or ``noise_multiple x`` its noise
floor): :func:`mark_divergence`. A diverging call *starts* divergence when its primary input has not diverged, or
when its error exceeds ``JUMP`` times its input's (a second, independent bug downstream); modules with no
counterpart, and modules whose output agrees only with its features in another order, are starts where the value
they hand on explains what diverges after them. An origin is a start with no start among its descendants:
:func:`localise`.
"""

from __future__ import annotations

from collections.abc import Mapping

from paritylab.comparison.alignment import Alignment
from paritylab.comparison.judgement import (
    DIVERGENCE_MARGIN,
    JUMP,
    Report,
    Row,
    ancestors,
    output_at,
    primary_input,
    producer_row,
    relative_error,
)
from paritylab.tracing.tracefile import Trace
from paritylab.tracing.values import iter_tensors


def mark_divergence(row: Row, noise_multiple: float) -> None:
    if row.tolerance is None:
        row.diverged = row.verdict == "fail"
        return
    threshold = DIVERGENCE_MARGIN * max(row.tolerance.rtol, 1e-12)
    if row.floor is not None:
        threshold = max(threshold, noise_multiple * row.floor)
    nonfinite = any(row.metrics.get(key) for key in ("nan_mismatch", "inf_mismatch"))
    out = relative_error(row.metrics)
    row.diverged = row.status in ("shape-mismatch", "error") or nonfinite or (out is not None and out > threshold)
    into = relative_error(row.input_metrics)
    row.input_known = into is not None
    in_nonfinite = any(row.input_metrics.get(key) for key in ("nan_mismatch", "inf_mismatch"))
    row.input_diverged = in_nonfinite or (into is not None and into > threshold)
    if row.input_diverged and out is not None and into is not None and not in_nonfinite and out > JUMP * into:
        row.input_diverged = False  # the row adds far more than it received: a second origin


def infer_inputs(rows: list[Row], reference: Trace) -> None:
    """Rows whose inputs could not be compared take their input's state from the row that produced it."""
    by_index = {row.index: row for row in rows}
    for row in rows:
        if row.input_known or not row.diverged:
            continue
        producer = producer_row(by_index, reference, row)
        if producer is not None and producer.status in _JUDGED:
            row.input_known, row.input_diverged = True, producer.diverged


_JUDGED = ("compared", "stats-only", "shape-mismatch", "error")


def localise(rows: list[Row], reference: Trace, reordered: frozenset[int] | set[int] = frozenset()) -> list[Row]:
    """Mark each diverging row as origin / contains-origin / inherited; return the origins in order.

    A start is a diverging row whose input agrees, or whose input is unknown and whose weights the weight ledger
    found to differ from its counterpart's (:func:`_own_weights`). A diverging row whose input diverged, when that input
    was produced by a module with no counterpart whose own input agrees, makes that unmatched module the
    start: divergence begins inside the unmatched stretch. So does a module whose output agrees only with its
    features in another order (``reordered``: its weight's rows are the reference's, permuted), when a module it
    feeds is handed them in that order and diverges: a legitimate layout (rotary's interleaved pairs) is read in its
    own order by the code after it, a wrong one (two halves swapped) is not. Rows whose input state is unknown are
    starts only when nothing else explains the divergence. An origin is a start with no start among its descendants.
    """
    by_index = {row.index: row for row in rows}
    starts = [row for row in rows if row.diverged and not row.input_diverged and (row.input_known or _own_weights(row))]
    for row in rows:
        if not (row.diverged and row.input_known and row.input_diverged):
            continue
        producer = producer_row(by_index, reference, row)
        if producer is not None and producer.status == "unmatched":  # an elementwise step with no counterpart
            upstream = producer_row(by_index, reference, producer)
            if upstream is not None and upstream.index in reordered and not upstream.diverged:
                producer = upstream  # it hands on what a reordered module made, in the order it made it
        if producer is not None and producer.index in reordered and not producer.diverged:
            producer.diverged, producer.verdict = True, "fail"
            finding = f"{REORDERED}, and {row.path or '<root>'} is handed them in that order: {REORDERED_WHY}"
            producer.note = f"{producer.note}; {finding}" if producer.note else finding
            if producer not in starts:
                starts.append(producer)
            continue
        if producer is None or producer.status != "unmatched":
            continue
        upstream = producer_row(by_index, reference, producer)
        if upstream is None:  # made by code: it agrees only where nothing that ran before it diverged
            around = set(ancestors(producer, by_index))
            agrees = not any(
                other.diverged and other.status in _JUDGED and other.index not in around
                for other in rows
                if other.index < producer.index
            )
        else:
            agrees = upstream.status in _JUDGED and not upstream.diverged
        if agrees and producer not in starts:
            producer.diverged = True
            finding = "no counterpart; its consumers' inputs diverge while its own input agrees"
            producer.note = f"{producer.note}; {finding}" if producer.note else finding
            starts.append(producer)
    for row in rows:  # the first child given a diverging value by its parent's own code
        if not (row.diverged and row.input_known and row.input_diverged):
            continue
        around = set(ancestors(row, by_index))
        sibling = reordered_sibling(row, rows, reordered, reference)
        if sibling is not None and not any(s.index < sibling.index and s.index not in around for s in starts):
            # its output, read in its own order by the parent's code, reached ``row``: the parent was no start
            starts[:] = [s for s in starts if s.index not in around]
            sibling.diverged, sibling.verdict = True, "fail"
            parent = by_index[row.parent].path or "<root>"  # type: ignore[index]
            finding = f"{REORDERED}, and {parent}'s own code hands {row.path} a value that diverges: {REORDERED_WHY}"
            sibling.note = f"{sibling.note}; {finding}" if sibling.note else finding
            starts.append(sibling)
            break
        if any(s.index < row.index for s in starts):
            continue
        source = unmatched_feeding(row, by_index, reference, received_calls(reference))
        if source is not None:
            source.diverged = True
            finding = (
                f"no counterpart; only {by_index[row.parent].path or '<root>'}'s own code uses its output, and the "  # type: ignore[index]
                f"value it gives {row.path} diverges while everything paired before agrees (the error is in this "
                "module or in that code)"
            )
            source.note = f"{source.note}; {finding}" if source.note else finding
            starts.append(source)
        break
    if not starts:
        starts = [row for row in rows if row.diverged and not row.input_known]
    has_start_below = {index for row in starts for index in ancestors(row, by_index)}
    origins = [
        reordered_child(row, rows, reordered, reference) or row for row in starts if row.index not in has_start_below
    ]
    for row in rows:
        if not row.diverged:
            continue
        if row in origins:
            row.cause = "origin"
        elif row in starts or not row.input_diverged:
            row.cause = "contains-origin"
        else:
            row.cause = "inherited"
    return sorted(origins, key=lambda row: row.index)


def reordered_rows(alignment: Alignment, reference: Trace) -> set[int]:
    """Reference call indices whose pair compares the candidate's output with its features reordered (the two
    modules hold the same weight rows in another order)."""
    return {
        reference.call(pair.reference).index
        for pair in alignment.pairs
        if pair.candidate_part is not None and pair.candidate_part.whole
    }


def reordered_maker(row: Row, rows: list[Row], reference: Trace, reordered: set[int]) -> Row | None:
    """The module inside ``row`` whose output ``row`` returns as its own (data flow, through calls that return their
    input), when that module's output agrees only with its features reordered: ``row`` diverges because it hands
    them on in that order (the last projection of an MLP with its rows' halves swapped). Marks it the origin."""
    if not reordered or row.reference.slot is None:
        return None
    by_index = {other.index: other for other in rows}
    node = output_at(reference.calls[row.index], row.reference.slot)
    made = node.get("from") if node is not None else None
    seen: set[int] = set()
    while isinstance(made, int) and made != row.index and made in by_index and made not in seen:
        seen.add(made)
        maker = by_index[made]
        if made in reordered:
            if maker.diverged and REORDERED not in maker.note:
                return None  # its own values differ: it is judged on them
            maker.diverged, maker.verdict, maker.cause, row.cause = True, "fail", "origin", "contains-origin"
            finding = f"{REORDERED}, and {row.path or '<root>'} returns them in that order: {REORDERED_WHY}"
            if REORDERED not in maker.note:
                maker.note = f"{maker.note}; {finding}" if maker.note else finding
            return maker
        if maker.status != "identity":
            return None
        handed = primary_input(reference.calls[made])  # a call returning its input: what made that input
        made = handed.get("from") if handed is not None else None
    return None


REORDERED = "its output agrees only with its features in another order"
REORDERED_WHY = "its weight's rows are the reference's, reordered"


def reordered_child(row: Row, rows: list[Row], reordered: frozenset[int] | set[int], reference: Trace) -> Row | None:
    """The one module inside an origin whose output agrees only reordered, when every module inside it agrees: the
    origin's own code reads that output in its own order (an attention splitting a query whose rows' halves were
    swapped into heads, a layer adding an MLP's reordered output to its residual). Marks it the origin. A module
    inside with no counterpart that is handed the reordered output or a value that agrees (data flow in
    ``reference``: BLOOM's ``gelu_impl``, a function in a port) is no other suspect, as in :func:`reordered_sibling`."""
    if not reordered:
        return None
    inside = _inside_through_unpaired(row, rows)
    turned = [other for other in inside if other.index in reordered and (not other.diverged or REORDERED in other.note)]
    if len(turned) != 1:
        return None
    by_index = {other.index: other for other in rows}
    if any(
        _unsure(other) and not _carries(other, turned[0], by_index, reference)
        for other in inside
        if other is not turned[0]
    ):
        return None
    child = turned[0]
    child.diverged, child.verdict = True, "fail"
    if REORDERED not in child.note:
        finding = f"{REORDERED}, and {row.path or '<root>'}'s own code reads them in that order: {REORDERED_WHY}"
        child.note = f"{child.note}; {finding}" if child.note else finding
    return child


def _inside_through_unpaired(row: Row, rows: list[Row]) -> list[Row]:
    """The modules directly inside ``row``, and inside those of them that have no counterpart but hold paired
    modules (a reference MLP container whose candidate computes its projections in the layer's own code, as
    ``nn.TransformerEncoderLayer`` does): the container is not itself a module that differs, its children are
    what was checked."""
    children: dict[int, list[Row]] = {}
    for other in rows:
        if other.parent is not None:
            children.setdefault(other.parent, []).append(other)
    found: list[Row] = []
    pending = list(children.get(row.index, []))
    while pending:
        other = pending.pop(0)
        below = children.get(other.index, [])
        if other.status == "unmatched" and not other.diverged and below:
            pending.extend(below)
        else:
            found.append(other)
    return found


def reordered_sibling(row: Row, rows: list[Row], reordered: frozenset[int] | set[int], reference: Trace) -> Row | None:
    """The one module before ``row`` in the same parent whose output agrees only reordered (``reordered``), when every
    other module before it there agrees: what the parent's code made of that output is what ``row`` was given. None
    where two are reordered (q and k for rotary on interleaved pairs: a layout the code reads so) or another differs.
    A sibling with no counterpart (a function on the other side: T5's ``act`` module after ``wi_0``) handed the
    reordered output, or a value that agrees (data flow in ``reference``), is no other suspect: with one sibling's
    rows out of order and everything it is given agreeing, that order is what the parent's code mixes wrongly."""
    if row.parent is None or not reordered:
        return None
    before = [other for other in rows if row.parent == other.parent and other.index < row.index]
    turned = [other for other in before if other.index in reordered and (not other.diverged or REORDERED in other.note)]
    if len(turned) != 1:
        return None  # several reordered (a layout the code reads so), or none
    by_index = {other.index: other for other in rows}
    others = [
        other for other in before if other is not turned[0] and not _carries(other, turned[0], by_index, reference)
    ]
    if any(_unsure(other) for other in others):
        return None  # another sibling differs or is unchecked
    return turned[0]


def _carries(other: Row, turned: Row, by_index: Mapping[int, Row], reference: Trace) -> bool:
    """``other`` has no counterpart and is handed ``turned``'s output or a value that agrees (data flow): it only
    carries what was checked, so it is no suspect beside the reordered module."""
    producer = producer_row(dict(by_index), reference, other) if other.status == "unmatched" else None
    return producer is not None and (producer is turned or not _unsure(producer))


def _unsure(row: Row) -> bool:
    """A row that differs, or that nothing checked (no counterpart): it may be what made a value diverge."""
    return row.diverged or row.verdict == "fail" or row.status == "unmatched"


def _own_weights(row: Row) -> bool:
    """The row's pair is the weight ledger's: its module computes with weights that are not the reference's, which
    explains its divergence whatever its input (a rotary table built from a wrong base, fed positions its
    counterpart is not)."""
    return row.source == "weights"


def unmatched_feeding(row: Row, by_index: Mapping[int, Row], reference: Trace, received: set[int]) -> Row | None:
    """Where a value computed in ``row``'s parent's own code (produced by no call) came from, when a module with
    no counterpart ran in that parent just before ``row`` and no call received its output directly: only the
    parent's code used it (OPT's offset position table, added to the token embeddings). Every sibling paired
    before ``row`` must agree. The error is in that module or in the code that uses its output; the module is
    the smaller answer. ``received``: :func:`received_calls` of ``reference``."""
    if row.parent is None or producer_row(dict(by_index), reference, row) is not None:
        return None
    siblings = [other for other in by_index.values() if other.parent == row.parent and other.index < row.index]
    if any(other.diverged and other.status != "unmatched" for other in siblings):
        return None
    unmatched = [other for other in siblings if other.status == "unmatched" and other.index not in received]
    return max(unmatched, key=lambda other: other.index) if unmatched else None


def received_calls(reference: Trace) -> set[int]:
    """The calls whose outputs some call received as an input (data flow)."""
    return {
        node["from"]
        for call in reference.calls
        for _, node in iter_tensors(call.inputs, "inputs")
        if isinstance(node.get("from"), int)
    }


def name_origin(report: Report, row: Row, note: str, replaced: tuple[Row | None, ...] = ()) -> None:
    """Name ``row`` of ``report`` (a copy the caller owns) where divergence starts, for ``note``: the modules around
    it that were origins contain it now, and they and ``replaced`` leave the report's origins."""
    by_index = {other.index: other for other in report.rows}
    row.diverged, row.verdict, row.cause = True, "fail", "origin"
    row.note = f"{row.note}; {note}" if row.note else note
    above = set(ancestors(row, by_index))
    for index in above:
        if by_index[index].cause == "origin":
            by_index[index].cause = "contains-origin"
    gone = [other for other in replaced if other is not None]
    kept = [other for other in report.origins if other is not row and other.index not in above]
    report.origins = [row, *(other for other in kept if all(other is not old for old in gone))]
    report.first_divergence, report.culprit_reason = row, note
