"""Render a comparison :class:`~paritylab.comparison.report.Report` as a console table, markdown, JSON or HTML."""

from __future__ import annotations

import functools
import html
import json
import math
from typing import Any

from paritylab.comparison.metrics import stats_within, within
from paritylab.comparison.report import Report, Row
from paritylab.comparison.weights import WeightFinding
from paritylab.tracing.tracefile import display_path, json_safe, printable

_COLUMNS = ("#", "module", "candidate", "status", "verdict", "cause", "rel_l2", "max_abs", "cosine", "input_rel")


def fmt(value: float | None, digits: int = 2) -> str:
    """A short number: scientific for small/large magnitudes, ``-`` when absent."""
    if value is None:
        return "-"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0:
        return "0"
    if 1e-2 <= abs(value) < 1e4:
        return f"{value:.{digits + 2}g}"
    return f"{value:.{digits}e}"


def _cells(row: Row) -> list[str]:
    return [
        str(row.index),
        display_path(row.path),
        display_path(row.candidate.key.rsplit("#", 1)[0]) if row.candidate else "-",
        row.status,
        row.verdict,
        row.cause or "",
        fmt(row.metrics.get("rel_l2")),
        fmt(row.metrics.get("max_abs")),
        fmt(row.metrics.get("cosine"), 6) if "cosine" in row.metrics else "-",
        fmt(row.input_metrics.get("rel_l2")),
    ]


def headline(report: Report) -> str:
    """One line: the verdict and where divergence starts (and any input a forward changed in place)."""
    said = [
        f"the {side} changed its input {', '.join(slots)} in place (each side was fed its own copy)"
        for side, slots in report.inputs_changed.items()
    ]
    buffers = report.buffers_changed
    if len(buffers) == 1:  # one side leaves state behind that the other does not: later forwards would differ
        side, names = next(iter(buffers.items()))
        other = "candidate" if side == "reference" else "reference"
        said.append(f"the {side} changed buffers {', '.join(names[:3])} in place during its forward, the {other} none")
    for found in report.decisions:  # a choice made otherwise on a near tie (teacher-forced), or by another rule
        said.append(f"at {display_path(str(found['module']))}: {printable(str(found['message']))}")
    changed = "; ".join(said)
    line = _verdict_line(report)
    return f"{line}; {changed}" if changed and not report.errors else line


def _verdict_line(report: Report) -> str:
    summary = report.summary()
    if report.errors:
        side, error = next(iter(report.errors.items()))
        where = display_path(error.get("module") or "") if error.get("module") is not None else "?"
        return f"ERROR: the {side} forward raised {error.get('type')} in {where}: {error.get('message')}"
    graph = report.whole_graph or {}
    if report.verdict == "inconclusive" and graph.get("verdict") == "unchecked" and not report.not_compared:
        return f"INCONCLUSIVE: every traced module agrees, but {printable(str(graph.get('message')))}; not a pass"
    if report.verdict == "inconclusive" and report.ledger.differing and not report.not_compared:
        ledger = report.ledger
        unchecked = ledger.differing[0].rsplit("#", 1)[0]
        found = report.alignment.weights.at(unchecked)
        weight = f": {found[0].line()}" if found else ""
        return (
            f"INCONCLUSIVE: every compared module agrees, but {len(ledger.differing)} reference calls holding weights "
            f"that differ were never checked (first {display_path(unchecked)}{weight}); not a pass"
        )
    if report.verdict == "inconclusive":
        missing = report.not_compared
        if not missing:
            return "INCONCLUSIVE: no aligned module was compared by value (empty or unmatched traces)"
        reason = missing[0].note or "judged on statistics only"
        return (
            f"INCONCLUSIVE: nothing failed, but {len(missing)} aligned modules could not be compared by value "
            f"(first {display_path(missing[0].path)}: {reason}); not a pass"
        )
    decode = summary["decode"] or {}
    steps = f" and {decode['steps'] - 1} decode steps" if decode else ""
    if report.passed:
        rel = fmt(summary["output_rel_l2"])
        line = f"PASS: {summary['passed']} modules within tolerance{steps} (output rel_l2 {rel})"
        unaccounted = report.ledger.unaccounted
        if unaccounted:  # said, never hidden: what the pass does not cover
            unchecked = display_path(unaccounted[0].rsplit("#", 1)[0])
            line += (
                f"; {len(unaccounted)} reference calls not checked (first {unchecked}: no counterpart, none around it)"
            )
        return line
    if report.first_divergence is None and decode.get("first_divergence"):
        token = decode.get("first_token_mismatch")
        tokens = f"greedy tokens first differ at step {token}" if token is not None else "greedy tokens all agree"
        where = printable(str(decode["first_divergence"]))
        return (
            f"FAIL: the forward agrees, but at decode step {decode['first_failing_step']} divergence starts at "
            f"{where.split('/', 1)[1]} ({decode.get('culprit_reason')}); {tokens}"
        )
    if report.first_divergence is None and graph.get("verdict") == "fail":
        return f"FAIL: every traced module agrees, but {printable(str(graph.get('message')))}"
    first = report.first_divergence
    where = display_path(first.path) if first else "?"
    own = first.local.get("local_rel_l2") if first else None
    error = f"own error {fmt(own)}" if own is not None else f"rel_l2 {fmt(first.rel_l2 if first else None)}"
    if first is not None and own is not None and not first.local.get("local_diverged"):
        error = f"rel_l2 {fmt(first.rel_l2)}"  # named on other evidence: an own error within tolerance says nothing
    if first is not None and own is None and first.rel_l2 is None and first.status == "unmatched":
        error = "no counterpart in the candidate"  # named from the modules around it: nothing of its own measured
    if first is not None and "changed_after_rel_l2" in first.metrics:  # its value is changed after it
        error = f"changed after it by rel_l2 {fmt(first.metrics['changed_after_rel_l2'])}"
    if first is not None and first.local.get("lifted_diverged"):  # found where the precision's rounding is gone
        error = f"own error {fmt(first.local.get('lifted_rel_l2'))} in float32"
        if first.local.get("changed_after_rel_l2"):  # by a hook point, in the float32 replay only
            error = f"changed after it by rel_l2 {fmt(first.local['changed_after_rel_l2'])} in float32"
    failed_output = next((check for check in (first.outputs if first else []) if check.verdict == "fail"), None)
    if failed_output is not None and first is not None and _primary_agrees(first):
        error = failed_output.describe()  # its compared output agrees: say which output does not
    why = f": {report.culprit_reason}" if report.culprit_reason else ""
    held = weights_at(report, first)
    if held:  # the weight ledger saw why: the module computes with weights that are not the reference's
        why += f"; its weights differ: {held[0].line()}"
    table = report.weight_origin
    if table is not None:  # a weight no call judges, read by the code of the module the rows name
        finding, reader = table
        where, code = display_path(finding.reference_module), display_path(reader.path)
        error = f"weight rel_l2 {fmt(finding.rel_l2)}"  # the measures above are the reader's row's
        runs = any(row.path == finding.reference_module for row in report.rows)
        how = (
            f"its calls have no counterpart: the candidate computes it in {code}'s own code"
            if runs
            else f"no call of it runs: {code}'s own code reads it"
        )
        reason = report.culprit_reason or "the rows name it"
        why = f": its weight differs, {finding.line()}; {how}, and diverges there ({reason})"
    return (
        f"FAIL: divergence starts at {where} ({error}){why}; "
        f"{summary['failed']} modules fail, output rel_l2 {fmt(summary['output_rel_l2'])}"
    )


def _primary_agrees(row: Row) -> bool:
    """The row's own compared output agrees (judged on values, or on statistics where no tensors were kept)."""
    if not row.metrics:
        return False
    if row.status == "stats-only":
        return row.tolerance is not None and stats_within(row.metrics, row.tolerance)
    return "frac_outside" in row.metrics and within(row.metrics)


def calls_line(report: Report) -> str:
    """Where every reference call ended (:attr:`Report.ledger`), and the candidate's calls with no counterpart."""
    ledger = report.ledger
    parts = [f"{len(ledger.compared)} compared", f"{len(ledger.covered)} covered by a compared call around them"]
    parts += [f"{len(ledger.folded)} folded"] if ledger.folded else []
    parts += [f"{len(ledger.ignored)} ignored by rule"] if ledger.ignored else []
    parts.append(f"{len(ledger.unaccounted)} unaccounted")
    if ledger.unaccounted:
        listed = ", ".join(display_path(key.rsplit("#", 1)[0]) for key in ledger.unaccounted[:3])
        parts[-1] += f" ({listed}{', ...' if len(ledger.unaccounted) > 3 else ''})"
    extra = len(report.alignment.unmatched_candidate)
    return f"reference calls: {', '.join(parts)}; candidate calls with no counterpart: {extra}"


def weights_at(report: Report, row: Row | None) -> list[WeightFinding]:
    """The weight ledger's findings at a row's two modules (differing values first, then layouts)."""
    if row is None:
        return []
    paths = [row.path]
    if row.candidate is not None:
        paths.append(row.candidate.key.rsplit("#", 1)[0])
    found = report.alignment.weights.at(*paths)
    if not found:  # a tensor inside it (a shard's block of a fused projection, read in its own code)
        found = [
            finding
            for finding in report.alignment.weights.differing
            if _inside(finding.reference_module, paths[0]) or _inside(finding.candidate_module, paths[-1])
        ]
    return sorted(found, key=lambda finding: finding.kind != "differs")


def _inside(module: str, ancestor: str) -> bool:
    return not ancestor or module.startswith(f"{ancestor}.")


def weights_lines(report: Report, limit: int = 5) -> list[str]:
    """The candidate tensors that hold a reference tensor with a defect (one line each, ``limit`` at most)."""
    differing = report.alignment.weights.differing
    if not differing:
        return []
    lines = [f"weights: {len(differing)} candidate tensors differ from the reference's (weight ledger)"]
    lines += [f"  {printable(finding.line())}" for finding in differing[:limit]]
    if len(differing) > limit:
        lines.append(f"  ... and {len(differing) - limit} more (report/report.json: weights)")
    return lines


def to_console(report: Report, limit: int | None = 60) -> str:
    """A plain-text table of the judged rows (failing ones and their context first when it is long)."""
    rows = [row for row in report.rows if row.status != "unmatched"]
    if limit is not None and len(rows) > limit:
        keep = {row.index for row in rows if row.diverged or row.verdict == "fail"}
        keep |= {row.index for row in rows[:5]}
        rows = [row for row in rows if row.index in keep][:limit]
    lines = [_table([_cells(row) for row in rows])]
    lines.append(calls_line(report))
    lines.extend(weights_lines(report))
    lines.append(headline(report))
    inside = operation_line(report)
    if inside:
        lines.append(inside)
    if report.whole_graph:
        lines.append(f"  {printable(str(report.whole_graph.get('message')))}")
    lines.extend(decode_lines(report))
    return "\n".join(lines)


def _table(cells: list[list[str]]) -> str:
    """The rows as a plain-text table (rich; cells are text, never markup: module names come from user code)."""
    import io

    from rich.box import Box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    rule_under_header = Box("    \n    \n -- \n    \n    \n    \n    \n    \n", ascii=True)  # ASCII: any terminal
    table = Table(*_COLUMNS, box=rule_under_header, pad_edge=False, show_edge=False, header_style="")
    for column in table.columns:
        column.no_wrap, column.overflow, column.max_width = True, "ellipsis", 60
    for row in cells:
        table.add_row(*(Text(cell) for cell in row))
    console = Console(file=io.StringIO(), width=400, color_system=None, force_terminal=False, highlight=False)
    console.print(table)
    text: str = console.file.getvalue()  # type: ignore[attr-defined]
    return "\n".join(line.rstrip() for line in text.splitlines() if line.strip())


def decode_lines(report: Report) -> list[str]:
    """One line per decode step: verdict, where it starts, tokens, KL and top-k overlap."""
    if not report.decode:
        return []
    summary = report.decode["summary"]
    lines = [f"decode steps (teacher-forced on the reference's tokens, top-{summary['top_k']} overlap):"]
    for step in report.decode["steps"]:
        where = f" starts at {display_path(step['first_divergence'])}" if step["first_divergence"] is not None else ""
        lines.append(
            f"  step {step['step']:>3}: {step['verdict']}{where}; tokens agree {step['token_agreement']:.0%}, "
            f"KL {fmt(step['kl'])}, top-k {step['top_k_overlap']:.0%}, max |logit diff| {fmt(step['max_abs'])}"
        )
    found = report.decode.get("drilldown")
    if found:
        where = display_path(str(found.get("reference", "")).rsplit("#", 1)[0])
        lines.append(f"  inside {where} at step {found['step']}: {printable(str(found.get('message')))}")
    return lines


def operation_line(report: Report) -> str | None:
    """Where, inside the origin module, the candidate's computation leaves the reference's (the drill-down)."""
    found = report.drilldown
    if not found or report.first_divergence is None:
        return None
    return f"  inside {display_path(report.first_divergence.path)}: {printable(str(found.get('message')))}"


def _md_escape(text: str) -> str:
    """Markdown text: no raw HTML (MLflow renders descriptions): ``<``, ``>`` and ``&`` as entities, which GitHub's
    markdown and MLflow's (showdown, which ignores a backslash before ``<``) both show as the characters; pipes
    and backticks neutralised. Module names go in code spans instead (:func:`_md_code`), where an entity would
    show as written."""
    return html.escape(text, quote=False).replace("|", "\\|").replace("`", "'").replace("\n", " ")


def _md_code(text: str, in_table: bool = False) -> str:
    """``text`` as a markdown code span: shown exactly as written (no HTML inside one), backticks as ``'``; in a
    table, ``|`` escaped (GFM reads a cell's pipes before its code spans)."""
    text = text.replace("`", "'").replace("\n", " ")
    if in_table:
        text = text.replace("|", "\\|")
    return f"`{text}`"


def _md_cells(row: Row) -> list[str]:
    """A row's cells in a markdown table: the module names as code spans, the rest as text."""
    cells = _cells(row)
    return [
        _md_code(cell, True) if column in (1, 2) and cell != "-" else _md_escape(cell)
        for column, cell in enumerate(cells)
    ]


def to_markdown(report: Report, limit: int | None = 200) -> str:
    """A markdown summary and table, safe to embed in MLflow descriptions and CI comments."""
    summary = report.summary()
    lines = [f"**{_md_escape(headline(report))}**", ""]
    inside = operation_line(report)
    if inside:
        lines += [_md_escape(inside.strip()), ""]
    if report.whole_graph:
        lines += [_md_escape(str(report.whole_graph.get("message"))), ""]
    if report.origins:
        lines.append("Origins: " + ", ".join(_md_code(display_path(r.path)) for r in report.origins))
        lines.append("")
    lines.append("| " + " | ".join(_COLUMNS) + " |")
    lines.append("|" + "---|" * len(_COLUMNS))
    rows = [row for row in report.rows if row.status != "unmatched"]
    for row in rows[:limit]:
        lines.append("| " + " | ".join(_md_cells(row)) + " |")
    if limit is not None and len(rows) > limit:
        lines.append(f"| … | {len(rows) - limit} more rows | | | | | | | | |")
    lines.append("")
    decode = decode_lines(report)
    if decode:
        lines += [_md_escape(decode[0]), "", *(f"- {_md_escape(line.strip())}" for line in decode[1:]), ""]
    lines.append(
        f"{summary['passed']} pass, {summary['failed']} fail, {summary['skipped']} skipped; "
        f"unmatched: {summary['unmatched_reference']} reference, {summary['unmatched_candidate']} candidate."
    )
    return "\n".join(lines)


def to_json(report: Report) -> str:
    """The full report as standard JSON (non-finite numbers spelt as strings)."""
    return json.dumps(json_safe(report.to_json()), indent=1, allow_nan=False)


def to_html(report: Report, title: str = "paritylab report", images: dict[str, str] | None = None) -> str:
    """A self-contained HTML page from ``templates/report.html.j2``, rendered with autoescape: every name shown
    is escaped (module names and operation arguments come from user code).

    ``images`` maps captions to SVG documents to embed (paritylab's own plots: trusted markup).
    """
    first = report.first_divergence
    return _template().render(
        title=title,
        headline=headline(report),
        drilldown=report.drilldown,
        origin=display_path(first.path) if first is not None else "",
        images=images or {},
        decode="\n".join(decode_lines(report)),
        columns=_COLUMNS,
        rows=[({"fail": "fail", "pass": "pass"}.get(row.verdict, "skip"), _cells(row)) for row in report.rows],
        summary=json.dumps(json_safe(report.summary()), indent=1),
    )


@functools.cache
def _template() -> Any:
    from jinja2 import Environment, PackageLoader, select_autoescape

    environment = Environment(
        loader=PackageLoader("paritylab.reports", "templates"), autoescape=select_autoescape(["html", "j2"])
    )
    return environment.get_template("report.html.j2")


def rows_table(report: Report) -> dict[str, list[Any]]:
    """Column-oriented rows (for ``mlflow.log_table`` and CSV)."""
    columns: dict[str, list[Any]] = {
        "index": [],
        "module": [],
        "candidate": [],
        "status": [],
        "verdict": [],
        "cause": [],
        "source": [],
        "rel_l2": [],
        "max_abs": [],
        "mean_abs": [],
        "cosine": [],
        "sqnr_db": [],
        "frac_outside": [],
        "input_rel_l2": [],
        "local_rel_l2": [],
        "lifted_rel_l2": [],
        "amplification": [],
        "note": [],
    }
    for row in report.rows:
        columns["index"].append(row.index)
        columns["module"].append(display_path(row.path))
        columns["candidate"].append(row.candidate.key if row.candidate else "")
        columns["status"].append(row.status)
        columns["verdict"].append(row.verdict)
        columns["cause"].append(row.cause)
        columns["source"].append(row.source)
        for name in ("rel_l2", "max_abs", "mean_abs", "cosine", "sqnr_db", "frac_outside"):
            columns[name].append(_finite(row.metrics.get(name)))
        columns["input_rel_l2"].append(_finite(row.input_metrics.get("rel_l2")))
        columns["local_rel_l2"].append(_finite(row.local.get("local_rel_l2")))
        columns["lifted_rel_l2"].append(_finite(row.local.get("lifted_rel_l2")))
        columns["amplification"].append(_finite(row.local.get("amplification")))
        columns["note"].append(row.note)
    return columns


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
