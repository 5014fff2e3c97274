"""A compiled candidate is traced with a graph break at every module; run once more as one graph, it is judged
on its output, so a difference only the whole graph makes is not hidden by tracing."""

from __future__ import annotations

import copy

import torch
from torch import nn

from paritylab import check
from paritylab.reports.render import headline, to_markdown


def _whole_graph_only(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
    """A backend with a planted bug that shows only in a graph holding the whole model (as a fusion across
    module boundaries would): the pieces between the tracer's graph breaks are one operation each."""
    calls = [node for node in gm.graph.nodes if node.op in ("call_function", "call_module", "call_method")]
    if len(calls) < 4:
        return gm.forward

    def run(*args: torch.Tensor):
        return tuple(out * 1.01 if isinstance(out, torch.Tensor) else out for out in gm(*args))

    return run


def _pair(backend, fullgraph: bool = False):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    compiled = torch.compile(copy.deepcopy(reference), backend=backend, fullgraph=fullgraph)
    return reference.eval(), compiled, torch.randn(3, 8)


def test_a_difference_only_the_whole_graph_makes_fails_the_run(tmp_path):
    reference, candidate, x = _pair(_whole_graph_only)
    result = check(reference, candidate, tmp_path, reference_call=lambda model: model(x), replay=False)
    assert all(row.verdict == "pass" for row in result.report.rows)  # every traced piece agrees ...
    graph = result.report.whole_graph
    assert graph["verdict"] == "fail" and graph["rel_l2"] == graph["traced_rel_l2"]  # ... the whole graph does not
    assert abs(graph["rel_l2"] - 0.01) < 1e-4
    assert result.verdict == "fail" and result.exit_code == 1
    assert headline(result.report).startswith("FAIL: every traced module agrees, but the compiled candidate run as")
    assert "graph breaks the tracer inserts hid it" in to_markdown(result.report)
    assert result.report.summary()["whole_graph"] == "fail"


def test_a_compiled_candidate_that_agrees_as_one_graph_passes(tmp_path):
    reference, candidate, x = _pair("aot_eager")
    result = check(reference, candidate, tmp_path, reference_call=lambda model: model(x), replay=False)
    assert result.verdict == "pass", headline(result.report)
    assert result.report.whole_graph["verdict"] == "pass" and result.report.whole_graph["rel_l2"] < 1e-6
    again = check(reference, candidate, tmp_path / "again", reference_call=lambda model: model(x), replay=False)
    assert len(again.candidate.calls) == len(result.candidate.calls)  # traced call by call after the untraced run


def test_an_eager_candidate_has_no_whole_graph_check(tmp_path):
    reference, _, x = _pair("aot_eager")
    result = check(reference, copy.deepcopy(reference), tmp_path, reference_call=lambda model: model(x), replay=False)
    assert result.report.whole_graph is None and result.verdict == "pass"


def test_a_whole_graph_that_does_not_run_fails_and_one_not_run_is_no_pass(tmp_path):
    def refuses_whole_graphs(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        calls = [node for node in gm.graph.nodes if node.op in ("call_function", "call_module", "call_method")]
        if len(calls) >= 4:
            raise RuntimeError("lowering failed")
        return gm.forward

    reference, candidate, x = _pair(refuses_whole_graphs)
    result = check(reference, candidate, tmp_path, reference_call=lambda model: model(x), replay=False)
    graph = result.report.whole_graph
    assert result.verdict == "fail" and graph["verdict"] == "fail", graph
    assert "raised" in graph["message"] and "lowering failed" in graph["message"]
    skipped = check(
        reference, candidate, tmp_path / "skipped", reference_call=lambda model: model(x), replay=False,
        whole_graph=False,
    )  # fmt: skip
    assert skipped.verdict == "inconclusive" and skipped.exit_code == 3
    assert headline(skipped.report).startswith("INCONCLUSIVE: every traced module agrees, but the compiled candidate")


def test_a_fullgraph_candidate_is_traced_eagerly_and_its_one_graph_judged(tmp_path):
    """``fullgraph=True`` forbids the graph break each traced module needs: the module calls are traced as eager
    code, and the compiled graph is judged by its output."""
    reference, candidate, x = _pair("aot_eager", fullgraph=True)
    clean = check(reference, candidate, tmp_path / "clean", reference_call=lambda model: model(x), replay=False)
    assert clean.verdict == "pass" and clean.candidate.meta["traced_eagerly"] is True
    assert len(clean.candidate.calls) == len(clean.reference.calls)  # every module call, as the reference's
    assert "eager tracing hid nothing" in clean.report.whole_graph["message"]
    reference, candidate, x = _pair(_whole_graph_only, fullgraph=True)
    buggy = check(reference, candidate, tmp_path / "buggy", reference_call=lambda model: model(x), replay=False)
    assert buggy.verdict == "fail" and all(row.verdict == "pass" for row in buggy.report.rows)
    assert "Eager tracing hid it" in buggy.report.whole_graph["message"]
