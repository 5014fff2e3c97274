"""The tensor-parallel Llama port traced under a launcher paritylab does not control: ``torchrun`` (the same
script runs under Slurm's ``srun`` or on several hosts, with NCCL on GPUs, as long as every rank can write into
``OUT``).

    torchrun --standalone --nproc-per-node 2 -m paritylab.experiments.torchrun_tp OUT [--defect rank1_scaled]
    paritylab-compare OUT/reference OUT/ranks

Rank 0 traces the one-device reference (a seeded tiny Llama) into ``OUT/reference`` and saves its weights; every
rank then builds its share of the port with :func:`paritylab.experiments.tp_llama.build` (``--defect`` plants one
of its :data:`~paritylab.experiments.tp_llama.DEFECTS`) and runs the forward inside
:func:`paritylab.distributed.trace_rank`, which writes ``OUT/ranks/rank<k>``. ``paritylab-compare`` merges the
rank folders, judges the merged trace against the reference and names the module and the rank.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from paritylab.distributed.launch import RankContext, save_tensors, state_dict_of
from paritylab.distributed.rank import trace_rank
from paritylab.tracing.tracer import TraceOptions, Tracer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchrun_tp", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="where the reference and the rank traces go")
    parser.add_argument("--defect", help="a defect of tp_llama.DEFECTS to plant")
    parser.add_argument("--layer", type=int, default=0, help="the decoder layer the defect is planted at")
    args = parser.parse_args(argv)

    from paritylab.experiments.tp_llama import build

    from paritylab.run.references import llama

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    reference = llama(seed=0, hidden_size=32, layers=2, heads=4, vocab_size=128)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    weights = args.out / "weights.safetensors"
    if rank == 0:
        with Tracer(reference, args.out / "reference", TraceOptions(save_tensors=True)):
            reference(input_ids=ids, use_cache=False)
        save_tensors(state_dict_of(reference), weights)
    dist.barrier()  # the weights are written before any rank reads them
    options = {"config": reference.config.to_dict(), "defect": args.defect, "layer": args.layer}
    model = build(RankContext(rank, world_size, options, weights, "gloo"))
    with torch.no_grad(), trace_rank(model, args.out / "ranks"):
        model(input_ids=ids, use_cache=False)
    dist.barrier()  # every rank's trace is complete before any process leaves
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
