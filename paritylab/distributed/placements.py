"""DTensor placements at module boundaries, recorded beside a rank's trace (``placements.json``).

paritylab's tracer stores a DTensor as its local shard (:func:`paritylab.tracing.values.encode`), which is
what the rank holds; how the shards make the whole tensor is the DTensor's placement, and that is what this
recorder keeps: for every module call (key ``path#n``, counted as the tracer counts) and every DTensor among
its inputs and outputs (slots named as the trace names them), the placements, the mesh shape and the global
shape. The merge (:mod:`paritylab.distributed.merge`) reassembles such a slot by its placements instead of
inferring them from values. Hooks are registered on entry and removed on exit; they only read.

Under ``parallelize_module`` a module's hooks run after its ``ParallelStyle``'s own (registered earlier): the
inputs they see are the DTensors the style made; its outputs are local tensors when ``use_local_output=True``
(the default of ``ColwiseParallel``/``RowwiseParallel``), so placements are recorded for inputs and for the
outputs of styles that keep DTensors.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from paritylab.tracing.files import write_json

PLACEMENTS_FILE = "placements.json"
Placement = dict[str, Any]
"""``{"kind": "shard", "dim": d}``, ``{"kind": "replicate"}``, ``{"kind": "partial", "op": "sum"}`` or
``{"kind": "other", "repr": ...}`` for placements the merge does not know (strided shards)."""
SlotPlacement = dict[str, Any]
"""``{"placements": [Placement per mesh dimension], "mesh": [sizes], "shape": [global sizes]}``."""


class PlacementRecorder:
    """Context manager that records the DTensor placements of every module call's inputs and outputs and
    writes them to ``directory/placements.json`` on exit (also when the forward raises)."""

    def __init__(self, model: nn.Module, directory: Path) -> None:
        self.model = model
        self.directory = directory
        self.calls: dict[str, dict[str, SlotPlacement]] = {}
        self._counts: dict[str, int] = {}
        self._open: dict[str, list[str]] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> PlacementRecorder:
        for path, module in self.model.named_modules():
            if isinstance(module, nn.ModuleList | nn.ModuleDict):
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(path), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_hook(path), with_kwargs=True))
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.directory.mkdir(parents=True, exist_ok=True)
        write_json(self.directory / PLACEMENTS_FILE, {"calls": self.calls})

    def _pre_hook(self, path: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            index = self._counts.get(path, 0)
            self._counts[path] = index + 1
            key = f"{path}#{index}"
            self._open.setdefault(path, []).append(key)
            found = dict(dtensor_slots({"args": args, "kwargs": kwargs}, "inputs"))
            if found:
                self.calls.setdefault(key, {}).update(found)

        return hook

    def _post_hook(self, path: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            stack = self._open.get(path)
            if not stack:
                return
            key = stack.pop()
            found = dict(dtensor_slots(output, "outputs"))
            if found:
                self.calls.setdefault(key, {}).update(found)

        return hook


def dtensor_slots(value: Any, prefix: str) -> Iterator[tuple[str, SlotPlacement]]:
    """``(slot, placement)`` for each DTensor in ``value``, walking it as :func:`~paritylab.tracing.values.encode`
    does (tuples and lists by position, mappings by key, dataclasses by field), so slots match the trace's."""
    if isinstance(value, torch.Tensor):
        described = describe(value)
        if described is not None:
            yield prefix, described
        return
    if isinstance(value, tuple | list):
        for index, item in enumerate(value):
            yield from dtensor_slots(item, f"{prefix}.{index}")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from dtensor_slots(item, f"{prefix}.{key}")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for item in dataclasses.fields(value):
            yield from dtensor_slots(getattr(value, item.name), f"{prefix}.{item.name}")


def describe(tensor: torch.Tensor) -> SlotPlacement | None:
    """The placement record of a DTensor, ``None`` for any other tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return None
    return {
        "placements": [placement_json(placement) for placement in tensor.placements],
        "mesh": list(tensor.device_mesh.shape),
        "shape": list(tensor.shape),
    }


def placement_json(placement: Any) -> Placement:
    """One DTensor placement as JSON (see :data:`Placement`)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if type(placement) is Shard:
        return {"kind": "shard", "dim": int(placement.dim)}
    if isinstance(placement, Replicate):
        return {"kind": "replicate"}
    if isinstance(placement, Partial):
        return {"kind": "partial", "op": str(getattr(placement, "reduce_op", "sum"))}
    return {"kind": "other", "repr": repr(placement)}


def read_placements(directory: Path) -> dict[str, dict[str, SlotPlacement]]:
    """The placements recorded for a rank's trace (empty when none were: a candidate of plain tensors)."""
    path = directory / PLACEMENTS_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        return {}
    calls = data.get("calls") if isinstance(data, dict) else None
    if not isinstance(calls, dict):
        return {}
    return {str(key): slots for key, slots in calls.items() if isinstance(slots, dict)}
