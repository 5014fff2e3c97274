"""Recording one module call operation by operation, for the drill-down and for decisions.

:func:`record_call` runs a forward and records, under a ``TorchFunctionMode``, every ``torch`` function and tensor
method one call of one module performs (in its children too): each operation's name, arguments and constants, and
a copy of every tensor it touched (:class:`Value`: its inputs, parameters, buffers, state it holds, results).
Fused functions with a faithful expansion (:mod:`paritylab.comparison.expansions`) are recorded as the operations
they perform. What the recording holds is bounded (:data:`MAX_OPS`, :data:`MAX_BYTES`); past the bounds it says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from paritylab.comparison.expansions import EXPANSIONS, faithful

MAX_OPS = 20_000
"""Operations recorded per side; beyond this the drill-down stops recording values (and says so)."""
MAX_BYTES = 512 * 2**20
"""Tensor bytes kept per side (copies of every value the call produced)."""


@dataclass
class Value:
    """One tensor the recorded call touched."""

    index: int
    origin: str
    """Where it came from: ``input <slot>``, ``parameter <name>``, ``buffer <name>``, ``op <n>``, ``forced <child>``
    (a child's output replaced by the reference's, teacher forcing) or ``state held by <module>`` (made before
    this call and kept: a KV cache's tensors, a tensor attribute)."""
    shape: list[int]
    dtype: str
    op: int | None = None
    """The operation that produced it (``None``: it came from outside the call)."""
    match: int | None = None
    """Candidate side: the reference value it equals (within tolerance)."""
    distance: float | None = None
    """Candidate side: relative L2 distance to the nearest reference value of its size."""
    layout: bool = False
    """Matched only with its elements in another order (a transpose, a head split)."""
    parts: list[int] = field(default_factory=list)
    """Candidate side, for a parameter or buffer matching no reference value whole: the reference values whose rows
    it holds (a fused qkv weight is q, k and v stacked; a separate q projection is part of a fused one)."""


@dataclass
class Op:
    """One recorded operation."""

    index: int
    name: str
    module: str
    """Innermost module running it, relative to the recorded module (``""``: the module itself)."""
    arguments: str
    """Its arguments as ``name(tensor[2, 4], 0.125, eps=1e-05)``, tensors by value index."""
    scalars: list[str]
    inputs: list[int]
    outputs: list[int]
    within: str = ""
    """The fused function this operation is part of, written out (:mod:`paritylab.comparison.expansions`)."""


@dataclass
class Recording:
    """One side's recorded call."""

    key: str
    ops: list[Op] = field(default_factory=list)
    values: list[Value] = field(default_factory=list)
    tensors: list[torch.Tensor | None] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    """The values the call returned."""
    truncated: str | None = None
    called: bool = False


def record_call(model: nn.Module, path: str, call_index: int, run: Callable[[nn.Module], Any]) -> Recording:
    """Run ``run(model)`` and record, operation by operation, call ``call_index`` of the module at ``path``."""
    target = model.get_submodule(path) if path else model
    recording = Recording(f"{path}#{call_index}")
    recorder = _Recorder(recording, target)
    with recorder.installed(target, call_index):
        run(model)
    return recording


def split_key(key: str) -> tuple[str, int]:
    """``model.layers.0.mlp#2`` -> (``model.layers.0.mlp``, 2)."""
    path, _, number = key.rpartition("#")
    return path, int(number)


class _Recorder(TorchFunctionMode):
    def __init__(self, recording: Recording, target: nn.Module) -> None:
        super().__init__()
        self.recording = recording
        self.known: dict[int, int] = {}
        """id(tensor) -> value index; the tensors themselves are held in ``alive`` so ids stay unique."""
        self.alive: list[torch.Tensor] = []
        self.bytes = 0
        self.stack: list[str] = [""]
        self.names = {id(t): f"parameter {n}" for n, t in target.named_parameters()}
        self.names.update({id(t): f"buffer {n}" for n, t in target.named_buffers()})
        self.paths = {id(m): p for p, m in target.named_modules()}
        self.active = False
        self.busy = False
        self.within: list[str] = []

    @contextmanager
    def installed(self, target: nn.Module, call_index: int) -> Iterator[None]:
        count = [0]

        def enter(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            count[0] += 1
            if count[0] - 1 != call_index or self.active:
                return
            for slot, tensor in _tensors((args, kwargs)):
                self._value(tensor, f"input {_slot(slot)}")
            self.active = True
            self.recording.called = True
            self.__enter__()

        def leave(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if self.active:
                self.active = False
                self.__exit__(None, None, None)
                for slot, tensor in _tensors(output):
                    self.recording.outputs.append(self._value(tensor, f"output {_slot(slot)}"))

        # Output hooks run in the order registered: these run after any the module already has (a user's hook
        # that changes the output is part of the call), and the call must not be teacher-forced (``within``).
        handles = [
            target.register_forward_pre_hook(enter, with_kwargs=True),
            target.register_forward_hook(leave, with_kwargs=True),
        ]
        for module in target.modules():
            if module is not target:
                handles.append(module.register_forward_pre_hook(self._push))
                handles.append(module.register_forward_hook(self._pop))
        try:
            yield
        finally:
            if self.active:  # the forward raised inside the call
                self.active = False
                self.__exit__(None, None, None)
            for handle in handles:
                handle.remove()

    def _push(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self.active:
            self.stack.append(self.paths.get(id(module), "?"))

    def _pop(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self.active:
            return
        if len(self.stack) > 1:
            self.stack.pop()
        self.busy = True  # what this hook does is bookkeeping, not the call's computation
        try:
            for slot, tensor in _tensors(output):  # made outside any recorded operation (teacher forcing)
                if id(tensor) not in self.known:
                    self._value(tensor, f"forced {self.paths.get(id(module), '?')} {_slot(slot)}".rstrip())
        finally:
            self.busy = False

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if not self.busy and (expanded := self._written_out(func, args, kwargs)) is not None:
            return expanded
        result = func(*args, **kwargs)
        if self.busy:
            return result
        outputs = list(_tensors(result))
        if not outputs and _name(func) == "__setitem__" and args and isinstance(args[0], torch.Tensor):
            outputs = [("", args[0])]  # ``t[i] = v`` (``t[i] += v``) changes ``t`` in place and returns nothing
        if not outputs or len(self.recording.ops) >= MAX_OPS:
            if outputs and self.recording.truncated is None:
                self.recording.truncated = f"{self.recording.key}: more than {MAX_OPS} operations; the rest unrecorded"
            return result
        index = len(self.recording.ops)
        inputs = [self._value(tensor, "") for _, tensor in _tensors((args, kwargs))]
        name = _name(func)
        arguments = _arguments(name, args, kwargs, lambda tensor: self._label(tensor))
        made = []
        for slot, tensor in outputs:
            self.known.pop(id(tensor), None)  # an in-place operation makes a new value in the same tensor
            made.append(self._value(tensor, f"op {index}{_slot(slot, ' ')}", op=index))
        within = self.within[-1] if self.within else ""
        self.recording.ops.append(
            Op(index, name, self.stack[-1], arguments, _scalars(args, kwargs), inputs, made, within)
        )
        return result

    def _written_out(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A fused function's result, computed and recorded operation by operation when it has a faithful
        expansion (:mod:`paritylab.comparison.expansions`); ``None``: record the fused call as it is."""
        name = _name(func)
        expansion = EXPANSIONS.get(name)
        if expansion is None or self.within or len(self.recording.ops) >= MAX_OPS:
            return None
        if not faithful(expansion, func, args, kwargs):
            return None
        self.within.append(name)
        try:
            return expansion(lambda f, *a, **k: self.__torch_function__(f, (), a, k), *args, **kwargs)
        finally:
            self.within.pop()

    def _label(self, tensor: torch.Tensor) -> str:
        """What a reader calls a tensor argument: ``input``, ``weight``, ``q_proj.weight``, or the name of
        the operation that made it (``linear``, ``softmax``)."""
        number = self.known.get(id(tensor))
        if number is None:
            return "tensor"
        value = self.recording.values[number]
        if value.op is not None:
            return self.recording.ops[value.op].name if value.op < len(self.recording.ops) else "tensor"
        kind, _, rest = value.origin.partition(" ")
        return rest if kind in ("parameter", "buffer") else "state" if kind == "state" else kind

    def _value(self, tensor: torch.Tensor, origin: str, op: int | None = None) -> int:
        known = self.known.get(id(tensor))
        if known is not None:
            return known
        recording = self.recording
        index = len(recording.values)
        origin = self.names.get(id(tensor)) or origin or f"state held by {self.stack[-1] or 'the module'}"
        recording.values.append(Value(index, origin, list(tensor.shape), str(tensor.dtype).removeprefix("torch."), op))
        size = tensor.numel() * tensor.element_size()
        if self.bytes + size > MAX_BYTES or tensor.is_meta:
            recording.tensors.append(None)
            if recording.truncated is None:
                recording.truncated = f"{recording.key}: over {MAX_BYTES >> 20} MiB of values; the rest kept unseen"
        else:
            self.bytes += size
            recording.tensors.append(tensor.detach().clone())
        self.known[id(tensor)] = index
        self.alive.append(tensor)
        return index


def _tensors(value: Any, slot: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield slot, value
    elif isinstance(value, tuple | list):
        for number, item in enumerate(value):
            yield from _tensors(item, f"{slot}.{number}")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _tensors(item, f"{slot}.{key}")
    elif hasattr(value, "to_tuple") and callable(value.to_tuple):  # transformers' ModelOutput
        yield from _tensors(dict(value.items()), slot)


def _slot(slot: str, prefix: str = "") -> str:
    slot = slot.lstrip(".")
    return f"{prefix}{slot}" if slot else ""


def _name(func: Any) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    if name in ("__get__", "__set__"):  # a property such as Tensor.T or Tensor.mT
        name = str(getattr(func, "__qualname__", name)).split(".")[-2]
    return name


def _scalar(value: Any) -> str | None:
    if isinstance(value, bool | int | float | str) or value is None:
        return repr(value) if not isinstance(value, float) else f"{value:.6g}"
    if isinstance(value, torch.dtype | torch.device):
        return str(value).removeprefix("torch.")
    if isinstance(value, tuple | list) and all(not isinstance(item, torch.Tensor) for item in value):
        return repr(tuple(value)) if len(value) <= 8 else f"({len(value)} items)"
    return None


def _scalars(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[str]:
    out = [text for text in map(_scalar, args) if text is not None]
    out += [f"{key}={text}" for key, value in kwargs.items() if (text := _scalar(value)) is not None]
    return out


def _arguments(
    name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any], label: Callable[[torch.Tensor], str]
) -> str:
    def show(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return f"{label(value)}{list(value.shape)}"
        if isinstance(value, tuple | list) and any(isinstance(item, torch.Tensor) for item in value):
            return "[" + ", ".join(show(item) for item in value) + "]"
        return _scalar(value) or type(value).__name__

    parts = [show(arg) for arg in args] + [f"{key}={show(value)}" for key, value in kwargs.items()]
    return f"{name}({', '.join(parts)})"
