"""Pairs written back as rules: layer numbers generalised to ``{}`` where they map the same on both sides."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace

from paritylab.comparison.alignment._pairs import Pair
from paritylab.comparison.alignment._rules import Rule

_NUMBER = re.compile(r"(?<![^.])\d+(?![^.])")


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
            pair.candidate_input_part,
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
