"""The rescue: out-of-order matches of what the ordered pass left (a port that runs two branches in the other
order), on structure alone."""

from __future__ import annotations

from paritylab.comparison.alignment._features import _Features, observer_classes
from paritylab.comparison.alignment._pairs import Pair
from paritylab.comparison.alignment._shapes import _shape
from paritylab.tracing.structure import ModulePrint, inner_digests
from paritylab.tracing.tracefile import CallRecord

RESCUE_SCORE = 0.75
"""Out-of-order matches (a port that runs two branches in the other order) need this much name evidence."""
MAX_RESCUE = 64
"""Out-of-order candidates examined per reference call (same output shape)."""


def _rescue(
    ref_calls: list[CallRecord],
    cand_calls: list[CallRecord],
    skip_ref: set[int],
    skip_cand: set[int],
    ref_prints: dict[str, ModulePrint],
    cand_prints: dict[str, ModulePrint],
) -> dict[int, Pair]:
    """Greedy best-first matching of what the ordered pass left (branches run in another order), on
    structure alone: equal output shapes and strong name evidence, unless the weights say otherwise (they differ, or
    one side holds weights and the other none)."""
    ref_inner, cand_inner = inner_digests(ref_prints), inner_digests(cand_prints)
    ref_observers, cand_observers = observer_classes(ref_calls), observer_classes(cand_calls)

    def features(
        call: CallRecord, prints: dict[str, ModulePrint], inner: dict[str, frozenset[int]], observers: frozenset[str]
    ) -> _Features:
        return _Features.of(call, prints.get(call.path), inner.get(call.path, frozenset()), observers)

    by_shape: dict[tuple[int, ...], list[int]] = {}
    for j in range(len(cand_calls)):
        shape = _shape(cand_calls[j]) if j not in skip_cand else None
        if shape is not None:
            by_shape.setdefault(shape, []).append(j)
    scored = []
    for i in range(len(ref_calls)):
        shape = _shape(ref_calls[i]) if i not in skip_ref else None
        if shape is None:
            continue
        ref = features(ref_calls[i], ref_prints, ref_inner, ref_observers)
        for j in by_shape.get(shape, [])[:MAX_RESCUE]:
            other = features(cand_calls[j], cand_prints, cand_inner, cand_observers)
            score = ref.structure(other)
            if score >= RESCUE_SCORE and not ref.contradicts(other) and not ref.unlike(other):
                scored.append((score, -abs(i - j), i, j))
    found: dict[int, Pair] = {}
    used: set[int] = set()
    for score, _, i, j in sorted(scored, reverse=True):
        if i not in found and j not in used:
            found[i] = Pair(ref_calls[i].key, cand_calls[j].key, "auto", round(score, 4))
            used.add(j)
    return found


def _weightless_at_home(
    ref_calls: list[CallRecord],
    cand_calls: list[CallRecord],
    paired: dict[int, int],
    skip_ref: set[int],
    skip_cand: set[int],
    ref_prints: dict[str, ModulePrint],
    cand_prints: dict[str, ModulePrint],
) -> dict[int, Pair]:
    """Weightless calls the passes before left open (an activation), each paired with the one open weightless call
    of the same output shape inside the candidate call its nearest paired ancestor is paired with, where each is the
    only such call on its side there. The counterpart a weightless module is refused with a weighted one for
    (:meth:`_Features.unlike`): x-transformers' GLU calls its ``act`` after the fused projection both of Llama's
    ``gate_proj`` and ``up_proj`` are paired with, so the ordered pass, which keeps to the order of the anchors,
    cannot reach it from ``act_fn``, called between them. ``paired``: reference call -> candidate call (whole)."""
    if not ref_prints or not cand_prints:
        return {}

    observers = observer_classes(ref_calls) | observer_classes(cand_calls)

    def weightless(call: CallRecord, prints: dict[str, ModulePrint]) -> bool:
        item = prints.get(call.path)  # an observer carrying a change stands for what it observes: never paired here
        return item is not None and not item.numel and _shape(call) is not None and call.cls not in observers

    def home(calls: list[CallRecord], position: int, stop: set[int] | dict[int, int]) -> int | None:
        parent = calls[position].parent
        while parent is not None and parent not in stop:
            parent = calls[parent].parent
        return parent

    ref_open: dict[tuple[int, tuple[int, ...] | None], list[int]] = {}
    for i, call in enumerate(ref_calls):
        if i in skip_ref or i in paired or not weightless(call, ref_prints):
            continue
        ancestor = home(ref_calls, i, paired)
        if ancestor is not None:
            ref_open.setdefault((paired[ancestor], _shape(call)), []).append(i)
    if not ref_open:
        return {}
    taken = skip_cand | set(paired.values())
    homes = {where for where, _ in ref_open}
    cand_open: dict[tuple[int, tuple[int, ...] | None], list[int]] = {}
    for j, call in enumerate(cand_calls):
        if j in taken or not weightless(call, cand_prints):
            continue
        parent = call.parent
        while parent is not None:
            if parent in homes:
                cand_open.setdefault((parent, _shape(call)), []).append(j)
            parent = cand_calls[parent].parent
    found: dict[int, Pair] = {}
    for key, rows in ref_open.items():
        cols = cand_open.get(key, [])
        if len(rows) == 1 and len(cols) == 1:
            found[rows[0]] = Pair(ref_calls[rows[0]].key, cand_calls[cols[0]].key, "auto", RESCUE_SCORE)
    return found
