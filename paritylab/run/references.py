"""Reference models from transformers: tiny seeded random-init configs, or real weights from a local dir/hub id."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paritylab.run.errors import ConfigError


def llava(
    pretrained: str | None = None,
    *,
    seed: int = 0,
    hidden_size: int = 32,
    layers: int = 2,
    heads: int = 4,
    intermediate_size: int | None = None,
    vision_hidden_size: int | None = None,
    vision_layers: int | None = None,
    vision_heads: int | None = None,
    image_size: int = 28,
    patch_size: int = 14,
    vocab_size: int = 128,
    attn_implementation: str = "eager",
    dtype: str = "float32",
) -> nn.Module:
    """``LlavaForConditionalGeneration``: CLIP vision tower, projector and Llama text model.

    With ``pretrained`` (a local directory or hub id) the real weights are loaded; otherwise a random-init
    model of the given size is built, seeded, with the image token as the last vocabulary id.
    """
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    if pretrained:
        return _from_pretrained(LlavaForConditionalGeneration, pretrained, attn_implementation, dtype)
    vision_hidden = vision_hidden_size or hidden_size
    vision = CLIPVisionConfig(
        hidden_size=vision_hidden,
        intermediate_size=4 * vision_hidden,
        num_hidden_layers=vision_layers or layers,
        num_attention_heads=vision_heads or heads,
        image_size=image_size,
        patch_size=patch_size,
        projection_dim=vision_hidden,
    )
    text = LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or _llama_intermediate(hidden_size),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=vocab_size,
        max_position_embeddings=4096,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=vocab_size - 1,
        image_seq_length=(image_size // patch_size) ** 2,
    )
    return _random_init(LlavaForConditionalGeneration, config, seed, attn_implementation, dtype)


def llama(
    pretrained: str | None = None,
    *,
    seed: int = 0,
    hidden_size: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int | None = None,
    intermediate_size: int | None = None,
    vocab_size: int = 128,
    attn_implementation: str = "eager",
    dtype: str = "float32",
) -> nn.Module:
    """``LlamaForCausalLM``: real weights from ``pretrained``, else a seeded random-init model of this size."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if pretrained:
        return _from_pretrained(LlamaForCausalLM, pretrained, attn_implementation, dtype)
    config = LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or _llama_intermediate(hidden_size),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        vocab_size=vocab_size,
        max_position_embeddings=4096,
    )
    return _random_init(LlamaForCausalLM, config, seed, attn_implementation, dtype)


def clip_vision(
    pretrained: str | None = None,
    *,
    seed: int = 0,
    hidden_size: int = 32,
    layers: int = 2,
    heads: int = 4,
    image_size: int = 28,
    patch_size: int = 14,
    attn_implementation: str = "eager",
    dtype: str = "float32",
) -> nn.Module:
    """``CLIPVisionModel``, a vision-only reference (pixels in, no vocabulary): real weights from ``pretrained``,
    else a seeded random-init model of this size."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    if pretrained:
        return _from_pretrained(CLIPVisionModel, pretrained, attn_implementation, dtype)
    config = CLIPVisionConfig(
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        image_size=image_size,
        patch_size=patch_size,
    )
    return _random_init(CLIPVisionModel, config, seed, attn_implementation, dtype)


def _llama_intermediate(hidden_size: int) -> int:
    return int(8 * hidden_size / 3 + 7) // 8 * 8


def _random_init(model_class: Any, config: Any, seed: int, attn_implementation: str, dtype: str) -> nn.Module:
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    return model.to(getattr(torch, dtype)).eval()


def _from_pretrained(model_class: Any, source: str, attn_implementation: str, dtype: str) -> nn.Module:
    """The weights through transformers, which reads safetensors, or a ``.bin`` with a weights-only ``torch.load``:
    a ``.bin`` that holds code (a pickle that calls something) is refused, and said in one line."""
    try:
        model = model_class.from_pretrained(
            source, attn_implementation=attn_implementation, dtype=getattr(torch, dtype)
        )
    except Exception as error:
        if type(error).__name__ != "UnpicklingError" and "Weights only load failed" not in str(error):
            raise
        raise ConfigError(
            f"model.build.pretrained={source}: a weights file there holds pickled code, not only tensors, and the "
            "weights-only load refused it; convert it to safetensors where you trust it, or use a safetensors copy"
        ) from None
    return model.eval()
