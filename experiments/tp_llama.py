"""A tensor-parallel port of transformers' Llama, built on every rank by :func:`build` (a ``"module:function"``
builder for :func:`paritylab.distributed.check_distributed`, and ``candidate=tp``'s: ``python -m paritylab
model=llama candidate=tp``, which names it ``paritylab.experiments.tp_llama:build`` so that it imports from a
checkout and from the wheel alike).

The port is the one PyTorch documents: ``torch.distributed.tensor.parallel.parallelize_module`` over a 1-D
device mesh, with ``ColwiseParallel`` on the q/k/v and gate/up projections (each rank computes its own heads and
its own slice of the MLP's hidden units) and ``RowwiseParallel`` on o_proj and down_proj (each rank multiplies
its slice and an all-reduce sums them). transformers' attention reshapes with ``-1`` heads, so it runs on the
rank's local heads unchanged; nothing else is sharded. The attention heads and the intermediate size must
divide by the world size.

``options["mesh"] = [dp, tp]`` runs it on a 2-D mesh: tensor parallel over ``tp`` consecutive ranks, inside
``dp`` replicas fed the same inputs.

``options["defect"]`` plants one of the bugs that live in a split (``DEFECTS``), so the test suite and a reader
can see what paritylab says about each; without it (or ``null``) the port is correct. On the command line:
``+candidate.options.defect=rank1_scaled +candidate.options.layer=1``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from paritylab.distributed.launch import RankContext, takes_options

DEFECTS = {
    "missing_all_reduce": "o_proj's partial products are returned without the all-reduce that sums them",
    "bias_every_rank": "down_proj's bias is added on every rank before the all-reduce (counted world_size times)",
    "swapped_gate_shards": "rank r holds gate_proj's shard world_size-1-r (the shards of the split are swapped)",
    "rank1_scaled": "rank 1 alone scales down_proj's (reduced) output by 1.5 (options['scale']), as a stray rank-local "
    "hook would",
    "rank1_up_scaled": "rank 1 alone scales its shard of up_proj's output by 1.01 (options['scale']): a rank-local "
    "error",
    "rank1_raises": "rank 1 alone raises in down_proj's forward",
}
"""Planted defects (``options["defect"]``) and what each does; ``options["layer"]`` picks the decoder layer
(default 0), ``options["scale"]`` the factor of ``rank1_scaled`` and ``rank1_up_scaled``."""


def tp_plan(num_layers: int, *, defect: str | None = None, layer: int = 0) -> dict[str, ParallelStyle]:
    """The Megatron-style plan for every decoder layer: column-parallel q/k/v and gate/up, row-parallel o/down.
    ``defect="missing_all_reduce"`` declares layer ``layer``'s o_proj output partial (so it is never reduced)."""
    plan: dict[str, ParallelStyle] = {}
    for index in range(num_layers):
        prefix = f"model.layers.{index}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{prefix}.{name}"] = ColwiseParallel()
        plan[f"{prefix}.mlp.down_proj"] = RowwiseParallel()
        missing = defect == "missing_all_reduce" and index == layer
        plan[f"{prefix}.self_attn.o_proj"] = RowwiseParallel(output_layouts=Partial()) if missing else RowwiseParallel()
    return plan


@takes_options("defect", "layer", "mesh", "scale")
def build(context: RankContext) -> nn.Module:
    """The rank's share of a Llama whose config is ``options["config"]`` (a ``LlamaConfig.to_dict()``) and whose
    weights are the reference's (``context.state_dict()``), parallelised over all ranks; ``options["defect"]``
    plants a bug (:data:`DEFECTS`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    options = context.options
    defect = options.get("defect")
    if defect is not None and defect not in DEFECTS:
        raise ValueError(f"unknown defect {defect!r}; known: {', '.join(DEFECTS)}")
    layer = int(options.get("layer", 0))
    given = dict(options["config"])
    if given.get("model_type") != "llama":
        raise ValueError(
            f"tp_llama builds transformers' Llama, and options['config'] is a {given.get('model_type')!r} model's "
            "config: give it a Llama reference (python -m paritylab model=llama candidate=tp)"
        )
    config = LlamaConfig.from_dict(given)
    mesh = _tp_mesh(context, options.get("mesh"))
    size = mesh.size()
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % size or kv_heads % size or config.intermediate_size % size:
        raise ValueError(
            f"{heads} attention heads, {kv_heads} key/value heads and an intermediate size of "
            f"{config.intermediate_size} must all divide by the tensor-parallel size {size}"
        )
    weights = context.state_dict()
    model = LlamaForCausalLM(config).eval()
    model.load_state_dict(weights)
    model.to(next(iter(weights.values())).dtype)  # the reference's dtype: a bfloat16 reference gets a bfloat16 port
    model.to(context.device)
    parallelize_module(model, mesh, tp_plan(config.num_hidden_layers, defect=defect, layer=layer))
    block = model.model.layers[layer]
    if defect == "bias_every_rank":
        _bias_on_every_rank(block.mlp.down_proj, context)
    elif defect == "swapped_gate_shards":
        _swap_shards(block.mlp.gate_proj, context)
    elif defect == "rank1_scaled" and context.rank == 1:
        factor = float(options.get("scale", 1.5))
        block.mlp.down_proj.register_forward_hook(lambda module, args, output: output * factor)
    elif defect == "rank1_up_scaled" and context.rank == 1:
        factor = float(options.get("scale", 1.01))
        block.mlp.up_proj.register_forward_hook(lambda module, args, output: output * factor)
    elif defect == "rank1_raises" and context.rank == 1:
        block.mlp.down_proj.register_forward_pre_hook(_raise)
    return model


def _tp_mesh(context: RankContext, shape: Any) -> Any:
    """The tensor-parallel mesh: all ranks (1-D, the default), or with ``options["mesh"] = [dp, tp]`` the ``tp``
    dimension of a 2-D ``(dp, tp)`` mesh (tensor parallel inside ``dp`` replicas, consecutive ranks sharding)."""
    if shape is None:
        return context.mesh()
    from torch.distributed.device_mesh import init_device_mesh

    sizes = tuple(int(item) for item in shape)
    if len(sizes) != 2 or sizes[0] * sizes[1] != context.world_size:
        raise ValueError(f"options['mesh']={list(shape)} must be [dp, tp] with dp * tp = {context.world_size} ranks")
    return init_device_mesh(context.device.type, sizes, mesh_dim_names=("dp", "tp"))["tp"]


def _bias_on_every_rank(linear: nn.Module, context: RankContext) -> None:
    """Make the row-parallel ``linear``'s bias a partial sum of full copies: every rank adds the whole bias to its
    partial product, and the all-reduce then sums world_size biases (RowwiseParallel keeps it replicated, so it
    is added once)."""
    bias = linear.bias
    if not isinstance(bias, DTensor):
        raise ValueError("bias_every_rank needs a row-parallel linear with a bias (LlamaConfig(mlp_bias=True))")
    whole = bias.full_tensor().detach()
    partial = DTensor.from_local(whole, bias.device_mesh, [Partial()], run_check=False)
    linear.register_parameter("bias", nn.Parameter(partial, requires_grad=False))


def _swap_shards(linear: nn.Module, context: RankContext) -> None:
    """Give this rank the shards of the column-parallel ``linear``'s weight and bias (DTensors, ``Shard(0)``)
    that belong to the rank opposite it: what loading a fused or pre-split checkpoint in the wrong order does."""
    for name, parameter in linear.named_parameters():
        if not isinstance(parameter, DTensor):
            raise ValueError(f"swapped_gate_shards needs a column-parallel linear; its {name} is not a DTensor")
        whole = parameter.full_tensor().detach()
        mesh = parameter.device_mesh  # the tensor-parallel ranks (all, or one row of a 2-D mesh)
        size, me = mesh.size(), mesh.get_local_rank()
        theirs = whole.chunk(size, dim=0)[size - 1 - me]
        with torch.no_grad():
            parameter.to_local().copy_(theirs)


def _raise(module: nn.Module, args: Any) -> None:
    raise RuntimeError("planted: rank 1's down_proj cannot run")
