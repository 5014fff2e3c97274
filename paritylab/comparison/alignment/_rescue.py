"""The rescue: out-of-order matches of what the ordered pass left (a port that runs two branches in the other
order), on structure alone."""

from __future__ import annotations

from paritylab.comparison.alignment._features import _Features
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
    structure alone: equal output shapes and strong name evidence, unless the weights say otherwise."""
    ref_inner, cand_inner = inner_digests(ref_prints), inner_digests(cand_prints)

    def features(call: CallRecord, prints: dict[str, ModulePrint], inner: dict[str, frozenset[int]]) -> _Features:
        return _Features.of(call, prints.get(call.path), inner.get(call.path, frozenset()))

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
        ref = features(ref_calls[i], ref_prints, ref_inner)
        for j in by_shape.get(shape, [])[:MAX_RESCUE]:
            other = features(cand_calls[j], cand_prints, cand_inner)
            score = ref.structure(other)
            if score >= RESCUE_SCORE and not ref.contradicts(other):
                scored.append((score, -abs(i - j), i, j))
    found: dict[int, Pair] = {}
    used: set[int] = set()
    for score, _, i, j in sorted(scored, reverse=True):
        if i not in found and j not in used:
            found[i] = Pair(ref_calls[i].key, cand_calls[j].key, "auto", round(score, 4))
            used.add(j)
    return found
