"""Weight name maps (YAML data): load a candidate's weights from a reference, and check weight parity.

A map is keyed by candidate parameter pattern; the value is a reference pattern, a list of them (their
tensors are concatenated along dim 0, e.g. q, k, v into a fused qkv), or ``null`` for a candidate
parameter with no reference counterpart (left as initialised)::

    llm.layers.{}.attention.wqkv.weight:
      - model.language_model.layers.{}.self_attn.q_proj.weight
      - model.language_model.layers.{}.self_attn.k_proj.weight
      - model.language_model.layers.{}.self_attn.v_proj.weight
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from paritylab.comparison.patterns import compile_pattern, fill

WeightMap = dict[str, str | list[str] | None]


class WeightMapError(ValueError):
    """A weight map that does not fit the models it is applied to."""


def load_weight_map(path: str | Path) -> WeightMap:
    """A weight map from YAML."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as error:
        raise WeightMapError(f"cannot read weight map {path}: {error}") from error
    if not isinstance(data, Mapping):
        raise WeightMapError(f"weight map {path} must map candidate names to reference names")
    for key, value in data.items():
        names = value if isinstance(value, list) else [value]
        if value is not None and not all(isinstance(v, str) for v in names):
            raise WeightMapError(f"weight map {path}: {key!r} must map to a name, a list of names or null")
    return {str(k): v for k, v in data.items()}


def sources(name: str, mapping: Mapping[str, str | list[str] | None]) -> list[str] | None:
    """The reference names candidate parameter ``name`` is built from; ``[]`` if deliberately unmapped,
    ``None`` if the map does not know it."""
    for pattern, target in mapping.items():
        match = compile_pattern(pattern).fullmatch(name)
        if match is None:
            continue
        if target is None:
            return []
        targets = [target] if isinstance(target, str) else target
        return [fill(t, match) for t in targets]
    return None


def mapped_sources(
    candidate: nn.Module, reference: Mapping[str, torch.Tensor], mapping: Mapping[str, str | list[str] | None]
) -> dict[str, list[str]]:
    """Per candidate state entry, the reference names it is built from (concatenated along the first dimension
    when several; deliberately unmapped entries left out). Raises on any name the map does not cover, any
    reference name that does not exist, and any shape that does not fit (listing them all)."""
    built: dict[str, list[str]] = {}
    problems: list[str] = []
    for name, current in candidate.state_dict().items():
        names = sources(name, mapping)
        if names is None:
            problems.append(f"{name}: not in the weight map")
            continue
        if not names:
            continue
        missing = [n for n in names if n not in reference]
        if missing:
            problems.append(f"{name}: reference has no {', '.join(missing)}")
            continue
        shape = _concatenated_shape([tuple(reference[n].shape) for n in names])
        if shape != tuple(current.shape):
            shown = "parts that cannot be concatenated" if shape is None else f"shape {shape}"
            problems.append(f"{name}: {shown} from the reference, {tuple(current.shape)} expected")
            continue
        built[name] = names
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise WeightMapError(f"weight map does not fit: {shown}")
    return built


def _concatenated_shape(shapes: list[tuple[int, ...]]) -> tuple[int, ...] | None:
    if len(shapes) == 1:
        return shapes[0]
    if any(not shape or shape[1:] != shapes[0][1:] for shape in shapes):
        return None
    return (sum(shape[0] for shape in shapes), *shapes[0][1:])


def load_mapped(candidate: nn.Module, reference: nn.Module, mapping: Mapping[str, str | list[str] | None]) -> None:
    """Copy the reference's weights into ``candidate`` through ``mapping`` (strict: see :func:`mapped_sources`),
    in place and one tensor at a time: a fused weight's parts are copied into its rows, so no concatenation of
    the model's weights is ever alive beside the two models (at 7 B, 18 GB of fused copies)."""
    state = reference.state_dict()
    targets = candidate.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, names in mapped_sources(candidate, state, mapping).items():
            target = targets[name]
            if len(names) == 1:
                target.copy_(state[names[0]])
                continue
            row = 0
            for part in (state[n] for n in names):
                target[row : row + part.shape[0]].copy_(part)
                row += part.shape[0]


@dataclass
class WeightParity:
    """Result of comparing every mapped parameter before any forward."""

    compared: int = 0
    mismatched: list[tuple[str, float]] = field(default_factory=list)
    """(candidate name, max abs difference) for values that differ."""
    unmapped_candidate: list[str] = field(default_factory=list)
    unused_reference: list[str] = field(default_factory=list)
    shape_errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.mismatched or self.unmapped_candidate or self.shape_errors)

    def summary(self) -> str:
        return (
            f"{self.compared} parameters compared, {len(self.mismatched)} differ, "
            f"{len(self.unmapped_candidate)} candidate parameters unmapped, "
            f"{len(self.unused_reference)} reference parameters unused"
        )


def weight_parity(
    candidate: nn.Module, reference: nn.Module, mapping: Mapping[str, str | list[str] | None], atol: float = 0.0
) -> WeightParity:
    """Compare every candidate parameter with the reference parameter(s) it maps to."""
    reference_state = reference.state_dict()
    used: set[str] = set()
    result = WeightParity()
    for name, value in candidate.state_dict().items():
        names = sources(name, mapping)
        if names is None:
            result.unmapped_candidate.append(name)
            continue
        if not names:
            continue
        if any(n not in reference_state for n in names):
            result.shape_errors.append(f"{name}: missing reference {[n for n in names if n not in reference_state]}")
            continue
        used.update(names)
        parts = [reference_state[n] for n in names]
        expected = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if expected.shape != value.shape:
            result.shape_errors.append(f"{name}: {tuple(value.shape)} vs reference {tuple(expected.shape)}")
            continue
        result.compared += 1
        expected = expected.to(device=value.device, dtype=value.dtype)  # parity at the candidate's precision
        difference = max_abs_difference(value, expected)
        if not difference <= atol or math.isnan(difference):
            result.mismatched.append((name, difference))
    result.unused_reference = [n for n in reference_state if n not in used]
    return result


_CHUNK = 1 << 20


def max_abs_difference(first: torch.Tensor, second: torch.Tensor) -> float:
    """Largest ``|first - second|`` in float64 (NaN if a NaN is involved), a chunk at a time: no
    full-size float64 copies of a large embedding."""
    if torch.equal(first, second):
        return 0.0
    first, second = first.reshape(-1), second.reshape(-1)
    worst = 0.0
    for start in range(0, first.numel(), _CHUNK):
        end = start + _CHUNK
        difference = (first[start:end].double() - second[start:end].double()).abs().max().item()
        if math.isnan(difference):
            return difference
        worst = max(worst, difference)
    return worst
