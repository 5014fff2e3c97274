"""The memory plan: what a run will need, computed before anything real is built, and where it will keep it.

A parity run holds the reference, the candidate and one forward's activations. Before building either model,
:func:`measure_reference` finds the reference's size without allocating it: from the safetensors headers of a
local checkpoint, else by building it on PyTorch's ``meta`` device (shapes and dtypes, no storage), where a
forward also runs in a fraction of a second and gives one forward's peak of live tensors and the bytes a full
trace will write. :func:`plan` then chooses where the models live (both resident, or one at a time, see
:mod:`paritylab.run.resident`) from the memory free on the device, and refuses in one line what cannot fit,
saying what it would need. Nothing here allocates more than a few small CPU tensors.
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from paritylab.run.errors import ConfigError
from paritylab.run.resident import tensor_slots

SHARE = 0.85
"""The share of the free memory a plan may fill: the rest is the allocator's fragmentation, the CUDA context
and kernels' workspaces, and the traced tensors waiting in staging buffers."""

UNKNOWN_FORWARD_SHARE = 0.10
"""When one forward's activations could not be measured on the meta device, this share of the models' size
is set aside for them (a language model's activations at a few hundred tokens are a few percent)."""


@dataclass(frozen=True)
class Sizes:
    """Bytes of one model's tensors (parameters, buffers, tensor attributes), by dtype, without the model."""

    by_dtype: dict[str, int]
    source: str
    """How they were found: ``"meta"`` (built on the meta device), ``"checkpoint"`` (safetensors headers)."""

    @property
    def total(self) -> int:
        return sum(self.by_dtype.values())

    def cast(self, dtype: torch.dtype) -> Sizes:
        """The sizes once every floating-point tensor is converted to ``dtype`` (what ``model.to(dtype)`` does)."""
        converted: dict[str, int] = {}
        for name, size in self.by_dtype.items():
            original = getattr(torch, name)
            if original.is_floating_point:
                key, size = _name(dtype), size // original.itemsize * dtype.itemsize
            else:
                key = name
            converted[key] = converted.get(key, 0) + size
        return Sizes(converted, self.source)


@dataclass(frozen=True)
class Forward:
    """One forward on the meta device: its peak of live tensors (activations) and the bytes of every module's
    outputs (what a full trace writes, each tensor once)."""

    peak: int
    outputs: int


@dataclass(frozen=True)
class MemoryPlan:
    """What the run needs and where the models live; said in the run's notes and ``run.json``."""

    device: str
    free: int | None
    """Bytes free on the device before building (``None``: unknown, then nothing is refused)."""
    reference: int
    candidate: int
    forward: int | None
    """One forward's peak activations (``None``: not measurable on the meta device)."""
    trace: int | None
    """Bytes a full trace of the reference writes (the candidate's is about the same)."""
    resident: str
    """``both`` or ``one``."""
    disk_free: int | None = None

    @property
    def activations(self) -> int:
        if self.forward is not None:
            return self.forward
        return int(UNKNOWN_FORWARD_SHARE * max(self.reference, self.candidate))

    @property
    def needed(self) -> int:
        """Peak bytes on the device with this plan's residency."""
        models = self.reference + self.candidate if self.resident == "both" else max(self.reference, self.candidate)
        return models + self.activations

    def describe(self) -> str:
        forward = f"one forward {_gib(self.forward)}" if self.forward is not None else "one forward not measured"
        free = f"{_gib(self.free)} free" if self.free is not None else "free memory unknown"
        line = (
            f"memory plan on {self.device} ({free}): reference {_gib(self.reference)}, candidate "
            f"{_gib(self.candidate)}, {forward}; {self.resident} resident, needs {_gib(self.needed)}"
        )
        if self.trace is not None:
            line += f"; traces about {_gib(2 * self.trace)} on disk"
            if self.disk_free is not None and 2 * self.trace > self.disk_free:
                line += f" (only {_gib(self.disk_free)} free there: lower compare.max_bytes or set output_dir)"
        return line

    def summary(self) -> dict[str, Any]:
        return {**asdict(self), "needed": self.needed}


def measure_reference(
    build: Callable[[], nn.Module], checkpoint: str | None = None, dtype: torch.dtype | None = None
) -> tuple[nn.Module | None, Sizes | None]:
    """The reference's sizes before it is built: a local safetensors checkpoint's headers (converted to
    ``dtype``), else ``build()`` run on the meta device, which also returns the meta model (for the candidate's
    size and a meta forward). ``(None, None)`` when neither works: the plan is then unknown, never a refusal."""
    if checkpoint:
        sizes = checkpoint_sizes(checkpoint)
        return None, (sizes.cast(dtype) if sizes is not None and dtype is not None else sizes)
    model = on_meta(build)
    return model, (model_sizes(model) if model is not None else None)


def on_meta(build: Callable[[], nn.Module]) -> nn.Module | None:
    """``build()`` with every tensor it creates on the meta device, or ``None`` if it cannot be built there
    (a builder that reads real values, or places tensors on a device itself)."""
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = build()
    except Exception:  # the user's builder: any failure only means the plan is unknown
        return None
    tensors = [tensor for tensor, _ in tensor_slots(model).values()]
    return model if tensors and all(t.is_meta for t in tensors) else None


def model_sizes(model: nn.Module) -> Sizes:
    by_dtype: dict[str, int] = {}
    for tensor, _ in tensor_slots(model).values():
        key = _name(tensor.dtype)
        by_dtype[key] = by_dtype.get(key, 0) + tensor.numel() * tensor.element_size()
    return Sizes(by_dtype, "meta")


def checkpoint_sizes(checkpoint: str) -> Sizes | None:
    """Bytes by dtype read from the headers of the ``*.safetensors`` files of a local checkpoint directory
    (nothing is loaded); ``None`` for a hub id or a checkpoint without safetensors files."""
    from safetensors import safe_open

    directory = Path(checkpoint)
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        return None
    by_dtype: dict[str, int] = {}
    try:
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as opened:
                for key in opened.keys():  # noqa: SIM118 (safe_open is no mapping)
                    piece = opened.get_slice(key)
                    dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype())
                    if dtype is None:
                        return None
                    count = 1
                    for extent in piece.get_shape():
                        count *= extent
                    by_dtype[_name(dtype)] = by_dtype.get(_name(dtype), 0) + count * dtype.itemsize
    except Exception:  # a damaged header: the build will say what is wrong
        return None
    return Sizes(by_dtype, "checkpoint")


def meta_forward(model: nn.Module, run: Callable[[nn.Module], Any]) -> Forward | None:
    """One forward on the meta device: the peak bytes of tensors alive at once (created by the forward: the
    weights are not counted) and the bytes of every module's outputs. ``None`` when the forward cannot run
    there (it reads a value: ``.item()``, data-dependent shapes)."""
    seen: dict[int, weakref.ref[torch.Tensor]] = {}  # held weakly: the forward frees what it no longer needs
    written = [0]

    def record(_: nn.Module, __: Any, output: Any) -> None:
        for value in tree_leaves(output):
            if not isinstance(value, torch.Tensor):
                continue
            known = seen.get(id(value))
            if known is not None and known() is value:  # a module handing its child's output on: traced once
                continue
            seen[id(value)] = weakref.ref(value)  # an id freed and reused by a new tensor is a new output
            written[0] += value.numel() * value.element_size()

    handles = [module.register_forward_hook(record) for module in model.modules()]
    live = _LiveBytes(tensor for tensor, _ in tensor_slots(model).values())
    try:
        with torch.no_grad(), live, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run(model)
    except Exception:  # the user's forward: any failure only means the activations are unknown
        return None
    finally:
        for handle in handles:
            handle.remove()
    return Forward(live.peak, written[0])


def plan(
    reference: int,
    candidate: int,
    forward: Forward | None,
    device: torch.device,
    free: int | None,
    resident: str,
    disk_free: int | None = None,
) -> MemoryPlan:
    """Where the models live, or a :class:`ConfigError` naming what cannot fit.

    ``resident``: ``auto`` chooses ``both`` when both models and a forward fit in :data:`SHARE` of ``free``,
    else ``one`` when the larger model and a forward do; ``both`` and ``one`` are checked as asked. Bytes are
    those on ``device``: with ``resident=one`` a model waiting its turn is a memory-mapped file on the host."""
    candidates = ("both", "one") if resident == "auto" else (resident,)
    trace = forward.outputs if forward is not None else None
    made = [
        MemoryPlan(str(device), free, reference, candidate, forward.peak if forward else None, trace, mode, disk_free)
        for mode in candidates
    ]
    if free is None:
        return made[0]
    for chosen in made:
        if chosen.needed <= SHARE * free:
            return chosen
    raise ConfigError(_refusal(made[-1], resident))


def _refusal(tried: MemoryPlan, resident: str) -> str:
    where = f"{_gib(tried.free)} free on {tried.device}"
    if tried.resident == "both" and resident == "both":
        return (
            f"the reference ({_gib(tried.reference)}) and the candidate ({_gib(tried.candidate)}) with one forward "
            f"need {_gib(tried.needed)}, more than the {where} allows: use resident=one (one model at a time) "
            "or resident=auto, or memory_check=false to try anyway"
        )
    larger = "reference" if tried.reference >= tried.candidate else "candidate"
    remedies = "dtype=bfloat16 (half a float32 reference), a device with more memory"
    if tried.device.startswith("cuda"):
        remedies += ", device=cpu, or candidate=tp (the candidate split over ranks)"
    return (
        f"the {larger} alone ({_gib(max(tried.reference, tried.candidate))}, with one forward "
        f"{_gib(tried.needed)}) does not fit in the {where}, even one model at a time: use {remedies}; "
        "memory_check=false tries anyway"
    )


RANK_PROCESS = 300 * 2**20
"""Resident bytes of one rank's process before its model: the interpreter and torch. Measured (``VmRSS`` of a
fresh process, torch 2.13 on Linux x86-64): ``import torch`` 219 MiB; with ``torch.distributed`` and paritylab's
worker 224 MiB; with transformers and the example TP builder 280 MiB. Rounded up to 300 MiB."""

RANKS_PER_CORE = 2
"""At most this many ranks per core: gloo ranks compute and wait on each other's collectives, and past two a core
a world spends its time switching (64 ranks on 2 cores reached load 75 before their first forward)."""


def cores() -> int:
    """The cores this process may run on (its CPU affinity, else the machine's count)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def plan_ranks(world_size: int, cores: int, free: int | None, weights: int = 0) -> str:
    """Whether ``world_size`` rank processes fit this machine: each is a process of :data:`RANK_PROCESS` bytes
    before its model, plus ``weights`` (every rank reads the reference's whole weights, and a builder typically
    builds the whole model before it shards it), within :data:`SHARE` of ``free``; and at most
    :data:`RANKS_PER_CORE` ranks per core. Returns the plan as one line; a world that does not fit is a
    :class:`ConfigError` saying how many ranks would."""
    per_rank = RANK_PROCESS + weights
    by_cores = max(1, cores * RANKS_PER_CORE)
    by_memory = int(SHARE * free // per_rank) if free is not None else None
    fit = by_cores if by_memory is None else min(by_cores, by_memory)
    needed = world_size * per_rank
    line = (
        f"{world_size} rank processes need about {_gib(needed)} ({_gib(per_rank)} each: interpreter, torch"
        f"{' and the weights' if weights else ''}) on {cores} cores"
    )
    if world_size <= fit:
        return line + (f" ({_gib(free)} free)" if free is not None else "")
    reasons = []
    if world_size > by_cores:
        reasons.append(f"{cores} cores take at most {by_cores} ranks ({RANKS_PER_CORE} per core)")
    if by_memory is not None and world_size > by_memory:
        reasons.append(f"{_gib(free)} free takes at most {by_memory}")
    fits = f"at most {fit} ranks fit here: use candidate.world_size={fit} or fewer" if fit >= 1 else "no rank fits"
    raise ConfigError(f"candidate.world_size={world_size}: {line}, and {' and '.join(reasons)}; {fits}")


def disk_free(directory: Path) -> int | None:
    """Bytes free on the file system of ``directory`` (or its nearest existing parent)."""
    for candidate in (directory, *directory.parents):
        with contextlib.suppress(OSError):
            if candidate.exists():
                return shutil.disk_usage(candidate).free
    return None


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of storages created under it that some tensor still references, and their peak.
    Views and in-place results share a storage counted once; storages that existed before (the weights, the
    inputs: ``excluded``) are not counted; a storage's bytes are freed when its last tensor is collected."""

    def __init__(self, excluded: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._excluded = {_storage_key(tensor) for tensor in excluded}
        self._holders: dict[int, int] = {}

    def __torch_dispatch__(
        self, func: Any, types: Iterable[type], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        for value in tree_leaves(result):
            if isinstance(value, torch.Tensor):
                self._hold(value)
        return result

    def _hold(self, tensor: torch.Tensor) -> None:
        key = _storage_key(tensor)
        if key in self._excluded:
            return
        size = tensor.untyped_storage().nbytes()
        if key not in self._holders:
            self._holders[key] = 0
            self.live += size
            self.peak = max(self.peak, self.live)
        self._holders[key] += 1
        weakref.finalize(tensor, self._release, key, size)

    def _release(self, key: int, size: int) -> None:
        self._holders[key] -= 1
        if not self._holders[key]:
            del self._holders[key]
            self.live -= size


def _storage_key(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage()._cdata)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _gib(size: int | None) -> str:
    """``size`` bytes for people: GiB from 1 GiB, else MiB (a tiny model's plan reads 0.3 MiB, not 0.0 GiB)."""
    if size is None:
        return "?"
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
