"""Isolated replay (teacher forcing): each candidate module fed the reference's values, so its error is its own.

The candidate runs again under the tracer. After each aligned call has been recorded, its output is
replaced by the reference's value for that call (cast to the candidate's dtype and device; for a fused
module, only the aligned slice of the last dimension is replaced). Everything downstream therefore
receives reference inputs, and every recorded output carries only the error of the module that made it
(for a parent module, the error of its own code between its children).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paritylab.comparison.alignment import (
    Alignment,
    Pair,
    Part,
    broadcastable,
    in_layout,
    merged,
    primary_slot,
    transposed,
)
from paritylab.comparison.lifted import LiftedReplay
from paritylab.comparison.metrics import Tolerances, systematic_z
from paritylab.comparison.report import (
    Report,
    Row,
    ancestors,
    compare_traces,
    innermost,
    producer_row,
    received_calls,
    relative_error,
    slot_value,
    unmatched_feeding,
    unmatched_maker,
)
from paritylab.comparison.verify import CHANGED_AFTER
from paritylab.tracing.tracefile import CallRecord, Trace
from paritylab.tracing.tracer import TraceOptions, trace_run
from paritylab.tracing.values import first_tensor_slot, iter_tensors


@dataclasses.dataclass
class _Replacement:
    slot: str
    value: torch.Tensor
    cut: Part | None


def isolated_replay(
    candidate: nn.Module,
    run: Callable[[nn.Module], Any],
    reference: Trace,
    candidate_trace: Trace,
    alignment: Alignment,
    directory: str | Path | None = None,
    fingerprint: bool = False,
    fed: Collection[str] = (),
) -> Trace:
    """Trace ``run(candidate)`` with every aligned output replaced by the reference's value.

    ``candidate_trace`` (the free-running candidate trace) tells which output slot each pair compares.
    Pairs whose reference value was not saved, or whose shapes differ, are left as they are. ``fed`` (candidate
    call keys): those calls also compute from the reference's value of their first input, whatever the code
    before them made of it; the trace still records the input they were handed (the lifted replay: a module whose
    input passes through code a cast rounded, such as a rotary table cached in bfloat16, is judged on its own).
    """
    options = TraceOptions(save_tensors=directory is not None, capture=None, fingerprint=fingerprint)
    replaced = 0

    def forced(model: nn.Module) -> None:
        nonlocal replaced
        with (
            teacher_forcing(model, reference, candidate_trace, alignment) as replaced,
            feeding(model, reference, candidate_trace, alignment, fed),
        ):
            run(model)

    trace = trace_run(candidate, forced, Path(directory) if directory is not None else None, options).trace
    trace.meta["replay"] = {"replaced_calls": replaced}
    return trace


@contextmanager
def teacher_forcing(
    candidate: nn.Module,
    reference: Trace,
    candidate_trace: Trace,
    alignment: Alignment,
    within: str | None = None,
    only: Collection[str] | None = None,
) -> Iterator[int]:
    """While inside, every aligned call of ``candidate`` returns the reference's value (yields how many calls
    are replaced). Hooks registered inside see the replaced outputs. Given ``within`` (a candidate call key),
    that call and the calls inside it run as they are: only what feeds it is forced. Given ``only`` (candidate
    call keys), just those calls are forced."""
    plan = _plan(reference, candidate_trace, alignment, only)
    if within is not None:
        for key in _inside(candidate_trace, within):
            plan.pop(key, None)
    counts: dict[str, int] = {}
    handles = [
        module.register_forward_hook(_replacer(path, counts, plan)) for path, module in candidate.named_modules()
    ]
    try:
        yield len(plan)
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def feeding(
    candidate: nn.Module, reference: Trace, candidate_trace: Trace, alignment: Alignment, fed: Collection[str]
) -> Iterator[None]:
    """While inside, each candidate call in ``fed`` computes from its counterpart's first input (the reference's
    value, in the candidate's order of dimensions) instead of the one it was handed. Hooks registered before see
    the input it was handed."""
    plan: dict[str, list[_Replacement]] = {}
    for pair in alignment.pairs:
        if pair.candidate in fed and (found := fed_value(reference, candidate_trace, pair)) is not None:
            plan[pair.candidate] = [found]
    counts: dict[str, int] = {}
    paths = {key.rsplit("#", 1)[0] for key in plan}
    handles = [
        module.register_forward_pre_hook(_feeder(path, counts, plan), with_kwargs=True)
        for path, module in candidate.named_modules()
        if path in paths
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def fed_value(reference: Trace, candidate: Trace, pair: Pair) -> _Replacement | None:
    """The reference's first input of a pair of whole modules, for the candidate's first input slot (in the
    candidate's order of features, where its weight's columns say the order differs); ``None`` when there is none
    to feed (a part of a fused module, a run of modules, an input that is not floating point)."""
    if pair.reference_part or pair.candidate_part or pair.reference_input or pair.candidate_input:
        return None
    ref_call, cand_call = reference.call(pair.reference), candidate.call(pair.candidate)
    ref_slot, cand_slot = first_tensor_slot(ref_call.inputs, "inputs"), first_tensor_slot(cand_call.inputs, "inputs")
    if ref_slot is None or cand_slot is None:
        return None
    node = dict(iter_tensors(ref_call.inputs, "inputs")).get(ref_slot)
    value = reference.tensor(node) if node is not None else None
    if value is None or not value.is_floating_point():
        return None
    return _Replacement(cand_slot, value, pair.candidate_input_part)


def _feeder(path: str, counts: dict[str, int], plan: Mapping[str, list[_Replacement]]) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        index = counts.get(path, 0)
        counts[path] = index + 1
        replacements = plan.get(f"{path}#{index}")
        if not replacements:
            return None
        parts = replacements[0].slot.split(".")[1:]  # ["args", "0"] or ["kwargs", name]
        if parts[0] == "args":
            return replace_slot(args, parts[1:], replacements[0]), kwargs
        return args, replace_slot(kwargs, parts[1:], replacements[0])

    return hook


def _inside(trace: Trace, key: str) -> set[str]:
    """``key`` and the keys of every call made inside it."""
    inside = {trace.call(key).index}
    for call in trace.calls:  # a parent starts before its children
        if call.parent in inside:
            inside.add(call.index)
    return {trace.calls[index].key for index in inside}


def layer_replay(
    candidate: nn.Module,
    run: Callable[[nn.Module], Any],
    reference: Trace,
    candidate_trace: Trace,
    alignment: Alignment,
    layers: Collection[str],
) -> dict[str, float]:
    """Each of ``layers`` (candidate call keys: a tower's numbered blocks) fed the reference's input and run
    whole: the candidate runs once more with only those calls' outputs forced to the reference's, so each
    layer's output error is everything that happens inside it and nothing before. Returns candidate call key ->
    that relative L2 error (what a per-layer "own error" chart shows: the isolated replay's own error of a
    layer is only its code between its children). Nothing is written: each output is measured as it is made."""
    wanted = {
        pair.candidate: found
        for pair in alignment.pairs
        if pair.candidate in layers and (found := _replacement(reference, candidate_trace, pair)) is not None
    }
    errors: dict[str, float] = {}
    counts: dict[str, int] = {}
    paths = {key.rsplit("#", 1)[0] for key in wanted}

    def measure(path: str) -> Callable[..., None]:
        def hook(_: nn.Module, __: tuple[Any, ...], output: Any) -> None:
            key = f"{path}#{counts.get(path, 0)}"
            counts[path] = counts.get(path, 0) + 1
            target = wanted.get(key)
            value = _slot(output, target.slot.split(".")[1:]) if target is not None else None
            if target is None or not isinstance(value, torch.Tensor):
                return
            if target.cut is not None:
                value = target.cut.select(value)
            expected = target.value.to(device=value.device, dtype=torch.float64)
            value = in_layout(value, expected.shape)
            if value.shape == expected.shape:
                difference = float(torch.linalg.vector_norm(value.detach().to(torch.float64) - expected))
                errors[key] = difference / max(float(torch.linalg.vector_norm(expected)), 1e-30)

        return hook

    with teacher_forcing(candidate, reference, candidate_trace, alignment, only=set(wanted)):
        handles = [  # before the forcing hooks: they see the layer's own output, not the reference's
            module.register_forward_hook(measure(path), prepend=True)
            for path, module in candidate.named_modules()
            if path in paths
        ]
        try:
            with torch.no_grad():
                run(candidate)
        finally:
            for handle in handles:
                handle.remove()
    return errors


def _slot(value: Any, parts: list[str]) -> Any:
    """The value at ``parts`` (a slot path without its ``outputs`` head) inside a module's output."""
    for head in parts:
        if isinstance(value, tuple | list) and head.isdigit() and int(head) < len(value):
            value = value[int(head)]
        elif isinstance(value, Mapping) and head in value:
            value = value[head]
        elif dataclasses.is_dataclass(value) and not isinstance(value, type) and hasattr(value, head):
            value = getattr(value, head)
        else:
            return None
    return value


def _plan(
    reference: Trace, candidate: Trace, alignment: Alignment, only: Collection[str] | None = None
) -> dict[str, list[_Replacement]]:
    """Candidate call key -> the reference values to put into its output (for the calls in ``only``, if given)."""
    plan: dict[str, list[_Replacement]] = {}
    for pair in alignment.pairs:
        if only is not None and pair.candidate not in only:
            continue
        replacement = _replacement(reference, candidate, pair)
        if replacement is not None:
            plan.setdefault(pair.candidate, []).append(replacement)
            plan[pair.candidate].extend(_other_outputs(reference, candidate, pair, replacement.slot))
    return plan


def _other_outputs(reference: Trace, candidate: Trace, pair: Pair, primary: str) -> list[_Replacement]:
    """The pair's other output tensors where both sides return the same structure (a rotary module's ``sin``
    beside its ``cos``, an attention's weights beside its output): the same slot, shape and floating dtype on
    both sides, so the module downstream is fed all of the reference's values, not only the compared one."""
    if pair.reference_part is not None or pair.candidate_part is not None or pair.reference_index is not None:
        return []
    ref_call, cand_call = reference.call(pair.reference), candidate.call(pair.candidate)
    theirs = dict(iter_tensors(cand_call.outputs, "outputs"))
    found = []
    for slot, node in iter_tensors(ref_call.outputs, "outputs"):
        other = theirs.get(slot)
        if slot == primary or other is None or other.get("shape") != node.get("shape"):
            continue
        if not str(node.get("dtype", "")).startswith(("float", "bfloat")):
            continue
        value = reference.tensor(node)
        if value is not None:
            found.append(_Replacement(slot, value, None))
    return found


def _replacement(reference: Trace, candidate: Trace, pair: Pair) -> _Replacement | None:
    ref_call, cand_call = reference.call(pair.reference), candidate.call(pair.candidate)
    ref_slot, cand_slot = primary_slot(ref_call, pair.reference_index), primary_slot(cand_call, pair.candidate_index)
    if ref_slot is None or cand_slot is None:
        return None
    ref_node = dict(iter_tensors(ref_call.outputs, "outputs")).get(ref_slot)
    value = reference.tensor(ref_node) if ref_node is not None else None
    if value is None:
        return None
    if pair.reference_part is not None:
        value = pair.reference_part.select(value)
    return _Replacement(cand_slot, value, pair.candidate_part)


def _replacer(path: str, counts: dict[str, int], plan: Mapping[str, list[_Replacement]]) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        index = counts.get(path, 0)
        counts[path] = index + 1
        replacements = plan.get(f"{path}#{index}")
        if not replacements:
            return None
        for replacement in replacements:
            output = replace_slot(output, replacement.slot.split(".")[1:], replacement)
        return output

    return hook


def replace_slot(value: Any, parts: list[str], replacement: _Replacement) -> Any:
    """A copy of ``value`` with the tensor at ``parts`` swapped for the replacement (same shape only)."""
    if not parts:
        if not isinstance(value, torch.Tensor):
            return value
        return _swap(value, replacement)
    head, rest = parts[0], parts[1:]
    if isinstance(value, tuple | list) and head.isdigit() and int(head) < len(value):
        items = list(value)
        items[int(head)] = replace_slot(items[int(head)], rest, replacement)
        return type(value)(items) if isinstance(value, list) or type(value) is tuple else type(value)(*items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and hasattr(value, head):
        return dataclasses.replace(value, **{head: replace_slot(getattr(value, head), rest, replacement)})
    if isinstance(value, Mapping) and head in value:
        copied = dict(value)
        copied[head] = replace_slot(value[head], rest, replacement)
        return copied
    return value


def _swap(tensor: torch.Tensor, replacement: _Replacement) -> torch.Tensor:
    new = replacement.value.to(device=tensor.device, dtype=tensor.dtype)
    if new is replacement.value:  # the reference trace's own tensor: code that changes it in place must not reach it
        new = new.clone()
    if replacement.cut is None:
        if transposed(tensor.shape, new.shape) is not None:  # the reference's value in the candidate's order
            new = in_layout(new, tensor.shape)
        elif new.shape != tensor.shape and broadcastable(list(new.shape), list(tensor.shape)):
            new = new.expand(torch.broadcast_shapes(new.shape, tensor.shape))  # a size-1 dimension one side kept
        elif merged(list(new.shape), list(tensor.shape)):
            new = new.reshape(tensor.shape)  # one side merged its leading dimensions
        return new if new.shape == tensor.shape else tensor
    cut = replacement.cut
    new = in_layout(new, cut.select(tensor).shape)
    if cut.select(tensor).shape != new.shape:
        return tensor
    combined = tensor.clone()
    if cut.indices is not None:
        combined[..., list(cut.indices)] = new
    else:
        start, stop = cut.bounds(tensor.shape[-1])
        combined[..., start:stop] = new
    return combined


def attach_replay(
    report: Report,
    reference: Trace,
    replay: Trace,
    tolerances: Tolerances | None = None,
    local_floor: Mapping[str, Mapping[str, float]] | None = None,
    floor_replay: Trace | None = None,
    lifted: LiftedReplay | None = None,
    floor_loosens_only: bool = False,
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
    float32 gives that module's code (:func:`_beyond_float32_rounding`).
    """
    lifted_rows = lifted.judged(tolerances) if lifted is not None else {}
    replay_report = compare_traces(reference, replay, alignment=report.alignment, tolerances=tolerances)
    report = report.copy()
    local_rows = {row.index: row for row in replay_report.rows}
    parts = {pair.reference: (pair.reference_part, pair.candidate_part) for pair in report.alignment.pairs}
    fed_wrong: dict[int, tuple[Row, str]] = {}
    by_index = {row.index: row for row in report.rows}
    received = received_calls(reference)
    fed_from = {pair.candidate: pair.candidate_input or pair.candidate for pair in report.alignment.pairs}
    exact = exact_pair(replay_report.rows)
    widest = widest_floors(reference, local_floor) if floor_loosens_only and local_floor else {}
    for row in report.rows:
        local = local_rows.get(row.index)
        own = relative_error(local.metrics) if local is not None else None
        if local is None or own is None:
            continue
        inherited = relative_error(row.input_metrics)
        output = relative_error(row.metrics)
        floor = (local_floor or {}).get(row.reference.key)
        reason, systematic, coded = None, None, False
        if floor is not None:
            systematic = _systematic(reference, replay, floor_replay, local, parts) if floor_replay else None
            reason = beyond_floor(local.metrics, floor, row.reference.dtype, systematic)
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
            blamed = _unreplaced_source(row, by_index, reference, received)
            if blamed is not None:  # not its own error: it was given a value the replay could not replace
                fed_wrong.setdefault(blamed[0].index, blamed)
                diverged, reason = False, None
        lifted_row, lifted_found = lifted_rows.get(row.reference.key), False
        if not diverged and lifted is not None:
            why = lifted.own_error(lifted_row)
            parent = by_index.get(row.parent) if row.parent is not None else None
            if why is not None:  # its code, not the precision: the same weights in float32 disagree
                diverged, reason, lifted_found = True, why, True
            elif parent is not None and lifted.gave_another_input(lifted_row, lifted_rows.get(parent.reference.key)):
                note = f"its own code between its children gives {row.path or '<root>'} a value the reference does not"
                note += f", with the same {lifted.dtype} weights computed in float32 (lifted replay)"
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
    _name_culprit(report, reference, replay, low_precision=local_floor is not None and not floor_loosens_only)
    named = report.first_divergence
    if named is not None and any(culprit is named for culprit, _ in fed_wrong.values()):
        report.culprit_reason = named.note  # what it gave which module, not "its input agrees"
    return report


def _systematic(
    reference: Trace, replay: Trace, floor_replay: Trace, local: Row, parts: Mapping[str, tuple[Part | None, ...]]
) -> dict[str, float] | None:
    """:func:`systematic_z` of a row's replayed output against the low-precision reference's, on the
    reference's output (``None`` when a value is missing or the layouts differ)."""
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
    if not str(node.get("dtype", "")).startswith(("float", "bfloat")):
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
    row: Row, by_index: Mapping[int, Row], reference: Trace, received: set[int]
) -> tuple[Row, str] | None:
    """Where a value the replay could not replace was made: the module whose value the candidate changes after it
    (:func:`~paritylab.comparison.verify.verify_pairs` charged it) or with no counterpart that produced the row's
    input (data flow, through folded calls), else the parent's own code between its children."""
    where = row.path or "<root>"
    producer = producer_row(dict(by_index), reference, row)
    if producer is not None and CHANGED_AFTER in producer.metrics:  # the candidate changed its value on the way
        return producer, producer.note
    if producer is not None and producer.status == "unmatched":
        note = f"no counterpart, and its output reaches {where} changed while everything paired before it agrees"
        return producer, note + " (isolated replay)"
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
_MIN_FLOOR = {"bfloat16": 2e-3, "float16": 2.5e-4, "float32": 3e-8}
"""Smallest local floor assumed per dtype: a quarter of its machine epsilon (exact reference modules)."""


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


def beyond_floor(
    metrics: Mapping[str, float],
    floor: Mapping[str, float],
    dtype: str | None,
    systematic: Mapping[str, float] | None = None,
) -> str | None:
    """Why a module's own low-precision error is more than rounding, or ``None`` when it is not.

    Rounding error is unbiased: it has no part along the output and no constant part beyond what the
    reference's own rounding shows, while a wrong scale, offset, eps or activation has one. ``systematic``
    (:func:`~paritylab.comparison.metrics.systematic_z` against the reference's own low-precision output)
    measures that part directly, with its standard error. Noise-like errors can only be told from rounding
    by their size.
    """
    if metrics.get("nan_mismatch") or metrics.get("inf_mismatch"):
        return "NaN/Inf the reference does not produce"
    rel_floor = max(floor.get("rel_l2", 0.0), _MIN_FLOOR.get(dtype or "", 0.0), 1e-12)
    rel = metrics.get("rel_l2", 0.0) / rel_floor
    if rel > REL_MULTIPLE:
        return f"own error {rel:.1f}x its local noise floor"
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


def _name_culprit(report: Report, reference: Trace, replay: Trace, low_precision: bool) -> None:
    """One culprit from the free-run origins and the replay's own errors (both sides of the evidence).

    - a free-run origin with no counterpart (an unmatched stretch) stands: replay cannot see inside it;
    - a free-run origin whose own error the replay confirms stands;
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
    if earlier and first is not None:  # the free run took a later module for the start: its input only seemed to agree
        chosen = earlier[0]
        reason = f"its own error (isolated replay) diverges before the free-run origin {first.path or '<root>'}"
        reason += ", whose own error does not" if first is not None and not first.local.get("local_diverged") else ""
    elif inside:
        chosen, reason = inside[0], "its own error (isolated replay) diverges inside the free-run origin"
    elif low_precision or first is None:
        if first is None and report.passed:
            return
        chosen, reason = replayed[0], "the earliest module whose own error (isolated replay) exceeds its local floor"
        if chosen.local.get("lifted_diverged"):
            reason = "the earliest module whose own code differs with the same low-precision weights in float32"
            reason += " (lifted replay)"
    if chosen is None:
        return
    maker = unmatched_maker(chosen, report.rows, reference, replay, report.alignment)
    if maker is not None:  # the culprit only hands on what a module with no counterpart made inside it
        maker.diverged, maker.verdict, chosen.cause = True, "fail", "contains-origin"
        maker.note = maker.note or f"it made {chosen.path or '<root>'}'s output, whose own error diverges"
        reason = f"it made {chosen.path or '<root>'}'s output, whose own error (isolated replay) diverges; it has no"
        reason += " counterpart in the candidate"
        chosen = maker
    report.first_divergence, report.culprit_reason = chosen, reason
    report.origins = [chosen, *(row for row in report.origins if row is not chosen)]
    chosen.cause = "origin"
