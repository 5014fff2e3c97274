"""Each side's parameter fingerprints, counting the weights its modules' code reads (not only which modules were
called)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from paritylab.tracing.structure import MASK, ModulePrint, module_ancestors, prints_from_meta, restrict_to_called
from paritylab.tracing.tracefile import Trace


def _read_prints(reference: Trace, candidate: Trace) -> tuple[dict[str, ModulePrint], dict[str, ModulePrint]]:
    """Each side's fingerprints, counting the weights its modules' code reads, not which modules were called.

    A module that never ran computed nothing of its own, but its weights may still be read by a called ancestor's
    code: ``nn.MultiheadAttention`` reads ``out_proj.weight`` in ``F.multi_head_attention_forward`` and never
    calls ``out_proj``. Such weights count in that ancestor's fingerprint (and above); the weights of a module
    nothing reads (a norm kept for another configuration, an unused head) do not. A never-called module's weights
    count as read when its nearest called ancestor called no module holding weights (that ancestor's own code
    did all its subtree computes), or when adding them makes a called ancestor hold exactly the weights of a called
    module on the other side (the same weights computed with there).
    """
    sides = []
    for trace in (reference, candidate):
        prints = prints_from_meta(trace.meta)
        called = {call.path for call in trace.calls}
        sides.append((prints, called, called | _read_by_own_code(prints, called)))
    counted = [restrict_to_called(prints, used) for prints, _, used in sides]
    computed = [  # (fingerprint, size) of each called module holding weights
        {(item.digest, item.numel) for path, item in side.items() if path in called and item.numel}
        for side, (_, called, _) in zip(counted, sides, strict=True)
    ]
    result = []
    for (prints, called, used), restricted, other in zip(sides, counted, reversed(computed), strict=True):
        read = _read_by_evidence(restricted, called, used, other)
        result.append(restricted if not read else restrict_to_called(prints, used | read))
    return result[0], result[1]


def _read_by_own_code(prints: Mapping[str, ModulePrint], called: set[str]) -> set[str]:
    """Never-called modules holding weights whose nearest called ancestor called no module holding weights."""
    running: set[str] = set()  # called modules below which a called module holding weights ran its own code
    for path in called:
        item = prints.get(path)
        if path and item is not None and item.numel:
            running.update(module_ancestors(path))
    read = set()
    for path, item in prints.items():
        if path in called or not item.params:
            continue
        caller = next((a for a in module_ancestors(path) if a in called), None)
        if caller is not None and caller not in running:
            read.add(path)
    return read


def _read_by_evidence(
    prints: Mapping[str, ModulePrint], called: set[str], used: set[str], other: set[tuple[int, int]]
) -> set[str]:
    """Never-called modules (not in ``used``) whose weights, added to a called ancestor's (``prints``: without
    them), make that ancestor's fingerprint and size those of a called module on the other side (``other``)."""
    read = set()
    for path, item in prints.items():
        if path in used or not item.params:
            continue
        own = sum(param.digest for param in item.params) & MASK
        size = sum(math.prod(param.shape) for param in item.params)
        for ancestor in module_ancestors(path):
            held = prints.get(ancestor)
            if ancestor in called and held is not None and ((held.digest + own) & MASK, held.numel + size) in other:
                read.add(path)
                break
    return read


def held_elsewhere(
    reference: Trace,
    candidate: Trace,
    ref_prints: Mapping[str, ModulePrint],
    cand_prints: Mapping[str, ModulePrint],
) -> tuple[dict[str, ModulePrint], dict[str, ModulePrint]]:
    """Each side's fingerprints with a lookup table the other side holds elsewhere taken out of its ancestors'
    (:func:`_moved_out`), so those ancestors pair with the other side's modules by what remains."""
    ref_lookups, cand_lookups = _lookups(reference), _lookups(candidate)
    return (
        _moved_out(ref_prints, cand_prints, ref_lookups & set(ref_prints), cand_lookups),
        _moved_out(cand_prints, ref_prints, cand_lookups & set(cand_prints), ref_lookups),
    )


def _lookups(trace: Trace) -> set[str]:
    """Modules every call of which takes no floating-point tensor: tables looked up by indices or positions (an
    embedding of relative position buckets), whose output depends on no value the model computes."""
    found: dict[str, bool] = {}
    for call in trace.calls:
        floating = any(
            str(node.get("dtype", "")).startswith(("float", "bfloat", "complex")) for _, node in call.tensors("inputs")
        )
        found[call.path] = found.get(call.path, True) and not floating
    return {path for path, lookup in found.items() if lookup}


def _moved_out(
    side: Mapping[str, ModulePrint], other: Mapping[str, ModulePrint], lookups: set[str], other_lookups: set[str]
) -> dict[str, ModulePrint]:
    """``side``'s fingerprints with each lookup table (in ``lookups``) that the other side holds in a lookup of its
    own but elsewhere taken out of the ancestors that hold it and have no counterpart.

    T5's first attention computes the position bias every layer receives from a table of relative position buckets;
    a port holding the table at the stack passes the bias in, and its first attention has all of the reference
    attention's weights but the table (blocks alike): none of them paired. A table's output depends on positions
    alone, so computing it elsewhere and passing it in changes nothing the module around it returns; a module taking
    values (a norm, a projection) is never moved: the module around it returns what it computes. The table is taken
    out of its ancestors up to the first that pairs as it is, where taking it out makes one of them pair."""
    keys = {(item.digest, item.numel) for item in other.values() if item.numel}
    tables = {(item.digest, item.numel) for path, item in other.items() if path in other_lookups and item.numel}
    result = dict(side)
    for path in lookups:
        item = side[path]
        if not path or not item.params or not item.numel or (item.digest, item.numel) not in tables:
            continue
        above: list[str] = []
        evidence = False
        for ancestor in module_ancestors(path):
            held = side.get(ancestor)
            if held is None or (held.digest, held.numel) in keys:
                break
            above.append(ancestor)
            evidence |= ((held.digest - item.digest) & MASK, held.numel - item.numel) in keys
        else:
            continue  # no ancestor pairs as it is: nothing says the other side holds it elsewhere in the same whole
        if not evidence:
            continue
        for ancestor in above:
            held = result[ancestor]
            result[ancestor] = dataclasses.replace(
                held, digest=(held.digest - item.digest) & MASK, numel=held.numel - item.numel
            )
    return result
