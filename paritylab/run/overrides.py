"""Command-line overrides checked against what paritylab knows, before anything runs.

Hydra lets ``+key=value`` add any key, so ``+compare.rtoll=1`` (a typo of ``rtol``) would run with ``rtol``
unchanged and PASS; and its message for a plain typo suggests exactly that ``+``. Here every key an override
names must be one the configuration has, or lie in an *open* section, where arbitrary keys are the point (a
builder's arguments, a call's keyword arguments, per-module tolerances); a config group's choice must be one of
its files. A refusal is one line with the closest known name (``compare.rtoll``: did you mean
``compare.rtol``?) and never suggests an override that would be ignored.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from paritylab.run.errors import ConfigError

OPEN_SECTIONS = (
    "model.build",
    "candidate.build",
    "candidate.ports",
    "candidate.options",
    "model.call.kwargs",
    "candidate.call.kwargs",
    "compare.modules",
)
"""Sections whose keys are the user's: a builder's arguments, a port per model family, a distributed builder's
options, a forward's keyword arguments, per-module tolerances."""
_NOT_OVERRIDE = re.compile(r"Could not override '([^']+)'")
_NOT_FOUND = re.compile(r"Could not find '([^']+)/([^'/]+)'")
_AVAILABLE = re.compile(r"Available options in '[^']+':\n((?:\t[^\n]+\n?)+)")
"""Hydra's own list of a group's options (it knows plugins' groups too: ``hydra/launcher``)."""


def group_choices(search: Iterable[Path]) -> dict[str, list[str]]:
    """Each config group's choices: the YAML files of its folder, in every configuration directory."""
    groups: dict[str, set[str]] = {}
    for root in search:
        if not root.is_dir():
            continue
        for folder in root.iterdir():
            if folder.is_dir() and not folder.name.startswith(("_", ".")):
                groups.setdefault(folder.name, set()).update(path.stem for path in folder.glob("*.yaml"))
    return {name: sorted(choices) for name, choices in groups.items()}


def known_keys(cfg: DictConfig) -> set[str]:
    """Every dotted key of ``cfg``, intermediate nodes included (``compare``, ``compare.rtol``)."""
    keys: set[str] = set()

    def walk(node: Any, prefix: str) -> None:
        if not isinstance(node, DictConfig):
            return
        for key in node:
            path = f"{prefix}{key!s}"
            keys.add(path)
            walk(node._get_node(key), f"{path}.")  # the node itself: values are not resolved

    walk(cfg, "")
    return keys


def is_open(key: str) -> bool:
    return any(key == section or key.startswith(section + ".") for section in OPEN_SECTIONS)


def additions(overrides: list[str], groups: Mapping[str, list[str]]) -> list[str]:
    """The keys that ``+key=...`` or ``++key=...`` overrides add outside the open sections (config groups and
    Hydra's own keys aside): the ones to check against the configuration before it had them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    keys = []
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.key_or_group
        if key in groups or "/" in key or key.startswith("hydra") or is_open(key):
            continue
        if override.is_add() or override.is_force_add():
            keys.append(key)
    return keys


def check_additions(keys: list[str], base: DictConfig) -> None:
    """Refuse (:class:`ConfigError`) the first of ``keys`` that ``base`` (the configuration composed without
    the key overrides) does not have."""
    known = known_keys(base)
    for key in keys:
        if key not in known:
            raise ConfigError(_unknown(key, known))


def explain(
    error: BaseException, cfg: DictConfig | None, groups: Mapping[str, list[str]], overrides: Iterable[str] = ()
) -> ConfigError | None:
    """Hydra's composition error for a typo, as one line with the closest known name (``None``: not a typo).
    ``overrides``: the command line's, to name the one that sets a key under a section that is null here."""
    text = str(error)
    if _NULL_ROOT in text and cfg is not None:
        for item in overrides:
            key = item.lstrip("+~").split("=", 1)[0]
            null = _null_prefix(cfg, key)
            if null is not None:
                return ConfigError(_under_null(key, null, known_keys(cfg)))
    found = _NOT_FOUND.search(text)
    if found is not None:
        group, choice = found.groups()
        available = _AVAILABLE.search(text)
        choices = available.group(1).split() if available else groups.get(group, [])
        close = difflib.get_close_matches(choice, choices, n=1)
        hint = f" (did you mean {group}={close[0]}?)" if close else ""
        listed = ", ".join(choices) or "none found"
        return ConfigError(f"{group}={choice} is not a {group} config{hint}: choose one of {listed}")
    missing = _NOT_OVERRIDE.search(text)
    if missing is not None and cfg is not None:
        return ConfigError(_unknown(missing.group(1), known_keys(cfg)))
    return None


_NULL_ROOT = "Unexpected type for root: NoneType"
"""OmegaConf's words when an override sets a key inside a section that is null (``candidate.build`` under
``candidate=port``, which builds through ``candidate.ports.<family>.build``)."""


def _null_prefix(cfg: DictConfig, key: str) -> str | None:
    """The first section on ``key``'s path that is null in ``cfg`` (``None``: none is)."""
    node: Any = cfg
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1], start=1):
        if not isinstance(node, DictConfig) or part not in node:
            return None
        node = node._get_node(part)
        if node is None or node._is_none():
            return ".".join(parts[:depth])
    return None


def _under_null(key: str, null: str, known: set[str]) -> str:
    """Why ``key`` cannot be set (``null`` is null here), with the keys of that name that exist elsewhere in its
    section (``candidate.ports.llava.build``)."""
    section, name = null.split(".", 1)[0], null.rpartition(".")[2]
    rest = key[len(null) + 1 :]
    elsewhere = sorted(
        other for other in known if other.startswith(section + ".") and other.endswith("." + name) and other != null
    )
    hint = f": set {elsewhere[0]}.{rest} instead" if elsewhere else ""
    return f"{key} cannot be set: {null} is null in this configuration{hint} (see the keys with --cfg job)"


def _unknown(key: str, known: set[str]) -> str:
    if is_open(key):  # a key of an open section that is not there yet: Hydra adds it only with +
        section = next(name for name in OPEN_SECTIONS if key == name or key.startswith(name + "."))
        parent, _, name = key.rpartition(".")
        siblings = sorted(other.rpartition(".")[2] for other in known if other.rpartition(".")[0] == parent)
        close = difflib.get_close_matches(name, siblings, n=1, cutoff=0.75)
        if close:  # a typo of an argument the section has (model.build.layrs: layers), not a new one
            return (
                f"{key} is not set (did you mean {parent}.{close[0]}?); a new argument is added with "
                f"+{key}=<value> ({section} takes any key)"
            )
        return f"{key} is not set yet: add it with +{key}=<value> ({section} takes any key)"
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return (
        f"{key} is not a paritylab setting{hint}: see them with python -m paritylab --cfg job; a builder's "
        f"arguments go under {', '.join(OPEN_SECTIONS[:3])}, which take any key"
    )
