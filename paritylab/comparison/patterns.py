"""Name patterns shared by alignment rules and weight maps: ``{}`` stands for a number; ``re:`` for a regex."""

from __future__ import annotations

import functools
import re


@functools.lru_cache(maxsize=1024)
def compile_pattern(pattern: str) -> re.Pattern[str]:
    """``a.{}.b`` matches ``a.12.b`` capturing ``12``; ``re:...`` is a regular expression as written."""
    if pattern.startswith("re:"):
        return re.compile(pattern[3:])
    return re.compile("".join(r"(\d+)" if part == "{}" else re.escape(part) for part in re.split(r"(\{\})", pattern)))


def fill(template: str, match: re.Match[str]) -> str:
    """The name ``template`` gives for ``match``: its ``{}`` filled in order, or regex back-references."""
    if template.startswith("re:"):
        return match.expand(template[3:])
    parts = template.split("{}")
    numbers = match.groups()
    if len(parts) - 1 > len(numbers):
        raise ValueError(f"{template!r} has more {{}} than its pattern captures ({len(numbers)})")
    return parts[0] + "".join(number + part for number, part in zip(numbers, parts[1:], strict=False))
