"""Layouts a module's code reads its children's outputs in.

Divergence can start in a module's own code while every module inside it agrees: each child is paired by its
weights, and a child whose weight rows are the reference's in another order (a query laid out for another rotary
convention, a fused gate and up) is compared in that order. Such an order may be exactly what is wrong: a
conversion that put a query's heads, a key's heads or a fused projection's parts in an order the module's code
does not read them in. Only the code around the children can tell, so each hypothesis here puts one child's
reference values in another order, one its siblings' layouts suggest (their order of blocks, their order within a
block, the reference's own order, or the fused parts in another order), for an isolated replay to test
(:func:`paritylab.run.layouts.judge_layouts`): the one order under which the module's own code agrees names the
child whose layout is wrong.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from paritylab.comparison.alignment import Alignment, Pair, Part, primary_slot
from paritylab.comparison.judgement import Report, Row, ancestors
from paritylab.comparison.localise import REORDERED
from paritylab.tracing.tracefile import Trace
from paritylab.tracing.values import iter_tensors

MAX_HYPOTHESES = 12
"""At most this many layouts are tried (one candidate forward each), children in call order."""
MAX_PARTS = 4
"""A fused child's parts are tried in every other order up to this many parts."""


@dataclass(frozen=True)
class Hypothesis:
    """One child's reference values put in another order: ``pairs`` replace the alignment's pairs of the same
    reference calls; ``row`` is named when the module's code agrees with them; ``said`` tells the order."""

    row: Row
    pairs: tuple[Pair, ...]
    said: str

    @property
    def candidates(self) -> frozenset[str]:
        """The candidate calls whose own output is compared in that order (not judged under it)."""
        return frozenset(pair.candidate for pair in self.pairs)


@dataclass(frozen=True)
class _Order:
    """A child's features in the candidate: reference feature ``j`` at candidate position ``order[j]``."""

    row: Row
    pair: Pair
    order: tuple[int, ...]
    side: str
    """``output`` (the pair compares the candidate's output reordered) or ``input`` (its input)."""
    offset: int | None = None
    """Where a fused output's part starts (its features at ``offset + order[j]``); None: the whole dimension."""


def layout_hypotheses(report: Report, candidate: Trace) -> tuple[Row, list[Hypothesis]] | None:
    """The module where divergence starts and the layouts to try for its children, when it is a module whose own
    code is blamed and some child agrees only in another order or as a part of a fused output (the candidate's
    trace gives a fused output's width); where a reordered child was named because its order reached a value
    that diverges (:data:`~paritylab.comparison.report.REORDERED`), the module whose code read it. None where
    there is nothing to try."""
    module = report.first_divergence
    if module is not None and REORDERED in module.note and module.parent is not None:
        module = next((row for row in report.rows if row.index == module.parent), None)  # its reader's code
    if module is not None and module.candidate is None and module.status == "unmatched":
        held = _code_holder(report, module, candidate)
        if held is None:
            return None
        module, children = held
    elif module is None or module.candidate is None or module.status != "compared":
        return None
    else:
        children = [row for row in report.rows if row.parent == module.index and row.status == "compared"]
    if not children or any(row.cause == "origin" and REORDERED not in row.note for row in children):
        return None  # a child that differs on its own values is judged on them
    by_reference = report.alignment.by_reference()
    orders, plain = _orders(children, by_reference, candidate)
    found = [*_permuted(orders, plain), *_fused(children, by_reference, candidate)]
    found.sort(key=lambda hypothesis: hypothesis.row.index)
    return (module, found[:MAX_HYPOTHESES]) if found else None


def _code_holder(report: Report, blamed: Row, candidate: Trace) -> tuple[Row, list[Row]] | None:
    """For a blamed module with no counterpart (a flat port computes its attention or MLP in an ancestor's own
    code): the nearest ancestor that has one, whose code the isolated replay runs, and the compared modules inside
    the blamed one whose candidate calls that ancestor's code makes itself (a fused ``qkv`` called by the root)."""
    by_index = {row.index: row for row in report.rows}
    holder = next(
        (by_index[index] for index in ancestors(blamed, by_index) if by_index[index].status == "compared"), None
    )
    if holder is None or holder.candidate is None:
        return None
    try:
        made_by = candidate.call(holder.candidate.key).index
    except KeyError:
        return None
    children = []
    for row in subtree(report, blamed):
        if row is blamed or row.status != "compared" or row.candidate is None:
            continue
        try:
            parent = candidate.call(row.candidate.key).parent
        except KeyError:
            continue
        if parent == made_by:
            children.append(row)
    return holder, children


def with_layout(alignment: Alignment, hypothesis: Hypothesis) -> Alignment:
    """``alignment`` with the hypothesis's pairs in place of those of the same reference calls."""
    replaced = {pair.reference: pair for pair in hypothesis.pairs}
    return replace(alignment, pairs=[replaced.get(pair.reference, pair) for pair in alignment.pairs])


def subtree(report: Report, module: Row) -> list[Row]:
    """``module``'s row and every row inside it."""
    by_index = {row.index: row for row in report.rows}
    return [row for row in report.rows if row is module or module.index in set(ancestors(row, by_index))]


def _orders(
    children: list[Row], by_reference: Mapping[str, Pair], candidate: Trace
) -> tuple[list[_Order], list[_Order]]:
    """The children compared in another order (outputs or inputs), and those compared in their own order whose
    output's width is known (the identity: a sibling's layout may be the one a reordered child should have)."""
    reordered: list[_Order] = []
    plain: list[_Order] = []
    for row in children:
        pair = by_reference.get(row.reference.key)
        if pair is None or pair.reference_part is not None:
            continue
        for side, part in (("output", pair.candidate_part), ("input", pair.candidate_input_part)):
            if part is not None and part.whole and part.indices:
                reordered.append(_Order(row, pair, tuple(part.indices), side))
        fused = _fused_span(pair.candidate_part)
        if fused is not None:  # a part of a fused output: in another order inside its span, or in its own
            start, order = fused
            (plain if order == tuple(range(len(order))) else reordered).append(
                _Order(row, pair, order, "output", start)
            )
        if pair.candidate_part is None and row.reference.shape:
            width = _width(candidate, pair.candidate)
            if width is not None and width == row.reference.shape[-1]:
                plain.append(_Order(row, pair, tuple(range(width)), "output"))
    return reordered, plain


def _fused_span(part: Part | None) -> tuple[int, tuple[int, ...]] | None:
    """A fused output's part as the span it covers and its order inside it (reference feature ``j`` at
    ``start + order[j]``): a contiguous slice, or positions that fill one span in another order."""
    if part is None or part.whole:
        return None
    if part.indices:
        start = min(part.indices)
        order = tuple(index - start for index in part.indices)
        return (start, order) if sorted(order) == list(range(len(order))) else None
    if part.index is not None or part.stop is None or part.stop <= part.start:
        return None
    return part.start, tuple(range(part.stop - part.start))


def _width(trace: Trace, key: str) -> int | None:
    """The last dimension of the compared output of the call ``key``."""
    try:
        call = trace.call(key)
    except KeyError:
        return None
    slot = primary_slot(call, None)
    node = dict(iter_tensors(call.outputs, "outputs")).get(slot) if slot is not None else None
    shape = node.get("shape") if node is not None else None
    return int(shape[-1]) if shape else None


def _permuted(orders: list[_Order], plain: list[_Order]) -> Iterator[Hypothesis]:
    """For each child whose output is compared reordered: the reference's order; and for it and each child compared
    in its own order: its blocks (heads: the smallest block every reordered order keeps whole) in another child's
    order of blocks, or with another child's order within a block (a query left in the reference's order beside a
    key laid out for interleaved rotary)."""
    if not any(order.side == "output" for order in orders):
        return
    size = _block_size([order.order for order in orders])
    sources = [*orders, *(order for order in plain if size is not None and len(order.order) % size == 0)]
    for child in (order for order in sources if order.side == "output"):
        tried = {child.order}
        identity = tuple(range(len(child.order)))
        if identity not in tried:
            tried.add(identity)
            yield _hypothesis(child, identity, "with its features in the reference's order")
        if size is None:
            continue
        outer, inner = _blocks(child.order, size)  # type: ignore[misc]  # every source keeps blocks of ``size``
        for other in sources:
            if other.row is child.row and other.side == child.side:
                continue
            their_outer, their_inner = _blocks(other.order, size)  # type: ignore[misc]
            whose = f"{other.row.path}'s {other.side}"
            if len(their_outer) == len(outer) and their_outer != outer:
                order = _compose(their_outer, inner, size)
                if order not in tried:
                    tried.add(order)
                    said = f"with its blocks of {size} features in the order {whose} holds them"
                    yield _hypothesis(child, order, said)
            if len(set(their_inner)) == 1 and any(block != their_inner[0] for block in inner):
                order = _compose(outer, [their_inner[0]] * len(outer), size)
                if order not in tried:
                    tried.add(order)
                    yield _hypothesis(child, order, f"with each block of {size} features in the order {whose} holds")


def _hypothesis(child: _Order, order: tuple[int, ...], said: str) -> Hypothesis:
    if child.offset is None:
        part = Part(indices=order, whole=True)
    elif order == tuple(range(len(order))):
        part = Part(start=child.offset, stop=child.offset + len(order))
    else:
        part = Part(indices=tuple(child.offset + position for position in order))
    return Hypothesis(child.row, (replace(child.pair, candidate_part=part),), said)


def _block_size(orders: Sequence[tuple[int, ...]]) -> int | None:
    """The smallest block size above 1 that divides every order's length and that every order keeps whole (each
    reference block lies in one candidate block); None where there is none below the whole length."""
    if not orders:
        return None
    common = math.gcd(*(len(order) for order in orders))
    for size in range(2, common + 1):
        if common % size == 0 and all(_blocks(order, size) is not None for order in orders):
            return size if any(len(order) > size for order in orders) else None
    return None


def _blocks(order: tuple[int, ...], size: int) -> tuple[list[int], list[tuple[int, ...]]] | None:
    """``order`` as whole blocks of ``size``: reference block ``k`` at candidate block ``outer[k]``, its features at
    ``inner[k]`` inside it; None where a block is split between candidate blocks."""
    if len(order) % size:
        return None
    outer: list[int] = []
    inner: list[tuple[int, ...]] = []
    for start in range(0, len(order), size):
        chunk = order[start : start + size]
        block = chunk[0] // size
        if any(position // size != block for position in chunk):
            return None
        outer.append(block)
        inner.append(tuple(position % size for position in chunk))
    return (outer, inner) if sorted(outer) == list(range(len(outer))) else None


def _compose(outer: Sequence[int], inner: Sequence[tuple[int, ...]], size: int) -> tuple[int, ...]:
    return tuple(block * size + within for block, positions in zip(outer, inner, strict=True) for within in positions)


def _fused(children: list[Row], by_reference: Mapping[str, Pair], candidate: Trace) -> Iterator[Hypothesis]:
    """For each fused candidate child (two to :data:`MAX_PARTS` reference children paired with contiguous parts of
    its output that tile a span): its parts laid over that span in every other order."""
    groups: dict[str, list[tuple[Row, Pair]]] = {}
    for row in children:
        pair = by_reference.get(row.reference.key)
        if pair is None or pair.reference_part is not None or pair.candidate_part is None:
            continue
        if pair.candidate_part.whole or pair.candidate_part.indices:
            continue
        groups.setdefault(pair.candidate, []).append((row, pair))
    for key, members in groups.items():
        width = _width(candidate, key)
        if width is None or not 2 <= len(members) <= MAX_PARTS:
            continue
        placed = sorted(
            ((*pair.candidate_part.bounds(width), row, pair) for row, pair in members if pair.candidate_part),
            key=lambda item: item[0],
        )
        if any(before[1] != after[0] for before, after in itertools.pairwise(placed)):
            continue  # not one run of parts: another layout than concatenation
        held = ", ".join(f"{row.path} at {start}-{stop - 1}" for start, stop, row, _ in placed)
        for arrangement in itertools.permutations(placed):
            if list(arrangement) == placed:
                continue
            pairs, said, moved, at = [], [], [], placed[0][0]
            for start, stop, row, pair in arrangement:
                pairs.append(replace(pair, candidate_part=Part(start=at, stop=at + stop - start)))
                said.append(f"{row.path} at {at}-{at + stop - start - 1}")
                if at != start:
                    moved.append(row)
                at += stop - start
            said_now = f"with its parts in another order (it holds {held}): read as " + ", ".join(said)
            yield Hypothesis(min(moved, key=lambda row: row.index), tuple(pairs), said_now)
