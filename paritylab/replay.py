"""Isolated replay (teacher forcing): each candidate module fed the reference's values, so its error is its own.

The candidate runs again under the tracer. After each aligned call has been recorded, its output is
replaced by the reference's value for that call (cast to the candidate's dtype and device; for a fused
module, only the aligned slice of the last dimension is replaced). Everything downstream therefore
receives reference inputs, and every recorded output carries only the error of the module that made it
(for a parent module, the error of its own code between its children).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paritylab.alignment import Alignment, Pair, Part, primary_slot
from paritylab.comparison import Report, compare_traces, relative_error
from paritylab.metrics import Tolerances
from paritylab.tracefile import Trace
from paritylab.tracing import TraceOptions, Tracer
from paritylab.values import iter_tensors


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
) -> Trace:
    """Trace ``run(candidate)`` with every aligned output replaced by the reference's value.

    ``candidate_trace`` (the free-running candidate trace) tells which output slot each pair compares.
    Pairs whose reference value was not saved, or whose shapes differ, are left as they are.
    """
    plan = _plan(reference, candidate_trace, alignment)
    counts: dict[str, int] = {}
    options = TraceOptions(save_tensors=directory is not None, capture=None)
    with Tracer(candidate, directory, options) as trace:
        handles = [
            module.register_forward_hook(_replacer(path, counts, plan)) for path, module in candidate.named_modules()
        ]
        try:
            run(candidate)
        finally:
            for handle in handles:
                handle.remove()
    trace.meta["replay"] = {"replaced_calls": len(plan)}
    return trace


def _plan(reference: Trace, candidate: Trace, alignment: Alignment) -> dict[str, list[_Replacement]]:
    """Candidate call key -> the reference values to put into its output."""
    plan: dict[str, list[_Replacement]] = {}
    for pair in alignment.pairs:
        replacement = _replacement(reference, candidate, pair)
        if replacement is not None:
            plan.setdefault(pair.candidate, []).append(replacement)
    return plan


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
        start, stop = pair.reference_part.bounds(value.shape[-1])
        value = value[..., start:stop]
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
    if replacement.cut is None:
        return new if new.shape == tensor.shape else tensor
    start, stop = replacement.cut.bounds(tensor.shape[-1])
    if tensor[..., start:stop].shape != new.shape:
        return tensor
    merged = tensor.clone()
    merged[..., start:stop] = new
    return merged


def attach_replay(report: Report, reference: Trace, replay: Trace, tolerances: Tolerances | None = None) -> Report:
    """Fill each row's ``local`` with the replay's error, its inherited (input) error and amplification;
    returns the comparison of the replay run itself."""
    replay_report = compare_traces(reference, replay, alignment=report.alignment, tolerances=tolerances)
    local_rows = {row.index: row for row in replay_report.rows}
    for row in report.rows:
        local = local_rows.get(row.index)
        own = relative_error(local.metrics) if local is not None else None
        if local is None or own is None:
            continue
        inherited = relative_error(row.input_metrics)
        output = relative_error(row.metrics)
        row.local = {"local_rel_l2": own, "local_diverged": float(local.diverged)}
        if inherited is not None:
            row.local["inherited_rel_l2"] = inherited
        if output is not None and inherited:
            row.local["amplification"] = output / inherited
    report.replay_origins = [row for row in report.rows if row.local.get("local_diverged")]
    return replay_report
