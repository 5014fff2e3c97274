"""The alignment checked against the values: pairs that the structure proposed but the numbers refute.

Alignment proposes pairs from structure, weights and order (:mod:`paritylab.comparison.alignment`). Two kinds of
proposal can be wrong in a way that would move the blame, and the compared values show it:

- **an observer paired with what it observes.** A hook point (an identity module that only hands a value on,
  like TransformerLens' ``hook_post``) is folded when it returns its input; a bug planted at it makes it return
  something else, and it is then paired like any module, with the module whose output it observes (``act``).
  Its input is that module's *output*, not its input, so comparing inputs says "fed another value" and blames
  the module before. Here the candidate's input is compared with the reference's output: when they agree, the
  row's input agrees, and a difference on the way out is the observer's own (named at the module it observes).
- **a near-identity paired with a transform.** The same planted hook point, paired by position with a module
  that changes its values (``act``), differs from it by O(1) while it returns almost exactly its input, and
  other calls of its class return their input exactly (folded: the class hands values on). That is not one
  computation: the pair is undone (both calls left unmatched, the row says why), and the small change
  the observer makes to the value it was handed is charged to the reference module that made that value (the
  counterpart of the observer's input's producer), which is where divergence then starts.

:func:`verify_pairs` runs after every pair is measured and before localisation. It only ever removes a pair or
clears an input that only looked as if it differed; it never adds a pair.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping

import torch

from paritylab.comparison.alignment import Alignment, Pair, in_layout, transposed
from paritylab.comparison.judgement import DIVERGENCE_MARGIN, Row, producer_row, relative_error
from paritylab.comparison.metrics import Tolerance, divergence
from paritylab.tracing.tracefile import CallRecord, Node, Trace
from paritylab.tracing.values import first_tensor_slot, iter_tensors

CHANGED_AFTER = "changed_after_rel_l2"
"""The metric a row charged with a change made after it carries: how much the candidate changed its value."""
O1_ERROR = 0.25
"""A pair whose outputs differ by this much relative L2 or more differs by O(1): far beyond any rounding, so it
is checked for being a wrong pairing before it is believed to be a bug."""
REFUTED_ERROR = 0.05
"""An ``auto`` pair is checked against the calls using its output when its outputs differ by this much relative L2
or more: far beyond any precision's rounding (bfloat16's unit is 0.4 %), and beyond the 1 % bugs a damped
downstream effect could hide (an activation variant changes what a projection returns far less than itself)."""
UNFELT = 0.1
"""... where what uses the output differs from its counterpart by less than this share of the pair's difference
(a value that wrong would show downstream, and every clean pair's users agree to rounding)."""
NEAR_IDENTITY = 0.1
"""An observer changes the value it was handed by at most this share of the pair's error to count as a
near-identity (a hook point with a planted change), against a module whose own change is large."""


def verify_pairs(
    rows: list[Row],
    reference: Trace,
    candidate: Trace,
    alignment: Alignment,
    partner: Mapping[int, int],
    rejudge: Callable[[CallRecord, CallRecord, Pair], Row] | None = None,
) -> dict[int, str]:
    """Check every compared whole pair against its values (see the module's text). Returns the rows charged
    with a change the candidate makes after them (reference call index -> why), for the headline.

    ``partner`` maps reference call indices to the candidate call indices they are paired with. ``rejudge``
    compares a pair the checks make (a refuted pair repaired, :func:`_repair`) as the first comparison did."""
    charged: dict[int, str] = {}
    by_index = {row.index: row for row in rows}
    passing = {candidate.call(key).cls for key in alignment.folded_candidate}  # classes that hand values on
    repaired: list[tuple[Row, CallRecord]] = []
    for refuted, wrong, why in _refuted(rows, reference, candidate, alignment, by_index, passing):
        _unpair(refuted, wrong, alignment, candidate.call(wrong.candidate))
        refuted.note = f"{refuted.note}; {why}"
        found = _repair(refuted, wrong, reference, candidate, alignment, by_index) if rejudge is not None else None
        if found is not None and rejudge is not None:
            repaired.append(_install(refuted, found, rows, by_index, reference, alignment, partner, rejudge))
    for lone, found in _repairs_alike(repaired, rows, reference, candidate, alignment, partner):
        assert rejudge is not None  # nothing is repaired without it
        _install(lone, found, rows, by_index, reference, alignment, partner, rejudge)
    unpaired = {reference.call(key).index for key in alignment.unmatched_reference}
    reverse = {cand: ref for ref, cand in partner.items() if ref not in unpaired}
    pairs = alignment.by_reference()
    for row in rows:
        if row.status != "compared" or row.candidate is None or row.tolerance is None:
            continue
        pair = pairs.get(row.reference.key)
        if pair is None or not _whole(pair):
            continue
        call, other = reference.call(row.reference.key), candidate.call(row.candidate.key)
        margin = DIVERGENCE_MARGIN * max(row.tolerance.rtol, 1e-12)
        unsure = row.input_diverged or not row.input_metrics  # fed another value, or one of another shape
        if unsure and _observes(row, reference, candidate, call, other, margin):
            continue
        if other.cls not in passing:
            continue  # a module whose kind computes something (an activation): a near-identity there is its bug
        undone = _near_identity(row, reference, candidate, call, other)
        if undone is None:
            continue
        change, producer = undone
        _unpair(row, pair, alignment, other)
        source = by_index.get(reverse.get(producer, -1)) if producer is not None else None
        if source is None:  # made by code with no module on the candidate's side: find whose value it is
            source = _observed(rows, row, reference, _value(candidate, _first(other, "inputs")), margin)
        # its class's other calls hand their input on exactly: any change at this one is the bug, in any precision
        if change > 0 and source is not None:
            _charge(source, other.path, change, "code with no counterpart, such as a hook point", charged)
    for wrapper, child, change, alike in _changed_wrappers(candidate, alignment):
        source = by_index.get(reverse.get(child, -1))
        if source is None:
            continue
        holder = _handed_on_by(reference, source, by_index)
        if holder is not None:  # the reference's container hands its child's value on; the candidate's does not
            _charge(holder, wrapper.path, change, f"its counterpart returns {source.path}'s value unchanged", charged)
        elif alike:
            _charge(source, wrapper.path, change, "a wrapper whose other calls return their child's value", charged)
        elif _fed_in_its_place(reference, candidate, alignment, source.index, wrapper.index):
            why = f"where the reference hands {source.path}'s value on as it was made"
            _charge(source, wrapper.path, change, why, charged)
    return charged


def charge_hand_ons(
    rows: list[Row], reference: Trace, candidate: Trace, alignment: Alignment, handed_on: frozenset[str], margin: float
) -> dict[int, str]:
    """Candidate calls left unpaired that handed their input on unchanged in the candidate's own run
    (``handed_on``: their keys; hook points) but change it in this one (a float32 replay) by more than ``margin``,
    while every other call of their class returns its input bit for bit: the change is code, which the
    candidate's precision rounded away (a hook scaling by 1.001 in bfloat16). Each is charged, as
    :func:`verify_pairs` charges a near-identity, to the reference module that made the value it was handed: its
    producer's counterpart, else the reference call inside the counterpart of its
    nearest paired ancestor whose output that value is (within ``margin``; a replay hands a module its
    counterpart's value, whose producer it does not record). Returns the rows charged (reference call index ->
    why)."""
    paired = {candidate.call(pair.candidate).index: pair for pair in alignment.pairs}
    by_class: dict[str, list[tuple[CallRecord, float]]] = {}
    for call in candidate.calls:
        handed, returned = _value(candidate, _first(call, "inputs")), _value(candidate, _first(call, "outputs"))
        if call.index in paired or handed is None or returned is None or handed.shape != returned.shape:
            continue
        if handed.is_floating_point():
            by_class.setdefault(call.cls, []).append((call, _relative(returned, handed)))
    by_index = {row.index: row for row in rows}
    charged: dict[int, str] = {}
    for calls in by_class.values():
        changed = [(call, change) for call, change in calls if change > 0]
        if len(calls) < 2 or len(changed) == len(calls) or any(call.key not in handed_on for call, _ in changed):
            continue  # not a class that hands values on, or a call that changed them in the candidate's own run
        for call, change in changed:
            source = _handed_source(call, reference, candidate, paired, by_index, margin)
            if source is not None and change > margin and source.index not in charged:
                _charge(source, call.path, change, "code with no counterpart, such as a hook point", charged)
    return charged


def hands_on_output(reference: Trace, candidate: Trace, pair: Pair) -> bool:
    """The pair's candidate call is handed a value nearer its counterpart's output than its counterpart's input (an
    observer paired with the module whose value it hands on): a replay must not feed it the reference's input."""
    call, other = reference.call(pair.reference), candidate.call(pair.candidate)
    handed = _value(candidate, _first(other, "inputs"))
    taken, made = _value(reference, _first(call, "inputs")), _value(reference, _first(call, "outputs"))
    if handed is None or made is None or not handed.is_floating_point() or not _fits(handed, made):
        return False
    to_output = _relative(in_layout(handed, made.shape), made)
    if taken is None or not _fits(handed, taken):
        return to_output < REFUTED_ERROR
    return to_output < _relative(in_layout(handed, taken.shape), taken)


def handing_on(trace: Trace) -> frozenset[str]:
    """Keys of the calls that returned their (first) input bit for bit: what :func:`charge_hand_ons` takes as
    ``handed_on``."""
    found = set()
    for call in trace.calls:
        handed, returned = _value(trace, _first(call, "inputs")), _value(trace, _first(call, "outputs"))
        if handed is not None and returned is not None and handed.shape == returned.shape:
            found.update([call.key] if handed.dtype == returned.dtype and torch.equal(handed, returned) else [])
    return frozenset(found)


def _handed_source(
    call: CallRecord,
    reference: Trace,
    candidate: Trace,
    paired: Mapping[int, Pair],
    by_index: Mapping[int, Row],
    margin: float,
) -> Row | None:
    """The reference row whose value the candidate ``call`` was handed (see :func:`charge_hand_ons`)."""
    node = _first(call, "inputs")
    producer = node.get("from") if node is not None else None
    if isinstance(producer, int) and producer in paired and _whole(paired[producer]):
        return by_index.get(reference.call(paired[producer].reference).index)
    ancestor = call.parent
    while ancestor is not None and ancestor not in paired:
        ancestor = candidate.calls[ancestor].parent
    if ancestor is None:
        return None
    scope = reference.call(paired[ancestor].reference).index
    handed = _value(candidate, node)
    assert handed is not None  # a call whose input has no value is never charged
    found = []
    for row in by_index.values():  # a replay hands on its counterpart's value, made by a paired module
        if row.status not in ("compared", "unmatched") or not _within(reference, reference.calls[row.index], scope):
            continue
        made = _value(reference, _first(reference.calls[row.index], "outputs"))
        if made is not None and _fits(handed, made) and _relative(in_layout(handed, made.shape), made) <= margin:
            found.append(row)
    # the maker: a call holding no other that returns the value (its parent hands it on), the first that does
    inner = [r for r in found if not any(_within(reference, reference.calls[o.index], r.index) for o in found)]
    return min(inner, key=lambda r: r.index) if inner else None


def _fed_in_its_place(reference: Trace, candidate: Trace, alignment: Alignment, made: int, wrapper: int) -> bool:
    """Some pair's reference call is fed the value reference call ``made`` returned, as it was made (data flow),
    while its counterpart is fed the candidate ``wrapper``'s value (data flow, or the same values: ``x + 0``
    makes a new tensor): the wrapper stands where the reference has no code at all (a token-embedding module
    around its ``nn.Embedding``, seen once), so a change it makes is the bug."""
    returned = None
    for pair in alignment.pairs:
        if not _whole(pair):
            continue
        ref_input = _first(reference.call(pair.reference), "inputs")
        cand_input = _first(candidate.call(pair.candidate), "inputs")
        if ref_input is None or cand_input is None or ref_input.get("from") != made:
            continue
        if cand_input.get("from") == wrapper:
            return True
        if returned is None:
            returned = _value(candidate, _first(candidate.calls[wrapper], "outputs"))
        handed = _value(candidate, cand_input)
        if returned is not None and handed is not None and torch.equal(handed, returned):
            return True
    return False


def _refuted(
    rows: list[Row],
    reference: Trace,
    candidate: Trace,
    alignment: Alignment,
    by_index: Mapping[int, Row],
    passing: set[str],
) -> list[tuple[Row, Pair, str]]:
    """Pairs proposed by order and shape alone (``auto``), or by equal paths alone (``identity``: a port that kept
    the original's names for modules of its own computing something else, :func:`_doubted`), that the traces
    refute, ``(row, pair, why)`` for each
    (nothing is changed here). Observers (a class whose other calls hand their input on) are left to the checks
    below, which know what they observe.

    - **Nesting**: the reference module's own modules are paired with candidate modules, none of them inside the
      candidate module (a decoder layer against a residual addition beside it): it cannot compute their values.
    - **Values**: its outputs differ by :data:`REFUTED_ERROR` or more while every compared call that used the
      output (else the nearest compared call enclosing it) differs by far less (:data:`UNFELT`), whatever a bug
      elsewhere changed there: a value that wrong would show there (a table of rotary frequencies against one of
      cosines, an activation against the gated product it feeds). A pair of the same modules in another block (the same
      paths but for their numbers) that differs as much is refuted with it."""
    pairs = alignment.by_reference()
    proposed: list[tuple[Row, Pair, CallRecord]] = []
    residuals: dict[int, str] = {}  # the structure pairs' rows whose outputs differ by an input: why
    for row in rows:
        pair = pairs.get(row.reference.key) if row.status == "compared" and row.candidate is not None else None
        if pair is None or not _whole(pair):
            continue
        other = candidate.call(pair.candidate)
        if pair.source == "identity" and not _doubted(row, reference.call(pair.reference), other):
            continue  # the same model's module (a cast, compiled or sharded run), or values that agree
        if pair.source == "structure":
            residual = _residual_elsewhere(row, reference.call(pair.reference), other, reference, candidate)
            if residual is not None:  # the same weights, and outputs that differ by an input
                residuals[row.index] = residual
                proposed.append((row, pair, other))
            continue  # else equal weights proposed it: the same computation, checked by its values
        if pair.source not in ("auto", "identity"):
            continue
        if other.cls not in passing:
            proposed.append((row, pair, other))
    if not proposed:  # most runs of one model against its cast or its port: nothing to check, nothing built
        return []
    consumers: dict[int, set[int]] = {}
    for call in reference.calls:
        for _, node in iter_tensors(call.inputs, "inputs"):
            source = node.get("from")
            if isinstance(source, int) and source != call.index:
                consumers.setdefault(source, set()).add(call.index)
    inside, ours = _descendants(candidate), _descendants(reference)
    partners = {reference.call(p.reference).index: candidate.call(p.candidate).index for p in alignment.pairs}
    found: dict[int, tuple[Row, Pair, str]] = {}
    suspects: list[tuple[Row, Pair, float]] = []
    for row, pair, other in proposed:
        outside = _paired_outside(row.index, other.index, reference, partners, ours, inside)
        if outside is not None:
            found[row.index] = (row, pair, f"{_proposed(pair)}, but {outside}: not one computation")
            continue
        error = row.rel_l2
        if error is not None and error >= REFUTED_ERROR and row.diverged:
            suspects.append((row, pair, error))
    witnessed: dict[tuple[str, str], str] = {}
    for row, pair, error in suspects:
        users = consumers.get(row.index, set()) - set(found)  # a call refuted by nesting says nothing here
        witness = _agreeing_user(row, users, by_index, error)
        if witness is None:
            continue
        why = f"{_proposed(pair)}, its output differs by {error:.3g} while {witness} does not"
        if row.index in residuals:
            found[row.index] = (row, pair, f"{why}, and {residuals[row.index]}: the same weights, not the same output")
            continue  # each such pair shows its own residual: none is refuted for another block's
        found[row.index] = (row, pair, why + ": not one computation")
        witnessed[_pattern(pair)] = witness
    for row, pair, error in suspects:
        witness = witnessed.get(_pattern(pair))
        if row.index not in found and witness is not None:
            why = f"{_proposed(pair)}, its output differs by {error:.3g}, as the same pair in "
            found[row.index] = (row, pair, why + f"another block does while {witness} does not: not one computation")
    return [found[index] for index in sorted(found)]


def _doubted(row: Row, call: CallRecord, other: CallRecord) -> bool:
    """A pair by equal paths is checked when a port kept the original's names for a module of its own class
    (another implementation, which the path does not prove) whose output differs by O(1). Modules of one class
    are the same model's (a cast, compiled or sharded run): a value that wrong there is a bug, felt or not."""
    return call.cls != other.cls and row.diverged and (row.rel_l2 or 0.0) >= REFUTED_ERROR


def _proposed(pair: Pair) -> str:
    if pair.source == "structure":
        return "paired by its weights"
    return "paired by its path only" if pair.source == "identity" else "paired by order and shape only"


def _residual_elsewhere(
    row: Row, call: CallRecord, other: CallRecord, reference: Trace, candidate: Trace
) -> str | None:
    """Why a pair that equal weights proposed computes another value: one side's module adds one of its inputs to
    what it returns (a residual: BLOOM's attention and MLP return ``residual + f(x)``) where the other side adds it
    after its module (a port's block does ``x + attn(norm(x))``), so the outputs differ by that input. Said when the
    outputs differ by :data:`REFUTED_ERROR` or more and adding (or taking away) one input of the output's shape
    leaves less than :data:`UNFELT` of the difference; ``None`` otherwise (a bug of that size is the module's own,
    and a module that forgot its residual is never refuted: what uses its output disagrees too)."""
    error = row.rel_l2
    if error is None or error < REFUTED_ERROR or not row.diverged or row.candidate is None:
        return None
    made = _value(reference, _at(call, row.reference.slot))
    returned = _value(candidate, _at(other, row.candidate.slot))
    if made is None or returned is None or not made.is_floating_point() or not _fits(returned, made):
        return None
    made, returned = made.double(), in_layout(returned, made.shape).double()
    best: tuple[float, str] | None = None  # the input that explains the difference best (a norm's input and output
    for side, trace, record, sign in (("reference", reference, call, 1.0), ("candidate", candidate, other, -1.0)):
        for slot, node in iter_tensors(record.inputs, "inputs"):  # can be near alike: random-init norms)
            value = _value(trace, node)
            if value is None or not value.is_floating_point() or not _fits(value, made):
                continue
            left = _relative(returned + sign * in_layout(value, made.shape).double(), made)
            whose = "its counterpart" if side == "reference" else "it"
            if left < UNFELT * error and (best is None or left < best[0]):
                best = left, f"{whose} adds its input {slot} to what it returns, which the other side adds after it"
    return best[1] if best is not None else None


def _descendants(trace: Trace) -> dict[int, set[int]]:
    """Call index -> the indices of the calls made inside it (its whole subtree)."""
    below: dict[int, set[int]] = {call.index: set() for call in trace.calls}
    for call in trace.calls:
        parent = call.parent
        while parent is not None and parent in below:
            below[parent].add(call.index)
            parent = trace.calls[parent].parent
    return below


def _paired_outside(
    ref: int,
    cand: int,
    reference: Trace,
    partners: Mapping[int, int],
    ours: Mapping[int, set[int]],
    inside: Mapping[int, set[int]],
) -> str | None:
    """Why the candidate call cannot be the reference call's counterpart by nesting: some of the reference call's
    own calls are paired, and none with a call inside the candidate call. ``None`` when nesting allows the pair."""
    paired = [(index, partners[index]) for index in sorted(ours.get(ref, ())) if index in partners]
    if not paired or any(their in inside.get(cand, set()) for _, their in paired):
        return None
    first = reference.calls[paired[0][0]].path
    return f"{len(paired)} of its modules ({first}, ...) are paired with modules outside its counterpart"


def _agreeing_user(row: Row, users: set[int], by_index: Mapping[int, Row], error: float) -> str | None:
    """When a compared call that used ``row``'s output differs from its counterpart by far less than ``error``
    (:data:`UNFELT`: the difference did not reach it, whatever else a bug upstream changed), the first such, said as
    "<path>, which uses it,"; with no compared user, when the nearest compared call enclosing it does ("encloses");
    else ``None``. One user suffices: a value that wrong reaches every call that uses it, so a bug in one of them
    (a rotary table used by every layer, one layer's projection wrong) cannot keep a refuted pair."""
    judged = [by_index[index] for index in sorted(users) if index in by_index]
    judged = [other for other in judged if other.status == "compared" and other.rel_l2 is not None]
    relation = "uses"
    unfelt = [other for other in judged if (other.rel_l2 or 0.0) < UNFELT * error]
    if unfelt:
        return f"{unfelt[0].path or '<root>'}, which uses it,"
    if not judged:
        parent = by_index.get(row.parent) if row.parent is not None else None
        while parent is not None and (parent.status != "compared" or parent.rel_l2 is None):
            parent = by_index.get(parent.parent) if parent.parent is not None else None
        judged, relation = ([parent] if parent is not None else []), "encloses"
    if not judged or any((other.rel_l2 or 0.0) >= UNFELT * error for other in judged):
        return None  # a wrong value shows in every call that uses it
    return f"{judged[0].path or '<root>'}, which {relation} it,"


def _pattern(pair: Pair) -> tuple[str, str]:
    """The pair's modules with their block numbers left out (``model.layers.#.norm#0``)."""
    return re.sub(r"\d+", "#", pair.reference), re.sub(r"\d+", "#", pair.candidate)


def _handed_on_by(reference: Trace, row: Row, by_index: Mapping[int, Row]) -> Row | None:
    """The unmatched reference call enclosing ``row`` whose output is ``row``'s output, handed on as it was made
    (data flow: a container returning its last module's value, as an encoder returns its final norm's)."""
    parent = by_index.get(row.parent) if row.parent is not None else None
    if parent is None or parent.status != "unmatched":
        return None
    node = _first(reference.calls[parent.index], "outputs")
    return parent if node is not None and node.get("from") == row.index else None


def _charge(source: Row, where: str, change: float, what: str, charged: dict[int, str]) -> None:
    """``source``'s value is changed after it by the candidate's ``where``: divergence starts there."""
    if source.status not in ("compared", "unmatched") or source.diverged:
        return
    source.diverged, source.verdict = True, "fail"
    source.note = (
        f"the candidate changes its value after it: {where} returns it with relative error {change:.3g} ({what})"
    )
    source.metrics[CHANGED_AFTER] = change
    charged[source.index] = source.note


def _changed_wrappers(candidate: Trace, alignment: Alignment) -> list[tuple[CallRecord, int, float, bool]]:
    """Unpaired candidate calls that wrap a paired call and hand on its output (a ``Sequential`` around an MLP
    that the other side does not have) but changed it at this call, while every other call of their class
    returns its last child's value exactly: ``(the wrapper, the child's call index, the relative change)``.
    The last item says whether the class gives that evidence (seen twice or more, its other calls exact); a
    class seen once, or whose calls change their child's value as a rule (a residual wrapper), needs the
    reference's to (:func:`_handed_on_by`).
    """
    paired = {candidate.call(pair.candidate).index for pair in alignment.pairs if _whole(pair)}
    skipped = paired | {candidate.call(key).index for key in alignment.folded_candidate}
    last_child: dict[int, CallRecord] = {}
    for call in candidate.calls:  # a parent opens before its children: the last one seen is the last called
        if call.parent is not None:
            last_child[call.parent] = call
    by_class: dict[str, list[tuple[CallRecord, int, float]]] = {}
    for call in candidate.calls:
        child = last_child.get(call.index)
        if call.index in skipped or child is None or child.index not in paired:
            continue
        returned, handed = _value(candidate, _first(call, "outputs")), _value(candidate, _first(child, "outputs"))
        if returned is None or handed is None or returned.shape != handed.shape or not returned.is_floating_point():
            continue
        by_class.setdefault(call.cls, []).append((call, child.index, _relative(returned, handed)))
    found: list[tuple[CallRecord, int, float, bool]] = []
    for calls in by_class.values():
        changed = [entry for entry in calls if entry[2] > 0]
        alike = len(calls) >= 2 and len(changed) < len(calls)  # the others hand the value on exactly
        found.extend((*entry, alike) for entry in changed)
    return found


def _whole(pair: Pair) -> bool:
    return (
        pair.reference_part is None
        and pair.candidate_part is None
        and pair.reference_input is None
        and pair.candidate_input is None
    )


def _observes(row: Row, reference: Trace, candidate: Trace, call: CallRecord, other: CallRecord, margin: float) -> bool:
    """The candidate call's input is the reference call's output (within the divergence margin): the row's
    input agrees, compared output to output."""
    handed = _value(candidate, _first(other, "inputs"))
    made = _value(reference, _at(call, row.reference.slot))
    if handed is None or made is None or not _fits(handed, made) or not handed.is_floating_point():
        return False
    metrics = divergence(made, in_layout(handed, made.shape), Tolerance(0.0, 0.0))
    error = relative_error(metrics)
    if error is None or error > margin:
        return False
    row.input_metrics, row.input_verdict, row.input_diverged, row.input_known = metrics, "pass", False, True
    row.observed = True
    row.note = "; ".join(filter(None, [row.note, f"its counterpart {other.path} is handed {call.path}'s output"]))
    return True


def _near_identity(
    row: Row, reference: Trace, candidate: Trace, call: CallRecord, other: CallRecord
) -> tuple[float, int | None] | None:
    """``(how much the candidate call changes its input, the candidate call that produced that input)`` when
    the pair differs by O(1) while the candidate call returns almost its input and the reference call does not
    (a near-identity paired with a transform); else ``None``."""
    error = row.rel_l2
    if error is None or error < O1_ERROR:
        return None
    node = _first(other, "inputs")
    handed, returned = (
        _value(candidate, node),
        _value(candidate, _at(other, row.candidate.slot if row.candidate else None)),
    )
    taken, made = _value(reference, _first(call, "inputs")), _value(reference, _at(call, row.reference.slot))
    if any(value is None for value in (handed, returned, taken, made)):
        return None
    assert handed is not None and returned is not None and taken is not None and made is not None
    if handed.shape != returned.shape:
        return None
    change = _relative(returned, handed)
    transform = math.inf if taken.shape != made.shape else _relative(made, taken)  # a new shape: a transform
    if change > NEAR_IDENTITY * error or transform < error / 2:
        return None
    row.note = (
        f"not one computation: {other.path} returns its input changed by {change:.3g} where {call.path} changes "
        f"it {'into another shape' if math.isinf(transform) else f'by {transform:.3g}'}, and the two outputs differ "
        f"by {error:.3g}"
    )
    producer = node.get("from") if node is not None else None
    return change, producer if isinstance(producer, int) else None


def _observed(rows: list[Row], row: Row, reference: Trace, handed: torch.Tensor | None, margin: float) -> Row | None:
    """The reference call beside ``row`` (same enclosing call) left without a counterpart whose output is the
    value the candidate's observer was handed (within ``margin``): the module that computes that value."""
    if handed is None or not handed.is_floating_point():
        return None
    for other in rows:
        if other.parent != row.parent or other is row or other.status != "unmatched":
            continue
        made = _value(reference, _first(reference.calls[other.index], "outputs"))
        if made is not None and _fits(handed, made) and _relative(in_layout(handed, made.shape), made) <= margin:
            return other
    return None


REPAIR_SCOPE = 64
CARRIED = 4.0
"""A repair also accepts a call whose output differs from the reference value by up to this many times what the
refuted row's input differs by (a 1 % bug in an earlier block reaches it as a few 1e-5), while that is small
beside the O(1) of the wrong pair it replaces (below :data:`REFUTED_ERROR`)."""
"""Calls examined for a refuted pair's repair: the wrong candidate module's own calls, then its siblings."""


def _handed_error(row: Row, reference: Trace, by_index: Mapping[int, Row]) -> float | None:
    """How much the value ``row``'s module was handed differs: its compared input, else the output of the compared
    row that produced it (a wrong pair compares inputs of other shapes)."""
    if row.input_metrics:
        return relative_error(row.input_metrics)
    producer = producer_row(dict(by_index), reference, row)
    return producer.rel_l2 if producer is not None and producer.status == "compared" else None


def _repair(
    row: Row, wrong: Pair, reference: Trace, candidate: Trace, alignment: Alignment, by_index: Mapping[int, Row]
) -> CallRecord | None:
    """The candidate call that computes what a refuted pair's reference call does, where exactly one does: a call
    no pair holds, inside the module it was wrongly paired with or beside it, whose output is the reference
    call's within the divergence margin (the GLU's own ``act`` for an ``act_fn`` wrongly paired with the GLU).
    Values alone choose here, so only a value that agrees to rounding, or to what the row was handed (a bug
    upstream: :data:`CARRIED`), re-pairs."""
    if row.tolerance is None:
        return None
    made = _value(reference, _first(reference.call(row.reference.key), "outputs"))
    if made is None or not made.is_floating_point():
        return None
    handed = _handed_error(row, reference, by_index)
    carried = CARRIED * handed if handed is not None and handed < REFUTED_ERROR / CARRIED else 0.0
    margin = DIVERGENCE_MARGIN * max(row.tolerance.rtol, 1e-12) + carried
    held = {pair.candidate for pair in alignment.pairs} | set(alignment.folded_candidate)
    around = candidate.call(wrong.candidate)
    inside = [call for call in candidate.calls if call.index > around.index and _within(candidate, call, around.index)]
    beside = [call for call in candidate.calls if call.parent == around.parent and call is not around]
    found = []
    for other in (inside + beside)[:REPAIR_SCOPE]:
        if other.key not in held and _makes(candidate, other, made, margin):
            found.append(other)
    return found[0] if len(found) == 1 else None


def _install(
    row: Row,
    found: CallRecord,
    rows: list[Row],
    by_index: dict[int, Row],
    reference: Trace,
    alignment: Alignment,
    partner: Mapping[int, int],
    rejudge: Callable[[CallRecord, CallRecord, Pair], Row],
) -> tuple[Row, CallRecord]:
    """Pair ``row``'s reference call with ``found`` and compare them (the new row takes the old one's place)."""
    pair = Pair(row.reference.key, found.key, "auto", 0.0)
    _repaired(alignment, pair, reference)
    new = rejudge(reference.call(pair.reference), found, pair)
    new.note = "; ".join(filter(None, [row.note, f"re-paired with {found.path}, whose output is its value"]))
    rows[rows.index(row)] = by_index[new.index] = new
    if isinstance(partner, dict):
        partner[new.index] = found.index
    return new, found


def _repairs_alike(
    repaired: list[tuple[Row, CallRecord]],
    rows: list[Row],
    reference: Trace,
    candidate: Trace,
    alignment: Alignment,
    partner: Mapping[int, int],
) -> list[tuple[Row, CallRecord]]:
    """For each repaired pair, the same reference module in other blocks (its path but for the numbers) left
    unmatched: paired with the one call of the repaired call's class inside its parent's counterpart that no pair
    holds and whose output is its value (a block whose wrong pair by order was never proposed)."""
    found: list[tuple[Row, CallRecord]] = []
    held = {pair.candidate for pair in alignment.pairs} | set(alignment.folded_candidate)
    patterns = {re.sub(r"\d+", "#", row.path): (call.cls, row.tolerance) for row, call in repaired}
    for row in rows:
        cls, tolerance = patterns.get(re.sub(r"\d+", "#", row.path), (None, None))
        home = partner.get(row.parent) if row.parent is not None else None
        if cls is None or tolerance is None or row.status != "unmatched" or home is None:
            continue
        made = _value(reference, _first(reference.calls[row.index], "outputs"))
        if made is None or not made.is_floating_point():
            continue
        margin = DIVERGENCE_MARGIN * max(tolerance.rtol, 1e-12)  # the repaired pair's (an unmatched row has none)
        agreeing = []
        for call in candidate.calls[home + 1 :][:REPAIR_SCOPE]:
            alike = call.cls == cls and call.key not in held and _within(candidate, call, home)
            if alike and _makes(candidate, call, made, margin):
                agreeing.append(call)
        if len(agreeing) == 1:
            found.append((row, agreeing[0]))
            held.add(agreeing[0].key)
    return found


def _makes(candidate: Trace, call: CallRecord, made: torch.Tensor, margin: float) -> bool:
    """``call``'s first output is the reference value ``made`` to within ``margin`` (in its order of dimensions)."""
    value = _value(candidate, _first(call, "outputs"))
    if value is None or not value.is_floating_point() or not _fits(value, made):
        return False
    return _relative(in_layout(value, made.shape), made) <= margin


def _within(trace: Trace, call: CallRecord, ancestor: int) -> bool:
    parent = call.parent
    while parent is not None and parent > ancestor:
        parent = trace.calls[parent].parent
    return parent == ancestor


def _repaired(alignment: Alignment, pair: Pair, reference: Trace) -> None:
    """Add ``pair`` to ``alignment`` (in reference order), both calls no longer unmatched."""
    alignment.unmatched_reference.remove(pair.reference)
    if pair.candidate in alignment.unmatched_candidate:
        alignment.unmatched_candidate.remove(pair.candidate)
    alignment.pairs.append(pair)
    alignment.pairs.sort(key=lambda each: reference.call(each.reference).index)


def _unpair(row: Row, pair: Pair, alignment: Alignment, other: CallRecord) -> None:
    alignment.pairs.remove(pair)
    alignment.unmatched_reference.append(pair.reference)
    alignment.unmatched_candidate.append(other.key)
    row.candidate, row.status, row.verdict, row.diverged = None, "unmatched", "skip", False
    row.metrics, row.input_metrics, row.input_diverged, row.outputs = {}, {}, False, []
    row.note = f"alignment: unpaired from {other.path}" + (f"; {row.note}" if row.note else "")


def _fits(candidate: torch.Tensor, reference: torch.Tensor) -> bool:
    """A candidate value and a reference value of the same shape, or of the same shape in another order of
    dimensions (a sequence-first candidate): comparable element for element once :func:`in_layout` is applied."""
    return candidate.shape == reference.shape or transposed(reference.shape, candidate.shape) is not None


def _relative(value: torch.Tensor, base: torch.Tensor) -> float:
    difference = torch.linalg.vector_norm(value.detach().double() - base.detach().double())
    return float(difference) / max(float(torch.linalg.vector_norm(base.detach().double())), 1e-30)


def _first(call: CallRecord, side: str) -> Node | None:
    slot = first_tensor_slot(getattr(call, side), side)
    return _at(call, slot, side) if slot is not None else None


def _at(call: CallRecord, slot: str | None, side: str = "outputs") -> Node | None:
    if slot is None:
        return None
    return dict(iter_tensors(getattr(call, side), side)).get(slot)


def _value(trace: Trace, node: Node | None) -> torch.Tensor | None:
    return trace.tensor(node) if node is not None else None
