"""What a parity report becomes in MLflow: metrics for the charts, tags for the runs list, the description.

Per-module divergence is logged against execution order (``divergence/*``) and, for the dashboards, against
layer index (``depth/<tower>/*``, in log10 so MLflow's linear axes read well); each layer also gets its own
keys (``layer/<path>/*``) for regression checks and the trend run. The verdict, the first divergence and the
origins are tags; the verdict and the first divergence are also in the run's name (see
:func:`paritylab.sink.publish.parity_name`), the one column MLflow's runs list shows whatever a person has set up.
"""

from __future__ import annotations

import math
from pathlib import Path

from paritylab.comparison.report import Report
from paritylab.reports.plots import LAYER, layer_rows, own_error, relative_limit
from paritylab.reports.render import to_markdown
from paritylab.sink.keys import metric_key
from paritylab.sink.tracking import Metric, log10_for_charts
from paritylab.tracing.files import write_json
from paritylab.tracing.tracefile import display_path


def run_verdict(report: Report | None, status: str) -> str:
    if status != "FINISHED" or report is None or report.errors:
        return "error"
    return report.verdict


def final_tags(report: Report | None, verdict: str, error: str | None, notes: list[str]) -> dict[str, str]:
    """Verdict, first divergence, origins and the markdown description."""
    first = report.first_divergence.path if report is not None and report.first_divergence else None
    decode = (report.decode or {}).get("summary", {}) if report is not None else {}
    if first is None and decode.get("first_divergence"):
        first = decode["first_divergence"]  # step<n>/<module>: the forward agrees, a decode step does not
    tags = {"paritylab.verdict": verdict, "paritylab.first_divergence": first if first is not None else "none"}
    if decode:
        for key in ("first_failing_step", "first_token_mismatch"):
            tags[f"paritylab.decode.{key}"] = "none" if decode.get(key) is None else str(decode[key])
    if report is not None and report.culprit_reason:
        tags["paritylab.culprit_reason"] = report.culprit_reason
    if report is not None and report.drilldown:
        tags["paritylab.first_operation"] = str(report.drilldown.get("operation"))[:500]
    elif decode.get("first_operation"):
        tags["paritylab.first_operation"] = f"step{decode['first_failing_step']}/{decode['first_operation']}"[:500]
    if report is not None and report.whole_graph:
        tags["paritylab.whole_graph"] = str(report.whole_graph.get("verdict"))
    tags["mlflow.note.content"] = description(report, verdict, error, notes)
    if report is not None:
        tags["paritylab.origins"] = ",".join(row.path or "<root>" for row in report.origins) or "none"
        tags["paritylab.unaccounted"] = unaccounted(report)
    return tags


UNACCOUNTED_LISTED = 20
"""The reference calls nothing checked that the ``paritylab.unaccounted`` tag names (the count is a metric)."""


def unaccounted(report: Report) -> str:
    """The modules of the reference calls nothing checked (no counterpart, no compared call around them), for the
    ``paritylab.unaccounted`` tag: a run that passes says in the runs table what it did not check."""
    calls = report.ledger.unaccounted
    if not calls:
        return "none"
    listed = ",".join(display_path(key.rsplit("#", 1)[0]) for key in calls[:UNACCOUNTED_LISTED])
    more = len(calls) - UNACCOUNTED_LISTED
    return f"{listed} and {more} more" if more > 0 else listed


def description(report: Report | None, verdict: str, error: str | None, notes: list[str]) -> str:
    lines = [f"### paritylab: **{verdict}**", ""]
    if error:
        lines += [f"Error: `{error[:500]}`", ""]
    if report is not None:
        lines += [to_markdown(report, limit=40), ""]
    lines += [f"- {note}" for note in notes]
    return "\n".join(lines)


def report_metrics(report: Report) -> list[Metric]:
    """Per-module divergence (step = execution order, the root left out), divergence against depth (step =
    layer index, one series per tower, in log10 so MLflow's linear axes read well), per-layer keys (a layer
    that produced NaN/Inf where the reference did not logs Inf), and summary metrics."""
    metrics: list[Metric] = []
    for row in report.rows:
        if not row.path:
            continue  # the whole model: its error is every module's, and drawn at step 0 it hides where it starts
        for name in ("rel_l2", "max_abs", "mean_abs", "cosine", "sqnr_db", "frac_outside"):
            _add(metrics, f"divergence/{name}", row.metrics.get(name), row.index)
        _add(metrics, "divergence/local_rel_l2", row.local.get("local_rel_l2"), row.index)
        if LAYER.match(row.path):
            nonfinite = row.metrics.get("nan_mismatch") or row.metrics.get("inf_mismatch")
            if nonfinite:
                metrics.append(Metric(f"layer/{row.path}/rel_l2", math.inf, 0))
            else:
                _add(metrics, f"layer/{row.path}/rel_l2", row.rel_l2, 0)
            _add(metrics, f"layer/{row.path}/max_abs", row.metrics.get("max_abs"), 0)
            _add(metrics, f"layer/{row.path}/local_rel_l2", row.local.get("local_rel_l2"), 0)
            _add(metrics, f"layer/{row.path}/layer_rel_l2", row.local.get("layer_rel_l2"), 0)
            _add(metrics, f"layer/{row.path}/limit", relative_limit(row), 0)
    for tower, rows in layer_rows(report).items():
        if len(rows) < 2:
            continue  # one point draws as a bar on an arbitrary axis: its layer/<path>/* keys say it all
        for number, row in rows:
            _add(metrics, f"depth/{tower}/log10_rel_l2", log10_for_charts(row.rel_l2), number)
            _add(metrics, f"depth/{tower}/log10_own_rel_l2", log10_for_charts(own_error(row)), number)
            cosine = row.metrics.get("cosine")
            _add(
                metrics,
                f"depth/{tower}/log10_1_minus_cosine",
                log10_for_charts(None if cosine is None else 1 - cosine),
                number,
            )
    summary = report.summary()
    _add(metrics, "summary/output_rel_l2", summary["output_rel_l2"], 0)
    _add(metrics, "summary/output_max_abs", summary["output_max_abs"], 0)
    _add(metrics, "summary/worst_rel_l2", summary["worst_rel_l2"], 0)
    first = summary["first_divergence_index"]
    _add(metrics, "summary/first_divergence_index", -1 if first is None else first, 0)
    _add(metrics, "summary/failing_modules", summary["failed"], 0)
    if report.decode:  # per decode step: step = the decode step
        for step in report.decode["steps"]:
            for name in ("token_agreement", "kl", "top_k_overlap", "max_abs", "output_rel_l2"):
                _add(metrics, f"decode/{name}", step.get(name), int(step["step"]))
            if step.get("output_rel_l2"):
                _add(
                    metrics,
                    "decode/log10_output_rel_l2",
                    math.log10(max(step["output_rel_l2"], 1e-300)),
                    int(step["step"]),
                )
        failing = report.decode["summary"]["first_failing_step"]
        _add(metrics, "summary/decode_first_failing_step", -1 if failing is None else failing, 0)
    if report.whole_graph:  # a compiled candidate run as one graph
        _add(metrics, "summary/whole_graph_rel_l2", report.whole_graph.get("rel_l2"), 0)
        _add(metrics, "summary/whole_graph_traced_rel_l2", report.whole_graph.get("traced_rel_l2"), 0)
    _add(metrics, "summary/passing_modules", summary["passed"], 0)
    _add(metrics, "summary/unmatched_reference", summary["unmatched_reference"], 0)
    _add(metrics, "summary/unmatched_candidate", summary["unmatched_candidate"], 0)
    _add(metrics, "summary/weights_differing", summary.get("weights_differing"), 0)
    _add(metrics, "summary/unaccounted_calls", summary.get("unaccounted_calls"), 0)
    return metrics


def _add(metrics: list[Metric], key: str, value: float | None, step: int) -> None:
    if value is not None and math.isfinite(float(value)):
        metrics.append(Metric(key, float(value), step))


def write_key_map(directory: Path, metrics: list[Metric]) -> None:
    """``metric_keys.json``: MLflow key -> module path, for every key that had to be made safe."""

    renamed = {metric_key(m.key): m.key for m in metrics if metric_key(m.key) != m.key}
    if renamed:
        write_json(directory / "metric_keys.json", renamed, indent=1)
