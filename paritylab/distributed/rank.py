"""Trace one rank of a distributed candidate, whoever launched it: paritylab's own launcher (:mod:`.worker`),
``torchrun``, Slurm, or several hosts with NCCL.

>>> dist.init_process_group("nccl")                        # under torchrun, on every rank
>>> with trace_rank(model, "traces/tp"):                   # writes traces/tp/rank<k>/
...     model(input_ids)

Every rank writes its trace (tensors saved, rank and world size in the meta, the fingerprints of its own tensors:
a DTensor's local shard) and the
DTensor placements it sees at module boundaries into ``directory/rank<k>``; a shared filesystem, or copying the
rank folders together, then lets :func:`paritylab.distributed.compare_ranks` or ``paritylab-compare REFERENCE
directory`` merge the ranks and judge them against a one-device reference.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paritylab.distributed.placements import PlacementRecorder
from paritylab.tracing.tracefile import TRACE_FILE, Trace
from paritylab.tracing.tracer import TraceOptions, Tracer

RANK_PREFIX = "rank"


def rank_directory(directory: str | Path, rank: int) -> Path:
    """Where rank ``rank`` writes its trace under ``directory``."""
    return Path(directory) / f"{RANK_PREFIX}{rank}"


def rank_directories(directory: str | Path) -> list[Path] | None:
    """The rank folders ``rank0`` ... ``rank<n-1>`` under ``directory`` that hold traces, in rank order; ``None``
    when there is no ``rank0`` trace (not a folder of rank traces). Raises one line when ranks are missing."""
    root = Path(directory)
    if not (rank_directory(root, 0) / TRACE_FILE).is_file():
        return None
    found = sorted(
        int(path.name.removeprefix(RANK_PREFIX))
        for path in root.glob(f"{RANK_PREFIX}*")
        if path.name.removeprefix(RANK_PREFIX).isdigit() and (path / TRACE_FILE).is_file()
    )
    expected = list(range(found[-1] + 1))
    if found != expected:
        missing = ", ".join(str(rank) for rank in expected if rank not in found)
        raise ValueError(f"{root} holds rank traces up to rank{found[-1]} but none for rank {missing}: copy every "
                         "rank's folder there")  # fmt: skip
    return [rank_directory(root, rank) for rank in found]


def rank_trace_options(
    rank: int, world_size: int, options: Mapping[str, Any] | None = None, **metadata: str
) -> TraceOptions:
    """A rank's trace options: ``options`` (``TraceOptions`` fields; ``save_dtype`` may name a dtype) with tensors
    saved, rank and world size (and ``metadata``) in the meta, and the fingerprints of the rank's own tensors (a
    DTensor parameter's local shard: :mod:`.rank_weights` matches them with the reference's)."""
    given = dict(options or {})
    saved = given.pop("save_dtype", None)
    if isinstance(saved, str):
        given["save_dtype"] = getattr(torch, saved)
    elif saved is not None:
        given["save_dtype"] = saved
    meta = {str(key): str(value) for key, value in dict(given.pop("metadata", {}) or {}).items()}
    meta.update({key: str(value) for key, value in metadata.items()}, rank=str(rank), world_size=str(world_size))
    return TraceOptions(**{**given, "save_tensors": True, "fingerprint": True, "metadata": meta})


def current_rank() -> tuple[int, int]:
    """This process's rank and world size: from the initialised process group, else from the ``RANK`` and
    ``WORLD_SIZE`` environment variables ``torchrun`` sets; raises one line when neither says."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, size = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or size is None:
        raise ValueError(
            "trace_rank: no process group is initialised and RANK/WORLD_SIZE are not set: call "
            "torch.distributed.init_process_group first (or launch with torchrun), or pass rank= and world_size="
        )
    return int(rank), int(size)


@contextmanager
def trace_rank(
    model: nn.Module,
    directory: str | Path,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    options: Mapping[str, Any] | None = None,
    folder: str | Path | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Iterator[Trace]:
    """Trace the forward(s) run inside the block as rank ``rank`` of ``world_size`` (default: this process's,
    :func:`current_rank`) into ``directory/rank<k>`` (``folder``: exactly there instead), placements included.
    ``options``: ``TraceOptions`` fields (``include``, ``max_depth``, ``save_dtype``, ``metadata``, ...);
    ``metadata``: more strings for the trace's meta."""
    if rank is None or world_size is None:
        found_rank, found_size = current_rank()
        rank = found_rank if rank is None else rank
        world_size = found_size if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"trace_rank: rank {rank} is not in 0..{world_size - 1} (world size {world_size})")
    target = Path(folder) if folder is not None else rank_directory(directory, rank)
    import torch.distributed as dist

    extra = dict(metadata or {})
    if "backend" not in extra and dist.is_available() and dist.is_initialized():
        extra["backend"] = str(dist.get_backend())
    tracer = Tracer(model, target, rank_trace_options(rank, world_size, options, **extra))
    with PlacementRecorder(model, target), tracer as trace:
        yield trace
