"""Which child's layout a module's code does not read: the layouts
:func:`~paritylab.comparison.layouts.layout_hypotheses` suggests, each tested by an isolated replay.

Where divergence starts in a module's own code while its children agree only in another order (a query's heads,
a fused gate and up), the order may be the bug. The candidate runs once as the isolated replay does, measuring the
own error of every module inside the one blamed, then once per hypothesis with one child's reference values in the
order the hypothesis gives. A hypothesis under which every module that failed comes within its floor (while none
that passed fails) names that child: its weight rows are the reference's, in an order the module's code does not
read them in. No hypothesis clears the module: it stays blamed, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from paritylab.comparison.attribution import EXACT_LIMIT, REL_MULTIPLE
from paritylab.comparison.judgement import Report, Row, ancestors, relative_error
from paritylab.comparison.layouts import Hypothesis, layout_hypotheses, subtree, with_layout
from paritylab.comparison.localise import REORDERED, REORDERED_WHY, name_origin
from paritylab.comparison.metrics import min_floor
from paritylab.comparison.replay import own_errors
from paritylab.tracing.tracefile import Trace

CLEARED = 100.0
"""A module that failed clears where its own error falls within its floor, or by this factor (float32's floors
are a few roundings: an independent implementation's own error may sit above them, far below a wrong order's)."""
KEPT = 2.0
"""A module that passed must stay within its floor or this multiple of its own error under the hypothesis."""


def judge_layouts(
    report: Report,
    candidate: nn.Module,
    candidate_call: Callable[[nn.Module], Any],
    reference_trace: Trace,
    candidate_trace: Trace,
    local_floors: Mapping[str, Mapping[str, float]] | None = None,
) -> Report:
    """``report`` with the child named where one of its layouts clears the module blamed for its own code
    (:mod:`paritylab.run.layouts`); ``report`` itself where none does or nothing was to try. ``local_floors``:
    the reference's own low-precision replay per reference call key (bfloat16 floors)."""
    found = layout_hypotheses(report, candidate_trace)
    if found is None:
        return report
    module, hypotheses = found
    rows = subtree(report, module)
    limits = _limits(report, rows, local_floors or {})
    measured = set(limits)
    baseline = own_errors(candidate, candidate_call, reference_trace, candidate_trace, report.alignment, measured)
    failing = {key for key, error in baseline.items() if error > limits[key]}
    if not failing:
        return report
    for hypothesis in hypotheses:
        judged = failing - hypothesis.candidates
        if not judged:
            continue
        alignment = with_layout(report.alignment, hypothesis)
        errors = own_errors(candidate, candidate_call, reference_trace, candidate_trace, alignment, measured)
        if _clears(errors, baseline, limits, failing, hypothesis.candidates):
            worst = max(baseline[key] for key in judged)
            after = max(errors.get(key, 0.0) for key in judged)
            return _named(report, module, hypothesis, worst, after)
    return report


def _limits(report: Report, rows: list[Row], local_floors: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Candidate call key -> the own error it may have: its reference module's floor times
    :data:`~paritylab.comparison.attribution.REL_MULTIPLE`, never below what rounding to the lower dtype gives
    (:data:`~paritylab.comparison.attribution.EXACT_LIMIT`)."""
    limits: dict[str, float] = {}
    for row in rows:
        if row.candidate is None or row.status != "compared":
            continue
        dtypes = (row.reference.dtype, row.candidate.dtype)
        floor = relative_error(local_floors.get(row.reference.key, {})) or 0.0
        limit = max(REL_MULTIPLE * max(floor, min_floor(*dtypes)), *(EXACT_LIMIT.get(str(d), 0.0) for d in dtypes))
        limits[row.candidate.key] = max(limits.get(row.candidate.key, 0.0), limit)
    return limits


def _clears(
    errors: Mapping[str, float],
    baseline: Mapping[str, float],
    limits: Mapping[str, float],
    failing: set[str],
    reordered: frozenset[str],
) -> bool:
    """Every module that failed is within its limit (or :data:`CLEARED` times below its error), and every one
    that passed stays within its limit or :data:`KEPT` times its error; the reordered child is not judged."""
    for key, limit in limits.items():
        if key in reordered or key not in baseline:
            continue
        error = errors.get(key)
        if error is None:
            return False
        if key in failing and error > max(limit, baseline[key] / CLEARED):
            return False
        if key not in failing and error > max(limit, KEPT * baseline[key]):
            return False
    return True


def _named(report: Report, module: Row, hypothesis: Hypothesis, worst: float, after: float) -> Report:
    """A copy of ``report`` naming the hypothesis's child where divergence starts, ``module`` containing it."""
    report = report.copy()
    by_index = {row.index: row for row in report.rows}
    child, around = by_index[hypothesis.row.index], by_index[module.index]
    named = report.first_divergence
    where = around.path or "<root>"
    code = f"{where}'s own code"
    if named is not None and named.candidate is None and around.index in ancestors(named, by_index):
        code = f"{code}, which computes {named.path},"  # a flat port: the blamed module's code is its ancestor's
    finding = (
        f"{REORDERED}, and {code} does not read them in that order ({REORDERED_WHY}): "
        f"{hypothesis.said}, {where} agrees (own error {worst:.3g} -> {after:.3g}, isolated replay)"
    )
    if named is child:  # already named for its order: the replay confirms it
        confirmed = f"{hypothesis.said}, {where} agrees (own error {worst:.3g} -> {after:.3g}, isolated replay)"
        report.culprit_reason = f"{report.culprit_reason}; {confirmed}"
        child.note = f"{child.note}; {confirmed}" if child.note else confirmed
        return report
    if named is not None and named is not around and REORDERED in named.note:
        kept = [part for part in named.note.split("; ") if not part.startswith(REORDERED)]
        named.note, named.diverged, named.verdict, named.cause = "; ".join(kept), False, "pass", ""
    name_origin(report, child, finding, replaced=(around, named))
    return report
