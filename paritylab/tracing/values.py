"""Nested module inputs and outputs as JSON-ready nodes, with tensors as leaves.

A node is a plain dict with a ``"t"`` (type) field:

- ``{"t": "tensor", "shape": [...], "dtype": "float32", "device": "cpu", "stats": {...}, "ref": "t3"}``
- ``{"t": "tuple" | "list", "items": [...]}``
- ``{"t": "dict", "items": {...}, "type": "CausalLMOutputWithPast"}`` (``type`` for mappings and dataclasses)
- ``{"t": "none"}``, ``{"t": "scalar", "v": 3}`` and ``{"t": "object", "repr": "..."}``

A *slot* names a tensor leaf by its path of keys, such as ``outputs.0`` or ``inputs.kwargs.attention_mask``.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

Node = dict[str, Any]
TensorEncoder = Callable[[torch.Tensor], Node]

_ADDRESS = re.compile(r" at 0x[0-9A-Fa-f]+")
_MAX_REPR = 200
_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
_PLAIN = (torch.dtype, torch.device, torch.Size, enum.Enum, slice, range)


def stable_repr(value: object) -> str:
    """A short repr with memory addresses removed, so traces diff cleanly across runs."""
    if type(value).__repr__ is object.__repr__:
        return f"<{type(value).__module__}.{type(value).__qualname__}>"
    try:
        text = repr(value)
    except Exception as error:  # a broken __repr__ in user code must not break tracing
        text = f"<{type(value).__qualname__}: repr raised {type(error).__name__}>"
    text = _ADDRESS.sub("", text)
    return text if len(text) <= _MAX_REPR else text[: _MAX_REPR - 3] + "..."


def _local_tensor(value: object) -> torch.Tensor | None:
    """The tensor behind ``value``: itself, or a DTensor's local shard."""
    if type(value) in _PLAIN_TENSORS:  # the common case, without an attribute lookup
        return value  # type: ignore[return-value]
    if isinstance(value, torch.Tensor):
        local = getattr(value, "_local_tensor", None)
        return local if isinstance(local, torch.Tensor) else value
    return None


def encode(value: object, on_tensor: TensorEncoder) -> Node:
    """Encode ``value`` as a node; ``on_tensor`` turns each tensor into its leaf node."""
    tensor = _local_tensor(value)
    if tensor is not None:
        return on_tensor(tensor)
    if value is None:
        return {"t": "none"}
    if type(value) is tuple:  # the common containers first, past the checks below (a module's args, its kwargs)
        return {"t": "tuple", "items": [encode(item, on_tensor) for item in value]}
    if type(value) is dict:
        return {"t": "dict", "items": {str(key): encode(item, on_tensor) for key, item in value.items()}}
    if isinstance(value, float) and not math.isfinite(value):
        return {"t": "object", "repr": repr(value)}  # JSON holds no NaN/Inf
    if isinstance(value, bool | int | float | str):
        return {"t": "scalar", "v": value if not isinstance(value, str) else value[:_MAX_REPR]}
    if isinstance(value, tuple | list):
        kind = "list" if isinstance(value, list) else "tuple"
        return {"t": kind, "items": [encode(item, on_tensor) for item in value]}
    if isinstance(value, Mapping):
        items = {str(key): encode(item, on_tensor) for key, item in value.items()}
        node: Node = {"t": "dict", "items": items}
        if type(value) is not dict:
            node["type"] = type(value).__name__
        return node
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: encode(getattr(value, f.name), on_tensor) for f in dataclasses.fields(value)}
        return {"t": "dict", "items": fields, "type": type(value).__name__}
    if isinstance(value, _PLAIN):
        return {"t": "object", "repr": str(value)}
    return {"t": "object", "repr": stable_repr(value)}


def map_tensors(value: Any, convert: Callable[[torch.Tensor, str], torch.Tensor], slot: str = "") -> Any:
    """``value`` with every tensor in it replaced by ``convert(tensor, slot)``, every container rebuilt as the type it
    was: a tuple subclass (a named tuple) with its fields, a mapping subclass (transformers' ``ModelOutput``, which
    code then indexes by position) by copying it and setting each key, a dataclass by :func:`dataclasses.replace`.
    Slots are named as :func:`encode`'s (``outputs.0``, ``outputs.logits``)."""
    if isinstance(value, torch.Tensor):
        return convert(value, slot)
    if isinstance(value, tuple | list):
        items = [map_tensors(item, convert, f"{slot}.{index}") for index, item in enumerate(value)]
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*items)
        return type(value)(items)
    if isinstance(value, Mapping):
        mapped = {key: map_tensors(item, convert, f"{slot}.{key}") for key, item in value.items()}
        if type(value) is dict:
            return mapped
        try:
            rebuilt = copy.copy(value)
            for key, item in mapped.items():
                rebuilt[key] = item  # type: ignore[index]
            return rebuilt
        except (TypeError, AttributeError, KeyError):
            return value  # a read-only mapping: handed on as given
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            field.name: map_tensors(getattr(value, field.name), convert, f"{slot}.{field.name}")
            for field in dataclasses.fields(value)
            if field.init
        }
        return dataclasses.replace(value, **changes)
    return value


def floating(node: Node) -> bool:
    """Whether a tensor node holds real floating-point values (else integers, booleans or complex numbers)."""
    return str(node.get("dtype", "")).startswith(("float", "bfloat"))


def iter_tensors(node: Node | None, prefix: str) -> Iterator[tuple[str, Node]]:
    """Yield ``(slot, tensor_node)`` for every tensor leaf below ``node``, depth first."""
    if node is None:
        return
    kind = node.get("t")
    if kind == "tensor":
        yield prefix, node
    elif kind in ("tuple", "list"):
        for index, item in enumerate(node["items"]):
            yield from iter_tensors(item, f"{prefix}.{index}")
    elif kind == "dict":
        for key, item in node["items"].items():
            yield from iter_tensors(item, f"{prefix}.{key}")


def select(node: Node | None, index: int | str | None) -> Node | None:
    """The element ``index`` of a tuple/list/dict node (``None``: the node itself; missing: ``None``).

    A non-container node is its own element 0, as transformers' OutputRecorder treats a bare tensor.
    """
    if node is None or index is None:
        return node
    kind = node.get("t")
    if kind in ("tuple", "list") and isinstance(index, int):
        items = node["items"]
        return items[index] if -len(items) <= index < len(items) else None
    if kind == "dict":
        items = node["items"]
        if isinstance(index, str):
            return items.get(index)
        values = list(items.values())
        return values[index] if -len(values) <= index < len(values) else None
    return node if index == 0 else None


def pick(value: object, index: int | str | None) -> object:
    """The live counterpart of :func:`select`: element ``index`` of a module's output."""
    if index is None:
        return value
    if isinstance(value, tuple | list) and isinstance(index, int):
        return value[index] if -len(value) <= index < len(value) else None
    if isinstance(value, Mapping):
        if isinstance(index, str):
            return value.get(index)
        values = list(value.values())
        return values[index] if -len(values) <= index < len(values) else None
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and isinstance(index, str):
        return getattr(value, index, None)
    return value if index == 0 else None


def first_tensor_slot(node: Node | None, prefix: str) -> str | None:
    """The slot of the first tensor leaf below ``node``, or ``None``."""
    return next((slot for slot, _ in iter_tensors(node, prefix)), None)
