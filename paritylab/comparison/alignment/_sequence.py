"""Sequence alignment: the anchors (pairs already fixed, in order on both sides) and a monotone
dynamic-programming alignment of the calls between them, banded on long segments."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping
from typing import Any

from paritylab.comparison.alignment._features import MIN_AUTO_SCORE, WRAPPER_SCORE, _Features, observer_classes
from paritylab.comparison.alignment._pairs import Pair
from paritylab.tracing.structure import ModulePrint, inner_digests
from paritylab.tracing.tracefile import CallRecord

MAX_CELLS = 250_000
BAND = 128
"""Segments between anchors larger than ``MAX_CELLS`` cells are aligned within ``BAND`` of the diagonal."""


def _monotone_chain(points: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The longest chain of pairs increasing on both sides (anchors that split the sequences)."""
    tails: list[int] = []
    tail_at: list[int] = []
    previous: list[int] = [-1] * len(points)
    for index, (_, c) in enumerate(points):
        slot = bisect.bisect_left(tails, c)
        if slot == len(tails):
            tails.append(c)
            tail_at.append(index)
        else:
            tails[slot] = c
            tail_at[slot] = index
        previous[index] = tail_at[slot - 1] if slot else -1
    chain: list[tuple[int, int]] = []
    at = tail_at[-1] if tail_at else -1
    while at >= 0:
        chain.append(points[at])
        at = previous[at]
    return chain[::-1]


def _align_segments(
    ref_calls: list[CallRecord],
    cand_calls: list[CallRecord],
    anchors: list[tuple[int, int]],
    skip_ref: set[int],
    skip_cand: set[int],
    ref_prints: dict[str, ModulePrint],
    cand_prints: dict[str, ModulePrint],
    near: Mapping[str, set[str]] | None = None,
) -> dict[int, Pair]:
    """Each segment between anchors aligned in order. ``near`` (candidate module -> reference modules, from the weight
    ledger): a candidate module holding a near copy of a reference module's weights pairs with it on that evidence
    where names alone would not (``fc_mid`` against ``2``, a final norm against one of several untrained ones)."""
    bounds = [(-1, -1), *anchors, (len(ref_calls), len(cand_calls))]
    found: dict[int, Pair] = {}
    features: dict[tuple[int, int], _Features] = {}
    inner = (inner_digests(ref_prints), inner_digests(cand_prints))
    observers = (observer_classes(ref_calls), observer_classes(cand_calls))

    def feature(side: int, position: int) -> _Features:
        key = (side, position)
        if key not in features:
            call = (ref_calls, cand_calls)[side][position]
            prints = (ref_prints, cand_prints)[side]
            features[key] = _Features.of(
                call, prints.get(call.path), inner[side].get(call.path, frozenset()), observers[side]
            )
        return features[key]

    for (r0, c0), (r1, c1) in itertools.pairwise(bounds):
        rows = [i for i in range(r0 + 1, r1) if i not in skip_ref]
        cols = [j for j in range(c0 + 1, c1) if j not in skip_cand]

        def similarity(i: int, j: int) -> float:
            score = feature(0, i).similarity(feature(1, j))
            if score == 0.0 and near and ref_calls[i].path in near.get(cand_calls[j].path, ()):
                ours, theirs = feature(0, i), feature(1, j)
                if ours.shape is not None and ours.shape == theirs.shape:
                    return WRAPPER_SCORE  # a near copy of its weights: the pair its bug must not cost it
            return score

        for i, j, score in _dp(rows, cols, similarity):
            ours, theirs = feature(0, i), feature(1, j)
            same = ours.weights is not None and (ours.weights == theirs.weights or ours.cut(theirs))
            source = "structure" if same else "auto"  # the same weights, or a table cut to a run of rows
            if not same and near and ref_calls[i].path in near.get(cand_calls[j].path, ()):
                source = "weights"
            found[i] = Pair(ref_calls[i].key, cand_calls[j].key, source, round(score, 4))
    return found


def _dp(rows: list[int], cols: list[int], similarity: Any) -> list[tuple[int, int, float]]:
    """Monotone alignment maximising the summed similarity (gaps cost nothing).

    Long segments are banded around their diagonal (``BAND`` cells either side), so the cost stays
    linear in the number of calls when anchors are sparse.
    """
    if not rows or not cols:
        return []
    n, m = len(rows), len(cols)
    banded = n * m > MAX_CELLS
    band = max(BAND, abs(n - m) + BAND) if banded else max(n, m)

    def in_band(a: int, b: int) -> bool:
        return not banded or abs(a * m // n - b) <= band

    scores: dict[tuple[int, int], float] = {}
    best: dict[tuple[int, int], float] = {}

    def value(a: int, b: int) -> float:
        return best.get((a, b), 0.0)

    for a in range(n - 1, -1, -1):
        centre = a * m // n
        low, high = (max(0, centre - band), min(m, centre + band + 1)) if banded else (0, m)
        for b in range(high - 1, low - 1, -1):
            score = similarity(rows[a], cols[b]) if in_band(a, b) else 0.0
            scores[(a, b)] = score
            take = value(a + 1, b + 1) + score if score >= MIN_AUTO_SCORE else -1.0
            best[(a, b)] = max(take, value(a + 1, b), value(a, b + 1))
    matches: list[tuple[int, int, float]] = []
    a = b = 0
    while a < n and b < m:
        score = scores.get((a, b), 0.0)
        if score >= MIN_AUTO_SCORE and math.isclose(value(a, b), value(a + 1, b + 1) + score):
            matches.append((rows[a], cols[b], score))
            a, b = a + 1, b + 1
        elif value(a, b) == value(a + 1, b):
            a += 1
        else:
            b += 1
    return matches
