"""Alignment rules: what a user writes (YAML, ``{}`` for a number, ``null`` to leave a module unmatched), how
they are read, and the pair a rule gives a call."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paritylab.comparison.alignment._pairs import Index, Pair, Part
from paritylab.comparison.patterns import compile_pattern, fill
from paritylab.tracing.tracefile import CallRecord


class AlignmentError(ValueError):
    """Alignment rules that cannot be used as given."""


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
    candidate_input_order: Part | None = None
    """The reference's input features in the candidate's input (see :attr:`Pair.candidate_input_part`)."""
    source: str = "rule"
    """The pair's source: ``rule`` for the user's; ``weights`` for a rule the weights prove (a distributed merge's row
    map: a reference projection's part of a fused one)."""

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
        if self.candidate_input_order is not None and self.candidate_input_order.indices is not None:
            data["candidate_input_order"] = list(self.candidate_input_order.indices)
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
    known = (
        {"reference", "candidate"}
        | {
            f"{side}_{kind}"
            for side in ("reference", "candidate")
            for kind in ("index", "slice", "chunk", "indices", "order", "input")
        }
        | {"candidate_input_order"}
    )
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
        _order(entry.get("candidate_input_order"), "candidate_input_order", position),
    )


def _order(value: object, name: str, position: int) -> Part | None:
    """A whole dimension in another order: where each reference feature sits on the candidate's side."""
    if value is None:
        return None
    positions = [i for i in value if isinstance(i, int) and not isinstance(i, bool)] if isinstance(value, list) else []
    if not isinstance(value, list) or len(positions) != len(value) or sorted(positions) != list(range(len(value))):
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise AlignmentError(
            f"rule #{position}: {name} must list each position 0..n-1 once, in the candidate's order, got {shown}"
        )
    return Part(indices=tuple(positions), whole=True)


def _input(entry: Mapping[str, Any], side: str, position: int) -> str | None:
    value = entry.get(f"{side}_input")
    if value is not None and not isinstance(value, str):
        raise AlignmentError(f"rule #{position}: {side}_input must be a module path, got {value!r}")
    return value


def _part(entry: Mapping[str, Any], side: str, position: int) -> Part | None:
    order = _order(entry.get(f"{side}_order"), f"{side}_order", position)
    if order is not None:
        return order
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
            "run" if ref_input or cand_input else rule.source,
            1.0,
            rule.reference_index,
            rule.candidate_index,
            rule.reference_part,
            rule.candidate_part,
            ref_input,
            cand_input,
            rule.candidate_input_order,
        )
    return False
