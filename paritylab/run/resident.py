"""One model resident at a time: move a traced model's tensors to a file and map them back.

:func:`offload` writes every parameter, buffer and tensor attribute of a model to a safetensors file
and replaces each by a copy-on-write memory map of it. The model object stays whole and usable (its
forward runs on the CPU, reading the weights from the page cache), so anything built from it later,
such as a port loaded from the reference's weights, works unchanged. What changes is the kind of
memory: file-backed pages the kernel can evict and read back, instead of process memory that must
fit next to the next model. A parity run therefore needs memory for the larger model, not the sum.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paritylab.tracing.storage import TensorReader, TensorStore

WEIGHTS_PREFIX = "weights"
_PLAIN_TYPES = (torch.Tensor, nn.Parameter)
"""Only these are moved: subclasses (quantized parameters, DTensors) carry state a mapping would lose."""


@dataclass(frozen=True)
class Slot:
    """Where a model holds a tensor: ``module.<name>`` as a parameter, buffer or plain attribute."""

    module: nn.Module
    name: str
    kind: str
    """``"parameter"``, ``"buffer"`` or ``"attribute"``."""


def offload(model: nn.Module, directory: str | os.PathLike[str]) -> int:
    """Move ``model``'s tensors to safetensors shards in ``directory`` and map them back in place.

    Tensors shared between modules (tied embeddings) stay shared; parameters keep ``requires_grad``.
    Tensors safetensors cannot hold (complex, sparse) and tensor subclasses stay in memory. The model ends up on
    the CPU. Returns the number of bytes moved out of process memory.
    """
    slots = tensor_slots(model)
    # widest dtypes first: every tensor then starts at an offset aligned for its dtype (zero-copy maps)
    order = sorted(slots, key=lambda key: -slots[key][0].element_size())
    store = TensorStore(directory, prefix=WEIGHTS_PREFIX, pending_bytes=0, metadata={"producer": "paritylab"})
    try:
        for key in order:
            if type(slots[key][0]) in _PLAIN_TYPES:  # the store itself refuses what safetensors cannot hold
                store.put(slots[key][0], key)
    finally:
        store.close()
    if store.failure is not None:
        raise OSError(f"could not move the model's weights to {directory}: {store.failure}")
    reader = TensorReader(directory)
    moved = 0
    for key, (tensor, places) in slots.items():
        if key not in store.files:
            continue
        mapped = reader.load(store.files[key], key)
        replacement: torch.Tensor = mapped
        if isinstance(tensor, nn.Parameter):
            replacement = nn.Parameter(mapped, requires_grad=tensor.requires_grad)
        for slot in places:
            assign_slot(slot, replacement)
        moved += tensor.numel() * tensor.element_size()
    return moved


def tensor_slots(model: nn.Module) -> dict[str, tuple[torch.Tensor, list[Slot]]]:
    """Every distinct tensor ``model`` holds, keyed by its first dotted name, with all the places holding it."""
    found: dict[int, tuple[str, torch.Tensor, list[Slot]]] = {}
    for prefix, module in model.named_modules(remove_duplicate=True):
        for slot, tensor in own_slots(module):
            key = f"{prefix}.{slot.name}" if prefix else slot.name
            entry = found.setdefault(id(tensor), (key, tensor, []))
            entry[2].append(slot)
    return {key: (tensor, places) for key, tensor, places in found.values()}


def own_slots(module: nn.Module) -> list[tuple[Slot, torch.Tensor]]:
    """The tensors ``module`` holds itself (not its children's): parameters, buffers, plain tensor attributes."""
    held: list[tuple[Slot, Any]] = [
        *((Slot(module, name, "parameter"), tensor) for name, tensor in module._parameters.items()),
        *((Slot(module, name, "buffer"), tensor) for name, tensor in module._buffers.items()),
        *((Slot(module, name, "attribute"), value) for name, value in vars(module).items()),
    ]
    return [(slot, tensor) for slot, tensor in held if isinstance(tensor, torch.Tensor)]


def model_bytes(model: nn.Module) -> int:
    """Bytes of all distinct tensors ``model`` holds."""
    return sum(t.numel() * t.element_size() for t, _ in tensor_slots(model).values())


def stored_ids(model: nn.Module) -> set[int]:
    """``id`` of every parameter and buffer ``model`` holds: what ``Module.to`` converts (plain tensor attributes
    it leaves as they are)."""
    return {id(t) for t in (*model.parameters(), *model.buffers())}


def converted_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of ``model``'s parameters and buffers converted to ``dtype`` (``Module.to``: floating-point ones)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size()) for t in tensors)


def assign_slot(slot: Slot, tensor: torch.Tensor) -> None:
    if slot.kind == "parameter":
        slot.module._parameters[slot.name] = tensor  # type: ignore[assignment]
    elif slot.kind == "buffer":
        slot.module._buffers[slot.name] = tensor
    else:
        vars(slot.module)[slot.name] = tensor


def available_memory(device: torch.device) -> int | None:
    """Bytes free for a new model on ``device`` (``MemAvailable`` on the host), or ``None`` if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def release_freed_memory() -> None:
    """Collect garbage and hand freed heap memory back to the OS (glibc keeps large freed blocks otherwise)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: its allocator decides
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def converted_copy(
    model: nn.Module,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
    rounded_to: torch.dtype | None = None,
    given: Mapping[int, torch.Tensor] | None = None,
) -> nn.Module:
    """``copy.deepcopy(model).to(device, dtype)`` without the intermediate full-precision copy: floating-point
    parameters and buffers are converted straight from the original, so peak memory is the converted model.

    ``rounded_to``: floating-point parameters (not buffers) are first rounded to that dtype, so the copy
    computes in ``dtype`` with the weights a cast to ``rounded_to`` would hold. ``given``: ``id`` of a parameter
    -> the values its copy holds instead (converted to ``dtype``, not rounded): what a low-precision candidate
    provably computes with there (:class:`~paritylab.comparison.twins.Twins`)."""
    memo: dict[int, Any] = {}
    given = given or {}
    for tensor, places in tensor_slots(model).values():
        if all(slot.kind == "attribute" for slot in places):
            continue  # like Module.to: plain tensor attributes are copied as they are
        target = dtype if tensor.is_floating_point() else tensor.dtype
        source = given.get(id(tensor), tensor).detach()
        rounds = rounded_to is not None and id(tensor) not in given
        if rounds and isinstance(tensor, nn.Parameter) and tensor.is_floating_point():
            source = source.to(device=device or tensor.device, dtype=rounded_to)
        converted = source.to(device=device or tensor.device, dtype=target, copy=True)
        if isinstance(tensor, nn.Parameter):
            converted = nn.Parameter(converted, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = converted
    return copy.deepcopy(model, memo)
