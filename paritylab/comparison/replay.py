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
from paritylab.tracing.tracefile import CallRecord, Trace
from paritylab.tracing.tracer import TraceOptions, trace_run
from paritylab.tracing.values import first_tensor_slot, floating, iter_tensors


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
    return _measured_replay(candidate, run, reference, candidate_trace, alignment, layers, forced=set(layers))


def own_errors(
    candidate: nn.Module,
    run: Callable[[nn.Module], Any],
    reference: Trace,
    candidate_trace: Trace,
    alignment: Alignment,
    measured: Collection[str],
) -> dict[str, float]:
    """The isolated replay's own error (relative L2) of each of ``measured`` (candidate call keys), every aligned
    call forced to the reference's value as :func:`isolated_replay` does, under ``alignment`` (which may put a
    module's reference values in another order than the free run's): the largest over a fused call's parts.
    Nothing is written: each output is measured as it is made."""
    return _measured_replay(candidate, run, reference, candidate_trace, alignment, measured, forced=None)


def _measured_replay(
    candidate: nn.Module,
    run: Callable[[nn.Module], Any],
    reference: Trace,
    candidate_trace: Trace,
    alignment: Alignment,
    measured: Collection[str],
    forced: Collection[str] | None,
) -> dict[str, float]:
    """The candidate run once with the calls in ``forced`` (all aligned calls: None) given the reference's values;
    each call in ``measured`` compared, before it is replaced, with its reference value(s)."""
    wanted: dict[str, list[_Replacement]] = {}
    for pair in alignment.pairs:
        if pair.candidate in measured and (found := _replacement(reference, candidate_trace, pair)) is not None:
            wanted.setdefault(pair.candidate, []).append(found)
    errors: dict[str, float] = {}
    counts: dict[str, int] = {}
    paths = {key.rsplit("#", 1)[0] for key in wanted}

    def measure(path: str) -> Callable[..., None]:
        def hook(_: nn.Module, __: tuple[Any, ...], output: Any) -> None:
            key = f"{path}#{counts.get(path, 0)}"
            counts[path] = counts.get(path, 0) + 1
            for target in wanted.get(key, ()):
                error = _error(_slot(output, target.slot.split(".")[1:]), target)
                if error is not None:
                    errors[key] = max(errors.get(key, 0.0), error)

        return hook

    with teacher_forcing(candidate, reference, candidate_trace, alignment, only=forced):
        handles = [  # before the forcing hooks: they see the call's own output, not the reference's
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


def _error(value: Any, target: _Replacement) -> float | None:
    """Relative L2 of ``value`` (a call's output, its part ``target.cut``) against the reference's value."""
    if not isinstance(value, torch.Tensor):
        return None
    if target.cut is not None:
        value = target.cut.select(value)
    expected = target.value.to(device=value.device, dtype=torch.float64)
    value = in_layout(value, expected.shape)
    if value.shape != expected.shape:
        return None
    difference = float(torch.linalg.vector_norm(value.detach().to(torch.float64) - expected))
    return difference / max(float(torch.linalg.vector_norm(expected)), 1e-30)


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
    """Candidate call key -> the reference values to put into its output (for the calls in ``only``, if given),
    and the same for the candidate's unpaired calls that repeat a planned one (:func:`_repeats`)."""
    plan: dict[str, list[_Replacement]] = {}
    for pair in alignment.pairs:
        if only is not None and pair.candidate not in only:
            continue
        replacement = _replacement(reference, candidate, pair)
        if replacement is not None:
            plan.setdefault(pair.candidate, []).append(replacement)
            plan[pair.candidate].extend(_other_outputs(reference, candidate, pair, replacement.slot))
    paired = {pair.candidate for pair in alignment.pairs}
    for repeat, source in _repeats(candidate, plan, paired).items():
        plan[repeat] = plan[source]
    return plan


def _repeats(candidate: Trace, plan: Mapping[str, list[_Replacement]], paired: Collection[str]) -> dict[str, str]:
    """Unpaired candidate calls of a planned call's module given the very same inputs (every tensor the same
    stored value, the rest alike): the same computation done again (TransformerLens normalises the residual
    once for the queries, once for the keys and once for the values, where the reference does it once). Each is
    forced as its planned call is, so what it feeds is fed the reference's value too. Repeat key -> planned key."""
    by_path: dict[str, list[CallRecord]] = {}
    for call in candidate.calls:
        by_path.setdefault(call.path, []).append(call)
    found: dict[str, str] = {}
    for key in plan:
        source = candidate.call(key)
        for other in by_path.get(source.path, []):
            if other.key in paired or other.key in plan or other.key in found:
                continue
            if _same_inputs(candidate, source, other):
                found[other.key] = key
    return found


def _same_inputs(trace: Trace, first: CallRecord, second: CallRecord) -> bool:
    """Both calls were given the same values: the same tensor slots, each the same stored tensor or equal
    values (bit for bit), and alike otherwise."""
    mine, theirs = dict(iter_tensors(first.inputs, "inputs")), dict(iter_tensors(second.inputs, "inputs"))
    if not mine or mine.keys() != theirs.keys() or _skeleton(first.inputs) != _skeleton(second.inputs):
        return False  # alike before any tensor is read
    for slot, node in mine.items():
        other = theirs[slot]
        if node.get("ref") is not None and node.get("ref") == other.get("ref"):
            continue
        if node.get("shape") != other.get("shape") or node.get("dtype") != other.get("dtype"):
            return False
        value, given = trace.tensor(node), trace.tensor(other)
        if value is None or given is None or not torch.equal(value, given):
            return False
    return True


def _skeleton(node: Any) -> Any:
    """A value tree without its tensors' contents (what is left to be alike between two calls' inputs)."""
    if isinstance(node, dict):
        if node.get("t") == "tensor":
            return ("tensor", tuple(node.get("shape") or ()), node.get("dtype"))
        return {key: _skeleton(value) for key, value in node.items() if key not in ("from", "ref", "stats", "changed")}
    if isinstance(node, list):
        return [_skeleton(value) for value in node]
    return node


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
        if not floating(node):
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
