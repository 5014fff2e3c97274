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
    from transformer_lens import HookedTransformer
    from transformer_lens.pretrained.weight_conversions import convert_llama_weights

    from tests.pairs import transformer_lens_config

    config = transformer_lens_config(reference.config)
    model = HookedTransformer(config)
    model.load_and_process_state_dict(
        convert_llama_weights(reference, config), fold_ln=False, center_writing_weights=False,
        center_unembed=False, fold_value_biases=False,
    )  # fmt: skip
    return model.eval()
