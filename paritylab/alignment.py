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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paritylab.patterns import compile_pattern, fill
from paritylab.tracefile import CallRecord, Trace, as_float
from paritylab.values import Node, first_tensor_slot, iter_tensors

Index = int | str | None
_NUMBER = re.compile(r"(?<![^.])\d+(?![^.])")
_TOKEN = re.compile(r"[a-z]+|\d+")
MIN_AUTO_SCORE = 0.3
MIN_STRUCTURE = 0.3
"""Automatic pairs need this much structural evidence (names, layer numbers), or ..."""
SAME_STATS = 0.9
"""... output statistics at least this similar (1 = identical): shape alone is never enough."""
RESCUE_SCORE = 0.75
RESCUE_STATS = 0.99
"""Out-of-order matches (a port that runs two branches in the other order) need this much similarity,
or output statistics this close to identical."""


class AlignmentError(ValueError):
    """Alignment rules that cannot be used as given."""


@dataclass(frozen=True)
class Part:
    """Part of the last dimension: ``[start, stop)``, or the ``index``-th of ``count`` equal chunks."""

    start: int = 0
    stop: int | None = None
    index: int | None = None
    count: int | None = None

    def bounds(self, size: int) -> tuple[int, int]:
        if self.index is not None and self.count:
            step = size // self.count
            return self.index * step, (self.index + 1) * step
        return slice(self.start, self.stop).indices(size)[:2]

    def to_yaml(self) -> dict[str, list[int | None]]:
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

    def to_yaml(self) -> dict[str, Any]:
        data: dict[str, Any] = {"reference": self.reference, "candidate": self.candidate}
        for side in ("reference", "candidate"):
            index, part = getattr(self, f"{side}_index"), getattr(self, f"{side}_part")
            if index is not None:
                data[f"{side}_index"] = index
            if part is not None:
                kind, value = next(iter(part.to_yaml().items()))
                data[f"{side}_{kind}"] = value
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
        f"{side}_{kind}" for side in ("reference", "candidate") for kind in ("index", "slice", "chunk")
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
    )


def _part(entry: Mapping[str, Any], side: str, position: int) -> Part | None:
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
    """``rule``, ``identity`` or ``auto``."""
    score: float = 1.0
    reference_index: Index = None
    candidate_index: Index = None
    reference_part: Part | None = None
    candidate_part: Part | None = None


@dataclass
class Alignment:
    """The pairs used, in reference execution order, and what stayed unmatched on each side."""

    pairs: list[Pair] = field(default_factory=list)
    unmatched_reference: list[str] = field(default_factory=list)
    unmatched_candidate: list[str] = field(default_factory=list)
    ignored_reference: list[str] = field(default_factory=list)
    """Reference calls a rule left unmatched on purpose."""

    def by_reference(self) -> dict[str, Pair]:
        return {pair.reference: pair for pair in self.pairs}

    def to_yaml(self) -> str:
        """The alignment as rules (numbers generalised to ``{}`` where consistent), to inspect, edit and reuse."""
        import yaml

        rules = _generalise(self.pairs) + [Rule(_path(key), None) for key in _unique_paths(self.ignored_reference)]
        return yaml.safe_dump({"rules": [rule.to_yaml() for rule in rules]}, sort_keys=False, width=200)


def align(reference: Trace, candidate: Trace, rules: Iterable[Rule] = ()) -> Alignment:
    """Align the calls of two traces: rules first, then identical paths, then automatic alignment."""
    rules = list(rules)
    ref_calls, cand_calls = reference.calls, candidate.calls
    cand_by_key = {call.key: call for call in cand_calls}
    cand_position = {call.key: position for position, call in enumerate(cand_calls)}
    fixed: dict[int, tuple[int, Pair]] = {}
    ignored: list[str] = []
    taken: set[str] = set()
    for position, call in enumerate(ref_calls):
        pair = _by_rule(call, rules, cand_by_key)
        if pair is None:
            ignored.append(call.key)
            continue
        if pair is False:
            pair = _by_identity(call, cand_by_key)
        shared = pair and pair.candidate_part is not None  # parts of one fused call may serve several
        if pair and (shared or pair.candidate not in taken):
            taken.add(pair.candidate)
            fixed[position] = (cand_position[pair.candidate], pair)
    anchors = _monotone_chain(sorted((r, c) for r, (c, _) in fixed.items()))
    skip_ref = set(fixed) | {i for i, call in enumerate(ref_calls) if call.key in ignored}
    skip_cand = {c for c, _ in fixed.values()}
    automatic = _align_segments(ref_calls, cand_calls, anchors, skip_ref, skip_cand)
    taken_cand = skip_cand | {cand_position[pair.candidate] for pair in automatic.values()}
    automatic |= _rescue(ref_calls, cand_calls, skip_ref | set(automatic), taken_cand)
    pairs_by_ref = {r: pair for r, (_, pair) in fixed.items()} | automatic
    pairs = [pairs_by_ref[i] for i in sorted(pairs_by_ref)]
    matched_cand = {pair.candidate for pair in pairs}
    return Alignment(
        pairs=pairs,
        unmatched_reference=[c.key for i, c in enumerate(ref_calls) if i not in pairs_by_ref and c.key not in ignored],
        unmatched_candidate=[c.key for c in cand_calls if c.key not in matched_cand],
        ignored_reference=ignored,
    )


def _by_rule(call: CallRecord, rules: list[Rule], cand_by_key: dict[str, CallRecord]) -> Pair | bool | None:
    """The pair a rule gives, ``None`` if a rule leaves the call unmatched, ``False`` if no rule applies."""
    for rule in rules:
        target = rule.match(call.path)
        if target is False:
            continue
        if target is None:
            return None
        key = f"{target}#{call.call_index}"
        if key not in cand_by_key:
            return False
        return Pair(
            call.key,
            key,
            "rule",
            1.0,
            rule.reference_index,
            rule.candidate_index,
            rule.reference_part,
            rule.candidate_part,
        )
    return False


def _by_identity(call: CallRecord, cand_by_key: dict[str, CallRecord]) -> Pair | bool:
    other = cand_by_key.get(call.key)
    if other is None:
        return False
    return Pair(call.key, other.key, "identity")


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
) -> dict[int, Pair]:
    ref_features = [_Features.of(call) for call in ref_calls]
    cand_features = [_Features.of(call) for call in cand_calls]
    bounds = [(-1, -1), *anchors, (len(ref_calls), len(cand_calls))]
    found: dict[int, Pair] = {}
    for (r0, c0), (r1, c1) in itertools.pairwise(bounds):
        rows = [i for i in range(r0 + 1, r1) if i not in skip_ref]
        cols = [j for j in range(c0 + 1, c1) if j not in skip_cand]
        for i, j, score in _dp(rows, cols, ref_features, cand_features):
            found[i] = Pair(ref_calls[i].key, cand_calls[j].key, "auto", round(score, 4))
    return found


def _rescue(
    ref_calls: list[CallRecord], cand_calls: list[CallRecord], skip_ref: set[int], skip_cand: set[int]
) -> dict[int, Pair]:
    """Greedy best-first matching of what the ordered pass left, for branches run in another order."""
    rows = [i for i in range(len(ref_calls)) if i not in skip_ref]
    cols = [j for j in range(len(cand_calls)) if j not in skip_cand]
    if not rows or not cols:
        return {}
    ref = {i: _Features.of(ref_calls[i]) for i in rows}
    cand = {j: _Features.of(cand_calls[j]) for j in cols}
    scored = sorted(
        (
            (_stats_similarity(ref[i].stats, cand[j].stats), ref[i].similarity(cand[j]), i, j)
            for i in rows
            for j in cols
            if ref[i].shape is not None and ref[i].shape == cand[j].shape
        ),
        reverse=True,
    )
    found: dict[int, Pair] = {}
    used: set[int] = set()
    for same_stats, score, i, j in scored:
        if score < RESCUE_SCORE and not (same_stats >= RESCUE_STATS and ref[i].stats is not None):
            continue
        if i not in found and j not in used:
            found[i] = Pair(ref_calls[i].key, cand_calls[j].key, "auto", round(score, 4))
            used.add(j)
    return found


def _dp(rows: list[int], cols: list[int], ref: list[_Features], cand: list[_Features]) -> list[tuple[int, int, float]]:
    """Monotone alignment maximising the summed similarity (gaps cost nothing)."""
    if not rows or not cols:
        return []
    n, m = len(rows), len(cols)
    scores = [[ref[i].similarity(cand[j]) for j in cols] for i in rows]
    best = [[0.0] * (m + 1) for _ in range(n + 1)]
    for a in range(n - 1, -1, -1):
        here, below, row = best[a], best[a + 1], scores[a]
        for b in range(m - 1, -1, -1):
            score = row[b]
            take = below[b + 1] + score if score >= MIN_AUTO_SCORE else -1.0
            here[b] = max(take, below[b], here[b + 1])
    matches: list[tuple[int, int, float]] = []
    a = b = 0
    while a < n and b < m:
        score = scores[a][b]
        if score >= MIN_AUTO_SCORE and math.isclose(best[a][b], best[a + 1][b + 1] + score):
            matches.append((rows[a], cols[b], score))
            a, b = a + 1, b + 1
        elif best[a][b] == best[a + 1][b]:
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
    stats: tuple[float, float, float] | None

    @classmethod
    def of(cls, call: CallRecord) -> _Features:
        node = _primary(call.outputs)
        stats = None
        if node is not None and node.get("stats"):
            s = node["stats"]
            stats = (as_float(s.get("mean")), as_float(s.get("std")), as_float(s.get("absmax")))
        leaf = call.path.rsplit(".", 1)[-1] if call.path else ""
        return cls(
            shape=tuple(node["shape"]) if node else None,
            tokens=frozenset(_TOKEN.findall(f"{call.path} {call.cls}".lower())),
            name=_bigrams(leaf.lower()),
            cls=call.cls.lower(),
            numbers=tuple(_NUMBER.findall(call.path)),
            depth=call.depth,
            stats=stats,
        )

    def similarity(self, other: _Features) -> float:
        """0 unless output shapes agree and there is evidence beyond shape: near-identical output
        statistics, or structure (layer numbers, names, class). Else a mix of both, in (0, 1]."""
        if self.shape is None or self.shape != other.shape:
            return 0.0
        structure = self.structure(other)
        same_stats = _stats_similarity(self.stats, other.stats)
        if structure < MIN_STRUCTURE and same_stats < SAME_STATS:
            return 0.0
        return 0.6 * same_stats + 0.4 * structure

    def structure(self, other: _Features) -> float:
        """Evidence from names alone: equal layer numbers, similar leaf names, shared tokens, same class."""
        if self.numbers and other.numbers and self.numbers[-1] != other.numbers[-1]:
            return 0.0  # layer 3 is not layer 4, whatever the names say
        numbers = 1.0 if self.numbers and self.numbers == other.numbers else 0.0
        overlap = len(self.tokens & other.tokens) / max(1, min(len(self.tokens), len(other.tokens)))
        return 0.5 * numbers + 0.3 * _dice(self.name, other.name) + 0.1 * overlap + 0.1 * (self.cls == other.cls)


def _dice(a: frozenset[str], b: frozenset[str]) -> float:
    return 2 * len(a & b) / (len(a) + len(b)) if a and b else 0.0


def _bigrams(name: str) -> frozenset[str]:
    padded = f"^{name}$"
    return frozenset(padded[i : i + 2] for i in range(len(padded) - 1))


def _stats_similarity(a: tuple[float, float, float] | None, b: tuple[float, float, float] | None) -> float:
    """1 for equal summaries, falling towards 0 as means, stds and maxima drift apart."""
    if a is None or b is None:
        return 0.3
    total = 0.0
    for x, y in zip(a, b, strict=True):
        if not (math.isfinite(x) and math.isfinite(y)):
            continue
        scale = max(abs(x), abs(y), 1e-12)
        total += min(abs(x - y) / scale, 1.0)
    return max(0.0, 1.0 - total / 3 * 2)


def _path(key: str) -> str:
    return key.rsplit("#", 1)[0]


def _unique_paths(keys: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(_path(key) for key in keys))


def _generalise(pairs: list[Pair]) -> list[Rule]:
    """Rules for the pairs: one ``{}`` rule per pattern whose layer numbers map the same on both sides."""
    groups: dict[tuple[Any, ...], list[Pair]] = {}
    for pair in pairs:
        ref_path, cand_path = _path(pair.reference), _path(pair.candidate)
        ref_numbers, cand_numbers = _NUMBER.findall(ref_path), _NUMBER.findall(cand_path)
        generic = ref_numbers == cand_numbers and ref_numbers
        key = (
            _NUMBER.sub("{}", ref_path) if generic else ref_path,
            _NUMBER.sub("{}", cand_path) if generic else cand_path,
            pair.reference_index,
            pair.candidate_index,
            pair.reference_part,
            pair.candidate_part,
        )
        groups.setdefault(key, []).append(pair)
    by_reference_pattern: dict[str, int] = {}
    for key in groups:
        by_reference_pattern[key[0]] = by_reference_pattern.get(key[0], 0) + 1
    rules: list[Rule] = []
    for key, members in groups.items():
        if by_reference_pattern[key[0]] == 1:
            rules.append(Rule(*key))
        else:  # one reference pattern, several candidate patterns: spell each pair out
            for pair in members:
                rules.append(
                    Rule(_path(pair.reference), _path(pair.candidate), *key[2:])  # type: ignore[arg-type]
                )
    return _dedupe(rules)


def _dedupe(rules: list[Rule]) -> list[Rule]:
    return list(dict.fromkeys(rules))


def primary_slot(call: CallRecord, index: Index) -> str | None:
    """The output slot compared for ``call``: element ``index`` if given, else the first tensor."""
    from paritylab.values import select

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
