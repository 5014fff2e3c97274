"""Modules handed another module's values: two agreeing pairs crossed on the way to a consumer (two same-shape
weights exchanged by a conversion) and a fused module whose parts lie out of the order the reference computes them
(a qkv weight's halves exchanged), or scores in another order that a discrete choice reads as indices (a router's
rows exchanged: its experts change places). Every pair agrees in these cases; only the data flow, or the layout the code
splits by position, shows the bug, so :mod:`.attribution` names these modules where it would blame the code around
them."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping

from paritylab.comparison.alignment import Pair, Part
from paritylab.comparison.judgement import Report, Row, ancestors, primary_input, producer_row
from paritylab.comparison.localise import REORDERED, REORDERED_WHY, reordered_rows
from paritylab.tracing.tracefile import Trace


def crossed_producer(
    rows_by_index: Mapping[int, Row], reference: Trace, candidate: Trace, counterparts: Mapping[str, str], row: Row
) -> tuple[Row, Row] | None:
    """Two paired modules that agree, crossed on the way to ``row``: the candidate hands ``row`` the output of the
    counterpart of one module (returned first) where the reference hands it another's (second), both whole pairs
    that agree. Two same-shape weights exchanged by a conversion (gate and up projections) pair crosswise by
    their weights, so every pair agrees and only the data flow shows it. ``counterparts`` maps candidate call keys
    to reference call keys (whole pairs only)."""
    expected = producer_row(dict(rows_by_index), reference, row)
    if expected is None or row.candidate is None or expected.verdict != "pass":
        return None
    try:
        call = candidate.call(row.candidate.key)
    except KeyError:
        return None
    node = primary_input(call)
    origin = node.get("from") if node else None
    if not isinstance(origin, int) or not 0 <= origin < len(candidate.calls):
        return None
    given = counterparts.get(candidate.calls[origin].key)
    if given is None or given == expected.reference.key:
        return None
    try:
        handed = rows_by_index.get(reference.call(given).index)
    except KeyError:
        return None
    if handed is None or handed.verdict != "pass" or handed.status != "compared":
        return None
    return handed, expected


def crossed(
    row: Row, by_index: Mapping[int, Row], reference: Trace, candidate: Trace, counterparts: Mapping[str, str]
) -> tuple[Row, str] | None:
    """The module whose counterpart's output the candidate hands ``row`` where the reference hands it another
    module's (:func:`crossed_producer`), and why."""
    found = crossed_producer(by_index, reference, candidate, counterparts, row)
    if found is None:
        return None
    handed, expected = found
    assert handed.candidate is not None  # a compared row
    made_by = handed.candidate.key.rsplit("#", 1)[0]
    where = row.path or "<root>"
    return handed, (
        f"the candidate's {made_by} computes the reference's {handed.path} (it holds its weights), and the candidate "
        f"hands its output to {where}, where the reference hands {where} {expected.path}'s: {handed.path} and "
        f"{expected.path} are exchanged (their weights, swapped by a conversion, or the code's wiring)"
    )


def misordered_parts(
    pairs: Iterable[Pair], reference: Trace, by_index: Mapping[int, Row]
) -> dict[int, tuple[Row, str]]:
    """Fused candidate modules whose parts lie in another order than the reference computes them, one of them cut
    in two (its q, k and v at rows 96-159, 160-191 and 0-31, 32-95 of a fused qkv: two halves of its weight
    swapped), by the reference row of the module around those parts: the first part's row, and why. A port that
    fuses them splits its output by position, so such a layout hands each consumer another part's values, while
    every part, paired by its rows, agrees."""
    by_candidate: dict[str, list[tuple[int, int, Part]]] = {}
    for pair in pairs:
        part = pair.candidate_part
        if part is None or part.whole or pair.reference_part is not None:
            continue
        try:
            call = reference.call(pair.reference)
        except KeyError:
            continue
        start = part.indices[0] if part.indices else part.start
        by_candidate.setdefault(pair.candidate, []).append((call.index, start, part))
    found: dict[int, tuple[Row, str]] = {}
    for candidate, parts in by_candidate.items():
        parts.sort()
        starts = [start for _, start, _ in parts]
        if len(parts) < 2 or starts == sorted(starts) or not any(_split(part) for _, _, part in parts):
            continue  # in order, or a whole permutation of blocks (a port may fuse [up; gate] and split it so)
        rows = [by_index[index] for index, _, _ in parts if index in by_index]
        if len(rows) != len(parts) or any(row.verdict != "pass" for row in rows):
            continue  # a part that differs is judged on its own values
        enclosing = _common_parent(rows, by_index)
        if enclosing is None:
            continue
        layout = ", ".join(f"{row.path} at {_where(part)}" for row, (_, _, part) in zip(rows, parts, strict=True))
        note = (
            f"{candidate.rsplit('#', 1)[0]} holds the reference's {layout}: not in the order the reference computes "
            "them, so code that splits its output by position hands each consumer another part's values (two "
            "blocks of its weight's rows exchanged)"
        )
        first = rows[0]
        found[enclosing.index] = (first, note)
    return found


def _split(part: Part) -> bool:
    """The part's rows are not one run: a block cut across a part's boundary (halves of a three-part weight
    exchanged), which no layout a port means produces."""
    if not part.indices:
        return False
    return any(after != before + 1 for before, after in itertools.pairwise(part.indices))


def _where(part: Part) -> str:
    if part.indices:
        runs, start = [], part.indices[0]
        for before, after in zip(part.indices, [*part.indices[1:], None], strict=True):
            if after != before + 1:
                runs.append(f"{start}-{before}")
                start = after if after is not None else start
        return "rows " + ", ".join(runs)
    return f"rows {part.start}-{(part.stop or 0) - 1}" if part.stop is not None else f"rows {part.start}-"


def _common_parent(rows: list[Row], by_index: Mapping[int, Row]) -> Row | None:
    """The innermost row above every one of ``rows``."""
    chains = [list(ancestors(row, by_index)) for row in rows]
    shared = set(chains[0]).intersection(*chains[1:])
    for index in chains[0]:
        if index in shared:
            return by_index.get(index)
    return None


def reordered_scores(report: Report, reference: Trace, module: str, probed: str, said: str) -> Row | None:
    """The module whose output a discrete choice read (``module``, a reference path: a router whose top-k picks
    experts), when that output agrees only with its features in another order (its weight's rows are the
    reference's, permuted) and divergence starts in the module the choice was found in (``probed``, a candidate call
    key), inside it or around it: the choice takes those features' positions as indices, so a layout other code
    could read in its own order is the bug here. Marked the origin, with ``said`` (how many choices flipped) in its
    note.
    None where the module's own values differ, the module around it agrees (a port whose experts are reordered
    alike), or divergence starts elsewhere."""
    first = report.first_divergence
    around = next((row for row in report.rows if row.candidate is not None and row.candidate.key == probed), None)
    if first is None or around is None:
        return None
    by_index = {row.index: row for row in report.rows}
    related = {first.index, *ancestors(first, by_index)}
    if around.index not in related and first.index not in set(ancestors(around, by_index)):
        return None  # divergence starts outside the module that took the choice, and not around it
    reordered = reordered_rows(report.alignment, reference)
    for row in report.rows:
        if row.path != module or row.index not in reordered or row.status != "compared":
            continue
        if row.diverged and REORDERED not in row.note:
            return None  # its own values differ: they are judged as they are
        user = by_index.get(row.parent) if row.parent is not None else None
        if user is None or not (user.diverged or user.verdict == "fail"):
            return None  # the code around it reads the order as it is (the experts reordered alike): a layout
        finding = f"{REORDERED}, and a choice takes their positions as indices ({said}): {REORDERED_WHY}"
        row.diverged, row.verdict, row.cause = True, "fail", "origin"
        row.note = f"{row.note}; {finding}" if row.note else finding
        for other in (first, around):
            if other is not row and other.index in set(ancestors(row, by_index)):
                other.cause = "contains-origin"
        report.origins = [row, *(other for other in report.origins if other is not row)]
        report.first_divergence, report.culprit_reason = row, finding
        return row
    return None
