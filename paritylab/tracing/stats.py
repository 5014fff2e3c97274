"""Summary statistics of tensors: cheap on the hot path, with one host transfer per device and batch.

Three vectorised reductions give everything: ``sum``, ``dot(x, x)`` and ``aminmax``. ``mean``, ``std``
(population) and ``norm`` derive from them; ``absmax`` from min and max.

- CPU: reading a result costs nothing, so a tensor whose sums are not finite takes a slow exact path:
  NaN and Inf are counted and the other statistics describe its finite elements (so they stay
  meaningful); a sum of squares that overflowed float32 is recomputed in float64.
- Accelerators: everything stays on the device, with no synchronisation per tensor and one kernel launch
  per tensor (:class:`StatsBatch` stages tensors into a buffer and reduces many at once); NaN and Inf are
  counted on the device and propagate into the other statistics. Results are read back once per forward.

``std`` is derived as ``sqrt(E[x²] − E[x]²)``: its relative precision drops when ``|mean| ≫ std``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

STAT_NAMES: tuple[str, ...] = ("mean", "std", "min", "max", "absmax", "norm", "nan", "inf")
"""Order of the statistics in a stats row."""

_ACCUMULATE = (torch.float32, torch.float64)


def supports_stats(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` can be summarised (dense, real, with data)."""
    return (
        tensor.layout == torch.strided
        and not tensor.is_complex()
        and not tensor.is_meta
        and not tensor.is_quantized
        and tensor.numel() > 0
    )


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    return flat if flat.dtype in _ACCUMULATE else flat.float()


def cpu_stats(tensor: torch.Tensor) -> list[float]:
    """Stats row of a CPU tensor (see the module docstring for the exact/slow path)."""
    flat = _flat(tensor)
    total, squares, low, high = _sums(flat)
    nan = inf = 0
    if not math.isfinite(total + low + high):
        finite_mask = torch.isfinite(flat)
        nan = int(torch.isnan(flat).sum())
        inf = flat.numel() - nan - int(finite_mask.sum())
        flat = flat[finite_mask]
        if flat.numel() == 0:
            return [math.nan] * 6 + [float(nan), float(inf)]
        total, squares, low, high = _sums(flat)
    if not math.isfinite(squares):
        wide = flat.double()
        squares = float(torch.dot(wide, wide))
    return [*_derive(total, squares, low, high, flat.numel()), float(nan), float(inf)]


def _sums(flat: torch.Tensor) -> list[float]:
    """``[sum, sum of squares, min, max]`` of a flat tensor, read back in one transfer."""
    low, high = torch.aminmax(flat)
    return torch.stack([flat.sum(), torch.dot(flat, flat), low, high]).tolist()


def device_stats(tensor: torch.Tensor) -> torch.Tensor:
    """The raw sums of one tensor, ``[sum, sum of squares, min, max, nan count, inf count]``, as one vector on its
    device (no sync): eight kernel launches. :class:`StatsBatch` stages a forward's tensors instead (one launch
    each); this is its path for a tensor too large to stage."""
    flat = _flat(tensor)
    if flat.numel() >= _EXACT_COUNT and flat.dtype != torch.float64:
        flat = flat.double()  # counts stay exact past float32's 2**24
    low, high = torch.aminmax(flat)
    nan = torch.isnan(flat).sum(dtype=flat.dtype)
    inf = torch.isinf(flat).sum(dtype=flat.dtype)
    return torch.stack([flat.sum(), torch.dot(flat, flat), low, high, nan, inf])


def segment_stats(data: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The raw sums of many tensors laid end to end in ``data``, ``lengths`` elements each (every one above zero,
    adding up to ``data``'s length: not checked, since a check would wait for the device): one row ``[sum, sum of
    squares, min, max, nan count, inf count]`` per tensor, with a fixed number of kernel launches however many
    tensors there are. Sums are taken in float64; NaN and Inf propagate, as on a device."""

    def reduce(values: torch.Tensor, how: str) -> torch.Tensor:  # unsafe: no check of the lengths (a device sync)
        return torch.segment_reduce(values, how, lengths=lengths, unsafe=True)

    low, high = reduce(data, "min"), reduce(data, "max")
    nan = reduce(torch.isnan(data).to(data.dtype), "sum")  # exact: fewer than 2**24 elements per tensor
    inf = reduce(torch.isinf(data).to(data.dtype), "sum")
    wide = data.double()
    total = reduce(wide, "sum")
    squares = reduce(wide.mul_(wide), "sum")  # in place: one float64 copy of the buffer at a time
    return torch.stack([total, squares, low.double(), high.double(), nan.double(), inf.double()], dim=1)


def _derive(total: float, squares: float, low: float, high: float, count: int) -> list[float]:
    """mean, std, min, max, absmax and norm from the raw sums; NaN in them propagates, as on a device."""
    mean = total / count
    variance = squares / count - mean * mean
    std = math.nan if math.isnan(variance) else math.sqrt(max(variance, 0.0))
    absmax = math.nan if math.isnan(low) or math.isnan(high) else max(abs(low), abs(high))
    return [mean, std, low, high, absmax, math.sqrt(squares) if squares >= 0 else math.nan]


_EXACT_COUNT = 2**24
"""From this many elements a float32 count of NaN or Inf could round: such tensors are summed in float64."""


STAGING_BYTES = 16 << 20
"""Bytes of one staging buffer (per device and accumulation dtype) of :class:`StatsBatch`. Measured on an H200
(llava-bench, 248 tensors per forward): 15 buffers of 16 MiB cost 11 ms of host time and 10.7 ms of device time
per forward; 4 of 64 MiB cost less host time but 17.4 ms of device time (``segment_reduce`` reduces each segment
in one thread block, so its time grows with the tensors' size), for the same wall time (3.50x and 3.47x the plain
forward). The smaller buffer keeps the device's share low where the forward, not the host, is the bottleneck."""


@dataclass
class _Staging:
    """Tensors copied end to end into one buffer on their device, waiting for one set of segment reductions."""

    key: tuple[torch.device, torch.dtype]
    buffer: torch.Tensor
    rows: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    used: int = 0


class StatsBatch:
    """Stats of the tensors seen during a forward, read back to the host once, at :meth:`resolve`.

    CPU tensors are summarised at once (reading a result there costs nothing). A tensor on an accelerator is
    *staged*: copied, in one kernel launch whatever its layout or floating dtype, into the next free slice of a
    buffer of :data:`STAGING_BYTES` on its device (the copy is also a snapshot: code that changes the tensor in
    place later cannot change its statistics). A full buffer is reduced with a fixed number of segment
    reductions (:func:`segment_stats`) for all the tensors in it, on the device, without a sync, so the cost follows
    the number of tensors (one launch each) plus one reduction per buffer, not eight launches per tensor. Tensors
    too large to stage take :func:`device_stats`. ``staged=True`` stages CPU tensors too (the tests' way to run
    the accelerator path on a CPU)."""

    def __init__(self, staged: bool = False, staging_bytes: int = STAGING_BYTES) -> None:
        self._staged = staged
        self._staging_bytes = staging_bytes
        self._rows: list[list[float] | None] = []
        self._raw: list[tuple[list[int], torch.Tensor]] = []
        """Rows of raw sums still on their device: (row indices, a tensor of one row per index)."""
        self._counts: dict[int, int] = {}
        """Element counts of the rows summarised on a device (their statistics are derived at :meth:`resolve`)."""
        self._staging: dict[tuple[torch.device, torch.dtype], _Staging] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, tensor: torch.Tensor) -> int:
        """Summarise ``tensor``; returns the index of its row in :meth:`resolve`."""
        index = len(self._rows)
        if tensor.device.type == "cpu" and not self._staged:
            self._rows.append(cpu_stats(tensor))
            return index
        self._rows.append(None)
        count = tensor.numel()
        self._counts[index] = count
        dtype = torch.float64 if tensor.dtype == torch.float64 else torch.float32
        if count >= _EXACT_COUNT or count * dtype.itemsize > self._staging_bytes:
            self._raw.append(([index], device_stats(tensor).double().unsqueeze(0)))
            return index
        key = (tensor.device, dtype)
        staging = self._staging.get(key)
        if staging is not None and staging.used + count > staging.buffer.numel():
            self._reduce(staging)
            staging = None
        if staging is None:
            buffer = torch.empty(self._staging_bytes // dtype.itemsize, dtype=dtype, device=tensor.device)
            staging = self._staging[key] = _Staging(key, buffer)
        strides = _contiguous_strides(tensor.shape)
        staging.buffer.as_strided(tensor.shape, strides, staging.used).copy_(tensor.detach())  # two host calls
        staging.rows.append(index)
        staging.lengths.append(count)
        staging.used += count
        return index

    def _reduce(self, staging: _Staging) -> None:
        """Queue the reductions of a staging buffer's tensors; the buffer is then released (a new one is made)."""
        lengths = torch.tensor(staging.lengths, dtype=torch.long).to(staging.buffer.device, non_blocking=True)
        raw = segment_stats(staging.buffer[: staging.used], lengths)
        self._raw.append((staging.rows, raw))
        del self._staging[staging.key]

    def resolve(self) -> list[dict[str, float | None]]:
        """All rows as dicts in the order added: one transfer per accelerator device."""
        for staging in list(self._staging.values()):
            self._reduce(staging)
        by_device: dict[torch.device, list[tuple[list[int], torch.Tensor]]] = {}
        for indices, raw in self._raw:
            by_device.setdefault(raw.device, []).append((indices, raw))
        for pieces in by_device.values():
            fetched = torch.cat([raw for _, raw in pieces]).cpu().tolist()
            indices = [index for chunk, _ in pieces for index in chunk]
            for i, (total, squares, low, high, nan, inf) in zip(indices, fetched, strict=True):
                self._rows[i] = [*_derive(total, squares, low, high, self._counts[i]), nan, inf]
        rows, self._rows, self._raw, self._counts = self._rows, [], [], {}
        return [stats_dict(_resolved(row)) for row in rows]


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _resolved(row: list[float] | None) -> list[float]:
    if row is None:
        raise AssertionError("a stats row was never reduced")
    return row


def stats_dict(row: list[float]) -> dict[str, float | None]:
    """Name the values of one stats row: counts become ints, undefined values (all non-finite) ``None``."""
    named: dict[str, float | None] = {k: v if math.isfinite(v) else None for k, v in zip(STAT_NAMES, row, strict=True)}
    named["nan"] = int(row[6]) if math.isfinite(row[6]) else 0
    named["inf"] = int(row[7]) if math.isfinite(row[7]) else 0
    return named
