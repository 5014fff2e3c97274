"""A from-scratch LLaVA port, built from a transformers reference through a YAML weight map."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from paritylab.run.weights import load_mapped, load_weight_map

from .model import LlavaPort, PortConfig, TextConfig, VisionConfig

HERE = Path(__file__).resolve().parent
WEIGHT_MAP = HERE / "weights.yaml"
ALIGNMENT = HERE / "alignment.yaml"
"""Explicit alignment rules for the fused projections: no longer needed (parameter fingerprints find them),
kept as an example of the rules format and for the tests of rules."""

__all__ = ["ALIGNMENT", "WEIGHT_MAP", "LlavaPort", "PortConfig", "config_from_reference", "from_reference"]


def config_from_reference(reference: nn.Module) -> PortConfig:
    """The port's configuration from a transformers ``LlavaForConditionalGeneration``'s config."""
    config = reference.config
    vision, text = config.vision_config, config.text_config
    if vision.hidden_act != "quick_gelu" or text.hidden_act != "silu":
        raise ValueError(
            f"the port implements quick_gelu/silu, the reference uses {vision.hidden_act}/{text.hidden_act}"
        )
    if not isinstance(config.vision_feature_layer, int):
        raise ValueError("the port selects one vision feature layer; the reference concatenates several")
    rope = getattr(text, "rope_parameters", None) or {}
    return PortConfig(
        vision=VisionConfig(
            dim=vision.hidden_size,
            layers=vision.num_hidden_layers,
            heads=vision.num_attention_heads,
            mlp_dim=vision.intermediate_size,
            image_size=vision.image_size,
            patch_size=vision.patch_size,
            eps=vision.layer_norm_eps,
        ),
        text=TextConfig(
            dim=text.hidden_size,
            layers=text.num_hidden_layers,
            heads=text.num_attention_heads,
            kv_heads=text.num_key_value_heads,
            mlp_dim=text.intermediate_size,
            vocab_size=text.vocab_size,
            eps=text.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))),
        ),
        image_token_id=config.image_token_id,
        feature_layer=config.vision_feature_layer,
        drop_cls=config.vision_feature_select_strategy == "default",
    )


def from_reference(reference: nn.Module, weight_map: str | Path = WEIGHT_MAP) -> LlavaPort:
    """Build the port with the reference's weights, dtype and device."""
    parameter = next(reference.parameters())
    port = LlavaPort(config_from_reference(reference)).to(device=parameter.device, dtype=parameter.dtype)
    load_mapped(port, reference, load_weight_map(weight_map))
    return port.eval()
