"""Candidates whose forwards do not take ``input_ids=``: built from the reference through config alone."""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaForCausalLM


class IdxLlama(LlamaForCausalLM):
    """litgpt-style forward: token ids positionally as ``idx``, logits returned as a tensor."""

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        return super().forward(input_ids=idx).logits


def idx_llama(reference: nn.Module) -> nn.Module:
    model = IdxLlama(reference.config)
    model.load_state_dict(reference.state_dict())
    return model.eval()


def transformer_lens_llama(reference: nn.Module) -> nn.Module:
    """TransformerLens' HookedTransformer (``forward(input, ...)``) with the reference's weights converted by
    TransformerLens' own converter."""
    from transformer_lens.pretrained.weight_conversions import convert_llama_weights

    from tests.pairs import transformer_lens_config, transformer_lens_model

    config = transformer_lens_config(reference.config)
    return transformer_lens_model(config, convert_llama_weights(reference, config))


class AuxFirstLlama(LlamaForCausalLM):
    """Returns ``(aux, logits)``: a summary first and the logits as a copy no module made, so data flow cannot
    tell which returned tensor is the output; ``candidate.call.output=1`` says it."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        logits = super().forward(input_ids=input_ids, attention_mask=attention_mask).logits
        return logits.mean(dim=-1), logits.clone()


def aux_first_llama(reference: nn.Module) -> nn.Module:
    model = AuxFirstLlama(reference.config)
    model.load_state_dict(reference.state_dict())
    return model.eval()
