"""A failing run judged again with the reference's discrete decisions fed to the candidate (teacher-forced routing).

Where divergence starts in a module that takes discrete decisions (a mixture-of-experts router's top-k), both
sides' calls of it are recorded operation by operation (:func:`~paritylab.comparison.operations.record_call`: the
reference as it ran; the candidate as it ran freely and as the isolated replay runs it, fed the reference's values)
and their decisions compared (:mod:`paritylab.comparison.decisions`). When every choice that differs is a near tie,
a flip that rounding makes between two correct implementations, the whole check runs once more with those modules'
decisions replaced by the reference's (:func:`~paritylab.comparison.decisions.forced_decisions`), and that run is
the verdict: a module that then agrees passes, with a note saying which decision flipped and by what margin; a
wrong routing rule, a wrong expert, still fails, now without the flip's noise around it. A choice that differs by
more than rounding flips is the decision rule itself differing: nothing is forced, the run fails and says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from paritylab.comparison.decisions import (
    INPUT_DIFFERS,
    REORDERED_SCORES,
    RULE_DIFFERS,
    Differing,
    Plan,
    compare_decisions,
    forced_decisions,
    pair_decisions,
)
from paritylab.comparison.judgement import Report, Row
from paritylab.comparison.lifted import LiftedReplay
from paritylab.comparison.operations import Recording, record_call, split_key
from paritylab.comparison.replay import teacher_forcing
from paritylab.comparison.wiring import reordered_scores
from paritylab.run.lifting import lifted_candidate_side, lifted_reference_side, private_call
from paritylab.tracing.tracefile import Trace

Call = Callable[[nn.Module], Any]
Rejudge = Callable[[Call], tuple[Report, Trace, LiftedReplay | None]]
"""The check run again with another candidate call (the same phases, the same reference side): its report, the
candidate's trace and the lifted replay."""

ROUNDS = 3
"""Re-judgements at most: each may uncover another module whose decisions flip (a later layer, fed alike now)."""
PROBES = 6
"""Modules opened per round: the origins and the compared modules around them, innermost first."""


@dataclass
class Decided:
    """What the decisions check found and did."""

    report: Report
    candidate_call: Call
    """The candidate's call the report was judged with (its planned decisions forced), for what runs after."""
    candidate_trace: Trace
    plan: dict[str, dict[int, dict[str, torch.Tensor]]] = field(default_factory=dict)
    found: list[dict[str, Any]] = field(default_factory=list)
    lifted: LiftedReplay | None = None
    """The lifted replay the report was judged with."""


def planned(call: Call, plan: Plan) -> Call:
    """``call`` with the planned modules' decisions replaced by the reference's (``plan`` empty: ``call``)."""
    if not plan:
        return call

    def run(model: nn.Module) -> Any:
        with forced_decisions(model, plan):
            return call(model)

    return run


def _probes(report: Report, done: set[str]) -> list[Row]:
    """Compared rows where divergence may start inside a decision: the origins (the free run's and the replay's)
    and the compared rows around them, innermost first, none already opened (``done``)."""
    by_index = {row.index: row for row in report.rows}
    seeds = [row for row in (report.first_divergence, *report.origins, *report.replay_origins) if row is not None]
    chosen: dict[int, Row] = {}
    for seed in seeds:
        row: Row | None = seed
        while row is not None:
            if row.status == "compared" and row.candidate is not None and row.candidate.key not in done:
                chosen.setdefault(row.index, row)
            row = by_index.get(row.parent) if row.parent is not None else None
    return sorted(chosen.values(), key=lambda r: (-r.depth, r.index))[:PROBES]


def _merge(found: list[Differing]) -> list[Differing]:
    """One entry per candidate decision, over the conditions it was recorded in: one that differs beyond a near
    tie if any does, else the one where the most choices differ."""
    merged: dict[int, Differing] = {}
    for item in found:
        held = merged.get(item.candidate_ordinal)
        if held is None or (not item.near_tie, item.differing) > (not held.near_tie, held.differing):
            merged[item.candidate_ordinal] = item
    return list(merged.values())


@dataclass
class _Condition:
    """One way the candidate's call ran, beside the reference's call it is judged against."""

    reference: Recording
    candidate: Recording
    dtype: str
    """The dtype whose rounding the margins are set against (the candidate's; float32 in the lifted replay)."""


def judge_decisions(
    report: Report,
    reference: nn.Module,
    reference_call: Call,
    candidate: nn.Module,
    candidate_call: Call,
    reference_trace: Trace,
    candidate_trace: Trace,
    rejudge: Rejudge,
    lifted: LiftedReplay | None = None,
) -> Decided:
    """``report`` judged again where its divergence starts in differing discrete decisions (see the module's
    docstring); ``lifted``: the run's lifted replay, whose copies are opened too. A passing report, or one with no
    differing decision, comes back as it is (with a note on a row whose decision rule differs)."""
    decided = Decided(report, candidate_call, candidate_trace)
    if report.passed or report.errors:
        return decided
    plan: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    done: set[str] = set()
    rule_notes: dict[str, str] = {}
    opened: set[str] = set()
    """Candidate modules whose decisions differed."""
    current, current_trace = report, candidate_trace
    for _ in range(ROUNDS):
        added = False
        for row in _probes(current, done):
            assert row.candidate is not None  # _probes keeps compared rows
            done.add(row.candidate.key)
            sides = Sides(reference, reference_call, candidate, planned(candidate_call, plan), reference_trace)
            conditions = _conditions(row, sides, current_trace, current, lifted)
            path = split_key(row.candidate.key)[0]
            differing = [  # a decision inside a module already opened is that module's (a layer holds its router)
                item
                for item in _merge(
                    [d for c in conditions for d in compare_decisions(c.reference, c.candidate, c.dtype)]
                )
                if not _inside(_joined(path, item.module), opened)
            ]
            if not differing:
                continue
            opened.add(path)
            decided.found += [
                d.to_dict() | {"module": _joined(row.path, d.reference_module), "call": row.candidate.key}
                for d in differing
            ]
            if not all(item.near_tie for item in differing):
                rule_notes[row.reference.key] = "; ".join(item.describe() for item in differing)
                continue
            plan[row.candidate.key] = _choices(conditions, {item.candidate_ordinal for item in differing})
            added = True
        if not added:
            break
        current, current_trace, lifted = rejudge(planned(candidate_call, plan))
        if current.passed:
            break
    if plan:
        decided.report, decided.candidate_trace = current, current_trace
        decided.candidate_call, decided.plan = planned(candidate_call, plan), plan
    decided.lifted = lifted
    _annotate(decided.report, decided.found, rule_notes, set(plan))
    _explain_rules(decided.report, decided.found, reference_trace)
    return decided


def _explain_rules(report: Report, found: list[dict[str, Any]], reference_trace: Trace) -> None:
    """Choices that differ beyond a near tie, told again where something other than their rule explains them: the
    scores they read are in another order (a router's rows exchanged: :func:`reordered_scores` names that module),
    or the module taking them was handed a value that already differs (a later layer's router, past the origin)."""
    rows = {row.path: row for row in reversed(report.rows)}  # each module's first call
    reordered = False
    for item in found:
        if item["near_tie"]:
            continue
        said = ""
        if not reordered and reordered_scores(report, reference_trace, item["module"], item["call"], item["flipped"]):
            said, reordered = REORDERED_SCORES, True
        elif item["module"] in rows and rows[item["module"]].input_diverged:
            said = INPUT_DIFFERS
        if said:
            told = str(item["message"]).replace(RULE_DIFFERS, said)
            for row in report.rows:
                row.note = row.note.replace(str(item["message"]), told)
            item["message"] = told


def _joined(path: str, inner: str) -> str:
    return ".".join(part for part in (path, inner) if part)


def _inside(path: str, modules: set[str]) -> bool:
    return any(path == module or path.startswith(f"{module}.") or not module for module in modules)


def _choices(conditions: list[_Condition], ordinals: set[int]) -> dict[int, dict[str, torch.Tensor]]:
    """The reference's choice for each paired decision among ``ordinals``, by the dtype of the candidate's scores in
    each condition (the first condition naming a dtype keeps it)."""
    choices: dict[int, dict[str, torch.Tensor]] = {}
    for condition in conditions:
        for theirs, ours in pair_decisions(condition.reference, condition.candidate):
            tensor = condition.reference.tensors[theirs.choice]
            if tensor is None or ours.ordinal not in ordinals:
                continue
            dtype = condition.candidate.values[ours.scores].dtype
            held = choices.setdefault(ours.ordinal, {})
            held.setdefault(dtype, tensor.detach())
            held.setdefault("*", tensor.detach())
    return choices


@dataclass(frozen=True)
class Sides:
    """The two models and the calls that run them (the candidate's with the decisions planned so far forced)."""

    reference: nn.Module
    reference_call: Call
    candidate: nn.Module
    candidate_call: Call
    reference_trace: Trace


def _conditions(
    row: Row, sides: Sides, candidate_trace: Trace, report: Report, lifted: LiftedReplay | None
) -> list[_Condition]:
    """The reference's call of ``row`` recorded as it ran, against the candidate's as it ran freely (when its input
    agrees) and as the isolated replay runs it (fed the reference's values); and, where the lifted replay judged the
    row, both sides' lifted copies (the candidate fed the lifted reference's values). A condition whose forward
    raised, or whose module was not called, is left out: the verdict stands without its evidence."""
    assert row.candidate is not None
    key, theirs_key = split_key(row.candidate.key), split_key(row.reference.key)
    dtype = row.candidate.dtype or "float32"
    conditions: list[_Condition] = []
    try:
        theirs = record_call(sides.reference, *theirs_key, private_call(sides.reference_call))
        if not row.input_diverged:  # fed another input, its choices differ for that input's sake
            free = record_call(sides.candidate, *key, private_call(sides.candidate_call))
            conditions.append(_Condition(theirs, free, dtype))
        with teacher_forcing(sides.candidate, sides.reference_trace, candidate_trace, report.alignment):
            fed = record_call(sides.candidate, *key, private_call(sides.candidate_call))
        conditions.append(_Condition(theirs, fed, dtype))
    except Exception:  # the user's forward
        return []
    if lifted is not None and "lifted_rel_l2" in row.local:
        low, made, copies = getattr(torch, lifted.dtype), lifted.made_with, lifted.copies
        try:
            reference, reference_call = lifted_reference_side(
                sides.reference, sides.reference_call, low, made, copies, sides.reference_trace.uncalled
            )
            candidate, candidate_call = lifted_candidate_side(
                sides.candidate, sides.candidate_call, low, made, copies, candidate_trace.uncalled
            )
            theirs = record_call(reference, *theirs_key, private_call(reference_call))
            with teacher_forcing(candidate, lifted.reference, candidate_trace, report.alignment):
                ours = record_call(candidate, *key, private_call(candidate_call))
            conditions.append(_Condition(theirs, ours, "float32"))
        except Exception:
            pass
    return [c for c in conditions if c.reference.called and c.candidate.called]


def _annotate(report: Report, found: list[dict[str, Any]], rule_notes: dict[str, str], forced: set[str]) -> None:
    """Notes on the rows whose decisions differed: forced (near ties) or not (the rule differs)."""
    report.decisions = found
    for row in report.rows:
        key = row.candidate.key if row.candidate is not None else None
        if key in forced:
            said = "; ".join(item["message"] for item in found if item["call"] == key)
            note = f"{said}; judged with the reference's decisions fed to the candidate (teacher-forced)"
            row.note = f"{row.note}; {note}" if row.note else note
        elif row.reference.key in rule_notes:
            note = rule_notes[row.reference.key]
            row.note = f"{row.note}; {note}" if row.note else note
