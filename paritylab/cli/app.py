"""Glue for the Hydra entry point: configuration errors as one line (exit 2), and the process exit code."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from pathlib import Path
from typing import NoReturn

from omegaconf import DictConfig

from paritylab.run.config import CONF_DIR

_HYDRA_FLAGS = {"--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i", "--shell-completion", "-sc"}
_WITH_VALUE = {"--config-dir", "-cd", "--config-name", "-cn", "--config-path", "-cp", "--cfg", "-c", "--info", "-i"}
_codes: list[int] = []


def record(code: int) -> None:
    """Remember a job's exit code (several under ``-m``)."""
    _codes.append(code)


def exit_code() -> int:
    """The process exit code: the worst job's (2 error > 1 parity fails > 0)."""
    return max(_codes, default=0)


def exit_process(code: int) -> NoReturn:
    """End the process with ``code``, skipping the interpreter's teardown when nothing can still need it.

    Exit handlers run and logs and streams are flushed as usual; only the final module teardown is
    skipped, which takes about two seconds with torch, transformers and MLflow loaded and does nothing
    for a finished run (its files are closed and its MLflow run ended). With other non-daemon threads
    still running, the process exits the ordinary way.
    """
    if any(thread.is_alive() and not thread.daemon for thread in threading.enumerate()[1:]):
        sys.exit(code)
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def take_profile_flag(argv: list[str]) -> str | None:
    """Remove ``--profile`` / ``--profile=FILE`` from ``argv`` (Hydra would refuse it); the file, or None."""
    for index, arg in enumerate(argv):
        if arg == "--profile" or arg.startswith("--profile="):
            del argv[index]
            return arg.partition("=")[2] or "paritylab.prof"
    return None


def preflight(argv: list[str]) -> None:
    """Compose the configuration once before Hydra runs, so a bad override or key exits 2 with one line.

    For a sweep (``-m a=x,y``) every value of each swept key is checked with the others at their first.
    """
    if any(arg in _HYDRA_FLAGS for arg in argv):
        return
    overrides, config_dir, config_name = _split(argv)
    from paritylab.run.config import check_complete, check_module_entries, one_line
    from paritylab.run.overrides import additions, check_additions, explain, group_choices

    groups = group_choices([CONF_DIR, *([Path(config_dir)] if config_dir else [])])
    try:
        variants = _expansions(overrides)
    except Exception as error:  # an override Hydra cannot parse
        print(f"paritylab: bad configuration: {one_line(error)}", file=sys.stderr)
        sys.exit(2)
    for variant in variants:
        try:
            composed = compose(variant, config_dir, config_name)
            check_complete(composed)
            check_module_entries(composed.compare.get("modules"))
            added = additions(variant, groups)
            if added:  # checked against the configuration before anything was added to it
                check_additions(added, compose(_choices_only(variant, groups), config_dir, config_name))
        except Exception as error:
            explained = explain(error, _base(variant, groups, config_dir, config_name), groups, variant)
            print(f"paritylab: bad configuration: {one_line(explained or error)}", file=sys.stderr)
            sys.exit(2)


def _choices_only(overrides: list[str], groups: dict[str, list[str]]) -> list[str]:
    """The overrides that choose a config group's option (``candidate=port``, ``+experiment=nightly``)."""
    return [item for item in overrides if item.lstrip("+~").split("=", 1)[0] in groups]


def _base(overrides: list[str], groups: dict[str, list[str]], config_dir: str | None, name: str) -> DictConfig | None:
    """The configuration with only the group choices applied (``None`` when even that does not compose)."""
    try:
        return compose(_choices_only(overrides, groups), config_dir, name)
    except Exception:
        return None


def compose(overrides: list[str], config_dir: str | None = None, config_name: str = "config") -> DictConfig:
    """The composed configuration (tests use this too), with the schema registered."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from paritylab.run.config import register

    register()
    extra = [f"hydra.searchpath=[file://{Path(config_dir).resolve()}]"] if config_dir else []
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return hydra_compose(config_name, overrides=[*overrides, *extra])


def _split(argv: list[str]) -> tuple[list[str], str | None, str]:
    overrides: list[str] = []
    config_dir, config_name = None, "config"
    skip = False
    for index, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg in ("-m", "--multirun"):
            continue
        if arg in _WITH_VALUE:
            value = argv[index + 1] if index + 1 < len(argv) else ""
            if arg in ("--config-dir", "-cd"):
                config_dir = value
            elif arg in ("--config-name", "-cn"):
                config_name = value
            skip = True
            continue
        if arg.startswith("--config-dir="):
            config_dir = arg.split("=", 1)[1]
        elif arg.startswith("--config-name="):
            config_name = arg.split("=", 1)[1]
        elif not arg.startswith("hydra.") and not arg.startswith("-"):
            overrides.append(arg)
    return overrides, config_dir, config_name


def _expansions(overrides: list[str]) -> list[list[str]]:
    """The override lists to check: sweeps expanded one key at a time."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    parsed = parser.parse_overrides(overrides)
    firsts: list[str] = []
    sweeps: list[tuple[int, list[str]]] = []
    for index, override in enumerate(parsed):
        if override.is_sweep_override():
            values = list(override.sweep_string_iterator())
            key = override.get_key_element()
            firsts.append(f"{key}={values[0]}")
            sweeps.append((index, [f"{key}={value}" for value in values[1:]]))
        else:
            firsts.append(overrides[index])
    variants = [firsts]
    for index, alternatives in sweeps:
        for alternative in alternatives:
            variants.append([*firsts[:index], alternative, *firsts[index + 1 :]])
    return variants
