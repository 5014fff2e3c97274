"""Summary statistics of tensors, computed on their device and fetched with one host sync per batch."""

from __future__ import annotations

import math

import torch

STAT_NAMES: tuple[str, ...] = ("mean", "std", "min", "max", "absmax", "norm", "nan", "inf")
"""Order of the statistics in a stats vector. ``std`` is the population standard deviation."""

_EXACT_DTYPES = (torch.float32, torch.float64)


def supports_stats(tensor: torch.Tensor) -> bool:
    """Whether :func:`stats_vector` can summarise ``tensor`` (dense, real, with data)."""
    return (
        tensor.layout == torch.strided
        and not tensor.is_complex()
        and not tensor.is_meta
        and not tensor.is_quantized
        and tensor.numel() > 0
    )


def stats_vector(tensor: torch.Tensor) -> torch.Tensor:
    """The statistics of ``tensor`` as a float64 vector on its device, in :data:`STAT_NAMES` order.

    Three passes over the data (``std_mean``, ``aminmax``, ``isfinite``) and no host synchronisation.
    ``absmax`` and ``norm`` are derived from the others. NaN and Inf are counted exactly.
    """
    x = tensor.detach()
    if x.dtype not in _EXACT_DTYPES:
        x = x.float()
    std, mean = torch.std_mean(x, correction=0)
    low, high = torch.aminmax(x)
    count = x.numel()
    nonfinite = count - torch.count_nonzero(torch.isfinite(x))
    nan = torch.count_nonzero(torch.isnan(x)) if x.dtype.is_floating_point else torch.zeros_like(nonfinite)
    summary = torch.stack([mean, std, low, high]).double()
    absmax = torch.maximum(summary[2].abs(), summary[3].abs())
    norm = torch.sqrt(count * (summary[1] ** 2 + summary[0] ** 2))
    return torch.cat([summary, torch.stack([absmax, norm]), torch.stack([nan, nonfinite - nan]).double()])


class StatsBatch:
    """Collects stats vectors during a forward and materialises them all with one transfer per device."""

    def __init__(self) -> None:
        self._pending: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, tensor: torch.Tensor) -> int:
        """Queue the stats of ``tensor``; returns the index to look them up by after :meth:`resolve`."""
        self._pending.append(stats_vector(tensor))
        return len(self._pending) - 1

    def resolve(self) -> list[dict[str, float]]:
        """All queued stats as dicts, in the order they were added (one host sync per device)."""
        by_device: dict[torch.device, list[int]] = {}
        for index, vector in enumerate(self._pending):
            by_device.setdefault(vector.device, []).append(index)
        rows: list[list[float]] = [[] for _ in self._pending]
        for indices in by_device.values():
            values = torch.stack([self._pending[i] for i in indices]).cpu().tolist()
            for i, row in zip(indices, values, strict=True):
                rows[i] = row
        self._pending.clear()
        return [stats_dict(row) for row in rows]


def stats_dict(row: list[float]) -> dict[str, float]:
    """Name the values of one stats vector; counts become ints, non-finite floats stay floats."""
    named = dict(zip(STAT_NAMES, row, strict=True))
    named["nan"] = int(named["nan"])
    named["inf"] = int(named["inf"])
    return named


def finite_or_none(value: float) -> float | None:
    """JSON has no NaN/Inf: map them to None."""
    return value if math.isfinite(value) else None
