"""Operation-level drill-down: inside the module named as the origin, the first operation whose output diverges.

Both sides run again with one call of that module recorded operation by operation (a ``TorchFunctionMode``
sees every ``torch`` function and tensor method the module's code calls, in its children too): the reference
as it ran, the candidate teacher-forced (every aligned call upstream returns the reference's value, see
:func:`paritylab.comparison.replay.teacher_forcing`), so both start from the same inputs.

Every tensor the candidate's call touched (its inputs, parameters and buffers, every operation's outputs) is
then looked up among the values the reference's call touched, in any position and, at full precision, in any
layout (a ``[batch, heads, tokens, dim]`` query matches a ``[batch, tokens, heads * dim]`` one). A value with no
match is not an error by itself: implementations differ in intermediates (a fused qkv projection, a query
scaled before the product). It is one when nothing computed from it matches again. The culprit is the earliest
such value whose operation's inputs are all clean: the first operation (or parameter, or buffer) where the
candidate's computation leaves the reference's for good. Fused functions (``scaled_dot_product_attention``,
``layer_norm``, ``rms_norm``) are recorded as the operations they perform
(:mod:`paritylab.comparison.expansions`), so their intermediates have counterparts on a written-out side.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from paritylab.comparison.expansions import EXPANSIONS, faithful

MAX_OPS = 20_000
"""Operations recorded per side; beyond this the drill-down stops recording values (and says so)."""
MAX_BYTES = 512 * 2**20
"""Tensor bytes kept per side (copies of every value the call produced)."""
_TOLERANCE = {"float64": (1e-9, 1e-5), "float32": (1e-6, 1e-4), "bfloat16": (1e-2, 3e-2), "float16": (2e-3, 5e-3)}
"""Per candidate dtype, the (smallest, largest) relative L2 distance under which two values are one value. The
tolerance used lies between them: an eighth of the module's own error, so a small error is still seen."""
_MOVES = frozenset(
    {"view", "reshape", "transpose", "permute", "contiguous", "expand", "expand_as", "unsqueeze", "squeeze"}
    | {"flatten", "unflatten", "t", "narrow", "select", "__getitem__", "split", "chunk", "unbind", "clone", "detach"}
    | {"movedim", "swapaxes", "repeat", "to", "type_as", "float", "dropout"}
)
"""Operations that move values without computing new ones (named as culprits only if nothing else is)."""


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


@dataclass
class Drilldown:
    """Where the candidate's computation leaves the reference's, inside one module call."""

    reference: str
    candidate: str
    tolerance: float
    value: Value | None
    """The candidate value where it leaves (``None``: no operation differs beyond the tolerance)."""
    operations: list[Op]
    """The candidate operations from there to the first value the reference also forms (the first is the
    culprit); empty when the culprit is a parameter, buffer or other value from outside the call."""
    counterparts: list[Op]
    """The reference operations doing the same job (consuming the same inputs)."""
    distance: float | None
    """Relative L2 distance between the two sides' results of that stretch."""
    message: str
    reference_ops: int
    candidate_ops: int
    notes: list[str] = field(default_factory=list)

    @property
    def culprit(self) -> Op | None:
        return self.operations[0] if self.operations else None

    @property
    def operation(self) -> str:
        """A short name for tags and tables: ``mlp.act: gelu``, ``ln_2: mean .. add (9 operations)``."""
        if self.value is None:
            return "none"
        if self.value.op is None or not self.operations:  # a parameter, buffer or tensor attribute
            return self.value.origin
        first, last = self.operations[0], self.operations[-1]
        where = f"{first.module}: " if first.module else ""
        if len(self.operations) == 1:
            return f"{where}{first.name}" + (f" in {first.within}" if first.within else "")
        return f"{where}{first.name} .. {last.name} ({len(self.operations)} operations)"

    def to_dict(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "candidate": self.candidate,
            "operation": self.operation,
            "message": self.message,
            "tolerance": self.tolerance,
            "distance": self.distance,
            "value": asdict(self.value) if self.value else None,
            "operations": [asdict(op) for op in self.operations],
            "counterparts": [asdict(op) for op in self.counterparts],
            "reference_ops": self.reference_ops,
            "candidate_ops": self.candidate_ops,
            "notes": self.notes,
        }


def record_call(model: nn.Module, path: str, call_index: int, run: Callable[[nn.Module], Any]) -> Recording:
    """Run ``run(model)`` and record, operation by operation, call ``call_index`` of the module at ``path``."""
    target = model.get_submodule(path) if path else model
    recording = Recording(f"{path}#{call_index}")
    recorder = _Recorder(recording, target)
    with recorder.installed(target, call_index):
        run(model)
    return recording


def drill_down(
    reference: Recording,
    candidate: Recording,
    dtype: torch.dtype | str,
    own_error: float | None = None,
    siblings: Mapping[str, torch.Tensor] | None = None,
) -> Drilldown:
    """Compare two recordings of one module call and name where the candidate leaves the reference.

    ``own_error`` (the module's own relative error, from isolated replay) sets the tolerance under which two
    values are one: an eighth of it, within the dtype's bounds (:data:`_TOLERANCE`). ``siblings``: the reference
    parameters and buffers beside the recorded module (its parent's, by full name), where the rest of a fused
    weight's rows are found (a port's gate/up ``w13`` against the reference's ``gate_proj``: the up rows are in
    ``up_proj``). They only complete a fused weight: a candidate value never matches one of them whole.
    """
    low, high = _TOLERANCE.get(str(dtype).removeprefix("torch."), _TOLERANCE["float32"])
    tolerance = min(high, max(low, (own_error or high) / 8))
    notes = [text for text in (reference.truncated, candidate.truncated) if text]
    notes += [f"{side.key} was never called" for side in (reference, candidate) if not side.called]
    layout_free = tolerance <= _TOLERANCE["float32"][1]
    equals = _match(reference, candidate, tolerance, layout_free)
    _stacked(_with_siblings(reference, siblings or {}), candidate, tolerance)
    _sliced(reference, candidate, tolerance)
    value = _frontier(candidate)
    if value is None:
        message = (
            f"no operation in {candidate.key} differs beyond {tolerance:.1g} (relative L2) from the reference's "
            "values: the difference lies below what single operations show"
        )
        return Drilldown(reference.key, candidate.key, tolerance, None, [], [], None, message,
                         len(reference.ops), len(candidate.ops), notes)  # fmt: skip
    anchor = candidate.ops[value.op] if value.op is not None else _first_use(candidate, value.index)
    counterparts = _counterparts(reference, anchor, equals) if anchor is not None else []
    direct = (
        anchor is not None
        and value.op is not None
        and bool(counterparts)
        and all(_same_call(candidate, anchor, op, equals) for op in counterparts)
    )
    operations, distance = _stretch(reference, candidate, value, counterparts, layout_free, direct)
    message = _describe(candidate, value, operations, counterparts, distance)
    return Drilldown(reference.key, candidate.key, tolerance, value, operations, counterparts, distance, message,
                     len(reference.ops), len(candidate.ops), notes)  # fmt: skip


# -- recording ---------------------------------------------------------------------------------------------------


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


# -- matching ----------------------------------------------------------------------------------------------------


_MASKED = 1e30
"""Values at least this large (or infinite) are an attention mask's fill (``-inf``, ``finfo.min``): compared as
zeros, so the positions they mask must agree while the other values are what the distance measures. Left as they
are, one such value outweighs every real one, and scores scaled wrongly would match once masked."""


def _flat(tensor: torch.Tensor) -> tuple[torch.Tensor, float]:
    data = tensor.detach().reshape(-1).to(torch.float64)
    masked = data.abs() >= _MASKED  # infinities too; NaN stays NaN and matches nothing
    if bool(masked.any()):
        data = data.masked_fill(masked, 0.0)
    return data, float(torch.linalg.vector_norm(data))


class _Distance:
    """Relative L2 distance between flattened values: in element order, then either (``layout_free``) in sorted
    order, which no reshape, transpose or head split changes, or (low precision, where sorted values of any
    two similar tensors are close) through the permutations of dimensions that map one shape onto the other
    (``shapes``: value key -> shape). Sorted copies are made once per value."""

    def __init__(self, layout_free: bool, shapes: Mapping[int, list[int]] | None = None) -> None:
        self.layout_free = layout_free
        self.shapes = shapes or {}
        self.sorted: dict[int, torch.Tensor] = {}

    def __call__(
        self, key: int, data: torch.Tensor, norm: float, other_key: int, other: torch.Tensor, other_norm: float,
        bound: float, tolerance: float = 0.0,
    ) -> tuple[float, bool]:  # fmt: skip
        """(distance, matched only out of order); ``inf`` when it cannot be below ``bound``. Other layouts are
        tried unless the element order is already within ``tolerance``."""
        scale = max(other_norm, 1e-30)
        if data.numel() != other.numel() or abs(norm - other_norm) / scale > bound:  # a lower bound of both
            return math.inf, False
        distance = float(torch.linalg.vector_norm(data - other)) / scale
        if distance <= tolerance:
            return distance, False
        if not self.layout_free:
            views = self._views(key, data, other_key, other)
            moved = min((float(torch.linalg.vector_norm(a - b)) / scale for a, b in views), default=math.inf)
            return (moved, True) if moved < distance else (distance, False)
        by_value = float(torch.linalg.vector_norm(self._sorted(key, data) - self._sorted(other_key, other))) / scale
        return (by_value, True) if by_value < distance else (distance, False)

    def _views(
        self, key: int, data: torch.Tensor, other_key: int, other: torch.Tensor
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Both values flattened after permuting one's dimensions so that its shape groups into the other's
        (``[b, h, t, d]`` read as ``[b, t, h * d]``, or a transposed ``[t, s]``), at most :data:`_VIEWS` of them."""
        mine = [size for size in self.shapes.get(key, []) if size != 1]
        theirs = [size for size in self.shapes.get(other_key, []) if size != 1]
        if not mine or not theirs or max(len(mine), len(theirs)) > 5:
            return
        found = 0
        for order in itertools.permutations(range(len(theirs))):
            if found < _VIEWS and list(order) != sorted(order) and _groups([theirs[i] for i in order], mine):
                found += 1
                yield data, other.reshape(theirs).permute(order).reshape(-1)
        for order in itertools.permutations(range(len(mine))):
            if found < _VIEWS and list(order) != sorted(order) and _groups([mine[i] for i in order], theirs):
                found += 1
                yield data.reshape(mine).permute(order).reshape(-1), other

    def _sorted(self, key: int, data: torch.Tensor) -> torch.Tensor:
        if key not in self.sorted:
            self.sorted[key] = torch.sort(data).values
        return self.sorted[key]


_VIEWS = 8
"""Permuted layouts tried per pair of values in low precision."""


def _groups(fine: list[int], coarse: list[int]) -> bool:
    """Whether ``fine``'s sizes, in order, multiply into ``coarse``'s (``[2, 6, 4, 8]`` into ``[2, 6, 32]``)."""
    position = 0
    for size in coarse:
        product = 1
        while product < size and position < len(fine):
            product *= fine[position]
            position += 1
        if product != size:
            return False
    return position == len(fine)


def _shapes(reference: Recording, candidate: Recording) -> dict[int, list[int]]:
    """Value shapes under the keys :class:`_Distance` is called with (candidate values: ``-1 - index``)."""
    shapes = {value.index: value.shape for value in reference.values}
    shapes.update({-1 - value.index: value.shape for value in candidate.values})
    return shapes


def _match(reference: Recording, candidate: Recording, tolerance: float, layout_free: bool) -> dict[int, set[int]]:
    """Give each candidate value its nearest reference value of the same size; returns, per candidate value,
    every reference value it equals (within ``tolerance``)."""
    pool: dict[int, list[tuple[int, torch.Tensor, float]]] = {}
    for value, tensor in zip(reference.values, reference.tensors, strict=True):
        if tensor is not None and tensor.numel():
            pool.setdefault(tensor.numel(), []).append((value.index, *_flat(tensor)))
    distance = _Distance(layout_free, _shapes(reference, candidate))
    equals: dict[int, set[int]] = {}
    for value, tensor in zip(candidate.values, candidate.tensors, strict=True):
        if tensor is None or not tensor.numel():
            continue
        data, norm = _flat(tensor)
        best, best_index, layout = math.inf, None, False
        for index, other, other_norm in pool.get(data.numel(), []):
            found, moved = distance(
                -1 - value.index, data, norm, index, other, other_norm, max(tolerance, best), tolerance
            )
            if found <= tolerance:
                equals.setdefault(value.index, set()).add(index)
            if found < best:
                best, best_index, layout = found, index, moved
        if best_index is None:
            continue
        value.distance = best
        if best <= tolerance:
            value.match, value.layout = best_index, layout
    return equals


def _sliced(reference: Recording, candidate: Recording, tolerance: float) -> None:
    """Set :attr:`Value.parts` of each candidate operation result that matches no reference value whole but holds
    one as a slice along one axis: a fused projection's output (gate and up side by side, or q, k and v) against the
    reference's separate one. Slices are tried where a part of that width starts in a concatenation: at multiples
    of its width, and at the end."""
    pool: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for value, tensor in zip(reference.values, reference.tensors, strict=True):
        if tensor is not None and tensor.numel() >= _SLICE_MIN and tensor.is_floating_point():
            pool.setdefault(tensor.dim(), []).append((value.index, tensor))
    for value, tensor in zip(candidate.values, candidate.tensors, strict=True):
        if value.op is None or value.match is not None or value.parts or tensor is None:
            continue
        for index, theirs in pool.get(tensor.dim(), []):
            axes = [axis for axis in range(tensor.dim()) if tensor.shape[axis] != theirs.shape[axis]]
            if len(axes) != 1 or theirs.shape[axes[0]] < 2 or theirs.shape[axes[0]] > tensor.shape[axes[0]]:
                continue
            axis, width, size = axes[0], theirs.shape[axes[0]], tensor.shape[axes[0]]
            for start in dict.fromkeys([*range(0, size - width + 1, width), size - width]):
                found = _distance(tensor.narrow(axis, start, width), theirs)
                if found <= tolerance:
                    value.parts, value.distance = [index], found
                    break
            if value.parts:
                break


_SLICE_MIN = 16
"""Reference results smaller than this are not looked for as slices (a column of a wide result could equal one
by chance)."""


def _with_siblings(reference: Recording, siblings: Mapping[str, torch.Tensor]) -> Recording:
    """``reference`` with ``siblings`` appended as values from outside the call (``parameter <full name>``),
    those the recording already holds left out."""
    held = {id(tensor) for tensor in reference.tensors if tensor is not None}
    extra = [(name, tensor.detach()) for name, tensor in siblings.items() if id(tensor) not in held]
    if not extra:
        return reference
    values = list(reference.values)
    for name, tensor in extra:
        values.append(Value(len(values), f"parameter {name}", list(tensor.shape), str(tensor.dtype)))
    tensors = [*reference.tensors, *(tensor for _, tensor in extra)]
    return replace(reference, values=values, tensors=tensors)


def _stacked(reference: Recording, candidate: Recording, tolerance: float) -> None:
    """Set :attr:`Value.parts` of each candidate parameter or buffer that matches no reference value whole but
    whose rows (or columns) are rows of reference parameters and buffers: a fused projection's weight and bias
    (``in_proj_weight``: q, k and v stacked) against separate ones, or a separate one against part of a fused one.
    Rows are located by the hashes that parameter fingerprints and the alignment's fused-row matching use (the
    sum of each row's element hashes, :func:`paritylab.tracing.structure.element_hashes`); what they locate is then
    compared as values, within ``tolerance``."""
    indexes: dict[tuple[torch.dtype, int], _Rows] = {}
    for value, tensor in _held(candidate):
        if value.match is not None or tensor.dim() not in (1, 2):
            continue
        grid = torch.float16 if tensor.dtype == torch.float16 else torch.bfloat16
        if (grid, tensor.dim()) not in indexes:
            indexes[(grid, tensor.dim())] = _Rows(reference, grid, tensor.dim())
        for axis, hashes in enumerate(_row_hashes(tensor, grid)):
            located = indexes[(grid, tensor.dim())].assemble(tensor.movedim(axis, 0), hashes, tolerance)
            if located is not None:
                value.parts, value.distance = located
                break


class _Rows:
    """The row hashes of a recording's ``dim``-D parameters and buffers along each axis (a 1-D value's rows are
    its elements), and where each hash occurs."""

    def __init__(self, recording: Recording, grid: torch.dtype, dim: int) -> None:
        self.recording = recording
        self.hashes: dict[tuple[int, int], list[int]] = {}
        self.where: dict[int, list[tuple[int, int, int]]] = {}
        for value, tensor in _held(recording):
            if tensor.dim() == dim:
                for axis, hashes in enumerate(_row_hashes(tensor, grid)):
                    self.hashes[(value.index, axis)] = hashes
                    for position, digest in enumerate(hashes):
                        self.where.setdefault(digest, []).append((value.index, axis, position))

    def row(self, value: int, axis: int, position: int) -> torch.Tensor:
        tensor = self.recording.tensors[value]
        assert tensor is not None
        return tensor.select(axis, position) if tensor.dim() == 2 else tensor[position]

    def assemble(self, rows: torch.Tensor, hashes: list[int], tolerance: float) -> tuple[list[int], float] | None:
        """The reference values whose rows, in order, make ``rows`` (``rows[i]`` hashing to ``hashes[i]``), and
        the distance between the two; ``None`` when a row is found nowhere or what is found differs as values. The
        row continuing the previous one's value is taken when its hash fits, else the first equal in value."""
        picked: list[tuple[int, int, int]] = []
        for number, digest in enumerate(hashes):
            if picked:
                value, axis, position = picked[-1]
                following = self.hashes[(value, axis)]
                if position + 1 < len(following) and following[position + 1] == digest:
                    picked.append((value, axis, position + 1))
                    continue
            wanted = rows[number]
            found = next(
                (
                    at
                    for at in self.where.get(digest, ())
                    if self.row(*at).numel() == wanted.numel() and _distance(wanted, self.row(*at)) <= tolerance
                ),
                None,
            )
            if found is None:
                return None
            picked.append(found)
        distance = _distance(rows, torch.stack([self.row(*at) for at in picked]).to(rows.dtype))
        return (list(dict.fromkeys(at[0] for at in picked)), distance) if distance <= tolerance else None


def _held(recording: Recording) -> Iterator[tuple[Value, torch.Tensor]]:
    """The recording's floating-point parameters and buffers, with their tensors."""
    for value, tensor in zip(recording.values, recording.tensors, strict=True):
        held = value.op is None and value.origin.startswith(("parameter ", "buffer "))
        if held and tensor is not None and tensor.numel() and tensor.is_floating_point():
            yield value, tensor


def _row_hashes(tensor: torch.Tensor, dtype: torch.dtype) -> list[list[int]]:
    """Per axis of a 2-D tensor, the hash of each row along it (a 1-D tensor: of each element), on the grid of
    ``dtype`` (values rounded to float16 first for a float16 side, as :mod:`paritylab.tracing.structure` does)."""
    from paritylab.tracing.structure import element_hashes

    values = tensor.detach()
    if dtype == torch.float16:
        values = values.to(torch.float16)
    hashed = element_hashes(values)
    if hashed.dim() == 1:
        return [hashed.tolist()]
    return [hashed.sum(dim=1, dtype=torch.int64).tolist(), hashed.sum(dim=0, dtype=torch.int64).tolist()]


def _distance(value: torch.Tensor, other: torch.Tensor) -> float:
    data, _ = _flat(value)
    theirs, other_norm = _flat(other)
    return (
        float(torch.linalg.vector_norm(data - theirs)) / max(other_norm, 1e-30)
        if data.numel() == theirs.numel()
        else math.inf
    )


def _consumers(recording: Recording) -> dict[int, list[Op]]:
    consumers: dict[int, list[Op]] = {}
    for op in recording.ops:
        for number in op.inputs:
            consumers.setdefault(number, []).append(op)
    return consumers


def _live(recording: Recording) -> list[bool]:
    """Per value: whether the call's output depends on it (a child output replaced, or a value never used,
    cannot be where the call goes wrong)."""
    live = [False] * len(recording.values)
    for number in recording.outputs:
        live[number] = True
    for op in reversed(recording.ops):
        if any(live[number] for number in op.outputs):
            for number in op.inputs:
                live[number] = True
    return live


def _clean(recording: Recording) -> list[bool]:
    """Per value: it equals a reference value, or something computed from it does (an intermediate the
    reference never forms), or it is what the call was given (the reference's own values)."""
    values = recording.values
    recovers = [False] * len(values)
    for op in reversed(recording.ops):  # a value recovers when a consumer's output matches or recovers
        if any(values[out].match is not None or recovers[out] for out in op.outputs):
            for number in op.inputs:
                recovers[number] = True
    clean = [
        value.origin.startswith(("input ", "forced "))
        or recording.tensors[value.index] is None
        or value.match is not None
        or bool(value.parts)
        or recovers[value.index]
        or _integral(value)
        for value in values
    ]
    for op in recording.ops:  # moving clean values (a transpose, a cast) makes clean values
        if op.name in _MOVES and all(clean[number] for number in op.inputs):
            for number in op.outputs:
                clean[number] = True
    return clean


def _frontier(candidate: Recording) -> Value | None:
    """The earliest value the call's output depends on that is not clean while everything it was computed
    from is (for a value from outside the call, its first use). A computing operation is preferred over one
    that only moves values."""
    clean, live = _clean(candidate), _live(candidate)
    found: list[tuple[int, int, int]] = []
    for value in candidate.values:
        if clean[value.index] or not live[value.index]:
            continue
        if value.op is None:
            first = _first_use(candidate, value.index)
            if first is not None:
                found.append((first.index, 0, value.index))
            continue
        op = candidate.ops[value.op]
        if all(clean[number] for number in op.inputs):
            found.append((op.index, 1 if op.name in _MOVES else 0, value.index))
    if not found:
        return None
    computing = [item for item in found if item[1] == 0]
    return candidate.values[min(computing or found)[2]]


def _first_use(recording: Recording, number: int) -> Op | None:
    return next((op for op in recording.ops if number in op.inputs), None)


def _integral(value: Value) -> bool:
    return not value.dtype.startswith(("float", "bfloat", "complex"))


def _counterparts(reference: Recording, anchor: Op, equals: dict[int, set[int]]) -> list[Op]:
    """The reference operations that take what ``anchor``'s inputs equal and make something no candidate
    value equals: what the reference does where the candidate goes its own way."""
    wanted = set().union(*(equals.get(n, set()) for n in anchor.inputs))
    seen = set().union(*equals.values())
    live = _live(reference)
    consuming = [
        op
        for op in reference.ops
        if wanted & set(op.inputs) and any(live[n] and not _integral(reference.values[n]) for n in op.outputs)
    ]
    found = [op for op in consuming if any(n not in seen for n in op.outputs)]
    # The same operation on the same inputs is the counterpart even when a candidate value happens to equal its
    # result (an eps of 1e-5 added to a variance near 1 is below the tolerance).
    same = [op for op in found if op.name == anchor.name] or [op for op in consuming if op.name == anchor.name]
    return (same or found)[:4]


def _same_call(candidate: Recording, anchor: Op, other: Op, equals: dict[int, set[int]]) -> bool:
    """``other`` (a reference operation) is ``anchor``'s function applied to what each of its floating-point
    tensor inputs equals: only the constants can differ (an eps, a scale)."""
    floats = [n for n in anchor.inputs if not _integral(candidate.values[n])]
    return other.name == anchor.name and bool(floats) and all(equals.get(n, set()) & set(other.inputs) for n in floats)


def _stretch(
    reference: Recording, candidate: Recording, value: Value, counterparts: list[Op], layout_free: bool, direct: bool
) -> tuple[list[Op], float | None]:
    """The candidate operations from ``value`` to the value nearest a counterpart's result, and that distance
    (``direct``: the counterparts are the operation that made ``value``, which is then the stretch alone)."""
    targets = [
        (n, *_flat(tensor))
        for op in counterparts
        for n in op.outputs
        if (tensor := reference.tensors[n]) is not None and tensor.numel()
    ]
    downstream = _descendants(candidate, value.index)
    if direct:
        downstream = {value.index}
    distance = _Distance(layout_free, _shapes(reference, candidate))
    best, end = math.inf, None
    for number in sorted(downstream):
        tensor = candidate.tensors[number]
        if tensor is None or not tensor.numel() or _integral(candidate.values[number]):
            continue
        data, norm = _flat(tensor)
        for key, other, other_norm in targets:
            found, _ = distance(-1 - number, data, norm, key, other, other_norm, math.inf)
            if found < best:
                best, end = found, number
    if end is None:
        first = candidate.ops[value.op] if value.op is not None else None
        return ([first] if first is not None else []), value.distance
    best = candidate.values[end].distance or best  # its distance to the nearest reference value: the error
    path = _ancestors(candidate, end) & downstream
    operations = sorted({op for n in path if (op := candidate.values[n].op) is not None})
    if value.op is None:  # a parameter or buffer: the stretch starts at its first use
        return [candidate.ops[i] for i in operations], best
    return [candidate.ops[i] for i in operations if i >= value.op], best


def _descendants(recording: Recording, start: int) -> set[int]:
    reached = {start}
    for op in recording.ops:
        if reached & set(op.inputs):
            reached.update(op.outputs)
    return reached


def _ancestors(recording: Recording, end: int) -> set[int]:
    reached = {end}
    for op in reversed(recording.ops):
        if reached & set(op.outputs):
            reached.update(op.inputs)
    return reached


def _describe(
    candidate: Recording, value: Value, operations: list[Op], counterparts: list[Op], distance: float | None
) -> str:
    off = f"{distance:.3g}" if distance is not None and math.isfinite(distance) else "no value of its size"
    theirs = "; ".join(op.arguments + (f" in {op.within}" if op.within else "") for op in counterparts)
    if not operations:
        use = _first_use(candidate, value.index)
        read = f", read by {use.arguments}" if use is not None else ""
        return f"{value.origin} {value.shape} matches no reference value (nearest: {off}){read}"
    first = operations[0]
    where = f" in {first.module}" if first.module else ""
    if first.within:
        where += f" ({first.within}, written out)"
    if value.op is None:
        text = f"{value.origin} {value.shape}{where} matches no reference value: "
    else:
        text = f"the floating-point inputs agree{where}, then "
    if len(operations) == 1:
        text += f"{first.arguments} differs from the reference's result by {off}"
    else:
        shown = " -> ".join(op.arguments for op in operations[:8]) + (" -> ..." if len(operations) > 8 else "")
        text += f"{len(operations)} operations ({shown}) differ from the reference's result by {off}"
    if not counterparts:
        return text + "; the reference has no operation on the same inputs"
    if all(op.name != first.name for op in counterparts):  # not one operation done otherwise: another way
        return text + f"; the two sides compute this differently (on the same inputs the reference computes {theirs})"
    text += f"; the reference computes {theirs}"
    ours = [item for op in operations for item in op.scalars if item != "None"]  # an absent bias, said or not
    reference = [item for op in counterparts for item in op.scalars if item != "None"]
    comparable = [op.name for op in operations] == [op.name for op in counterparts]  # step for step, else not
    if ours != reference and comparable:  # (q and k scaled by d**-0.25 each against q by d**-0.5: not comparable)
        text += f" (constants: {', '.join(ours) or 'none'} vs the reference's {', '.join(reference) or 'none'})"
    return text


def sibling_tensors(model: nn.Module, path: str) -> dict[str, torch.Tensor]:
    """The floating-point parameters and buffers of the module holding ``path`` (by full name), except those of
    ``path`` itself; none when they are many times the module's own (a top-level module's parent is the whole
    model: hashing every row of a 7 B model is not what a fused projection needs)."""
    parent, _, own = path.rpartition(".")
    try:
        holder = model.get_submodule(parent)
    except AttributeError:
        return {}
    named = [(name, tensor) for name, tensor in (*holder.named_parameters(), *holder.named_buffers())]
    mine = sum(t.numel() * t.element_size() for name, t in named if name.startswith(f"{own}."))
    beside = {
        f"{parent}.{name}" if parent else name: tensor
        for name, tensor in named
        if not name.startswith(f"{own}.") and tensor is not None and tensor.is_floating_point()
    }
    size = sum(t.numel() * t.element_size() for t in beside.values())
    return beside if size <= max(_SIBLING_SHARE * mine, _SIBLING_FLOOR) else {}


_SIBLING_SHARE, _SIBLING_FLOOR = 16, 64 * 2**20
"""The siblings a drill-down reads: at most 16 times the drilled module's own bytes, or 64 MiB."""


def split_key(key: str) -> tuple[str, int]:
    """``model.layers.0.mlp#2`` -> (``model.layers.0.mlp``, 2)."""
    path, _, number = key.rpartition("#")
    return path, int(number)


def drill_into(
    reference: nn.Module,
    reference_run: Callable[[nn.Module], Any],
    reference_key: str,
    candidate: nn.Module,
    candidate_run: Callable[[nn.Module], Any],
    candidate_key: str,
    forcing: Callable[[nn.Module], Any],
    dtype: torch.dtype | str,
    own_error: float | None = None,
) -> Drilldown:
    """Record call ``reference_key`` of the reference as it runs, and call ``candidate_key`` of the candidate
    under ``forcing(candidate)`` (a context manager feeding it the reference's values, such as
    :func:`paritylab.comparison.replay.teacher_forcing`), and compare them (:func:`drill_down`).

    A compiled candidate is recorded through its eager module: the operations its source calls, which the
    compiled graph may fuse or reorder (a note says so).
    """
    notes = []
    eager = getattr(candidate, "_orig_mod", None)
    compiled = isinstance(eager, nn.Module)
    if isinstance(eager, nn.Module):
        notes.append("compiled candidate: operations recorded on its eager module (the compiled graph fuses them)")
        candidate = eager
    reference_recording = record_call(reference, *split_key(reference_key), reference_run)
    with forcing(candidate):
        candidate_recording = record_call(candidate, *split_key(candidate_key), candidate_run)
    siblings = sibling_tensors(reference, split_key(reference_key)[0])
    result = drill_down(reference_recording, candidate_recording, dtype, own_error, siblings)
    result.notes[:0] = notes
    if compiled and result.value is None and candidate_recording.called:
        result.message = (
            f"every operation of {candidate_key}'s eager code agrees with the reference: the divergence is made by "
            "the compiled graph itself (graph capture, fusion or lowering), which operations recorded on eager "
            "code cannot show; candidate.backend=aot_eager tells capture from lowering"
        )
    return result
