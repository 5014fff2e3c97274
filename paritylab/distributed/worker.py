"""One rank of a distributed candidate: ``python -m paritylab.distributed.worker <launch.json> <rank>``.

Joins the process group (the launcher's store), builds the rank's share of the candidate with the user's
builder, runs the forward under :func:`~paritylab.distributed.rank.trace_rank` into ``rank<k>/`` (rank and
world size in the trace's meta) and records the DTensor placements it sees at module boundaries
(:mod:`paritylab.distributed.placements`). ``status.json`` says how far it got at every step, so a rank that
is stopped or dies can still be described; a failure also ends the process at once (``os._exit``), so the
peers' collectives fail instead of waiting for a rank that will never join them.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paritylab.distributed.launch import (
    INPUTS_FILE,
    STATUS_FILE,
    WEIGHTS_FILE,
    LaunchSpec,
    RankContext,
    load_tensors,
    resolve,
    unknown_option,
)
from paritylab.distributed.rank import trace_rank
from paritylab.tracing.files import write_json
from paritylab.tracing.tracefile import Trace


class _Status:
    """Writes a variant's ``status.json`` as the rank moves through its phases."""

    def __init__(self, folder: Path, rank: int) -> None:
        self.path = folder / STATUS_FILE
        self.rank = rank
        self.phase = "start"
        self.started: dict[str, float] = {"start": time.time()}
        """When each phase began (wall clock): where a rank's time goes."""

    def enter(self, phase: str) -> None:
        self.phase = phase
        self.started[phase] = time.time()
        write_json(self.path, {"rank": self.rank, "status": "running", "phase": phase, "started": self.started})

    def finish(
        self, error: BaseException | str | None = None, module: str | None = None, consequence: bool = False
    ) -> None:
        outcome = "ok" if error is None else "error"
        document: dict[str, Any] = {"rank": self.rank, "status": outcome, "phase": self.phase, "started": self.started}
        if error is not None:
            text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
            document.update(error=text[:2000], module=module, time=time.time(), consequence=consequence)
        write_json(self.path, document)


def run(spec: LaunchSpec, rank: int) -> None:
    """Join the group, then build, trace and save every variant in turn (raises what a builder or a forward
    raises, after writing it into that variant's ``status.json``)."""
    import torch.distributed as dist

    statuses = {variant: _Status(spec.rank_directory(rank, variant), rank) for variant in spec.variant_names}
    try:
        for status in statuses.values():
            status.enter("init")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        store = dist.TCPStore(os.environ["MASTER_ADDR"], spec.port, spec.world_size + 1, False, timeout=timeout)
        if spec.backend == "nccl":  # one device per rank, before the group is made (its collectives use it)
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(spec.backend, store=store, rank=rank, world_size=spec.world_size, timeout=timeout)
    except BaseException as error:
        for status in statuses.values():
            status.finish(error)
        raise
    mesh: Any = None
    for position, (variant, status) in enumerate(statuses.items()):
        context = RankContext(rank, spec.world_size, spec.options_for(variant), _weights(spec), spec.backend, mesh)
        try:
            _run_variant(spec, rank, variant, status, context)
        except BaseException:
            for later in list(statuses.values())[position + 1 :]:
                later.finish(f"not run: variant {variant} failed on this rank first", consequence=True)
            raise
        mesh = context._mesh  # one mesh for all variants
    dist.destroy_process_group()


def _run_variant(spec: LaunchSpec, rank: int, variant: str | None, status: _Status, context: RankContext) -> None:
    folder = spec.rank_directory(rank, variant)
    trace: Trace | None = None
    try:
        status.enter("build")
        builder = resolve(spec.builder)
        unknown = unknown_option(builder, spec.builder, context.options)
        if unknown is not None:
            raise ValueError(f"options.{unknown}")
        model = builder(context)
        if not isinstance(model, nn.Module):
            raise TypeError(f"builder {spec.builder} returned {type(model).__name__}, not an nn.Module")
        inputs = {name: value.to(context.device) for name, value in load_tensors(spec.directory / INPUTS_FILE).items()}
        call = resolve(spec.call, "call") if spec.call else None
        status.enter("forward")
        metadata = {"backend": spec.backend, "builder": spec.builder}
        with trace_rank(model, spec.directory, rank=rank, world_size=spec.world_size, options=spec.trace,
                        folder=folder, metadata=metadata) as trace:  # fmt: skip
            if call is not None:
                call(model, inputs, **spec.call_kwargs)
            else:
                model(**inputs, **spec.call_kwargs)
        status.enter("done")
        status.finish()
    except BaseException as error:
        raised = trace.meta.get("error") if trace is not None else None
        status.finish(error, raised.get("module") if isinstance(raised, dict) else None)
        raise


def _weights(spec: LaunchSpec) -> Path | None:
    weights = spec.directory / WEIGHTS_FILE
    return weights if weights.is_file() else None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m paritylab.distributed.worker <launch.json> <rank>", file=sys.stderr)
        return 2
    spec = LaunchSpec.read(Path(args[0]))
    try:
        run(spec, int(args[1]))
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # no atexit: a process group's teardown must not wait on peers that are gone
    return 0


if __name__ == "__main__":
    sys.exit(main())
