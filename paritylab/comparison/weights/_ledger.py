"""The ledger itself: every candidate tensor matched (exactly, near or by blocks), and the modules its near
matches pair."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy

from paritylab.comparison.weights._blocks import Fibers, _by_blocks, _by_part, _by_tiles
from paritylab.comparison.weights._describe import _describe, _describe_reordered, _values_differ
from paritylab.comparison.weights._exact import TURNED, _all_rows_held, _layout, _row_index, line_order
from paritylab.comparison.weights._near import _nearest, _nearest_shifted, _transposed
from paritylab.comparison.weights._records import (
    MAX_LISTED,
    Held,
    WeightFinding,
    WeightLedger,
    _named,
    _numel,
    _value_key,
    held,
)
from paritylab.comparison.weights._stretches import _by_stretches
from paritylab.comparison.weights._tables import (
    EXACT,
    _derived,
    _derived_detail,
    _from_table,
    _from_table_detail,
    _rebased,
    frequency_tables,
    source,
)
from paritylab.tracing.structure import MASK, ModulePrint, ParamPrint
from paritylab.tracing.tracefile import display_path


def weight_ledger(reference: Mapping[str, ModulePrint], candidate: Mapping[str, ModulePrint]) -> WeightLedger:
    """Match every candidate tensor to the reference's: exactly (fingerprints, rows of fused or cut tables), else by
    nearness of values; describe each near match and each same-valued tensor in another layout."""
    ledger = WeightLedger()
    ours, theirs = held(reference), held(candidate)
    if not ours or not theirs:
        return ledger
    digests: dict[int, list[Held]] = {}
    for item in ours:
        digests.setdefault(item.print.digest, []).append(item)
        if item.print.shifted:
            digests.setdefault(item.print.shifted, []).append(item)
    rows = _row_index(ours)
    open_theirs: list[Held] = []
    claimed: set[int] = set()
    shared: set[int] = set()
    beside: dict[str, set[str]] = {}  # candidate module -> reference modules holding its other tensors' values
    for item in theirs:
        same = [twin for twin in digests.get(item.print.digest, ()) if _numel(twin) == _numel(item)]
        same += [
            twin for twin in digests.get(item.print.shifted, ()) if item.print.shifted and _numel(twin) == _numel(item)
        ]
        if same:
            ledger.matched += 1
            free = [twin for twin in same if id(twin) not in claimed]  # each reference copy holds one candidate's
            claimed.add(id(free[0] if free else same[0]))
            beside.setdefault(item.module, set()).update(twin.module for twin in same)
            if not free or len(same) > 1:  # values the reference holds several times (untrained norms) or the
                shared.update(id(twin) for twin in same)  # candidate more often: still a near one's twin
            layout = _layout(same[0], item) if len(same) == 1 else None
            if layout:
                ledger.findings.append(_finding(same[0], item, "layout", layout))
            if layout == TURNED:  # for each of the reference's columns (input features), the candidate's row
                order = _turned_order(same[0].print, item.print)
                if order is not None:
                    ledger.turned[(same[0].module, item.module)] = order
            continue
        if _all_rows_held(item, rows):
            ledger.matched += 1
            continue
        open_theirs.append(item)
    open_ours = [item for item in ours if (id(item) not in claimed or id(item) in shared) and item.print.sketch]
    near = _nearest(open_ours, open_theirs, frozenset(claimed))
    fibers: Fibers | None = None  # indexed once, where a tensor needs it
    tables = frequency_tables(ours)
    taken = {id(match.twin) for match in near.values()}
    shifted = _nearest_shifted(
        [item for item in open_ours if id(item) not in taken], [item for item in open_theirs if id(item) not in near]
    )
    for item in open_theirs:
        match = near.get(id(item))
        if match is None and id(item) in shifted:  # a norm's scale stored the other way (g = w - 1), with a defect
            twin, _, ref_values, cand_values = shifted[id(item)]
            text, distance = _values_differ(ref_values, cand_values)
            ledger.near_modules.setdefault(item.module, set()).add(twin.module)
            detail = f"{text} (as w - 1), rel_l2 {distance:.3g}"
            ledger.findings.append(_finding(twin, item, "differs", detail, distance))
            continue
        if match is None:
            if len(item.print.shape) >= 2:
                fibers = fibers or Fibers.of(ours, theirs)
                blocks = _by_blocks(item, fibers) or _by_part(item, fibers)
            else:
                blocks = _by_tiles(item, ours)
                stretches = _by_stretches(item, ours) if blocks is None else None
                if stretches is not None:  # a shard of a bias, of a fused one
                    exact, found = stretches
                    ledger.matched += exact
                    ledger.findings += found
                    continue
            clean = blocks is not None and not blocks.findings and not blocks.unmatched
            table = None if clean else _as_table(item, ours, tables)
            if table is not None and (not table or blocks is None or blocks.unmatched):
                ledger.matched += not table  # built from the reference's frequencies: exactly, else what differs
                ledger.findings += table  # (a block reading that explains every column says more where it differs)
                continue
            if blocks is None:
                ledger.unmatched.append(item.name)
                continue
            ledger.matched += not blocks.findings and not blocks.unmatched
            ledger.findings += blocks.findings
            ledger.unmatched += blocks.unmatched
            if blocks.twin_digest is not None:
                ledger.twin_digests[item.name] = blocks.twin_digest
            for finding, start, stop in blocks.parts:
                ledger.part_pairs[finding.reference_module] = (finding.candidate_module, start, stop)
            continue
        twin = match.twin
        copies = sorted({other.module for other in ours if other.print.digest == twin.print.digest})
        ledger.near_modules.setdefault(item.module, set()).update(copies or {twin.module})
        rel_l2: float | None
        if match.reordered is not None:  # axis and order in the reference's layout (a transposed copy turned back)
            turned = dataclasses.replace(item, print=_transposed(item.print)) if match.flipped else item
            detail, rel_l2, order = _describe_reordered(twin, turned, match.reordered)
            if match.flipped:
                detail = f"transposed, {detail}"
                if match.reordered == 1:  # its columns, turned back: the order its input would arrive in
                    ledger.turned[(twin.module, item.module)] = order
            else:
                ledger.orders[(twin.module, item.module)] = (match.reordered, order)
        else:
            detail, rel_l2 = _describe(twin, item, match.flipped)
        if len(copies) > 1:  # which copy, the order of the calls tells (the alignment), not the values
            listed = ", ".join(display_path(path) for path in copies[:MAX_LISTED])
            more = f" and {len(copies) - MAX_LISTED} more" if len(copies) > MAX_LISTED else ""
            detail += f" (the reference holds these values {len(copies)} times: in {listed}{more})"
        ledger.findings.append(_finding(twin, item, "differs", detail, rel_l2))
    for twin, module in _dropped(reference, candidate, beside, claimed, ours):
        name = f"{module}.{twin.print.name}" if module else twin.print.name
        ledger.near_modules.setdefault(module, set()).add(twin.module)
        detail = "none: its module holds every other tensor of the reference's and no such one (dropped, or zeros)"
        ledger.findings.append(WeightFinding(name, twin.name, module, twin.module, "differs", detail, 1.0))
    ledger.module_pairs = _module_pairs(ledger, reference, candidate)
    return ledger


def _dropped(
    reference: Mapping[str, ModulePrint],
    candidate: Mapping[str, ModulePrint],
    beside: Mapping[str, set[str]],
    claimed: set[int],
    ours: list[Held],
) -> list[tuple[Held, str]]:
    """Reference tensors a conversion dropped (a bias left out, or zeroed: fingerprints leave all-zero tensors out, as
    they compute nothing): held by no candidate tensor, in a reference module whose every other tensor is held
    exactly by one candidate module that holds nothing else. Each with that candidate module."""
    found: list[tuple[Held, str]] = []
    for cand_path, modules in beside.items():
        theirs = candidate.get(cand_path)
        if theirs is None or len(modules) != 1 or theirs.buffers:
            continue
        (ref_path,) = modules
        mine = reference.get(ref_path)
        if mine is None or len(mine.params) <= len(theirs.params):
            continue
        held_keys = {_value_key(param) for param in theirs.params}
        missing = [param for param in mine.params if _value_key(param) not in held_keys]
        if len(missing) != len(mine.params) - len(theirs.params):
            continue  # the candidate module holds something the reference module does not
        for param in missing:
            twin = next((item for item in ours if item.module == ref_path and item.print is param), None)
            if twin is not None and id(twin) not in claimed:
                found.append((twin, cand_path))
    return found


def _turned_order(ours: ParamPrint, theirs: ParamPrint) -> tuple[int, ...] | None:
    """For each column of a reference 2-D tensor, the row of the candidate's transposed copy holding it."""
    columns = numpy.frombuffer(ours.col_bytes, dtype="<u8")
    if len(numpy.unique(columns)) != len(columns):
        return None
    return line_order(columns, numpy.frombuffer(theirs.row_bytes, dtype="<u8"))


def _as_table(item: Held, ours: list[Held], tables: list[Held]) -> list[WeightFinding] | None:
    """A candidate tensor read as frequencies or a sinusoid table the reference's frequencies (its ``inv_freq``, or
    ``tables``: those its own tables are built from) make: no finding where it is that within rounding, one saying
    what differs where it is near (certain where it was built with another base); ``None`` where it is neither."""
    read = _from_table(item, tables)
    if read is not None:  # frequencies (inv_freq) against those a reference table is built from
        table, distance = read
        if distance <= EXACT:
            return []
        detail, distance = _from_table_detail(item, table)
        return [_finding(table, item, "differs", detail, distance)]
    derived = _derived(item, [*ours, *tables])
    if derived is not None:  # a rotary table built from the reference's frequencies
        twin, function, distance, expected, row_sums = derived
        if distance <= EXACT:
            return []
        return [
            _finding(twin, item, "differs", _derived_detail(function, twin, expected, row_sums, distance), distance)
        ]
    rebased = _rebased(item, [*ours, *tables])
    if rebased is None:
        return None
    twin, function, base, built, distance = rebased
    detail = (
        f"as {function}(position x {source(twin)}), from row sums: built with base {built:.6g}, the reference's "
        f"frequencies have base {base:.6g}; rel_l2 ~{distance:.3g}"
    )
    return [dataclasses.replace(_finding(twin, item, "differs", detail, distance), certain=True)]


def _finding(ours: Held, theirs: Held, kind: str, detail: str, rel_l2: float | None = None) -> WeightFinding:
    return WeightFinding(theirs.name, ours.name, theirs.module, ours.module, kind, detail, rel_l2)


def _module_pairs(
    ledger: WeightLedger, reference: Mapping[str, ModulePrint], candidate: Mapping[str, ModulePrint]
) -> dict[str, str]:
    """Modules whose own tensors match one to one, one at least differing: reference path -> candidate path."""
    near: dict[str, set[str]] = {}
    for finding in ledger.differing:
        near.setdefault(finding.candidate_module, set()).add(finding.reference_module)
    pairs: dict[str, str] = {}
    taken: set[str] = set()
    for cand_path, ref_paths in near.items():
        if len(ref_paths) != 1 or len(ledger.near_modules.get(cand_path, ())) > 1:
            continue  # near identical copies in several modules (untrained norms): which one, the order tells
        ref_path = next(iter(ref_paths))
        ours, theirs = reference.get(ref_path), candidate.get(cand_path)
        if ours is None or theirs is None or ref_path in taken or not _one_to_one(ours, theirs, ledger):
            continue
        pairs[ref_path] = cand_path
        taken.add(ref_path)
    return pairs


def _one_to_one(ours: ModulePrint, theirs: ModulePrint, ledger: WeightLedger) -> bool:
    """Every value the candidate module holds is one the reference module holds, or a near copy of one of them, and
    every distinct value the reference module holds is held so (a copy it keeps twice, as transformers keeps
    ``inv_freq`` and ``original_inv_freq``, counts once)."""
    near = {
        finding.candidate: finding.reference
        for finding in ledger.differing
        if finding.candidate_module == theirs.path and finding.reference_module == ours.path
    }
    ref_values = {_value_key(param): param.name for param in (*ours.params, *ours.buffers)}
    covered: set[tuple[int, int]] = set()
    for param in (*theirs.params, *theirs.buffers):
        name = f"{theirs.path}.{param.name}" if theirs.path else param.name
        if name in near:
            twin = next((p for p in (*ours.params, *ours.buffers) if _named(ours.path, p) == near[name]), None)
            if twin is None:
                return False  # a block of a reference tensor: a part, not the module's own tensor
            covered.add(_value_key(twin))
        elif _value_key(param) in ref_values:
            covered.add(_value_key(param))
        else:
            return False
    names = {_named(theirs.path, param) for param in (*theirs.params, *theirs.buffers)}
    for name, reference_name in near.items():  # a tensor the candidate's module does not hold (dropped)
        twin = next((p for p in (*ours.params, *ours.buffers) if _named(ours.path, p) == reference_name), None)
        if name not in names and twin is not None:
            covered.add(_value_key(twin))
    return covered == set(ref_values)


def as_twins(
    candidate: Mapping[str, ModulePrint], reference: Mapping[str, ModulePrint], ledger: WeightLedger
) -> dict[str, ModulePrint]:
    """The candidate's fingerprints with each tensor the ledger found a near copy of a reference tensor fingerprinted
    as that tensor (every module's fingerprint above it moved alike): the alignment's stages then pair by weights as
    if the defect were not there (a module holding the weights of a run of reference modules, fused parts, untrained
    copies in call order), and the comparison finds the defect where it is."""
    twins: dict[str, ParamPrint] = {}
    for item in reference.values():
        for param in (*item.params, *item.buffers):
            twins[_named(item.path, param)] = param
    moved: list[tuple[str, ParamPrint, ParamPrint]] = []  # (candidate module, its tensor, the twin's print)
    replaced: dict[str, dict[str, ParamPrint]] = {}
    for holder in candidate.values():  # a part or a composite with a differing block: fingerprinted as if right
        for param in holder.params:
            digest = ledger.twin_digests.get(_named(holder.path, param))
            if digest is not None:
                replaced.setdefault(holder.path, {})[param.name] = dataclasses.replace(param, digest=digest)
                moved.append((holder.path, param, replaced[holder.path][param.name]))
    for finding in ledger.differing:
        twin = twins.get(finding.reference)
        module = candidate.get(finding.candidate_module)
        if twin is None or module is None:
            continue  # a block of a fused tensor: the block stages pair it
        name = finding.candidate[len(module.path) + 1 :] if module.path else finding.candidate
        own = next((param for param in module.params if param.name == name), None)
        if own is None or (own.shape != twin.shape and own.shape != twin.shape[::-1]):
            continue  # a buffer (no part of a fingerprint), or another shape
        replaced.setdefault(module.path, {})[name] = dataclasses.replace(twin, name=name)
        moved.append((module.path, own, twin))
    if not replaced:
        return dict(candidate)
    shift: dict[str, int] = {}
    for module_path, own, twin in moved:
        delta = (twin.digest - own.digest) & MASK
        for path in candidate:
            if _inside(module_path, path):
                shift[path] = (shift.get(path, 0) + delta) & MASK
    result = {}
    for path, item in candidate.items():
        params = tuple(replaced.get(path, {}).get(param.name, param) for param in item.params)
        digest = (item.digest + shift.get(path, 0)) & MASK if item.numel else item.digest
        result[path] = dataclasses.replace(item, params=params, digest=digest)
    return result


def _inside(module: str, ancestor: str) -> bool:
    """``module`` is ``ancestor`` or lies below it (``""`` is the root)."""
    return not ancestor or module == ancestor or module.startswith(f"{ancestor}.")
