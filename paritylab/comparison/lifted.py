"""Lifted replay: a low-precision candidate's code checked in float32, with the very weights it holds.

In bfloat16 a module's own rounding error is 2e-3 to 4e-3 of its output, so an error of 1e-3 in its code (a
gain, an offset, noise, an eps, an activation variant) hides under it. Rounding belongs to the precision,
not to the code: run the candidate's modules in float32 and the error is gone, except that its weights are
rounded. Run the reference in float32 with its parameters rounded to the candidate's precision, and the two
hold the same weights bit for bit. The candidate, in float32, is then replayed in isolation on that run
(every aligned module's output replaced by its counterpart's, so each module is fed what its counterpart
was), and what still differs between a module and its counterpart is code, judged against float32
tolerances as an fp32 candidate's would be.

That only holds where the weights are provably the same, so a module is judged this way only when:

- its subtree's parameters and its counterpart's, rounded to the candidate's precision, have the same
  fingerprint (:mod:`paritylab.tracing.structure`: the same values, whatever the layout or fusion), and the
  candidate's parameters there are all in that precision, or kept wider with values a reference parameter
  provably holds (a norm kept in float32: its twin is then left unrounded in the lifted reference), or hold a
  norm's scale minus one (``g = w - 1``: its twin then holds ``g + 1`` in the lifted reference); or the
  candidate's are the reference's with a table cut to a run of its rows (a position table without its offset
  rows: :func:`~paritylab.tracing.structure.rows_of`);
- its subtree holds no other floating-point tensor that rounding may have changed (integers, powers of two and
  mask fills survive any cast), unless the values prove what it held before: inverse frequencies that are the
  rounding of a reference buffer are restored; a table (rotary sin and cos by position) that is, column for
  column, the rounding of one the reference holds or computes has the lifted reference round its own the same
  way, as the low-precision reference does (:func:`~paritylab.comparison.twins.rounded_tables`);
- or the pair is the weight ledger's (:mod:`paritylab.comparison.weights`: the candidate holds the reference's
  weights with a defect beyond rounding, a scaled weight, a changed element): lifted, each side computes with its
  own weights, and what differs is that defect's effect, which bfloat16's rounding would hide;
- for a fused module paired by parts (one qkv against q, k and v) or a module paired with a run of modules
  (an MLP against its two projections), the same holds for the fused module against all its parts' pairs,
  or for the module against the whole run;
- in the lifted replay, every floating-point value it received is one its counterpart received.

Everywhere else the low-precision judgement alone decides. The lifted replay only adds findings: code that
behaves differently *only* at low precision (an fp16 overflow) is still the low-precision judgement's to find.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from paritylab.comparison.alignment import Alignment, Pair, in_layout
from paritylab.comparison.judgement import DIVERGENCE_MARGIN, Row, relative_error
from paritylab.comparison.metrics import Tolerance, Tolerances
from paritylab.comparison.report import compare_traces, slot_value
from paritylab.comparison.twins import (
    Twins,
    cast_proof,
    rounded_state,
    shifted_prints,
    twins,
    unwrap,
)
from paritylab.comparison.verify import CHANGED_AFTER, charge_hand_ons
from paritylab.tracing.structure import MASK, ModulePrint, fingerprint, rows_of
from paritylab.tracing.tracefile import CallRecord, Trace
from paritylab.tracing.values import floating, iter_tensors

LIFTED_CHANGE = "lifted_changed_after_rel_l2"
"""A lifted row's metric: how much the candidate changes its value after it in float32, beyond float32's rounding
(judged against the row's float32 tolerance): see :meth:`LiftedReplay.changed_after`."""


CODE_AGREES = 1e-5
"""A lifted row within this relative L2 error shows the candidate's code computing what the reference's does: fp32
pairs of independent implementations agree to about 1e-6; a 1e-3 code difference is a hundred times more."""


@dataclass(frozen=True)
class LiftedReplay:
    """Both sides replayed in float32 with the candidate's low-precision weights (see the module's text)."""

    dtype: str
    """The candidate's precision, whose weights both sides hold (``bfloat16``, ``float16``)."""
    reference: Trace
    """The reference, parameters rounded to :attr:`dtype`, run in float32."""
    candidate: Trace
    """The candidate in float32 (its weights are exact there), replayed on that run's values."""
    eligible: frozenset[str]
    """Reference call keys of the pairs whose weights are provably the same on both sides."""
    alignment: Alignment
    observers: frozenset[str] = frozenset()
    """Reference call keys of the pairs whose candidate module holds nothing (a hook point): judged only where
    the comparison found it handed its counterpart's output (``Row.observed``), the value being the proof."""
    fed: frozenset[str] = frozenset()
    """Reference call keys of the pairs whose candidate module computed from the reference's input (leaves with
    the same weights): their output is their own code's whatever they were handed, which the rows still show
    (a parent's code that handed them another value is found from that)."""
    sources: frozenset[str] = frozenset()
    """Candidate module paths that hold no parameter and no state a cast rounded (:func:`exact_sources`): a value
    such a module made from positions or other cast-proof inputs alone (rotary frequencies computed once and
    handed to every attention) is the one the candidate computes in float32, counterpart or none."""
    handed_on: frozenset[str] = frozenset()
    """Candidate call keys that returned their input bit for bit in the candidate's own run (hook points): one that
    changes it in the lifted replay is code the candidate's precision rounded away
    (:func:`~paritylab.comparison.verify.charge_hand_ons`)."""
    made_with: Twins | None = None
    """What the two lifted copies were made with (:func:`~paritylab.comparison.twins.twins`): a drill-down into a
    lifted origin makes its copies the same way."""
    copies: bool = False
    """The lifted sides ran as float32 copies of both models, because the models could not run converted in place
    (:func:`~paritylab.run.lifting.lift`): a drill-down into a lifted origin makes copies too."""
    _judged: dict[tuple[object, ...], dict[str, Row]] = field(default_factory=dict, compare=False, repr=False)
    """Rows already judged, per set of tolerances (the run's guard and its judgement read the same rows)."""

    def judged(self, tolerances: Tolerances | None = None) -> dict[str, Row]:
        """Reference call key -> the lifted comparison's row, for the eligible pairs (float32 tolerances)."""
        tolerances = tolerances or Tolerances()
        key = (tolerances.rtol, tolerances.atol, tuple(tolerances.overrides))
        if key not in self._judged:
            self._judged[key] = self._judge(tolerances)
        return self._judged[key]

    def _judge(self, tolerances: Tolerances) -> dict[str, Row]:
        report = compare_traces(self.reference, self.candidate, alignment=self.alignment, tolerances=tolerances)
        margin = DIVERGENCE_MARGIN * max(tolerances.resolve("", "float32").rtol, 1e-12)
        charge_hand_ons(report.rows, self.reference, self.candidate, self.alignment, self.handed_on, margin)
        for row in report.rows:  # a change beyond float32's rounding (a replay's own values differ by rounding)
            change = row.metrics.get(CHANGED_AFTER)
            if change is not None and change > DIVERGENCE_MARGIN * tolerances.resolve(row.path, "float32").rtol:
                row.metrics[LIFTED_CHANGE] = change
        rows = {
            row.reference.key: row
            for row in report.rows
            if row.reference.key in self.eligible
            or (row.observed and row.reference.key in self.observers)
            or LIFTED_CHANGE in row.metrics  # code that hands values on changed its value (no weights involved)
        }
        for row in rows.values():
            if row.input_diverged and not self._floating_input(row):
                row.input_diverged = False  # token or position ids: what each side chose to pass, not values
        return rows

    def changed_after(self, row: Row | None) -> str | None:
        """Why the candidate changes ``row``'s value after it in float32, by more than float32's rounding
        (:data:`LIFTED_CHANGE`: a hook point returned another value than it was handed,
        :func:`~paritylab.comparison.verify.charge_hand_ons`, or a wrapper another than its child's, the pair checks
        of :func:`~paritylab.comparison.verify.verify_pairs`), or ``None``. No weight takes part in such a change,
        and an identity's float32 copy returns its input bit for bit: the change is code, although the candidate's
        own precision rounded it away."""
        if row is None or LIFTED_CHANGE not in row.metrics:
            return None
        return f"{row.note}, with the same {self.dtype} weights computed in float32"

    def own_error(self, row: Row | None) -> str | None:
        """Why a lifted row shows an error in its module's own code, or ``None`` when it does not (or cannot
        tell: not compared, fed another value, or its code rounds to low precision itself)."""
        if row is None or row.status != "compared" or not row.diverged or CHANGED_AFTER in row.metrics:
            return None  # a value changed after it is no error of its own (:meth:`changed_after`)
        if row.reference.key in self.fed:  # it computed from the reference's own input
            return None if self._rounds(row) else self._own_error(row)
        if row.input_diverged:
            return None
        if self._rounds(row) or not (row.observed or self._fed_alike(row.reference.key)):
            return None  # an observed row's input agreed with its counterpart's output: checked there
        return self._own_error(row)

    def agrees(self, row: Row | None) -> bool:
        """The lifted row measures its module's own code, fed alike, and finds it the reference's: its error is
        within :data:`CODE_AGREES` (what two float32 implementations of one computation differ by)."""
        if row is None or row.status != "compared" or CHANGED_AFTER in row.metrics:
            return False
        error = relative_error(row.metrics)
        if error is None or error > CODE_AGREES or row.metrics.get("nan_mismatch") or row.metrics.get("inf_mismatch"):
            return False
        if row.reference.key in self.fed:
            return not self._rounds(row)
        if row.input_diverged or self._rounds(row):
            return False
        return row.observed or self._fed_alike(row.reference.key)

    def _own_error(self, row: Row) -> str:
        error = relative_error(row.metrics)
        size = f"{error:.2e} relative error" if error is not None else "NaN/Inf"
        return f"own code differs with the same {self.dtype} weights computed in float32: {size}"

    def gave_another_input(self, row: Row | None, parent: Row | None) -> bool:
        """The parent module's own code, between its children, gave ``row``'s module another floating-point
        input: that input differs while the parent (its weights the same) was fed alike and every paired module
        before was given its counterpart's value. ``row`` and ``parent`` are lifted rows."""
        if row is None or parent is None or not row.input_diverged or not self._floating_input(row):
            return False
        if not (row.diverged or row.reference.key in self.fed):  # a fed module's output is its own code's alone
            return False
        return parent.status == "compared" and not parent.input_diverged and self._fed_alike(parent.reference.key)

    def _fed_alike(self, key: str) -> bool:
        """Every floating-point value the candidate module received (not only the one compared as its input)
        is one its counterpart received: a module fed a second value from code upstream that differs (a key
        and value computed apart from the query) is not where that difference starts. For a run of modules,
        what the run's first received."""
        pair = next(pair for pair in self.alignment.pairs if pair.reference == key)
        received = _floating_inputs(self.reference, pair.reference_input or pair.reference)
        order = pair.candidate_input_part  # input features in another order (its weight's columns say so)
        for node, value in _floating_nodes(self.candidate, pair.candidate_input or pair.candidate):
            if cast_proof(value):
                continue  # a mask or an index-like table: what each side chose to build
            readings = [value]
            if order is not None and order.indices is not None and value.shape[-1] == len(order.indices):
                readings.append(order.select(value))
            alike = any(_same_values(reading, other) for reading in readings for other in received)
            if not alike and not self._exact(node):
                return False
        return True

    def _exact(self, node: dict[str, object]) -> bool:
        """The value was made in the lifted replay by a module of :attr:`sources` from cast-proof inputs alone."""
        origin = node.get("from")
        if not isinstance(origin, int) or not 0 <= origin < len(self.candidate.calls):
            return False
        call = self.candidate.calls[origin]
        if call.path not in self.sources:
            return False
        made = (self.candidate.tensor(n) for _, n in iter_tensors(call.inputs, "inputs"))
        return all(v is not None and (not v.is_floating_point() or cast_proof(v)) for v in made)

    def _floating_input(self, row: Row) -> bool:
        node = next((node for _, node in iter_tensors(self.reference.calls[row.input_call].inputs, "inputs")), None)
        return node is not None and floating(node)

    def _rounds(self, row: Row) -> bool:
        """The candidate module's float32 output lies on the low-precision grid: its code casts to that
        precision itself (hard-coded), so its lifted error is rounding, not evidence."""
        if row.candidate is None:
            return False
        value = slot_value(self.candidate, row.candidate.key, row.candidate.slot, None)
        if value is None or not value.is_floating_point() or value.numel() < 16:
            return False
        low = getattr(torch, self.dtype)
        return bool((value.to(low).to(value.dtype) == value).all())


def lifts(reference: nn.Module, candidate: nn.Module) -> torch.dtype | None:
    """The candidate's low precision when a lifted replay applies: every floating-point parameter of the
    candidate in bfloat16 or float16 (one of them) or wider, some in low precision, and the reference wider."""
    low = {p.dtype for p in unwrap(candidate).parameters() if p.dtype in (torch.bfloat16, torch.float16)}
    if len(low) != 1 or any(p.dtype in (torch.bfloat16, torch.float16) for p in unwrap(reference).parameters()):
        return None
    return low.pop()


def same_weights(
    reference: nn.Module,
    candidate: nn.Module,
    reference_trace: Trace,
    candidate_trace: Trace,
    alignment: Alignment,
    dtype: torch.dtype,
    found: Twins | None = None,
) -> frozenset[str]:
    """Reference call keys of the pairs whose two modules hold the same weights once the reference's are
    rounded to ``dtype`` (see the module's text for the conditions). ``found``: :func:`twins`, if computed."""
    grid = "fp16" if dtype == torch.float16 else "bf16"
    found = found or twins(reference, candidate, dtype)
    prints = (shifted_prints(fingerprint(reference, grid), reference, found.shifted), fingerprint(candidate, grid))
    unsafe = rounded_state(candidate, dtype, found.proven)
    eligible = set()
    for pair in alignment.pairs:
        ref_calls, cand_calls = (
            _holders(pair, alignment, reference_trace, "reference"),
            _holders(pair, alignment, candidate_trace, "candidate"),
        )
        if any(call.path in unsafe for call in cand_calls):
            continue
        if any(call.path in found.folded for call in cand_calls) and pair.reference_input is not None:
            eligible.add(pair.reference)  # the lifted reference holds the candidate's fold, unfolded
            continue
        if pair.source == "weights" or _holds_finding(alignment, ref_calls, cand_calls):
            eligible.add(pair.reference)  # the weight ledger's defect inside: lifted, its own effect is measured
            continue
        sums = [_weights(side, calls) for side, calls in zip(prints, (ref_calls, cand_calls), strict=True)]
        if (sums[0] is not None and sums[0] == sums[1]) or _rows_of(prints, ref_calls, cand_calls):
            eligible.add(pair.reference)
    return frozenset(eligible)


def _holds_finding(alignment: Alignment, ref_calls: list[CallRecord], cand_calls: list[CallRecord]) -> bool:
    """The pair's two subtrees hold the two tensors of a weight ledger finding (the candidate's the reference's with a
    defect): what the lifted replay measures there is that defect, as bfloat16's rounding cannot hide it."""

    def within(path: str, calls: list[CallRecord]) -> bool:
        return any(not call.path or path == call.path or path.startswith(f"{call.path}.") for call in calls)

    return any(
        within(finding.candidate_module, cand_calls) and within(finding.reference_module, ref_calls)
        for finding in alignment.weights.differing
    )


def _rows_of(prints: tuple[dict[str, ModulePrint], dict[str, ModulePrint]], *calls: list[CallRecord]) -> bool:
    """Whether a module pair's candidate holds its reference's parameters, a table cut to a run of its rows
    (:func:`~paritylab.tracing.structure.rows_of`): the lifted reference then holds every row the candidate holds,
    rounded alike, and which rows each side's code reads is its code, judged as such."""
    if any(len(side) != 1 for side in calls):
        return False
    found = [prints[side].get(side_calls[0].path) for side, side_calls in enumerate(calls)]
    return found[0] is not None and found[1] is not None and rows_of(found[0], found[1])


def weightless(
    candidate: nn.Module, candidate_trace: Trace, alignment: Alignment, dtype: torch.dtype
) -> frozenset[str]:
    """Reference call keys of the pairs whose candidate module holds no parameter and no state a cast may have
    rounded (a hook point): see :attr:`LiftedReplay.observers`."""
    unsafe = rounded_state(candidate, dtype)
    found = set()
    for pair in alignment.pairs:
        if pair.reference_part or pair.candidate_part or pair.reference_input or pair.candidate_input:
            continue
        path = candidate_trace.call(pair.candidate).path
        module = candidate.get_submodule(path) if path else candidate
        if path not in unsafe and not any(True for _ in module.parameters()):
            found.add(pair.reference)
    return frozenset(found)


def _holders(pair: Pair, alignment: Alignment, trace: Trace, side: str) -> list[CallRecord]:
    """The calls on one side whose weights the pair's other side must hold: the module itself; for a run pair,
    each module of the run (its first to its last); for a fused module paired by parts, every module paired
    with one of its parts (q, k and v against one qkv)."""
    other = "candidate" if side == "reference" else "reference"
    if getattr(pair, f"{other}_part") is not None:  # the other side is fused: all of this side paired with it
        fused = getattr(pair, other)
        keys = {getattr(each, side) for each in alignment.pairs if getattr(each, other) == fused}
        return [trace.call(key) for key in sorted(keys)]
    last, first = trace.call(getattr(pair, side)), getattr(pair, f"{side}_input")
    if first is None:
        return [last]
    enclosing = set()  # modules the run's last is called inside: only their parts within the run belong to it
    parent = last.parent
    while parent is not None:
        enclosing.add(parent)
        parent = trace.calls[parent].parent
    span = [call for call in trace.calls[trace.call(first).index : last.index + 1] if call.index not in enclosing]
    inside = {call.index for call in span}
    return [call for call in span if call.parent not in inside]


def _weights(prints: dict[str, ModulePrint], calls: list[CallRecord]) -> tuple[int, int] | None:
    """The summed fingerprint and size of the weights the calls' modules hold (each module once)."""
    paths = {call.path for call in calls}
    found = [prints.get(path) for path in paths]
    if any(item is None for item in found):
        return None
    digest = sum(item.digest for item in found if item is not None) & MASK
    return digest, sum(item.numel for item in found if item is not None)


def _floating_inputs(trace: Trace, key: str) -> list[torch.Tensor]:
    return [value for _, value in _floating_nodes(trace, key)]


def _floating_nodes(trace: Trace, key: str) -> list[tuple[dict[str, object], torch.Tensor]]:
    nodes = (node for _, node in iter_tensors(trace.call(key).inputs, "inputs"))
    found = ((node, trace.tensor(node)) for node in nodes)
    return [(node, value) for node, value in found if value is not None and value.is_floating_point()]


def _same_values(value: torch.Tensor, other: torch.Tensor) -> bool:
    """``value`` holds ``other``'s values within float32's divergence margin (relative L2): element for
    element in another shape, or broadcast along a dimension one side keeps at size 1 (rotary tables given
    per sequence or per batch)."""
    value = in_layout(value, other.shape)  # a sequence-first side's value in the other's order of dimensions
    if value.shape != other.shape and value.numel() != other.numel():
        try:
            shape = torch.broadcast_shapes(value.shape, other.shape)
        except RuntimeError:
            return False
        value, other = value.expand(shape), other.expand(shape)
    a, b = value.reshape(-1).to(torch.float64), other.reshape(-1).to(torch.float64)
    return float((a - b).norm()) <= INPUT_MARGIN * max(float(b.norm()), 1e-30)


INPUT_MARGIN = DIVERGENCE_MARGIN * Tolerance.for_dtypes("float32").rtol
"""Two float32 values computed apart by the same code agree to about 1e-7 relative; this is the margin a
float32 row's input is judged with."""
