"""Which candidate call corresponds to which reference call.

Precedence: explicit rules, then identical paths, then automatic alignment of what is left. The
automatic step is a dynamic-programming alignment of the two call sequences (execution order) between
the pairs already fixed, scored on output shape and dtype, output statistics, class and name
similarity, and layer numbers. Rules are data (YAML), litgpt-style: ``{}`` stands for a number, and
``null`` leaves a module unmatched on purpose.
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy

from paritylab.comparison.patterns import compile_pattern, fill
from paritylab.tracing.structure import MASK, ModulePrint, inner_digests, prints_from_meta, restrict_to_called
from paritylab.tracing.tracefile import CallRecord, Trace
from paritylab.tracing.values import Node, first_tensor_slot, iter_tensors

Index = int | str | None
_NUMBER = re.compile(r"(?<![^.])\d+(?![^.])")
_TOKEN = re.compile(r"[a-z]+|\d+")
MIN_AUTO_SCORE = 0.3
"""Between anchors, calls of equal output shape pair with at least this score (more with name evidence)."""
MIN_STRUCTURE = 0.3
"""Name evidence needed to pair two modules whose parameters differ."""
RESCUE_SCORE = 0.75
"""Out-of-order matches (a port that runs two branches in the other order) need this much name evidence."""
MAX_RESCUE = 64
"""Out-of-order candidates examined per reference call (same output shape)."""
MAX_CELLS = 250_000
BAND = 128
"""Segments between anchors larger than ``MAX_CELLS`` cells are aligned within ``BAND`` of the diagonal."""


class AlignmentError(ValueError):
    """Alignment rules that cannot be used as given."""


@dataclass(frozen=True)
class Part:
    """Part of the last dimension: ``[start, stop)``, the ``index``-th of ``count`` equal chunks, or the
    positions ``indices`` (a fused projection whose parts are interleaved, e.g. grouped-query qkv)."""

    start: int = 0
    stop: int | None = None
    index: int | None = None
    count: int | None = None
    indices: tuple[int, ...] | None = None

    def select(self, value: Any) -> Any:
        """The part of ``value`` (a tensor) along its last dimension."""
        if self.indices is not None:
            import torch

            return value.index_select(-1, torch.tensor(self.indices, device=value.device))
        start, stop = self.bounds(value.shape[-1])
        return value[..., start:stop]

    def size(self, size: int) -> int:
        if self.indices is not None:
            return len(self.indices)
        start, stop = self.bounds(size)
        return max(0, stop - start)

    def bounds(self, size: int) -> tuple[int, int]:
        if self.index is not None and self.count:
            step = size // self.count
            return self.index * step, (self.index + 1) * step
        return slice(self.start, self.stop).indices(size)[:2]

    def to_yaml(self) -> dict[str, list[int | None]]:
        if self.indices is not None:
            return {"indices": list(self.indices)}
        if self.index is not None:
            return {"chunk": [self.index, self.count]}
        return {"slice": [self.start, self.stop]}


@dataclass(frozen=True)
class Rule:
    """Reference path pattern -> candidate path pattern (``None``: leave unmatched on purpose)."""

    reference: str
    candidate: str | None
    reference_index: Index = None
    candidate_index: Index = None
    reference_part: Part | None = None
    candidate_part: Part | None = None
    """Compare only part of the last dimension (e.g. the q part of a fused qkv projection)."""
    reference_input: str | None = None
    """For a module paired with a run of modules: the module whose input stands for this side's input (the
    run's first), a template filled like ``candidate``."""
    candidate_input: str | None = None

    def match(self, path: str) -> str | bool | None:
        """The candidate path for reference ``path``, ``None`` if deliberately unmatched, ``False`` if no match."""
        found = compile_pattern(self.reference).fullmatch(path)
        if found is None:
            return False
        if self.candidate is None:
            return None
        try:
            return fill(self.candidate, found)
        except ValueError as error:
            raise AlignmentError(f"rule {self.reference!r} -> {self.candidate!r}: {error}") from error

    def inputs(self, path: str) -> tuple[str | None, str | None]:
        """The paths whose inputs stand for reference ``path``'s pair's inputs (``None``: the pair's own)."""
        found = compile_pattern(self.reference).fullmatch(path)
        if found is None:
            return None, None

        def filled(template: str | None) -> str | None:
            try:
                return None if template is None else fill(template, found)
            except ValueError as error:
                raise AlignmentError(f"rule {self.reference!r}: input {error}") from error

        return filled(self.reference_input), filled(self.candidate_input)

    def to_yaml(self) -> dict[str, Any]:
        data: dict[str, Any] = {"reference": self.reference, "candidate": self.candidate}
        for side in ("reference", "candidate"):
            index, part = getattr(self, f"{side}_index"), getattr(self, f"{side}_part")
            if index is not None:
                data[f"{side}_index"] = index
            if part is not None:
                kind, value = next(iter(part.to_yaml().items()))
                data[f"{side}_{kind}"] = value
            if getattr(self, f"{side}_input") is not None:
                data[f"{side}_input"] = getattr(self, f"{side}_input")
        return data


def parse_rules(data: object) -> list[Rule]:
    """Rules from YAML data: a mapping ``{reference: candidate}``, or a list of rule mappings, or
    ``{"rules": [...]}`` as written by :meth:`Alignment.to_yaml`."""
    if isinstance(data, Mapping) and "rules" in data:
        data = data["rules"]
    if data is None:
        return []
    if isinstance(data, Mapping):
        return [Rule(str(ref), None if cand is None else str(cand)) for ref, cand in data.items()]
    if not isinstance(data, list):
        raise AlignmentError("alignment rules must be a mapping or a list of {reference:, candidate:} entries")
    return [_rule(entry, position) for position, entry in enumerate(data)]


def _rule(entry: object, position: int) -> Rule:
    if not isinstance(entry, Mapping) or "reference" not in entry or "candidate" not in entry:
        raise AlignmentError(f"rule #{position} needs 'reference' and 'candidate' keys (candidate may be null)")
    known = {"reference", "candidate"} | {
        f"{side}_{kind}"
        for side in ("reference", "candidate")
        for kind in ("index", "slice", "chunk", "indices", "input")
    }
    unknown = set(entry) - known
    if unknown:
        raise AlignmentError(f"rule #{position} has unknown keys {sorted(unknown)}; allowed: {sorted(known)}")
    candidate = entry["candidate"]
    return Rule(
        str(entry["reference"]),
        None if candidate is None else str(candidate),
        entry.get("reference_index"),
        entry.get("candidate_index"),
        _part(entry, "reference", position),
        _part(entry, "candidate", position),
        _input(entry, "reference", position),
        _input(entry, "candidate", position),
    )


def _input(entry: Mapping[str, Any], side: str, position: int) -> str | None:
    value = entry.get(f"{side}_input")
    if value is not None and not isinstance(value, str):
        raise AlignmentError(f"rule #{position}: {side}_input must be a module path, got {value!r}")
    return value


def _part(entry: Mapping[str, Any], side: str, position: int) -> Part | None:
    indices = entry.get(f"{side}_indices")
    if indices is not None:
        if not isinstance(indices, list) or not all(isinstance(i, int) and i >= 0 for i in indices):
            raise AlignmentError(f"rule #{position}: {side}_indices must be a list of non-negative integers")
        return Part(indices=tuple(indices))
    cut, chunk = entry.get(f"{side}_slice"), entry.get(f"{side}_chunk")
    if cut is not None and chunk is not None:
        raise AlignmentError(f"rule #{position}: give {side}_slice or {side}_chunk, not both")
    for name, value in ((f"{side}_slice", cut), (f"{side}_chunk", chunk)):
        if value is None:
            continue
        pair_ok = isinstance(value, Sequence) and len(value) == 2
        if not pair_ok or not all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in value):
            raise AlignmentError(f"rule #{position}: {name} must be [start, stop] / [index, count], got {value!r}")
        if name.endswith("chunk"):
            index, count = value
            if index is None or count is None or not 0 <= index < count:
                raise AlignmentError(f"rule #{position}: {name} [index, count] needs 0 <= index < count")
            return Part(index=value[0], count=value[1])
        return Part(start=value[0] or 0, stop=value[1])
    return None


def load_rules(path: str | Path) -> list[Rule]:
    """Rules from a YAML file."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as error:
        raise AlignmentError(f"cannot read alignment rules {path}: {error}") from error
    return parse_rules(data)


@dataclass(frozen=True)
class Pair:
    """One aligned pair of calls, and which output element of each to compare."""

    reference: str
    candidate: str
    source: str
    """``rule``, ``identity``, ``structure`` (equal weights), ``run`` (one side's weights are those of a run of
    modules on the other, paired with the run's last: outputs compare, inputs do not) or ``auto``."""
    score: float = 1.0
    reference_index: Index = None
    candidate_index: Index = None
    reference_part: Part | None = None
    candidate_part: Part | None = None
    reference_input: str | None = None
    """For a ``run`` pair: the call whose input stands for the reference side's input (the run's first)."""
    candidate_input: str | None = None
    """The same on the candidate side."""


@dataclass
class Alignment:
    """The pairs used, in reference execution order, and what stayed unmatched on each side."""

    pairs: list[Pair] = field(default_factory=list)
    unmatched_reference: list[str] = field(default_factory=list)
    unmatched_candidate: list[str] = field(default_factory=list)
    ignored_reference: list[str] = field(default_factory=list)
    """Reference calls a rule left unmatched on purpose."""
    folded_reference: list[str] = field(default_factory=list)
    folded_candidate: list[str] = field(default_factory=list)
    """Calls that return their own input (hook points, ``nn.Identity``, eval dropout): shown, never paired."""
    lost: list[str] = field(default_factory=list)
    """Reference calls a rule (or a pinned alignment) pairs with a candidate call that does not exist."""

    def by_reference(self) -> dict[str, Pair]:
        return {pair.reference: pair for pair in self.pairs}

    def to_yaml(self) -> str:
        """The alignment as rules (numbers generalised to ``{}`` where consistent), to inspect, edit and reuse.

        Modules no call of which was paired come first as ``candidate: null`` rules (first match wins), so a
        generalised rule never pairs what this alignment left unmatched: pinned, it reproduces it exactly.
        """
        import yaml

        paired = {_path(pair.reference) for pair in self.pairs}
        left = _unique_paths([*self.unmatched_reference, *self.ignored_reference])
        unpaired = [path for path in left if path not in paired]  # left unmatched, or by a rule: before any pattern
        rules = [Rule(path, None) for path in unpaired] + _generalise(self.pairs)
        return yaml.safe_dump({"rules": [rule.to_yaml() for rule in rules]}, sort_keys=False, width=200)


def align(reference: Trace, candidate: Trace, rules: Iterable[Rule] = (), *, pinned: bool = False) -> Alignment:
    """Align the calls of two traces from evidence a numerical bug cannot change.

    In order: the user's rules; parameter fingerprints (equal weights, up to layout and cast, are the same
    module; a module whose weight rows are part of a fused one is paired with that part); identical paths
    where fingerprints do not contradict them; then order, shape, class and names between those anchors.
    Output statistics never decide a pair. Calls that return their own input (hook points, ``nn.Identity``,
    eval dropout) are folded: listed, never paired.

    ``pinned``: ``rules`` are a frozen alignment (``report/alignment.yaml`` of an earlier run) and the only
    evidence: nothing else is paired, and a rule whose candidate call no longer exists is listed in
    :attr:`Alignment.lost`.
    """
    rules = list(rules)
    ref_calls, cand_calls = reference.calls, candidate.calls
    folded_ref, folded_cand = _folded(ref_calls), _folded(cand_calls)
    cand_by_key = {call.key: call for i, call in enumerate(cand_calls) if i not in folded_cand}
    ref_keys = {call.key for call in ref_calls}
    cand_position = {call.key: position for position, call in enumerate(cand_calls)}
    ref_prints, cand_prints = _read_prints(reference, candidate)
    fixed: dict[int, tuple[int, Pair]] = {}
    ignored: list[str] = []
    taken: set[int] = set(folded_cand)

    def fix(i: int, j: int, pair: Pair) -> None:
        fixed[i] = (j, pair)
        if pair.candidate_part is None:
            taken.add(j)

    lost: list[str] = []
    for position, call in enumerate(ref_calls):
        if position in folded_ref:
            continue
        pair = _by_rule(call, rules, cand_by_key, lost, ref_keys)
        if pair is None:
            ignored.append(call.key)
        elif isinstance(pair, Pair) and cand_position[pair.candidate] not in taken:
            fix(position, cand_position[pair.candidate], pair)
    if pinned:
        return _alignment(ref_calls, cand_calls, fixed, ignored, folded_ref, folded_cand, lost)
    skipped = set(fixed) | folded_ref
    open_ref = [i for i in range(len(ref_calls)) if i not in skipped and ref_calls[i].key not in ignored]
    structured = bool(ref_prints and cand_prints)
    if structured:
        known = {i: j for i, (j, _) in fixed.items()}
        for i, j, pair in _by_fingerprint(ref_calls, cand_calls, open_ref, taken, ref_prints, cand_prints, known):
            fix(i, j, pair)
        open_ref = [i for i in open_ref if i not in fixed]
    for i in open_ref:
        call = ref_calls[i]
        other = cand_by_key.get(call.key)
        if other is not None and cand_position[other.key] not in taken:
            fix(i, cand_position[other.key], Pair(call.key, other.key, "identity"))
    open_ref = [i for i in open_ref if i not in fixed]
    if structured:
        for i, j, pair in _by_parts(ref_calls, cand_calls, open_ref, taken, ref_prints, cand_prints):
            fix(i, j, pair)
        open_ref = [i for i in open_ref if i not in fixed]
        for i, j, pair in _by_runs(ref_calls, cand_calls, open_ref, taken, ref_prints, cand_prints):
            fix(i, j, pair)
    anchors = _monotone_chain(sorted((r, c) for r, (c, _) in fixed.items()))
    skip_ref = set(fixed) | folded_ref | {i for i, call in enumerate(ref_calls) if call.key in ignored}
    skip_cand = set(taken) | {c for c, _ in fixed.values()}
    automatic = _align_segments(ref_calls, cand_calls, anchors, skip_ref, skip_cand, ref_prints, cand_prints)
    taken_cand = skip_cand | {cand_position[pair.candidate] for pair in automatic.values()}
    automatic |= _rescue(ref_calls, cand_calls, skip_ref | set(automatic), taken_cand, ref_prints, cand_prints)
    return _alignment(ref_calls, cand_calls, fixed, ignored, folded_ref, folded_cand, [], automatic)


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


def _ancestors(path: str) -> Iterable[str]:
    """Proper ancestors of a module path, nearest first (the root ``""`` last)."""
    while path:
        path = path.rsplit(".", 1)[0] if "." in path else ""
        yield path


def _read_by_own_code(prints: Mapping[str, ModulePrint], called: set[str]) -> set[str]:
    """Never-called modules holding weights whose nearest called ancestor called no module holding weights."""
    running: set[str] = set()  # called modules below which a called module holding weights ran its own code
    for path in called:
        item = prints.get(path)
        if path and item is not None and item.numel:
            running.update(_ancestors(path))
    read = set()
    for path, item in prints.items():
        if path in called or not item.params:
            continue
        caller = next((a for a in _ancestors(path) if a in called), None)
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
        for ancestor in _ancestors(path):
            held = prints.get(ancestor)
            if ancestor in called and held is not None and ((held.digest + own) & MASK, held.numel + size) in other:
                read.add(path)
                break
    return read


def _alignment(
    ref_calls: list[CallRecord],
    cand_calls: list[CallRecord],
    fixed: dict[int, tuple[int, Pair]],
    ignored: list[str],
    folded_ref: set[int],
    folded_cand: set[int],
    lost: list[str],
    automatic: dict[int, Pair] | None = None,
) -> Alignment:
    pairs_by_ref = {r: pair for r, (_, pair) in fixed.items()} | (automatic or {})
    pairs = [pairs_by_ref[i] for i in sorted(pairs_by_ref)]
    matched_cand = {pair.candidate for pair in pairs}
    return Alignment(
        pairs=pairs,
        unmatched_reference=[
            c.key
            for i, c in enumerate(ref_calls)
            if i not in pairs_by_ref and c.key not in ignored and i not in folded_ref
        ],
        unmatched_candidate=[
            c.key for j, c in enumerate(cand_calls) if c.key not in matched_cand and j not in folded_cand
        ],
        ignored_reference=ignored,
        folded_reference=[ref_calls[i].key for i in sorted(folded_ref)],
        folded_candidate=[cand_calls[j].key for j in sorted(folded_cand)],
        lost=lost,
    )


def _folded(calls: list[CallRecord]) -> set[int]:
    """Calls that compute nothing new: those returning their own input, and a module called again on the
    very tensor an earlier call of it received (TransformerLens normalises the same residual for q, k and v)."""
    folded: set[int] = set()
    seen: set[tuple[str, str]] = set()
    for position, call in enumerate(calls):
        if call.identity:
            folded.add(position)
            continue
        node = _primary_input(call)
        ref = node.get("ref") if node else None
        if ref is None:
            continue
        if (call.path, ref) in seen:
            folded.add(position)
        seen.add((call.path, ref))
    return folded


def _primary_input(call: CallRecord) -> Node | None:
    return next((node for _, node in iter_tensors(call.inputs, "inputs")), None)


def _by_rule(
    call: CallRecord, rules: list[Rule], cand_by_key: dict[str, CallRecord], lost: list[str], ref_keys: set[str]
) -> Pair | bool | None:
    """The pair a rule gives, ``None`` if a rule leaves the call unmatched, ``False`` if no rule applies
    (a rule whose candidate call does not exist adds the reference call to ``lost``; so does a run's input
    call that no longer exists)."""
    for rule in rules:
        target = rule.match(call.path)
        if target is False:
            continue
        if target is None:
            return None
        key = f"{target}#{call.call_index}"
        ref_input, cand_input = (
            None if path is None else f"{path}#{call.call_index}" for path in rule.inputs(call.path)
        )
        if (
            key not in cand_by_key
            or (ref_input and ref_input not in ref_keys)
            or (cand_input and cand_input not in cand_by_key)
        ):
            lost.append(call.key)
            return False
        return Pair(
            call.key,
            key,
            "run" if ref_input or cand_input else "rule",
            1.0,
            rule.reference_index,
            rule.candidate_index,
            rule.reference_part,
            rule.candidate_part,
            ref_input,
            cand_input,
        )
    return False


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


def _fits(ref: CallRecord, cand: CallRecord) -> bool:
    """Output shapes that hold the same values (see :func:`shapes_fit`)."""
    a, b = _shape(ref), _shape(cand)
    return a is not None and b is not None and shapes_fit(a, b)


def shapes_fit(a: Sequence[int], b: Sequence[int]) -> bool:
    """Equal, equal but for dimensions one side kept at 1 (:func:`broadcastable`), or equal but for leading
    dimensions one side merged (:func:`merged`)."""
    return list(a) == list(b) or broadcastable(a, b) or merged(a, b)


def broadcastable(a: Sequence[int], b: Sequence[int]) -> bool:
    """Same rank, and every dimension equal or 1 on one side: the same values, one side repeated."""
    return len(a) == len(b) and all(x == y or x == 1 or y == 1 for x, y in zip(a, b, strict=True))


def merged(a: Sequence[int], b: Sequence[int]) -> bool:
    """The same values in the same order, one side with consecutive leading dimensions merged: ``[24, 64]``
    against ``[2, 12, 64]`` (an implementation that flattens batch and sequence before its MLP)."""
    if len(a) == len(b) or not a or not b or a[-1] != b[-1]:
        return False
    longer, shorter = (a, b) if len(a) > len(b) else (b, a)
    position = 0
    for size in shorter[:-1]:
        product = 1
        while position < len(longer) - 1 and (product < size or longer[position] == 1):
            product *= longer[position]
            position += 1
        if product != size:
            return False
    return all(size == 1 for size in longer[position:-1])


def _within_group(ref: _Features, cand: _Features) -> float:
    """Among modules holding the same weights: output shapes that fit needed; structure breaks ties."""
    if ref.shape is None or cand.shape is None:
        return 0.0
    if not shapes_fit(ref.shape, cand.shape):
        return 0.0
    if ref.numbers and cand.numbers and ref.numbers[-1] != cand.numbers[-1]:
        return 0.0
    return 0.5 + 0.5 * ref.structure(cand)


def _by_parts(
    ref_calls: list[CallRecord],
    cand_calls: list[CallRecord],
    open_ref: list[int],
    taken: set[int],
    ref_prints: dict[str, ModulePrint],
    cand_prints: dict[str, ModulePrint],
) -> list[tuple[int, int, Pair]]:
    """Modules whose weight is part of a fused one on the other side (q of qkv, gate of gate+up), and the
    positions of the output's last dimension that part computes, found from row and column hashes."""
    cand_paths = {call.path for j, call in enumerate(cand_calls) if j not in taken}
    cand_index = _axis_index(cand_prints, cand_paths)
    cand_by_key = {call.key: j for j, call in enumerate(cand_calls) if j not in taken}
    cand_widths = _widths(cand_calls[j] for j in cand_by_key.values())
    found: list[tuple[int, int, Pair]] = []
    for i in open_ref:
        call = ref_calls[i]
        located = _locate(ref_prints.get(call.path), _shape(call), cand_index, cand_prints, cand_widths)
        if located is None:
            continue
        path, part = located
        j = cand_by_key.get(f"{path}#{call.call_index}")
        if j is None:
            continue
        found.append((i, j, Pair(call.key, cand_calls[j].key, "structure", 1.0, candidate_part=part)))
    ref_paths = {ref_calls[i].path for i in open_ref}
    ref_index = _axis_index(ref_prints, ref_paths)
    ref_by_key = {ref_calls[i].key: i for i in open_ref}
    ref_widths = _widths(ref_calls[i] for i in open_ref)
    paired = {i for i, _, _ in found}
    for j, call in enumerate(cand_calls):
        if j in taken:
            continue
        located = _locate(cand_prints.get(call.path), _shape(call), ref_index, ref_prints, ref_widths)
        if located is None:
            continue
        path, part = located
        found_at = ref_by_key.get(f"{path}#{call.call_index}")
        if found_at is None or found_at in paired:
            continue
        paired.add(found_at)
        found.append((found_at, j, Pair(ref_calls[found_at].key, call.key, "structure", 1.0, reference_part=part)))
    return found


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


@dataclass(frozen=True)
class _AxisIndex:
    """Every row and column hash of the 2-D parameters of some modules, sorted, with where each sits: ``owners``
    indexes ``keys`` (module path, parameter name, axis), ``positions`` is the row or column. Built from the hashes'
    bytes with numpy: llava-bench's 150,000 rows and columns took 0.29 s as a dict of Python lists."""

    hashes: numpy.ndarray
    owners: numpy.ndarray
    positions: numpy.ndarray
    keys: list[tuple[str, str, int]]

    def find(self, values: numpy.ndarray) -> dict[tuple[str, str, int], list[int]]:
        """For each (path, parameter, axis) holding any of ``values``: the positions there of the values it holds,
        in the order of ``values``; owners in the order they are first met."""
        left = numpy.searchsorted(self.hashes, values, "left")
        counts = numpy.searchsorted(self.hashes, values, "right") - left
        total = int(counts.sum())
        if not total:
            return {}
        ends = numpy.cumsum(counts)
        at = numpy.repeat(left - (ends - counts), counts) + numpy.arange(total)  # every match, value by value
        owners, positions = self.owners[at], self.positions[at]
        unique, first = numpy.unique(owners, return_index=True)
        return {
            self.keys[int(owner)]: positions[owners == owner].tolist()
            for owner in unique[numpy.argsort(first, kind="stable")]
        }


def _axis_index(prints: dict[str, ModulePrint], paths: set[str]) -> _AxisIndex:
    hashes: list[numpy.ndarray] = []
    owners: list[numpy.ndarray] = []
    positions: list[numpy.ndarray] = []
    keys: list[tuple[str, str, int]] = []
    for path in sorted(paths):
        item = prints.get(path)
        if item is None:
            continue
        for param in item.params:
            for axis, raw in ((0, param.row_bytes), (1, param.col_bytes)):
                if not raw:
                    continue
                values = numpy.frombuffer(raw, dtype="<u8")
                hashes.append(values)
                owners.append(numpy.full(len(values), len(keys), dtype=numpy.int64))
                positions.append(numpy.arange(len(values), dtype=numpy.int64))
                keys.append((path, param.name, axis))
    if not keys:
        empty = numpy.zeros(0, dtype=numpy.int64)
        return _AxisIndex(numpy.zeros(0, dtype="<u8"), empty, empty, keys)
    every = numpy.concatenate(hashes)
    order = numpy.argsort(every, kind="stable")  # equal hashes keep the order of their owners
    return _AxisIndex(every[order], numpy.concatenate(owners)[order], numpy.concatenate(positions)[order], keys)


def _widths(calls: Iterable[CallRecord]) -> dict[str, set[int]]:
    """Module path -> the sizes of its outputs' last dimension."""
    widths: dict[str, set[int]] = {}
    for call in calls:
        shape = _shape(call)
        if shape:
            widths.setdefault(call.path, set()).add(shape[-1])
    return widths


def _locate(
    item: ModulePrint | None,
    shape: tuple[int, ...] | None,
    index: _AxisIndex,
    prints: dict[str, ModulePrint],
    widths: Mapping[str, set[int]],
) -> tuple[str, Part] | None:
    """Where the output features of ``item`` (a module with a 2-D weight) sit in a fused module's output.
    The fused weight's axis must be its module's output features too (``widths``: a ``Linear``'s rows are;
    an ``Embedding``'s rows are table entries, and a table holding another's entries plus more, such as
    positions with an offset, computes the same features, not a part of them)."""
    if item is None or not shape:
        return None
    for param in item.params:
        for raw in (param.row_bytes, param.col_bytes):
            hashes = numpy.frombuffer(raw, dtype="<u8")
            if len(hashes) != shape[-1] or len(numpy.unique(hashes)) != len(hashes):
                continue
            for (path, name, axis), positions in index.find(hashes).items():
                other = next(p for p in prints[path].params if p.name == name)
                if path == item.path or len(positions) != len(hashes) or len(positions) == other.shape[axis]:
                    continue  # not a strict part (equal weights are paired by fingerprint)
                if other.shape[axis] not in widths.get(path, ()):
                    continue  # that axis is not what the fused module outputs
                return path, _part_of(positions)
    return None


def _part_of(positions: list[int]) -> Part:
    if positions == list(range(positions[0], positions[0] + len(positions))):
        return Part(start=positions[0], stop=positions[0] + len(positions))
    return Part(indices=tuple(positions))


def _shape(call: CallRecord) -> tuple[int, ...] | None:
    node = _primary(call.outputs)
    return tuple(node["shape"]) if node else None


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
) -> dict[int, Pair]:
    bounds = [(-1, -1), *anchors, (len(ref_calls), len(cand_calls))]
    found: dict[int, Pair] = {}
    features: dict[tuple[int, int], _Features] = {}
    inner = (inner_digests(ref_prints), inner_digests(cand_prints))

    def feature(side: int, position: int) -> _Features:
        key = (side, position)
        if key not in features:
            call = (ref_calls, cand_calls)[side][position]
            prints = (ref_prints, cand_prints)[side]
            features[key] = _Features.of(call, prints.get(call.path), inner[side].get(call.path, frozenset()))
        return features[key]

    for (r0, c0), (r1, c1) in itertools.pairwise(bounds):
        rows = [i for i in range(r0 + 1, r1) if i not in skip_ref]
        cols = [j for j in range(c0 + 1, c1) if j not in skip_cand]
        for i, j, score in _dp(rows, cols, lambda i, j: feature(0, i).similarity(feature(1, j))):
            weights = feature(0, i).weights
            source = "structure" if weights is not None and weights == feature(1, j).weights else "auto"
            found[i] = Pair(ref_calls[i].key, cand_calls[j].key, source, round(score, 4))
    return found


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


def _primary(outputs: Node | None) -> Node | None:
    return next((node for _, node in iter_tensors(outputs, "outputs")), None)


@dataclass
class _Features:
    shape: tuple[int, ...] | None
    tokens: frozenset[str]
    name: frozenset[str]
    cls: str
    numbers: tuple[str, ...]
    depth: int
    weights: int | None = None
    """The module's parameter fingerprint, when it holds parameters and the trace carries fingerprints."""
    inner: frozenset[int] = frozenset()
    """The fingerprints of its descendants that hold parameters."""
    numel: int = 0
    """How many parameter values its subtree holds (with :attr:`weights`)."""

    @classmethod
    def of(cls, call: CallRecord, item: ModulePrint | None = None, inner: frozenset[int] = frozenset()) -> _Features:
        node = _primary(call.outputs)
        leaf = call.path.rsplit(".", 1)[-1] if call.path else ""
        return cls(
            shape=tuple(node["shape"]) if node else None,
            tokens=frozenset(_TOKEN.findall(f"{call.path} {call.cls}".lower())),
            name=_bigrams(leaf.lower()),
            cls=call.cls.lower(),
            numbers=_layer_numbers(call.path),
            depth=call.depth,
            weights=item.digest if item is not None and item.numel else None,
            inner=inner,
            numel=item.numel if item is not None else 0,
        )

    def contradicts(self, other: _Features) -> bool:
        """The weights rule the pair out: they differ, and either they are not even as many values (a
        projection against a norm of the same output shape: a wrong weight conversion keeps the count, a
        different module does not), or one side's weights are exactly those of a part of the other (a wrapper
        around what the other computes plus more, such as a patch projection against a patch embedding that
        also adds position embeddings)."""
        if self.weights is None or other.weights is None or self.weights == other.weights:
            return False
        if self.numel != other.numel:
            return True
        return self.weights in other.inner or other.weights in self.inner

    def similarity(self, other: _Features) -> float:
        """0 unless output shapes agree and layer numbers do not rule the pair out; else structural
        evidence, in (0, 1]. Modules of the same shape in the same place in the order pair on shape and
        position alone, unless both hold parameters that differ: then names must agree too (a weight
        conversion bug still pairs with its namesake, a different computation does not)."""
        if self.shape is None or other.shape is None:
            return 0.0
        if self.shape != other.shape and not merged(self.shape, other.shape):
            return 0.0
        if self.numbers and other.numbers and self.numbers[-1] != other.numbers[-1]:
            return 0.0
        if self.weights is not None and self.weights == other.weights:
            return 1.0  # the same weights: as strong as evidence gets (a group the weights alone could not order)
        structure = self.structure(other)
        differ = self.weights is not None and other.weights is not None and self.weights != other.weights
        if differ and (structure < MIN_STRUCTURE or self.contradicts(other)):
            return 0.0
        return MIN_AUTO_SCORE + (1 - MIN_AUTO_SCORE) * structure

    def structure(self, other: _Features) -> float:
        """Evidence from names alone: equal layer numbers, similar leaf names, shared tokens, same class."""
        if self.numbers and other.numbers and self.numbers[-1] != other.numbers[-1]:
            return 0.0  # layer 3 is not layer 4, whatever the names say
        numbers = 1.0 if self.numbers and self.numbers == other.numbers else 0.0
        overlap = len(self.tokens & other.tokens) / max(1, min(len(self.tokens), len(other.tokens)))
        return 0.5 * numbers + 0.3 * _dice(self.name, other.name) + 0.1 * overlap + 0.1 * (self.cls == other.cls)


def _layer_numbers(path: str) -> tuple[str, ...]:
    """Numeric path components followed by more components (``layers.3.mlp``): layer numbers. A numeric
    leaf is a position inside a ``Sequential`` (``mlp.1``), not a layer."""
    parts = path.split(".")
    return tuple(part for part in parts[:-1] if part.isdigit())


def _dice(a: frozenset[str], b: frozenset[str]) -> float:
    return 2 * len(a & b) / (len(a) + len(b)) if a and b else 0.0


def _bigrams(name: str) -> frozenset[str]:
    padded = f"^{name}$"
    return frozenset(padded[i : i + 2] for i in range(len(padded) - 1))


def _path(key: str) -> str:
    return key.rsplit("#", 1)[0]


def _unique_paths(keys: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(_path(key) for key in keys))


def _generalise(pairs: list[Pair]) -> list[Rule]:
    """Rules for the pairs: one ``{}`` rule per pattern whose layer numbers map the same on both sides."""
    groups: dict[Rule, list[Pair]] = {}
    for pair in pairs:
        ref_path, cand_path = _path(pair.reference), _path(pair.candidate)
        ref_numbers, cand_numbers = _NUMBER.findall(ref_path), _NUMBER.findall(cand_path)
        generic = bool(ref_numbers == cand_numbers and ref_numbers)

        def pattern(path: str, generic: bool = generic) -> str:
            return _NUMBER.sub("{}", path) if generic else path

        key = Rule(
            pattern(ref_path),
            pattern(cand_path),
            pair.reference_index,
            pair.candidate_index,
            pair.reference_part,
            pair.candidate_part,
            None if pair.reference_input is None else pattern(_path(pair.reference_input)),
            None if pair.candidate_input is None else pattern(_path(pair.candidate_input)),
        )
        groups.setdefault(key, []).append(pair)
    by_reference_pattern: dict[str, int] = {}
    for key in groups:
        by_reference_pattern[key.reference] = by_reference_pattern.get(key.reference, 0) + 1
    rules: list[Rule] = []
    for key, members in groups.items():
        if by_reference_pattern[key.reference] == 1:
            rules.append(key)
        else:  # one reference pattern, several candidate patterns: spell each pair out
            for pair in members:
                rules.append(
                    replace(
                        key,
                        reference=_path(pair.reference),
                        candidate=_path(pair.candidate),
                        reference_input=None if pair.reference_input is None else _path(pair.reference_input),
                        candidate_input=None if pair.candidate_input is None else _path(pair.candidate_input),
                    )
                )
    return _dedupe(rules)


def _dedupe(rules: list[Rule]) -> list[Rule]:
    return list(dict.fromkeys(rules))


def primary_slot(call: CallRecord, index: Index) -> str | None:
    """The output slot compared for ``call``: element ``index`` if given, else the first tensor."""
    from paritylab.tracing.values import select

    outputs = call.outputs
    if index is None:
        return first_tensor_slot(outputs, "outputs")
    chosen = select(outputs, index)
    if chosen is None or outputs is None:
        return None
    if outputs.get("t") == "tensor":
        return "outputs"
    if outputs.get("t") == "dict" and isinstance(index, int):
        index = list(outputs["items"])[index]
    return first_tensor_slot(chosen, f"outputs.{index}")
