"""Pairing by parameter fingerprints: modules holding equal weights are the same module, ordered by execution and
confirmed by data flow where a group is ambiguous."""

from __future__ import annotations

from collections.abc import Mapping

from paritylab.comparison.alignment._features import _Features
from paritylab.comparison.alignment._pairs import Pair
from paritylab.comparison.alignment._sequence import _dp
from paritylab.comparison.alignment._shapes import _fits, _primary_input, shapes_fit
from paritylab.tracing.structure import ModulePrint
from paritylab.tracing.tracefile import CallRecord


def _by_fingerprint(
    ref_calls: list[CallRecord],
    cand_calls: list[CallRecord],
    open_ref: list[int],
    taken: set[int],
    ref_prints: dict[str, ModulePrint],
    cand_prints: dict[str, ModulePrint],
    known: dict[int, int],
) -> list[tuple[int, int, Pair]]:
    """Calls of modules with equal parameter fingerprints, paired in execution order within each group.

    A group with as many calls on both sides pairs them in order. In the others (a module wrapping just one
    child, weights shared by several modules, freshly initialised norms that all hold ones) only pairs that
    data flow confirms are fixed here (the calls that produced their inputs are paired with each other:
    ``known`` and the groups decided in order); the rest is left to the ordered pass between anchors.
    """
    ref_groups: dict[int, list[int]] = {}
    for i in open_ref:
        item = ref_prints.get(ref_calls[i].path)
        if item is not None and item.numel:
            ref_groups.setdefault(item.digest, []).append(i)
    cand_groups: dict[int, list[int]] = {}
    for j, call in enumerate(cand_calls):
        item = cand_prints.get(call.path)
        if j not in taken and item is not None and item.numel and item.digest in ref_groups:
            cand_groups.setdefault(item.digest, []).append(j)
    decided: list[tuple[int, int, float]] = []
    ambiguous: list[tuple[list[int], list[int]]] = []
    for digest, rows in ref_groups.items():
        cols = cand_groups.get(digest)
        if not cols:
            continue
        in_order = list(zip(rows, cols, strict=False))
        if len(rows) == len(cols) and all(_fits(ref_calls[i], cand_calls[j]) for i, j in in_order):
            decided += [(i, j, 1.0) for i, j in in_order]
        else:
            ambiguous.append((rows, cols))
    flow = dict(known) | {i: j for i, j, _ in decided}
    for rows, cols in ambiguous:
        ref_features = {i: _Features.of(ref_calls[i]) for i in rows}
        cand_features = {j: _Features.of(cand_calls[j]) for j in cols}

        def confirmed(
            i: int, j: int, r: dict[int, _Features] = ref_features, c: dict[int, _Features] = cand_features
        ) -> float:
            return _within_group(r[i], c[j]) if _same_source(ref_calls[i], cand_calls[j], flow) else 0.0

        decided += _dp(rows, cols, confirmed)
    found: list[tuple[int, int, Pair]] = []
    for i, j, score in decided:
        source = "identity" if ref_calls[i].key == cand_calls[j].key else "structure"
        found.append((i, j, Pair(ref_calls[i].key, cand_calls[j].key, source, round(score, 4))))
    return found


def _same_source(ref: CallRecord, cand: CallRecord, pairs: Mapping[int, int]) -> bool:
    """The calls that produced the two primary inputs are paired with each other (data flow confirms)."""
    ref_node, cand_node = _primary_input(ref), _primary_input(cand)
    ref_from = ref_node.get("from") if ref_node else None
    cand_from = cand_node.get("from") if cand_node else None
    return isinstance(ref_from, int) and ref_from in pairs and pairs[ref_from] == cand_from


def _within_group(ref: _Features, cand: _Features) -> float:
    """Among modules holding the same weights: output shapes that fit needed; structure breaks ties."""
    if ref.shape is None or cand.shape is None:
        return 0.0
    if not shapes_fit(ref.shape, cand.shape):
        return 0.0
    if ref.numbers and cand.numbers and ref.numbers[-1] != cand.numbers[-1]:
        return 0.0
    return 0.5 + 0.5 * ref.structure(cand)
