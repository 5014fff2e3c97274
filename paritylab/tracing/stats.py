"""Summary statistics of tensors: cheap on the hot path, with one host transfer per device and batch.

Three vectorised reductions give everything: ``sum``, ``dot(x, x)`` and ``aminmax``. ``mean``, ``std``
(population) and ``norm`` derive from them; ``absmax`` from min and max.

- CPU: reading a result costs nothing, so a tensor whose sums are not finite takes a slow exact path:
  NaN and Inf are counted and the other statistics describe its finite elements (so they stay
  meaningful); a sum of squares that overflowed float32 is recomputed in float64.
- Accelerators: everything stays on the device, with no synchronisation per tensor; NaN and Inf are
  counted on the device and propagate into the other statistics.

``std`` is derived as ``sqrt(E[x²] − E[x]²)``: its relative precision drops when ``|mean| ≫ std``.
"""

from __future__ import annotations

import math

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
    total = float(flat.sum())
    squares = float(torch.dot(flat, flat))
    low, high = (float(v) for v in torch.aminmax(flat))
    nan = inf = 0
    if not math.isfinite(total + low + high):
        finite_mask = torch.isfinite(flat)
        nan = int(torch.isnan(flat).sum())
        inf = flat.numel() - nan - int(finite_mask.sum())
        flat = flat[finite_mask]
        if flat.numel() == 0:
            return [math.nan] * 6 + [float(nan), float(inf)]
        total = float(flat.sum())
        squares = float(torch.dot(flat, flat))
        low, high = (float(v) for v in torch.aminmax(flat))
    if not math.isfinite(squares):
        wide = flat.double()
        squares = float(torch.dot(wide, wide))
    return [*_derive(total, squares, low, high, flat.numel()), float(nan), float(inf)]


def device_stats(tensor: torch.Tensor) -> torch.Tensor:
    """The raw sums of a tensor on an accelerator, ``[sum, sum of squares, min, max, nan count, inf count]``, as
    one vector on that device (no sync): eight kernel launches, the least that gives every statistic. The
    statistics are derived from them on the host, once per forward (:meth:`StatsBatch.resolve`): a forward's
    hundreds of tensors would otherwise pay two dozen launches each, which on a GPU costs more than the forward."""
    flat = _flat(tensor)
    if flat.numel() >= _EXACT_COUNT and flat.dtype != torch.float64:
        flat = flat.double()  # counts stay exact past float32's 2**24
    low, high = torch.aminmax(flat)
    nan = torch.isnan(flat).sum(dtype=flat.dtype)
    inf = torch.isinf(flat).sum(dtype=flat.dtype)
    return torch.stack([flat.sum(), torch.dot(flat, flat), low, high, nan, inf])


def _derive(total: float, squares: float, low: float, high: float, count: int) -> list[float]:
    """mean, std, min, max, absmax and norm from the raw sums; NaN in them propagates, as on a device."""
    mean = total / count
    variance = squares / count - mean * mean
    std = math.nan if math.isnan(variance) else math.sqrt(max(variance, 0.0))
    absmax = math.nan if math.isnan(low) or math.isnan(high) else max(abs(low), abs(high))
    return [mean, std, low, high, absmax, math.sqrt(squares) if squares >= 0 else math.nan]


_EXACT_COUNT = 2**24
"""From this many elements a float32 count of NaN or Inf could round: such tensors are summed in float64."""


class StatsBatch:
    """Stats of the tensors seen during a forward; accelerator rows are fetched together at the end."""

    def __init__(self) -> None:
        self._rows: list[list[float] | torch.Tensor] = []
        self._counts: dict[int, int] = {}
        """Element counts of the accelerator rows, by index (their statistics are derived at :meth:`resolve`)."""

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, tensor: torch.Tensor) -> int:
        """Summarise ``tensor``; returns the index of its row in :meth:`resolve`."""
        if tensor.device.type == "cpu":
            self._rows.append(cpu_stats(tensor))
        else:
            self._counts[len(self._rows)] = tensor.numel()
            self._rows.append(device_stats(tensor))
        return len(self._rows) - 1

    def resolve(self) -> list[dict[str, float | None]]:
        """All rows as dicts in the order added: one transfer per accelerator device."""
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for index, row in enumerate(self._rows):
            if isinstance(row, torch.Tensor):
                groups.setdefault((row.device, row.dtype), []).append(index)
        for indices in groups.values():
            fetched = torch.stack([self._rows[i] for i in indices]).double().cpu().tolist()  # type: ignore[misc]
            for i, (total, squares, low, high, nan, inf) in zip(indices, fetched, strict=True):
                self._rows[i] = [*_derive(total, squares, low, high, self._counts[i]), nan, inf]
        rows, self._rows, self._counts = self._rows, [], {}
        return [stats_dict(row) for row in rows]  # type: ignore[arg-type]


def stats_dict(row: list[float]) -> dict[str, float | None]:
    """Name the values of one stats row: counts become ints, undefined values (all non-finite) ``None``."""
    named: dict[str, float | None] = {k: v if math.isfinite(v) else None for k, v in zip(STAT_NAMES, row, strict=True)}
    named["nan"] = int(row[6]) if math.isfinite(row[6]) else 0
    named["inf"] = int(row[7]) if math.isfinite(row[7]) else 0
    return named
