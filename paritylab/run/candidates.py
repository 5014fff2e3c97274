"""Build the candidate: a port looked up by the reference's family, a variant of the reference, or any callable."""

from __future__ import annotations

import copy
import importlib.resources
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from paritylab.comparison.alignment import Rule, load_rules
from paritylab.run.config import CONF_DIR, resolve_target
from paritylab.run.errors import ConfigError
from paritylab.run.resident import converted_copy
from paritylab.run.weights import WeightParity, load_weight_map, weight_parity

PKG = "pkg://"


@dataclass
class Candidate:
    model: nn.Module
    rules: list[Rule] = field(default_factory=list)
    weights: WeightParity | None = None
    notes: list[str] = field(default_factory=list)
    cast_of: torch.dtype | None = None
    """Set when the candidate is the reference converted to this dtype: the same computation at that
    precision, so its trace is the reference's own low-precision trace (the noise floor reuses it)."""


def build_candidate(cfg: DictConfig, family: str, reference: nn.Module) -> Candidate:
    """The candidate described by ``cfg`` (the ``candidate`` config group) for this reference."""
    kind = str(cfg.kind)  # config enums are StrEnums: str() is the value
    if kind == "port":
        return _cast(_port(cfg, family, reference), cfg.dtype)
    if kind == "dtype":
        dtype = getattr(torch, str(cfg.dtype))
        return Candidate(converted_copy(reference, dtype), cast_of=dtype)
    if kind == "attention":
        return Candidate(_with_attention(reference, str(cfg.attn_implementation)))
    if kind == "compiled":
        compiled = cast(nn.Module, torch.compile(copy.deepcopy(reference), backend=cfg.backend))
        return Candidate(compiled, notes=[f"torch.compile(backend={cfg.backend!r}); traced modules graph-break"])
    model = instantiate("candidate.build", cfg.build, reference)
    rules = load_rules(resolve_path(cfg.rules)) if cfg.rules else []
    candidate = Candidate(model, rules)
    if cfg.weight_map:
        candidate.weights = weight_parity(model, reference, load_weight_map(resolve_path(cfg.weight_map)))
    return _cast(candidate, cfg.dtype)


def _cast(candidate: Candidate, dtype: Any) -> Candidate:
    """A port or a built candidate in ``candidate.dtype`` (``null``: as built): "my port in bf16 against the
    float32 reference". Weight parity was checked before the cast, on the weights as built."""
    if dtype is None:
        return candidate
    name = str(dtype)
    candidate.model = candidate.model.to(getattr(torch, name))
    candidate.notes.append(f"candidate cast to {name} (candidate.dtype={name})")
    return candidate


def _port(cfg: DictConfig, family: str, reference: nn.Module) -> Candidate:
    ports = cfg.ports or {}
    if family not in ports:
        available = ", ".join(sorted(ports)) or "none"
        raise ConfigError(
            f"candidate=port: no port of a {family!r} model; ports exist for: {available} "
            "(add one under candidate.ports, or choose another candidate)"
        )
    port = ports[family]
    model = instantiate(f"candidate.ports.{family}.build", port.build, reference)
    rules = load_rules(resolve_path(port.rules)) if port.rules else []
    weights = None
    if port.weight_map:
        weights = weight_parity(model, reference, load_weight_map(resolve_path(port.weight_map)))
    return Candidate(model, rules, weights)


def _with_attention(reference: nn.Module, implementation: str) -> nn.Module:
    model = copy.deepcopy(reference)
    setter = getattr(model, "set_attn_implementation", None)
    if setter is None:
        raise ConfigError(
            f"candidate attention={implementation!r} needs a transformers model; {type(reference).__name__} is not one"
        )
    try:
        setter(implementation)
    except (ValueError, ImportError) as error:
        raise ConfigError(f"candidate.attn_implementation={implementation!r}: {error}") from error
    return model


def instantiate(key: str, node: Any, reference: nn.Module | None = None) -> nn.Module:
    """Call ``node._target_`` with the node's arguments (plus ``reference=`` when the callable takes it)."""
    arguments = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node or {})
    if not isinstance(arguments, dict) or "_target_" not in arguments:
        raise ConfigError(f"{key} needs a _target_ (a dotted path to a callable returning an nn.Module)")
    target = resolve_target(key, str(arguments.pop("_target_")))
    if "reference" in _parameters(target) and reference is not None:
        arguments["reference"] = reference
    model = target(**{str(name): value for name, value in arguments.items()})
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{key}._target_ returned {type(model).__name__}, not a torch.nn.Module")
    return model.eval()


def _parameters(target: Any) -> set[str]:
    try:
        return set(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return set()


def resolve_path(path: str) -> Path:
    """``pkg://package.name/file`` (a file shipped in a package, as Hydra spells it), else a path as given,
    else relative to the directory holding paritylab's configs (so shipped configs work from anywhere)."""
    if path.startswith(PKG):
        package, _, name = path.removeprefix(PKG).partition("/")
        try:
            return Path(str(importlib.resources.files(package).joinpath(name)))
        except (ModuleNotFoundError, TypeError) as error:
            raise ConfigError(
                f"{path!r}: package {package!r} cannot be found; check the spelling or install it"
            ) from error
    given = Path(path).expanduser()
    if given.is_absolute() or given.exists():
        return given
    return CONF_DIR.parent / given
