"""The result: :class:`Alignment` (the pairs, what stayed unmatched, and the rules that reproduce it), and its
assembly from the pairs the stages fixed."""

from __future__ import annotations

from dataclasses import dataclass, field

from paritylab.comparison.alignment._generalise import _generalise, _path, _unique_paths
from paritylab.comparison.alignment._pairs import Pair
from paritylab.comparison.alignment._rules import Rule
from paritylab.comparison.weights import WeightLedger
from paritylab.tracing.tracefile import CallRecord


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
    weights: WeightLedger = field(default_factory=WeightLedger)
    """Every candidate parameter and buffer against the reference's (:mod:`paritylab.comparison.weights`)."""

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


def _alignment(
    ref_calls: list[CallRecord],
    cand_calls: list[CallRecord],
    fixed: dict[int, tuple[int, Pair]],
    ignored: list[str],
    folded_ref: set[int],
    folded_cand: set[int],
    lost: list[str],
    automatic: dict[int, Pair] | None = None,
    weights: WeightLedger | None = None,
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
        weights=weights or WeightLedger(),
    )
