"""Pairing by parameter fingerprints: modules holding equal weights are the same module, ordered by execution and
confirmed by data flow where a group is ambiguous."""

from __future__ import annotations

from collections.abc import Mapping

import numpy

from paritylab.comparison.alignment._features import MIN_AUTO_SCORE, WRAPPER_SCORE, _Features
from paritylab.comparison.alignment._pairs import Pair, Part
from paritylab.comparison.alignment._sequence import _dp
from paritylab.comparison.alignment._shapes import _fits, _primary_input, _shape, shapes_fit
from paritylab.comparison.weights import line_order
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
    shift: str = "",
) -> list[tuple[int, int, Pair]]:
    """Calls of modules with equal parameter fingerprints, paired in execution order within each group.

    ``shift`` (``"reference"`` or ``"candidate"``): that side's norms are grouped by their weights minus one, so a
    norm stored as ``w`` meets its counterpart stored as ``w - 1`` on the other side.

    A group with as many calls on both sides pairs them in order. In the others (a module wrapping just one
    child, weights shared by several modules, freshly initialised norms that all hold ones) only pairs that
    data flow confirms are fixed here (the calls that produced their inputs are paired with each other:
    ``known`` and the groups decided in order); the rest is left to the ordered pass between anchors.
    """
    ref_groups: dict[int, list[int]] = {}
    for i in open_ref:
        item = ref_prints.get(ref_calls[i].path)
        key = _key(item, shift == "reference")
        if key:
            ref_groups.setdefault(key, []).append(i)
    cand_groups: dict[int, list[int]] = {}
    for j, call in enumerate(cand_calls):
        key = _key(cand_prints.get(call.path), shift == "candidate")
        if j not in taken and key and key in ref_groups:
            cand_groups.setdefault(key, []).append(j)
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
        ref_features = {i: _Features.of(ref_calls[i], ref_prints.get(ref_calls[i].path)) for i in rows}
        cand_features = {j: _Features.of(cand_calls[j], cand_prints.get(cand_calls[j].path)) for j in cols}

        def confirmed(
            i: int, j: int, r: dict[int, _Features] = ref_features, c: dict[int, _Features] = cand_features
        ) -> float:
            return _within_group(r[i], c[j]) if _same_source(ref_calls[i], cand_calls[j], flow) else 0.0

        decided += _dp(rows, cols, confirmed)
    found: list[tuple[int, int, Pair]] = []
    for i, j, score in decided:
        ref, cand = ref_calls[i], cand_calls[j]
        source = "identity" if ref.key == cand.key else "structure"
        ref_print, cand_print = ref_prints.get(ref.path), cand_prints.get(cand.path)
        reordered = _reordered(ref_print, cand_print, _shape(ref))
        read = _reordered(ref_print, cand_print, _input_shape(ref), columns=True)
        pair = Pair(ref.key, cand.key, source, round(score, 4), candidate_part=reordered, candidate_input_part=read)
        found.append((i, j, pair))
    return found


def _input_shape(call: CallRecord) -> tuple[int, ...] | None:
    node = _primary_input(call)
    return tuple(node["shape"]) if node else None


def _key(item: ModulePrint | None, shifted: bool) -> int:
    """The fingerprint a module is grouped by: its digest, or (``shifted``) its weights minus one (a norm stored as
    ``w`` against one stored as ``w - 1``); 0 when it holds no weights."""
    if item is None or not item.numel:
        return 0
    return item.shifted if shifted else item.digest


def _reordered(
    ref: ModulePrint | None, cand: ModulePrint | None, shape: tuple[int, ...] | None, columns: bool = False
) -> Part | None:
    """Where each of the reference's output features sits in the candidate's output, when the two modules hold
    the same weights with the output features' rows in another order (a query projection converted for rotary on
    interleaved pairs, as Meta's Llama code lays it out, against transformers' halves); else ``None``. The rows
    must be the output's last dimension and tell themselves apart (unique row hashes). ``columns``: the same for
    the input features (``shape`` the input's), read from the weight's columns (an output projection reading the
    attention heads in another order)."""
    if ref is None or cand is None or not shape:
        return None
    ref_rows = [param.col_bytes if columns else param.row_bytes for param in ref.params if param.row_bytes]
    cand_rows = [param.col_bytes if columns else param.row_bytes for param in cand.params if param.row_bytes]
    if len(ref_rows) != 1 or len(cand_rows) != 1 or ref_rows[0] == cand_rows[0]:
        return None
    theirs = numpy.frombuffer(ref_rows[0], dtype="<u8")
    if len(theirs) != shape[-1] or len(numpy.unique(theirs)) != len(theirs):
        return None
    order = line_order(theirs, numpy.frombuffer(cand_rows[0], dtype="<u8"))
    if order is None:
        return None  # the rows differ (equal digests from other columns' order): not a reordering
    return Part(indices=order, whole=True)


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
    same = ref.own == cand.own  # else a module computing with the weights against one wrapping it: less likely
    if ref.numbers and cand.numbers and ref.numbers[-1] != cand.numbers[-1]:
        # other block numbers: preferred against, not ruled out (a flat list numbers its entries otherwise)
        return MIN_AUTO_SCORE + 0.2 * ref.structure(cand) * (1.0 if same else 0.5)
    return (0.5 + 0.5 * ref.structure(cand)) * (1.0 if same else WRAPPER_SCORE)
