"""A pipeline-parallel port of transformers' Llama, built on every rank by :func:`build` (a ``"module:function"``
builder for :func:`paritylab.distributed.check_distributed`).

The decoder layers are split into ``world_size`` consecutive stages, one per rank, the way hand-written pipelines
(and torchtitan's) split a model: each rank keeps the modules of its stage under their original names (the
layers in an ``nn.ModuleDict`` keyed by their index, so rank 1's first layer is still ``model.layers.2``), the
first stage embeds the tokens, each stage sends its last hidden state to the next (``torch.distributed.send`` /
``recv``), and the last stage applies the final norm and the head. Every stage computes the rotary angles and the
causal mask itself. A module therefore exists on one rank only, and the root and ``model`` return a value on the
last rank only: what :mod:`paritylab.distributed.merge` merges by stage.

``options["defect"]`` plants one of the bugs that live in a pipeline split (:data:`DEFECTS`); without it the port
is correct. ``options["layer"]`` picks the decoder layer the defect is planted at (default: the first layer of
the last stage).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paritylab.distributed.launch import RankContext, takes_options

DEFECTS = {
    "stage_scaled": "the stage holding layer `layer` scales that layer's down_proj output by 1.5",
    "stale_handoff": "the stage before layer `layer` sends the hidden state from before its own last layer",
    "stage_weights": "the stage holding layer `layer` loads its layers' weights by local index (from layer 0 on)",
}
"""Planted defects (``options["defect"]``) and what each does."""


def stage_layers(num_layers: int, world_size: int, rank: int) -> range:
    """The decoder layers of rank ``rank``'s stage: consecutive, as even as the count allows, earlier stages
    taking the remainder."""
    if num_layers < world_size:
        raise ValueError(f"{num_layers} decoder layers cannot make {world_size} pipeline stages: use fewer ranks")
    size, extra = divmod(num_layers, world_size)
    start = rank * size + min(rank, extra)
    return range(start, start + size + (1 if rank < extra else 0))


def causal_mask(hidden: torch.Tensor, attention: str) -> torch.Tensor | None:
    """The causal mask transformers' attention implementations take, made here (``create_causal_mask``'s keywords
    changed between transformers releases): none for sdpa and the flash kernels, which are causal by themselves
    when given none; else the additive mask, 0 where a position may look and the dtype's minimum where not."""
    if attention != "eager":
        return None
    length = hidden.shape[1]
    blocked = torch.full((length, length), torch.finfo(hidden.dtype).min, dtype=hidden.dtype, device=hidden.device)
    return blocked.triu(1)[None, None].expand(hidden.shape[0], 1, length, length)


class StageModel(nn.Module):
    """One stage of ``LlamaModel``: the embedding on the first stage, its own decoder layers, the final norm on the
    last; receives its input from the previous stage and sends its output to the next."""

    def __init__(self, model: Any, layers: range, context: RankContext, defect: str | None, layer: int) -> None:
        super().__init__()
        self.config: Any = model.config
        self.rank, self.world_size = context.rank, context.world_size
        self.embed_tokens = model.embed_tokens if context.rank == 0 else None
        self.rotary_emb = model.rotary_emb
        self.layers = nn.ModuleDict({str(index): model.layers[index] for index in layers})
        self.norm = model.norm if context.rank == context.world_size - 1 else None
        self.stale = defect == "stale_handoff" and layers.stop == layer and self.norm is None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        if self.embed_tokens is not None:
            hidden = self.embed_tokens(input_ids)
        else:
            weight = next(self.layers.parameters())
            hidden = torch.empty(*input_ids.shape, self.config.hidden_size, dtype=weight.dtype, device=weight.device)
            dist.recv(hidden, src=self.rank - 1)
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = causal_mask(hidden, str(self.config._attn_implementation))
        angles = self.rotary_emb(hidden, position_ids=position_ids)
        before = hidden
        for block in self.layers.values():
            before = hidden
            hidden = block(hidden, attention_mask=mask, position_embeddings=angles, position_ids=position_ids)
        if self.norm is None:
            dist.send((before if self.stale else hidden).contiguous(), dst=self.rank + 1)
            return None
        return self.norm(hidden)


class StageLlama(nn.Module):
    """One stage of ``LlamaForCausalLM`` (module paths as the reference's): returns the logits on the last
    stage, ``None`` on the others."""

    def __init__(self, model: Any, context: RankContext, defect: str | None, layer: int) -> None:
        super().__init__()
        layers = stage_layers(model.config.num_hidden_layers, context.world_size, context.rank)
        self.model = StageModel(model.model, layers, context, defect, layer)
        self.lm_head = model.lm_head if context.rank == context.world_size - 1 else None

    def forward(self, input_ids: torch.Tensor, **ignored: Any) -> torch.Tensor | None:
        hidden = self.model(input_ids)
        return None if hidden is None or self.lm_head is None else self.lm_head(hidden)


@takes_options("defect", "layer")
def build(context: RankContext) -> nn.Module:
    """The rank's stage of a Llama whose config is ``options["config"]`` (a ``LlamaConfig.to_dict()``) and whose
    weights are the reference's (``context.state_dict()``); ``options["defect"]`` plants a bug (:data:`DEFECTS`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    options = context.options
    defect = options.get("defect")
    if defect is not None and defect not in DEFECTS:
        raise ValueError(f"unknown defect {defect!r}; known: {', '.join(DEFECTS)}")
    config = LlamaConfig.from_dict(dict(options["config"]))
    last_stage = stage_layers(config.num_hidden_layers, context.world_size, context.world_size - 1)
    layer = int(options.get("layer", last_stage.start))
    model = LlamaForCausalLM(config).eval()
    state = context.state_dict()
    mine = stage_layers(config.num_hidden_layers, context.world_size, context.rank)
    if defect == "stage_weights" and layer in mine:
        for local, index in enumerate(mine):  # the stage's checkpoint read by local layer number
            prefix, source = f"model.layers.{index}.", f"model.layers.{local}."
            for name in [name for name in state if name.startswith(prefix)]:
                state[name] = state[source + name.removeprefix(prefix)]
    model.load_state_dict(state)
    stage = StageLlama(model, context, defect, layer).eval().to(context.device)
    if defect == "stage_scaled" and layer in mine:
        block: Any = stage.model.layers[str(layer)]
        block.mlp.down_proj.register_forward_hook(lambda module, args, output: output * 1.5)
    return stage
