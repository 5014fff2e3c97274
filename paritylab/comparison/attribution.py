"""What an isolated replay says: each module's own error judged, and the one culprit named.

:mod:`.replay` runs the candidate again with every aligned module fed the reference's values, so each recorded
output carries only the error of the module that made it. :func:`attach_replay` reads that replay against the
free-run report: a module's own error against its local noise floor (and, in low precision, the lifted replay's
float32 evidence, the pair's bit-exactness, float32's rounding of its code); a module fed a value the replay could
not replace blames whoever made that value (a module the candidate changes the value after, one with no
counterpart, the parent's own code); and one culprit is named from both sides of the evidence
(:func:`_name_culprit`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from paritylab.comparison.alignment import (
    Alignment,
    Pair,
    Part,
    in_layout,
)
from paritylab.comparison.judgement import Report, Row, ancestors, innermost, producer_row, relative_error
from paritylab.comparison.lifted import LIFTED_CHANGE, LiftedReplay
from paritylab.comparison.localise import (
    REORDERED,
    REORDERED_WHY,
    received_calls,
    reordered_child,
    reordered_maker,
    reordered_rows,
    reordered_sibling,
    unmatched_feeding,
)
from paritylab.comparison.metrics import Tolerances, min_floor, narrower, systematic_z
from paritylab.comparison.report import charge_quiet_weights, compare_traces, slot_value, unmatched_maker
from paritylab.comparison.verify import CHANGED_AFTER
from paritylab.comparison.wiring import crossed, misordered_parts
from paritylab.tracing.tracefile import CallRecord, Trace
from paritylab.tracing.values import floating, iter_tensors


def attach_replay(
    report: Report,
    reference: Trace,
    replay: Trace,
    tolerances: Tolerances | None = None,
    local_floor: Mapping[str, Mapping[str, float]] | None = None,
    floor_replay: Trace | None = None,
    lifted: LiftedReplay | None = None,
    floor_loosens_only: bool = False,
    candidate: Trace | None = None,
) -> Report:
    """The free-run ``report`` judged again with the replay: a new report (``report`` is left as it is) whose
    rows' ``local`` hold the replay's error, the inherited (input) error and the amplification, with one
    culprit named from the free run and the replay together.

    ``local_floor`` (low-precision runs) maps reference call keys to the metrics of the reference module
    itself at the candidate's precision on the reference's exact input (:func:`paritylab.run.parity.estimate_floors`).
    A module's own error is then judged against that, not against the dtype's wide tolerance: see
    :func:`beyond_floor`. Such a module fails the run. ``floor_replay``: that low-precision reference's own
    isolated replay (its outputs); each module's replayed output is then also tested against it for a
    systematic part (:func:`~paritylab.comparison.metrics.systematic_z`), which finds gains and offsets far
    below the rounding of single values. ``lifted`` (a low-precision candidate): both sides replayed in
    float32 with the same weights (:mod:`paritylab.comparison.lifted`); a module whose own code differs there
    fails as well. ``floor_loosens_only`` (float32's floors against float64): a module's own error diverges when
    it is beyond both its tolerance and its floor, or, within its tolerance, when it is far beyond any rounding
    float32 gives that module's code (:func:`_beyond_float32_rounding`). ``candidate``: the candidate's free run,
    whose data flow (which call's output each call was handed) shows two agreeing modules exchanged (the replay's
    own does not: a replaced output is a value its tracer never saw made).
    """
    lifted_rows = lifted.judged(tolerances) if lifted is not None else {}
    replay_report = compare_traces(reference, replay, alignment=report.alignment, tolerances=tolerances)
    report = report.copy()
    local_rows = {row.index: row for row in replay_report.rows}
    parts = {pair.reference: (pair.reference_part, pair.candidate_part) for pair in report.alignment.pairs}
    fed_wrong: dict[int, tuple[Row, str]] = {}
    by_index = {row.index: row for row in report.rows}
    received = received_calls(reference)
    reordered = reordered_rows(report.alignment, reference)
    fed_from = {pair.candidate: pair.candidate_input or pair.candidate for pair in report.alignment.pairs}
    exact = exact_pair(replay_report.rows)
    misordered = misordered_parts(report.alignment.pairs, reference, by_index)
    counterparts = {
        pair.candidate: pair.reference
        for pair in report.alignment.pairs
        if not (pair.reference_part or pair.candidate_part or pair.reference_input or pair.candidate_input)
    }
    widest = widest_floors(reference, local_floor) if floor_loosens_only and local_floor else {}
    folds = folded_pairs(report.alignment)
    runs = {pair.reference for pair in folds}
    if local_floor:
        local_floor = run_floors(folds, reference, local_floor)
    for row in report.rows:
        local = local_rows.get(row.index)
        own = relative_error(local.metrics) if local is not None else None
        if local is None or own is None:
            continue
        inherited = relative_error(row.input_metrics)
        output = relative_error(row.metrics)
        floor = (local_floor or {}).get(row.reference.key)
        reason, systematic, coded, ordered = None, None, False, None
        if floor is not None:
            folded = row.reference.key in runs  # a batch norm's output: channels on axis 1
            systematic = _systematic(reference, replay, floor_replay, local, parts, folded) if floor_replay else None
            candidate_dtype = local.candidate.dtype if local.candidate is not None else None
            order = order_floor(reference.call(row.reference.key)) if floor_loosens_only else 0.0
            reason = beyond_floor(local.metrics, floor, row.reference.dtype, systematic, candidate_dtype, order)
            if reason is None and order and local.verdict == "fail" and beyond_floor(local.metrics, floor, "float32"):
                ordered = (
                    f"its own float32 error {own:.3g} is beyond the reference's ({floor.get('rel_l2', 0.0):.3g}) but "
                    f"within what summing its {round((order / FLOAT32_UNIT) ** 2)}-long inputs in another order may "
                    f"show ({order:.2g}), with no systematic part: the two sum in another order, not a bug"
                )
            kept_wide = floor.get("rel_l2", 0.0) < POLICY_SHARE * min_floor(candidate_dtype)
            if kept_wide and narrower(candidate_dtype, row.reference.dtype):
                policy = (
                    f"the reference keeps this module wider than {candidate_dtype} when cast (its own floor "
                    f"{floor.get('rel_l2', 0.0):.2g}), the candidate computes it in {candidate_dtype}: judged against "
                    f"{candidate_dtype}'s rounding (the two precision policies differ)"
                )
                row.note = f"{row.note}; {policy}" if row.note else policy
        diverged = local.diverged if floor is None else reason is not None
        if floor_loosens_only:
            diverged = local.diverged and (floor is None or reason is not None)
            code = _beyond_float32_rounding(own, widest.get(row.reference.key), row.reference.dtype)
            if not diverged:  # within its tolerance: a failure only where rounding cannot explain it
                diverged, reason, coded = code is not None, code, code is not None
        if (
            not diverged
            and exact is not None
            and own > EXACT_LIMIT.get(str(local.candidate and local.candidate.dtype), 1.0)
        ):
            diverged, reason = True, f"own error {own:.2g} where {exact} of this pair's modules replay bit for bit"
        comparable = bool(row.input_metrics)  # the free run found its inputs to be counterparts (data flow)
        inputs = (reference.calls[row.input_call], _input_call(replay, fed_from, row))
        if diverged and comparable and _fed_wrong(local, floor, row.reference.dtype, *inputs, floor_loosens_only):
            blamed = crossed(row, by_index, reference, candidate or replay, counterparts) or _unreplaced_source(
                row, by_index, reference, received, reordered, misordered
            )
            if blamed is not None:  # not its own error: it was given a value the replay could not replace
                fed_wrong.setdefault(blamed[0].index, blamed)
                diverged, reason = False, None
        lifted_row, lifted_found = lifted_rows.get(row.reference.key), False
        cleared = _cleared(own, floor, reason, local, lifted, lifted_row) if diverged and floor is not None else None
        if ordered is not None and not diverged:  # float32 in another summation order: cleared like rounding
            cleared = ordered
        if cleared is not None:  # its code agrees in float32: the excess is how the two round, not a bug
            diverged, reason = False, None
        if not diverged and lifted is not None:
            why = lifted.own_error(lifted_row)
            parent = by_index.get(row.parent) if row.parent is not None else None
            if why is not None:  # its code, not the precision: the same weights in float32 disagree
                diverged, reason, lifted_found = True, why, True
            elif parent is not None and lifted.gave_another_input(lifted_row, lifted_rows.get(parent.reference.key)):
                sibling = reordered_sibling(row, report.rows, reordered, reference)
                if sibling is not None:  # what the parent's code gave it came from a reordered child, in its order
                    note = f"{REORDERED}, and {parent.path or '<root>'}'s own code hands {row.path} a value that "
                    fed_wrong.setdefault(sibling.index, (sibling, note + f"diverges: {REORDERED_WHY}"))
                else:
                    maker = producer_row(by_index, reference, row)
                    upstream = producer_row(by_index, reference, maker) if maker is not None else None
                    if (
                        maker is not None
                        and maker.status == "unmatched"
                        and upstream is not None
                        and not any(
                            upstream.diverged or lifted.own_error(lifted_rows.get(upstream.reference.key)) is not None
                            for _ in (0,)
                        )
                    ):  # what it was given came straight from a module with no counterpart, fed what agrees
                        note = f"no counterpart, and what it gives {row.path} differs while its own input agrees, "
                        note += f"with the same {lifted.dtype} weights computed in float32 (lifted replay)"
                        fed_wrong.setdefault(maker.index, (maker, note))
                    elif (source := unmatched_feeding(row, by_index, reference, received)) is not None:
                        note = f"no counterpart; only {parent.path or '<root>'}'s own code uses its output, and the "
                        note += f"value it gives {row.path} differs with the same {lifted.dtype} weights computed in "
                        note += "float32 (lifted replay; the error is in this module or in that code)"
                        fed_wrong.setdefault(source.index, (source, note))  # as the free run and isolated replay say
                    else:
                        note = f"its own code between its children gives {row.path or '<root>'} a value the "
                        note += f"reference does not, with the same {lifted.dtype} weights computed in float32 "
                        note += "(lifted replay)"
                        fed_wrong.setdefault(parent.index, (parent, note))
        row.local = {"local_rel_l2": own, "local_diverged": float(diverged)}
        if coded:
            row.local[CODE_DIFFERENCE] = 1.0
        if lifted_found:
            row.local["lifted_diverged"] = 1.0
        lifted_error = relative_error(lifted_row.metrics) if lifted_row is not None else None
        if lifted_error is not None:
            row.local["lifted_rel_l2"] = lifted_error
        if floor is not None:
            row.local["local_floor"] = floor["rel_l2"]
        if systematic is not None:  # z-scores of its gain and offset against the reference's own rounding
            row.local.update({"gain_z": systematic["gain_z"], "offset_z": systematic["offset_z"]})
        if inherited is not None:
            row.local["inherited_rel_l2"] = inherited
        if output is not None and inherited:
            row.local["amplification"] = output / inherited
        if reason and row.verdict == "pass" and row.status != "identity":
            row.verdict, row.note = "fail", f"{reason} (isolated replay)"
        if cleared is not None:
            row.local[CLEARED] = 1.0
            row.note = f"{row.note}; {cleared}" if row.note else cleared
    _clear_rounding_origins(report)
    if lifted is not None:
        _changed_after_lifted(report.rows, lifted, lifted_rows)
    own_errors = [row for row in report.rows if row.local.get("local_diverged") and row.status != "identity"]
    for culprit, note in fed_wrong.values():
        culprit.verdict, culprit.note = "fail", note
        if culprit not in own_errors:
            own_errors.append(culprit)
    own_errors.sort(key=lambda r: r.index)
    for row in report.origins:  # relative error beyond the margin, hidden under atol, and confirmed as its own
        if row.verdict == "pass" and row.local.get("local_diverged"):
            row.verdict = "fail"
            row.note = "relative error beyond the divergence margin (hidden under atol); its own error confirms it"
    report.replay_origins = innermost(own_errors, report.rows)
    low = local_floor is not None and not floor_loosens_only
    _name_culprit(report, reference, replay, low_precision=low, reordered=reordered)
    _independent_origins(report)
    named = report.first_divergence
    if named is not None and any(culprit is named for culprit, _ in fed_wrong.values()):
        report.culprit_reason = named.note  # what it gave which module, not "its input agrees"
    charge_quiet_weights(report)
    return report


def _independent_origins(report: Report) -> None:
    """No masking: every module whose own error the replay finds (its input the reference's) is an origin of its
    own, listed after the one where divergence starts, in execution order, whatever happened before it; a module
    around the one named, or inside it, is not (the named one explains it)."""
    named = report.first_divergence
    if named is None:
        return
    by_index = {row.index: row for row in report.rows}
    around = set(ancestors(named, by_index))
    listed = [*report.origins]
    for row in report.replay_origins:
        if any(row is other for other in listed) or row.index in around or named.index in ancestors(row, by_index):
            continue
        if row.cause in ("", "inherited"):
            row.cause = "origin"
        listed.append(row)
    first = [row for row in listed if row is named]
    report.origins = first + sorted((row for row in listed if row is not named), key=lambda row: row.index)


CLEARED = "cleared_by_lifted"
"""The ``local`` flag of a row whose low-precision excess the lifted replay cleared (:func:`_cleared`)."""
CLEARABLE = 8.0
"""The lifted replay clears an own error up to this multiple of the candidate dtype's smallest floor (bfloat16:
1.6e-2): two implementations ordering their sums differently round differently, by a few units of the last place
at most; an error beyond that is no rounding, whatever float32 shows."""


def _cleared(
    own: float,
    floor: Mapping[str, float],
    reason: str | None,
    local: Row,
    lifted: LiftedReplay | None,
    lifted_row: Row | None,
) -> str | None:
    """Why a module whose own low-precision error is beyond its floor is precision, not a bug: the lifted replay
    (the same low-precision weights, both sides in float32) finds its code equal to the reference's, and the error
    is within a few units of the candidate dtype's last place. ``None`` when it is not cleared."""
    if lifted is None or reason is None or not lifted.agrees(lifted_row) or "NaN" in reason:
        return None
    dtype = local.candidate.dtype if local.candidate is not None else None
    if own > CLEARABLE * min_floor(dtype, local.reference.dtype):
        return None
    assert lifted_row is not None  # lifted.agrees checked it
    measured = relative_error(lifted_row.metrics) or 0.0
    return (
        f"its own {dtype} error {own:.3g} is beyond the reference's ({floor.get('rel_l2', 0.0):.3g}), but with the "
        f"same weights in float32 its code computes the reference's values (lifted replay rel_l2 {measured:.2g}): "
        "the two implementations round differently, not a bug"
    )


def _clear_rounding_origins(report: Report) -> None:
    """Free-run failures the lifted replay cleared pass, and so do the failures that only carry what they passed on
    (their own errors within their floors), when no other origin and no own error is left: one false origin must not
    fail the run, nor hide a real one after it (that one keeps its own error, and the run its failure)."""
    cleared = [row for row in report.rows if row.local.get(CLEARED)]
    if not cleared:
        return
    for row in cleared:
        if row.verdict == "fail" and not row.input_diverged and not _other_output_fails(row):
            row.verdict, row.diverged, row.cause = "pass", False, ""
    report.origins = [row for row in report.origins if not row.local.get(CLEARED)]
    if report.first_divergence is not None and report.first_divergence.local.get(CLEARED):
        report.first_divergence, report.culprit_reason = None, ""
    if report.origins or any(row.local.get("local_diverged") for row in report.rows):
        return
    for row in report.rows:  # no own error anywhere: what still fails carries the cleared rounding on
        inherits = "local_rel_l2" in row.local and row.status == "compared"
        if row.verdict == "fail" and inherits and not _other_output_fails(row):
            row.verdict, row.diverged, row.cause = "pass", False, ""
            where = cleared[0].path or "<root>"
            row.note = f"inherits only the rounding difference cleared at {where} (see its note)"


def _other_output_fails(row: Row) -> bool:
    return any(check.verdict == "fail" for check in row.outputs)


def _changed_after_lifted(rows: list[Row], lifted: LiftedReplay, lifted_rows: Mapping[str, Row]) -> None:
    """Rows whose value the candidate's code with no counterpart changes after them in the lifted replay only (a
    hook point's error that the candidate's precision rounded away): each is an own error, as such a change in
    the free run is a charge (:func:`~paritylab.comparison.verify.verify_pairs`)."""
    for row in rows:
        lifted_row = lifted_rows.get(row.reference.key)
        why = lifted.changed_after(lifted_row)
        if why is None or row.local.get("local_diverged") or row.status not in ("compared", "unmatched"):
            continue
        assert lifted_row is not None  # a row with a change has a lifted row
        change = lifted_row.metrics[LIFTED_CHANGE]
        row.local.update({"local_diverged": 1.0, "lifted_diverged": 1.0, CHANGED_AFTER: change})
        if CHANGED_AFTER not in row.metrics:  # else the free run charged it already, and said so
            row.verdict, row.note = "fail", f"{why} (lifted replay)"


def _systematic(
    reference: Trace,
    replay: Trace,
    floor_replay: Trace,
    local: Row,
    parts: Mapping[str, tuple[Part | None, ...]],
    channels_first: bool = False,
) -> dict[str, float] | None:
    """:func:`systematic_z` of a row's replayed output against the low-precision reference's, on the
    reference's output (``None`` when a value is missing or the layouts differ). ``channels_first``: the output of a
    norm folded into the layer before it, whose channels (axis 1) each carry their own rounding of the folded
    weights: the standard errors are clustered by channel, not by the last axis."""
    if local.status != "compared" or local.candidate is None:
        return None
    ref_part, cand_part = parts.get(local.reference.key, (None, None))
    ref_value = slot_value(reference, local.reference.key, local.reference.slot, ref_part)
    floor_value = slot_value(floor_replay, local.reference.key, local.reference.slot, ref_part)
    own = slot_value(replay, local.candidate.key, local.candidate.slot, cand_part)
    if ref_value is None or floor_value is None or own is None:
        return None
    own = in_layout(own, ref_value.shape)
    if not (ref_value.shape == floor_value.shape == own.shape) or not ref_value.is_floating_point():
        return None
    if channels_first and ref_value.dim() > 2:  # rounding shared by a channel (its folded weights) is clustered
        ref_value, floor_value, own = (value.movedim(1, -1) for value in (ref_value, floor_value, own))
    return systematic_z(ref_value, floor_value, own)


def _fed_wrong(
    local: Row,
    floor: Mapping[str, float] | None,
    dtype: str | None,
    call: CallRecord,
    replayed: CallRecord | None,
    loosens: bool = False,
) -> bool:
    """In the replay, the row's input differs from the reference's although every paired module upstream was
    given the reference's values. A floating-point input counts whenever it differs. An integer input (token or
    position ids) counts only where one side's own code changed it in place before passing it on (the tracer
    marks such a value ``changed``): otherwise different integer inputs are what each implementation chose to
    pass, not values an upstream error could have changed (GPT-2's position embedding takes positions where
    TransformerLens' takes the tokens). ``loosens`` (float32's floors): a floating-point input counts only beyond
    both its tolerance and its floor."""
    node = next((node for _, node in iter_tensors(call.inputs, "inputs")), None)
    if not local.input_metrics or node is None:
        return False
    if not floating(node):
        other = next((n for _, n in iter_tensors(replayed.inputs, "inputs")), None) if replayed else None
        return local.input_diverged and any(n is not None and n.get("changed") for n in (node, other))
    if floor is None:
        return local.input_diverged
    beyond = beyond_floor(local.input_metrics, floor, dtype) is not None
    return beyond and local.input_diverged if loosens else beyond  # float32's floors only loosen the tolerance


def _input_call(replay: Trace, fed_from: Mapping[str, str], row: Row) -> CallRecord | None:
    """The replay's call whose input the row compared (the first call of a paired run, else the row's own)."""
    if row.candidate is None:
        return None
    try:
        return replay.call(fed_from.get(row.candidate.key, row.candidate.key))
    except KeyError:
        return None


def _unreplaced_source(
    row: Row,
    by_index: Mapping[int, Row],
    reference: Trace,
    received: set[int],
    reordered: set[int],
    misordered: Mapping[int, tuple[Row, str]] | None = None,
) -> tuple[Row, str] | None:
    """Where a value the replay could not replace was made: the module whose value the candidate changes after it
    (:func:`~paritylab.comparison.verify.verify_pairs` charged it) or with no counterpart that produced the row's
    input (data flow, through folded calls), else the parent's own code between its children."""
    where = row.path or "<root>"
    producer = producer_row(dict(by_index), reference, row)
    if producer is not None and CHANGED_AFTER in producer.metrics:  # the candidate changed its value on the way
        return producer, producer.note
    if producer is not None and producer.status == "unmatched":
        upstream = producer_row(dict(by_index), reference, producer)
        if upstream is not None and upstream.index in reordered:  # it hands on a reordered module's output
            return upstream, f"{REORDERED}, and {where} is handed them in that order: {REORDERED_WHY}"
        note = f"no counterpart, and its output reaches {where} changed while everything paired before it agrees"
        return producer, note + " (isolated replay)"
    sibling = reordered_sibling(row, list(by_index.values()), reordered, reference)
    if sibling is not None:  # the parent's code read a reordered child's output in its own order
        parent_row = by_index.get(row.parent) if row.parent is not None else None
        parent_path = parent_row.path if parent_row is not None else ""
        return (
            sibling,
            f"{REORDERED}, and {parent_path or '<root>'}'s own code hands {where} a value that diverges: "
            + (REORDERED_WHY),
        )
    source = unmatched_feeding(row, by_index, reference, received)
    if source is not None:
        parent_row = by_index.get(row.parent) if row.parent is not None else None
        parent_path = parent_row.path if parent_row is not None else ""
        note = f"no counterpart; only {parent_path or '<root>'}'s own code uses its output, and the value it gives"
        return source, note + f" {where} diverges while every paired module before it was given the reference's values"
    parent = by_index.get(row.parent) if row.parent is not None else None
    while parent is not None and parent.input_verdict == "fail":
        outer = by_index.get(parent.parent) if parent.parent is not None else None
        if outer is None:
            break
        parent = outer  # it was given that value too: the code that made it is further out
    if parent is None:
        return None
    if misordered and parent.index in misordered:  # its code splits a fused child whose parts lie out of order
        return misordered[parent.index]
    note = f"its own code between its children gives {where} a value the reference does not, while every paired"
    return parent, note + " module before it was given the reference's values (isolated replay)"


EXACT_SHARE, EXACT_MIN = 0.9, 8
"""A pair whose isolated replay gives exactly 0 own error at this share of its compared modules (at least
``EXACT_MIN`` of them) computes bit for bit like its reference: its noise is none, not its precision's."""
EXACT_LIMIT = {"float64": 1e-12, "float32": 1e-6, "bfloat16": 6e-3, "float16": 8e-4}
"""In such a pair, an own error above this is a code difference (an eps, a constant), not rounding: about 16
units of float32 rounding, 1.5 of bfloat16's, 1.6 of float16's; what an operation done in another order gives
stays below it."""


def exact_pair(rows: list[Row]) -> str | None:
    """``"k of n"`` when the replay's compared rows are bit-identical at :data:`EXACT_SHARE` or more of them
    (see :data:`EXACT_LIMIT`), else ``None``."""
    own = [relative_error(row.metrics) for row in rows if row.status == "compared" and row.path]
    own = [value for value in own if value is not None]
    zeros = sum(value == 0.0 for value in own)
    if len(own) < EXACT_MIN or zeros < EXACT_SHARE * len(own):
        return None
    return f"{zeros} of {len(own)}"


REL_MULTIPLE = 4.5
"""A module's own error diverges beyond this multiple of its local noise floor (independent implementations
of one module at bfloat16 were measured up to 3.2x apart) ..."""
SYSTEMATIC_MULTIPLE = 12.0
"""... or, when only the reference's own metrics are at hand (no low-precision outputs to test against), when its
error's systematic part, along the output (a gain) or constant (an offset), exceeds this multiple of the
reference's own (a single noisy sample: clean pairs measured up to 12x with other seeds, which is why the
z-test below decides whenever it can)."""
SYSTEMATIC_Z = 8.0
"""... or when the difference from the reference's own low-precision replay has a gain or offset this many
standard errors from zero (clean pairs of independently written implementations measured at most 3.6; a
0.1 % offset in bfloat16 gives 5 to 46)."""


POLICY_SHARE = 0.25
"""A reference floor below this share of the candidate dtype's smallest floor is no rounding at that dtype: the
reference's cast keeps the module wider (a precision policy), and the note says so."""
CODE_MULTIPLE = 16.0
"""A float32 module's own error beyond this multiple of float32's own rounding of its code (its floor against
float64, or float32's unit roundoff where the floor is smaller) is a code difference, whatever the tolerance says.
Clean pairs of independently written implementations measured at most 1.5x their floors (ten pairs, every
module); an eps of 1e-5 where the reference has 1e-6 gives about 50x."""
CODE_DIFFERENCE = "code_difference"
"""A row's ``local`` flag: its own float32 error is within its tolerance and beyond :data:`CODE_MULTIPLE`."""
FLOAT32_UNIT = 2.0**-24
"""float32's unit roundoff: the smallest floor assumed (a reference that computes a module in float32 even when
widened, as an RMSNorm that upcasts to float32 does, shows a floor of 0)."""


def folded_pairs(alignment: Alignment) -> list[Pair]:
    """The pairs of a candidate module with a reference layer and the norm it folded into its weight (the layer's
    input, the norm's output: :attr:`~paritylab.comparison.weights.WeightLedger.folds`)."""
    folds = alignment.weights.folds
    return [
        pair
        for pair in alignment.pairs
        if pair.reference_input is not None and pair.candidate.rsplit("#", 1)[0] in folds
    ]


def run_floors(
    pairs: list[Pair], reference: Trace, local_floor: Mapping[str, Mapping[str, float]]
) -> Mapping[str, Mapping[str, float]]:
    """``local_floor`` with each of ``pairs`` (one candidate module against a run of reference modules: a layer and
    the norm folded into it) given the floor of the whole run: the modules of the run each round, and a module's
    floor measures only its own rounding on exact inputs. Their ``rel_l2`` add in quadrature (rounding errors are
    independent), the other figures take the largest."""
    if not pairs:
        return local_floor
    floors = dict(local_floor)
    for pair in pairs:
        try:
            first, last = reference.call(pair.reference_input or ""), reference.call(pair.reference)
        except KeyError:
            continue
        level = {first.parent, last.parent}
        members = [
            floor
            for call in reference.calls[first.index : last.index + 1]
            if call.parent in level and (floor := local_floor.get(call.key)) is not None
        ]
        if len(members) < 2:
            continue
        combined = {name: max(abs(floor.get(name, 0.0)) for floor in members) for name in members[-1]}
        combined["rel_l2"] = math.sqrt(sum(floor.get("rel_l2", 0.0) ** 2 for floor in members))
        floors[pair.reference] = combined
    return floors


def widest_floors(reference: Trace, local_floor: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Per reference call key, the largest local floor (``rel_l2``) of that module and everything under it: the
    rounding its code may show when its counterpart holds some of its children's work inline (a candidate's
    attention computing its output projection itself, where the reference's is a replaced child)."""
    by_path: dict[str, float] = {}
    for call in reference.calls:
        floor = (local_floor.get(call.key) or {}).get("rel_l2", 0.0)
        parts = call.path.split(".") if call.path else []
        for depth in range(len(parts) + 1):
            path = ".".join(parts[:depth])
            by_path[path] = max(by_path.get(path, 0.0), floor)
    return {call.key: by_path.get(call.path, 0.0) for call in reference.calls}


def _beyond_float32_rounding(own: float, floor: float | None, dtype: str | None) -> str | None:
    """Why a float32 module's own error within its tolerance is a code difference (:data:`CODE_MULTIPLE`), or
    ``None``."""
    if floor is None or dtype != "float32":
        return None
    rounding = max(floor, FLOAT32_UNIT)
    if own <= CODE_MULTIPLE * rounding:
        return None
    return (
        f"own error {own:.2g}, {own / rounding:.0f}x the rounding float32 gives this module's code ({floor:.2g}"
        " against float64): a code difference (an eps, a constant), not the same arithmetic in another order"
    )


def order_floor(call: CallRecord) -> float:
    """What float32's rounding of a reduction as long as ``call``'s widest input dimension (after the first) may
    show when summed in another order: ``2**-24 * sqrt(length)``. Summing in sequence, the worst order a kernel
    uses, measured 0.3 of this (a 4,096-long dot product: 1.15e-6 against float64, where a blocked sum shows
    2.6e-7; cuBLAS, fusing gate and up projections of a 7B model into one product, 1.27e-6 from the reference's
    product in an H200 run): the reference's own order is one of many, so its floor alone is no yardstick for a
    candidate's order. An estimate: the length is read from the input's shape, the reduction's own length is not
    recorded."""
    length = 1
    for _, node in iter_tensors(call.inputs, "inputs"):
        if floating(node) and len(node.get("shape") or ()) > 1:
            length = max(length, *node["shape"][1:])
    return FLOAT32_UNIT * math.sqrt(length)


def beyond_floor(
    metrics: Mapping[str, float],
    floor: Mapping[str, float],
    dtype: str | None,
    systematic: Mapping[str, float] | None = None,
    candidate_dtype: str | None = None,
    order: float = 0.0,
) -> str | None:
    """Why a module's own low-precision error is more than rounding, or ``None`` when it is not. The floor is never
    below what rounding to the lower of ``dtype`` and ``candidate_dtype`` causes (:func:`min_floor`).

    Rounding error is unbiased: it has no part along the output and no constant part beyond what the
    reference's own rounding shows, while a wrong scale, offset, eps or activation has one. ``systematic``
    (:func:`~paritylab.comparison.metrics.systematic_z` against the reference's own low-precision output)
    measures that part directly, with its standard error. Noise-like errors can only be told from rounding
    by their size: ``order`` (:func:`order_floor`, float32's floors) is the size another summation order may show,
    which the size test allows; the tests for a systematic part keep the reference's own floor.
    """
    if metrics.get("nan_mismatch") or metrics.get("inf_mismatch"):
        return "NaN/Inf the reference does not produce"
    rel_floor = max(floor.get("rel_l2", 0.0), min_floor(dtype, candidate_dtype), 1e-12)
    rel = metrics.get("rel_l2", 0.0) / max(rel_floor, order)
    if rel > REL_MULTIPLE:
        what = "its local noise floor" if rel_floor >= order else "the rounding another summation order may show"
        return f"own error {rel:.1f}x {what}"
    if systematic is not None:  # measured with its own standard error: the test that decides
        for name in ("gain", "offset"):
            z = systematic[f"{name}_z"]
            if abs(z) > SYSTEMATIC_Z:
                value, where = systematic[name], f"against the reference at {dtype}"
                return f"systematic {name} of {value:+.3%} {where} ({abs(z):.0f} standard errors)"
        return None
    noise = 0.05 * rel_floor  # no low-precision outputs to test against: compare with the reference's own rounding
    for name, what in (("scale_err", "gain"), ("offset_err", "offset")):
        ratio = abs(metrics.get(name, 0.0)) / max(abs(floor.get(name, 0.0)), noise)
        if ratio > SYSTEMATIC_MULTIPLE:
            return f"systematic {what} of {metrics[name]:+.2%}, {ratio:.0f}x the reference's own rounding"
    return None


def _name_culprit(
    report: Report, reference: Trace, replay: Trace, low_precision: bool, reordered: set[int] | None = None
) -> None:
    """One culprit from the free-run origins and the replay's own errors (both sides of the evidence).

    - a free-run origin with no counterpart (an unmatched stretch) stands: replay cannot see inside it;
    - a free-run origin whose own error the replay confirms stands, and so does one whose value the candidate changes
      after it (the pair check's charge) when the replay's culprit encloses it;
    - else a module before it (not enclosing it) whose own error the replay finds, and whose free-run output
      diverges too, is where divergence starts: the free-run origin's input only looked as if it agreed;
    - else the replay's earliest own error inside the free-run origin is more precise, and in low
      precision, where free-run divergence is judged against a wide tolerance, the replay's earliest own
      error (judged against the local noise floor) is named;
    - with no free-run origin, the replay's earliest own error is the culprit when the run fails;
    - a culprit whose compared output a module with no counterpart made inside it, as the candidate's was made by
      one with none on its side, hands that module's finding on: it is named (``unmatched_maker``, as the free
      run does).
    """
    first = report.origins[0] if report.origins else None
    if first is not None and report.first_divergence is None and not report.passed:
        report.first_divergence = first
        report.culprit_reason = "the earliest module whose output diverges while its input agrees"
    replayed = report.replay_origins
    if not replayed or (first is not None and first.status == "unmatched"):
        return
    if first is not None and first in replayed:
        return
    by_index = {row.index: row for row in report.rows}
    inside = [row for row in replayed if first is not None and first.index in ancestors(row, by_index)]
    earlier = [
        row
        for row in replayed
        if first is not None
        and row.index < first.index
        and (row.diverged or row.local.get(CODE_DIFFERENCE))  # its free run within a tolerance it beats
        and row.index not in ancestors(first, by_index)
    ]
    chosen: Row | None = None
    charged = first is not None and CHANGED_AFTER in first.metrics  # the free run's pair check changed it after it
    if earlier and first is not None:  # the free run took a later module for the start: its input only seemed to agree
        chosen = earlier[0]
        reason = f"its own error (isolated replay) diverges before the free-run origin {first.path or '<root>'}"
        reason += ", whose own error does not" if first is not None and not first.local.get("local_diverged") else ""
    elif inside:
        chosen, reason = inside[0], "its own error (isolated replay) diverges inside the free-run origin"
    elif charged and first is not None and replayed[0].index in ancestors(first, by_index):
        return  # the replay's culprit encloses the module whose value the candidate changes after it: more precise
    elif low_precision or first is None:
        if first is None and report.passed:
            return
        chosen, reason = replayed[0], "the earliest module whose own error (isolated replay) exceeds its local floor"
        if chosen.local.get("lifted_diverged"):
            reason = "the earliest module whose own code differs with the same low-precision weights in float32"
            reason = chosen.note if chosen.local.get(CHANGED_AFTER) else f"{reason} (lifted replay)"
    if chosen is None:
        return
    reordered = reordered if reordered is not None else reordered_rows(report.alignment, reference)
    turned = reordered_maker(chosen, report.rows, reference, reordered) or reordered_child(
        chosen, report.rows, reordered, reference
    )
    if turned is not None:  # the culprit returns, or its code reads, what a reordered module made, in that order
        reason, chosen = turned.note, turned
    maker = unmatched_maker(chosen, report.rows, reference, replay, report.alignment) if turned is None else None
    if maker is not None:  # the culprit only hands on what a module with no counterpart made inside it
        maker.diverged, maker.verdict, chosen.cause = True, "fail", "contains-origin"
        maker.note = maker.note or f"it made {chosen.path or '<root>'}'s output, whose own error diverges"
        reason = f"it made {chosen.path or '<root>'}'s output, whose own error (isolated replay) diverges; it has no"
        reason += " counterpart in the candidate"
        chosen = maker
    report.first_divergence, report.culprit_reason = chosen, reason
    report.origins = [chosen, *(row for row in report.origins if row is not chosen)]
    chosen.cause = "origin"
