"""transformers' Llama sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``), built on every rank by
:func:`build` (a ``"module:function"`` builder for :func:`paritylab.distributed.check_distributed`).

Each decoder layer and then the whole model are ``fully_shard``-ed over a 1-D mesh: every parameter is a DTensor
holding one rank's ``Shard(0)`` rows, all-gathered for the forward and freed after it. Fed the same inputs, every
rank computes the whole model, so every activation is replicated across ranks and must equal the reference's.
``options["defect"]``: ``rank1_scaled`` (rank 1 alone scales layer ``options["layer"]``'s ``down_proj`` output
by 1.5, as a rank-local hook would) or ``wrong_shard`` (rank 1 loads rank 0's rows of that layer's
``gate_proj`` weight before sharding: what a checkpoint split in the wrong order gives).
"""

from __future__ import annotations

import torch
from torch import nn

from paritylab.distributed.launch import RankContext, takes_options

DEFECTS = {
    "rank1_scaled": "rank 1 alone scales down_proj's output by 1.5",
    "wrong_shard": "rank 1 holds rank 0's rows of gate_proj's weight",
}


@takes_options("defect", "layer")
def build(context: RankContext) -> nn.Module:
    """The rank's FSDP2-sharded Llama with the reference's weights; ``options["defect"]`` plants a bug."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import LlamaConfig, LlamaForCausalLM

    options = context.options
    defect, layer = options.get("defect"), int(options.get("layer", 0))
    if defect is not None and defect not in DEFECTS:
        raise ValueError(f"unknown defect {defect!r}; known: {', '.join(DEFECTS)}")
    model = LlamaForCausalLM(LlamaConfig.from_dict(dict(options["config"]))).eval()
    model.load_state_dict(context.state_dict())
    mesh = context.mesh()
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    target = model.model.layers[layer].mlp
    if defect == "rank1_scaled" and context.rank == 1:
        target.down_proj.register_forward_hook(lambda module, args, output: output * 1.5)
    elif defect == "wrong_shard":
        weight = target.gate_proj.weight
        assert isinstance(weight, DTensor)
        local = weight.to_local()
        with torch.no_grad():  # every rank gets rank 0's rows: rank 1's shard is wrong
            rows = weight.full_tensor()[: local.shape[0]]
            local.copy_(rows)
    return model
