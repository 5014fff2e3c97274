"""A model computed in a wider dtype without a wide copy of it: each module's own tensors are widened while it runs.

float32's own rounding is measured against float64 (the float32 noise floor, :func:`paritylab.run.parity.
estimate_float32_floors`). A float64 copy of a 7 B model is 54 GB; :func:`widened_in_place` instead gives each module,
for the duration of each of its calls, float64 copies of the parameters, buffers and tensor attributes it holds
itself and those its direct children hold (a module reads its children's weights and their dtype before calling
them: CLIP's and ViT's patch embeddings cast the pixels to ``self.projection.weight.dtype``; ``nn.
MultiheadAttention`` reads ``out_proj.weight`` and never calls ``out_proj``), and those of deeper descendants that
are never called as modules; and puts the originals back when the call returns. Only the tensors of the running
modules and their children are wide at a time (a transformer's layers hold few of their own), and the model is
unchanged afterwards.

A forward that reads a tensor another module owns while neither it nor its parent is running (a tied embedding
read as ``F.linear(x, self.embed.weight)`` from another branch) meets it in the original dtype, and PyTorch refuses
the mixed product: the caller treats any failure as "no floor", never as a verdict.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from paritylab.run.resident import Slot, assign_slot, own_slots


@contextmanager
def widened_in_place(model: nn.Module, dtype: torch.dtype, uncalled: Collection[str] = ()) -> Iterator[None]:
    """While inside, every module of ``model`` computes with ``dtype`` copies of its own floating-point tensors
    and its direct children's during its calls. ``uncalled``: paths of modules never called as modules; their
    tensors are widened with their nearest called ancestor's."""
    paths = dict(model.named_modules(remove_duplicate=True))
    adopted: dict[str, list[nn.Module]] = {}
    for path in uncalled:
        if path not in paths or not path:
            continue
        parent = path.rpartition(".")[0]
        while parent and parent in uncalled:
            parent = parent.rpartition(".")[0]
        adopted.setdefault(parent, []).append(paths[path])
    depth: dict[int, int] = {}
    saved: dict[int, list[tuple[Slot, torch.Tensor]]] = {}

    def widen(module: nn.Module, extra: list[nn.Module]) -> Any:
        def pre(_: nn.Module, __: Any) -> None:
            key = id(module)
            depth[key] = depth.get(key, 0) + 1
            if depth[key] > 1:  # a module calling itself again: already wide
                return
            owners = (module, *module.children(), *extra)
            held = [
                (slot, t)
                for owner in owners
                for slot, t in own_slots(owner)
                if t.is_floating_point() and t.dtype != dtype
            ]  # a tensor already wide belongs to a running ancestor, which puts it back
            saved[key] = held
            for slot, tensor in held:
                wide = tensor.detach().to(dtype)
                assign_slot(slot, nn.Parameter(wide, requires_grad=False) if slot.kind == "parameter" else wide)

        return pre

    def restore(module: nn.Module) -> Any:
        def post(_: nn.Module, __: Any, ___: Any) -> None:
            key = id(module)
            depth[key] -= 1
            if depth[key]:
                return
            for slot, tensor in saved.pop(key, []):
                assign_slot(slot, tensor)

        return post

    handles = []
    for path, module in paths.items():
        extra = adopted.get(path, [])
        handles.append(module.register_forward_pre_hook(widen(module, extra), prepend=True))
        handles.append(module.register_forward_hook(restore(module), always_call=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for entries in saved.values():  # a forward that raised inside a call: put everything back
            for slot, tensor in entries:
                assign_slot(slot, tensor)
        saved.clear()
