"""Runs: a module whose weights are exactly those of a run of consecutive modules on the other side, paired with
the run's last module."""

from __future__ import annotations

import math

from paritylab.comparison.alignment._features import _layer_numbers
from paritylab.comparison.alignment._pairs import Pair
from paritylab.comparison.alignment._shapes import _fits
from paritylab.tracing.structure import MASK, ModulePrint
from paritylab.tracing.tracefile import CallRecord


def _by_runs(
    ref_calls: list[CallRecord],
    cand_calls: list[CallRecord],
    open_ref: list[int],
    taken: set[int],
    ref_prints: dict[str, ModulePrint],
    cand_prints: dict[str, ModulePrint],
) -> list[tuple[int, int, Pair]]:
    """A module whose weights are exactly those of a run of consecutive modules on the other side (in call
    order), and the last module of that run: what its output is. TransformerLens' ``mlp`` holds the weights of
    OPT's ``fc1`` and ``fc2``, which sit directly in the layer; its ``attn`` those of BERT's query, key, value
    and output projection, whose output BERT normalises inside another module. The last module computes the
    same output, so the two are paired; a run is at least two modules long, with as many values in total."""
    open_set, found = set(open_ref), []
    free_cand = {j for j in range(len(cand_calls)) if j not in taken}
    for i, j, first in _runs(ref_calls, cand_calls, ref_prints, cand_prints, open_set, free_cand):
        pair = Pair(ref_calls[i].key, cand_calls[j].key, "run", 1.0, candidate_input=cand_calls[first].key)
        found.append((i, j, pair))
    paired_ref, paired_cand = {i for i, _, _ in found}, {j for _, j, _ in found}
    for j, i, first in _runs(
        cand_calls, ref_calls, cand_prints, ref_prints, free_cand - paired_cand, open_set - paired_ref
    ):
        pair = Pair(ref_calls[i].key, cand_calls[j].key, "run", 1.0, reference_input=ref_calls[first].key)
        found.append((i, j, pair))
    return found


MAX_RUN = 8
"""Longest run of modules one module's weights may be spread over (query, key, value, output: 4)."""


def _runs(
    whole_calls: list[CallRecord],
    run_calls: list[CallRecord],
    whole_prints: dict[str, ModulePrint],
    run_prints: dict[str, ModulePrint],
    open_whole: set[int],
    open_run: set[int],
) -> list[tuple[int, int, int]]:
    """(call of a module on the ``whole`` side, calls of the last and first modules of the run on the other side), for
    open first calls of modules on the whole side that hold all their weights themselves. Every run of 2 to
    :data:`MAX_RUN` consecutive weight-holding modules of one layer is summed once, so each module is one
    lookup; a sum two different runs reach (freshly initialised norms all hold the same weights) is no
    evidence."""
    holders = []  # the run side's modules holding parameters directly, in the order of their first call
    seen: set[str] = set()
    for position, call in enumerate(run_calls):
        item = run_prints.get(call.path)
        if call.call_index == 0 and call.path not in seen and item is not None and item.params:
            seen.add(call.path)
            own = sum(param.digest for param in item.params) & MASK
            size = sum(math.prod(param.shape) for param in item.params)
            holders.append((position, own, size, _layer_numbers(call.path)))
    windows: dict[tuple[int, int], tuple[int, int] | None] = {}  # summed (digest, size) -> (first, last) call
    for start in range(len(holders)):
        digest = size = 0
        first = holders[start][0]
        for position, own, count, numbers in holders[start : start + MAX_RUN]:
            if numbers != holders[start][3]:
                break  # a run never crosses from one layer into the next
            digest, size = (digest + own) & MASK, size + count
            if position != first:
                key, run = (digest, size), (first, position)
                windows[key] = run if windows.get(key, run) == run else None  # None: two runs reach it
    found = []
    for i in sorted(open_whole):
        call = whole_calls[i]
        item = whole_prints.get(call.path)
        if call.call_index != 0 or item is None or not item.numel or not item.params:
            continue
        if sum(math.prod(param.shape) for param in item.params) != item.numel:
            continue  # it holds modules that hold weights (a block): its output is more than its last part's
        spans = windows.get((item.digest, item.numel))
        if spans is not None and spans[1] in open_run and _fits(call, run_calls[spans[1]]):
            found.append((i, spans[1], spans[0]))
    return found
