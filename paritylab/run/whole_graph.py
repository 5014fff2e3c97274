"""A compiled candidate, run once more as one graph: what the tracer's graph breaks could hide.

Tracing a ``torch.compile`` model runs the tracer's hooks eagerly, so the compiler breaks its graph at every
traced module: what was compared is the candidate compiled piece by piece. Fusion across module boundaries,
a different lowering, or a bug that needs the whole graph to appear is not in that trace. This phase runs the
compiled candidate once more with no hook installed (one graph, as it is deployed) and judges its output, with
the output row's tolerance, against its own traced output and against the reference's. Within either, the graph
breaks hid nothing. Outside both, the run fails: the graph breaks hid a difference, and no module can be named
inside one graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paritylab.comparison.metrics import divergence, within
from paritylab.comparison.report import Report
from paritylab.tracing.tracefile import Trace
from paritylab.tracing.tracer import is_compiled
from paritylab.tracing.values import Node, encode, iter_tensors


def check_whole_graph(
    report: Report, model: nn.Module, call: Callable[[nn.Module], Any], reference: Trace, candidate: Trace
) -> dict[str, Any] | None:
    """Run the compiled ``model`` untraced and judge its output (at the report's output row) against the
    reference's and its own traced output. ``None`` for a model that is not compiled; a ``verdict`` of
    ``pass``, ``fail`` or ``unchecked`` (nothing to compare it with: no output row, or no saved values)."""
    if not is_compiled(model):
        return None
    row = report.output_row
    if row is None or row.candidate is None or row.tolerance is None or row.candidate.slot is None:
        return not_checked("the report has no compared output row")
    reference_value = _traced(reference, row.reference.key, row.reference.slot)
    traced_value = _traced(candidate, row.candidate.key, row.candidate.slot)
    if reference_value is None or traced_value is None:
        return not_checked("the traced outputs hold no values")
    # Dynamo does not guard on module hooks: without a reset, the code compiled around the tracer's hooks (in
    # pieces) would run again. After the run, reset again so later traced runs compile with their hooks.
    torch.compiler.reset()
    try:
        with torch.no_grad():
            output = call(model)
    except Exception as error:  # the graph it is deployed as does not run: that is the finding
        return {
            "verdict": "fail",
            "module": row.path,
            "message": f"the compiled candidate run as one graph (no graph breaks) raised {type(error).__name__}: "
            f"{' '.join(line.strip() for line in str(error).splitlines() if line.strip())[:300]}; traced in pieces "
            "it ran",
        }
    finally:
        torch.compiler.reset()
    whole = _slot(output, row.candidate.slot)
    if whole is None or whole.shape != traced_value.shape or whole.numel() != reference_value.numel():
        return not_checked(f"the untraced output has no tensor at {row.candidate.slot} shaped as the traced one")
    against_reference = divergence(reference_value.reshape(whole.shape), whole, row.tolerance)
    against_traced = divergence(traced_value, whole, row.tolerance)
    passed = within(against_traced) or within(against_reference)
    result = {
        "verdict": "pass" if passed else "fail",
        "module": row.path,
        "slot": row.candidate.slot,
        "rel_l2": against_reference["rel_l2"],
        "max_abs": against_reference["max_abs"],
        "traced_rel_l2": against_traced["rel_l2"],
        "traced_max_abs": against_traced["max_abs"],
    }
    eager = bool(candidate.meta.get("traced_eagerly"))  # fullgraph=True: traced as eager code, not in pieces
    hidden = "eager tracing" if eager else "the graph breaks the tracer inserts"
    if passed:
        result["message"] = (
            f"the compiled candidate run as one graph agrees: output rel_l2 {result['rel_l2']:.3g} against the "
            f"reference, {result['traced_rel_l2']:.3g} against its traced run ({hidden} hid nothing)"
        )
    else:
        result["message"] = (
            f"the compiled candidate run as one graph (no tracing hooks, so no graph breaks) differs: output "
            f"rel_l2 {result['rel_l2']:.3g} against the reference, {result['traced_rel_l2']:.3g} against its own "
            f"traced run. {hidden[0].upper() + hidden[1:]} hid it, so no module can be named inside the graph; "
            "candidate.backend=aot_eager tells capture from lowering"
        )
    return result


def not_checked(why: str) -> dict[str, Any]:
    """The result for a compiled candidate that was not run as one graph (the run is then not a PASS)."""
    return {"verdict": "unchecked", "message": f"the compiled candidate was not run as one graph: {why}"}


def _traced(trace: Trace, key: str, slot: str | None) -> torch.Tensor | None:
    try:
        call = trace.call(key)
    except KeyError:
        return None
    if slot is None:
        return None
    node = dict(iter_tensors(call.outputs, "outputs")).get(slot)
    return trace.tensor(node) if node is not None else None


def _slot(output: Any, slot: str) -> torch.Tensor | None:
    """The tensor of a live output at a traced slot (``outputs.logits``, ``outputs.0``)."""
    tensors: list[torch.Tensor] = []

    def keep(tensor: torch.Tensor) -> Node:
        tensors.append(tensor.detach())
        return {"t": "tensor", "i": len(tensors) - 1}

    node = encode(output, keep)
    leaf = dict(iter_tensors(node, "outputs")).get(slot)
    return tensors[int(leaf["i"])] if leaf is not None else None
