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

:func:`converted_in_place` is the mechanism with any conversion: the lifted replay (:mod:`paritylab.run.lifting`)
runs the float32 reference with its parameters rounded, and a bfloat16 candidate widened to float32, the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from paritylab.run.resident import Slot, assign_slot, own_slots, stored_ids
from paritylab.tracing.initial import attributes_kept

Convert = Callable[[Slot, torch.Tensor], torch.Tensor | None]
"""What a module computes with in place of one tensor it holds while it runs (``None``: the tensor as it is)."""


@contextmanager
def widened_in_place(
    model: nn.Module, dtype: torch.dtype, uncalled: Collection[str] = (), stand_in: bool = False
) -> Iterator[None]:
    """While inside, every module of ``model`` computes with ``dtype`` copies of its own floating-point tensors
    and its direct children's during its calls. ``uncalled``: paths of modules never called as modules; their
    tensors are widened with their nearest called ancestor's. ``stand_in``: a weight read while its module is
    not running raises (:func:`converted_in_place`) instead of being met in its own dtype."""

    def wide(_: Slot, tensor: torch.Tensor) -> torch.Tensor | None:
        return tensor.detach().to(dtype) if tensor.is_floating_point() and tensor.dtype != dtype else None

    with converted_in_place(model, wide, uncalled, stand_in=dtype if stand_in else None):
        yield


@contextmanager
def converted_in_place(
    model: nn.Module, convert: Convert, uncalled: Collection[str] = (), stand_in: torch.dtype | None = None
) -> Iterator[None]:
    """While inside, every module of ``model`` computes, during each of its calls, with ``convert(slot, tensor)``
    in place of each tensor it and its direct children hold (and the modules in ``uncalled`` its nearest called
    ancestor adopts); the originals are put back when the call returns, so only the running modules' tensors
    are converted at a time and the model is unchanged afterwards. A tensor a running ancestor converted
    already is left to it.

    ``stand_in``: outside the calls of the modules that hold them, parameters and buffers are replaced by
    :class:`StandIn` tensors (``stand_in`` the dtype of floating-point ones): code that reads a weight of a module
    that is not running (a tied embedding read as ``x @ self.embed.emb.weight.T`` from another branch) then fails,
    where it would otherwise compute with the original silently. Its shape, device and dtype (what a converted
    copy would hold: HF's ``self.dtype``) still read as they should."""
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
    saved: dict[int, list[tuple[Slot, torch.Tensor, torch.Tensor]]] = {}
    made: set[int] = set()  # ids of the conversions in place now: an ancestor's, which it puts back
    originals = _stood_in(paths.values(), stand_in) if stand_in is not None else {}

    def converting(module: nn.Module, extra: list[nn.Module]) -> Any:
        def pre(_: nn.Module, __: Any) -> None:
            key = id(module)
            depth[key] = depth.get(key, 0) + 1
            if depth[key] > 1:  # a module calling itself again: already converted
                return
            held = []
            for owner in (module, *module.children(), *extra):
                for slot, now in own_slots(owner):
                    if id(now) in made:
                        continue
                    original = originals.get((id(slot.module), slot.name), now)
                    replacement = convert(slot, original)
                    if replacement is None:
                        if original is now:
                            continue
                        replacement = original  # stood in for, and used as it is
                    elif slot.kind == "parameter" and not isinstance(replacement, nn.Parameter):
                        replacement = nn.Parameter(replacement, requires_grad=False)
                    held.append((slot, now, replacement))
            saved[key] = held
            for slot, _now, replacement in held:
                made.add(id(replacement))
                assign_slot(slot, replacement)

        return pre

    def restore(module: nn.Module) -> Any:
        def post(_: nn.Module, __: Any, ___: Any) -> None:
            key = id(module)
            depth[key] -= 1
            if depth[key]:
                return
            for slot, before, replacement in saved.pop(key, []):
                made.discard(id(replacement))
                assign_slot(slot, before)

        return post

    handles = []
    for path, module in paths.items():
        extra = adopted.get(path, [])
        handles.append(module.register_forward_pre_hook(converting(module, extra), prepend=True))
        handles.append(module.register_forward_hook(restore(module), always_call=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for entries in saved.values():  # a forward that raised inside a call: put everything back
            for slot, before, _ in entries:
                assign_slot(slot, before)
        saved.clear()
        made.clear()
        for module in paths.values():
            for slot, _now in own_slots(module):
                if (id(module), slot.name) in originals:
                    assign_slot(slot, originals[(id(module), slot.name)])


def _stood_in(modules: Iterable[nn.Module], dtype: torch.dtype) -> dict[tuple[int, str], torch.Tensor]:
    """Replace every parameter and buffer of ``modules`` (wherever held, plain attributes too) by a :class:`StandIn`
    of its shape (``dtype`` if floating-point); returns ``(id(module), name)`` -> the original."""
    modules = list(modules)
    stored = {id(t) for module in modules for t in (*module._parameters.values(), *module._buffers.values())}
    stand_ins: dict[int, torch.Tensor] = {}
    originals: dict[tuple[int, str], torch.Tensor] = {}
    for module in modules:
        for slot, tensor in own_slots(module):
            if id(tensor) not in stored:
                continue
            if id(tensor) not in stand_ins:  # one stand-in per tensor: tied weights stay tied
                stand_ins[id(tensor)] = StandIn(tensor, dtype if tensor.is_floating_point() else tensor.dtype)
            originals[(id(module), slot.name)] = tensor
            assign_slot(slot, stand_ins[id(tensor)])
    return originals


Call = Callable[[nn.Module], Any]


def cast_in_place(call: Call, dtype: torch.dtype, uncalled: Collection[str] = ()) -> Call:
    """``call`` for a model computing as its copy converted to ``dtype`` (``Module.to``) would, without the copy:
    each module's parameters and buffers, and its direct children's, are ``dtype`` copies while it runs; a weight
    read while its module is not running raises (:func:`converted_in_place`); the plain
    attributes the run sets (caches made in ``dtype``) are put back afterwards."""

    def run(model: nn.Module) -> Any:
        stored = stored_ids(model)

        def convert(_: Slot, tensor: torch.Tensor) -> torch.Tensor | None:
            if id(tensor) not in stored:
                return None
            return tensor.detach().to(dtype if tensor.is_floating_point() else tensor.dtype, copy=True)

        with attributes_kept(model), converted_in_place(model, convert, uncalled, stand_in=dtype):
            return call(model)

    return run


class StandIn(torch.Tensor):
    """A tensor with a shape, dtype and device and no values: any operation on it raises. Held, during a run
    converted in place, where a weight is while its module is not running (:func:`converted_in_place`)."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, dtype: torch.dtype) -> StandIn:
        return torch.Tensor._make_wrapper_subclass(
            cls, like.shape, dtype=dtype, device=like.device, requires_grad=False
        )

    def __init__(self, like: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        raise RuntimeError(
            f"{func} read a weight of a module that was not running; a model run converted in place cannot give it"
            " (a converted copy can)"
        )
