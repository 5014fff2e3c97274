"""Model inputs: seeded synthetic tensors for tiny models, or an image and a prompt through the model's processor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from paritylab.run.config import ConfigError
from paritylab.run.workload import synthetic_inputs

SAMPLE_IMAGE = Path(__file__).resolve().parents[1] / "assets" / "sample.png"


def build_inputs(cfg: Any, family: str, model: nn.Module, pretrained: str | None) -> dict[str, torch.Tensor]:
    """Keyword inputs for ``model(**inputs)`` (on the CPU; the runner moves them)."""
    if cfg.batch_size < 1 or cfg.prompt_length < 1:
        raise ConfigError(
            f"inputs.batch_size={cfg.batch_size} and inputs.prompt_length={cfg.prompt_length} must be at least 1"
        )
    if str(cfg.kind) == "processor":
        return processor_inputs(cfg, pretrained)
    if str(cfg.kind) == "file":
        return file_inputs(cfg.path)
    generator = torch.Generator().manual_seed(int(cfg.seed))
    config = getattr(model, "config", None)
    if family == "llava":
        return llava_inputs(config, cfg.batch_size, cfg.prompt_length, generator)
    return synthetic_inputs(model, cfg.batch_size, cfg.prompt_length, generator)


def file_inputs(path: str | None) -> dict[str, torch.Tensor]:
    """Named tensors from a safetensors file (never a pickle)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path or not Path(path).is_file():
        raise ConfigError(f"inputs=file needs inputs.path=<a safetensors file of named tensors>; got {path!r}")
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError) as error:
        raise ConfigError(f"inputs.path={path!r} is not a readable safetensors file: {error}") from error
    if not tensors:
        raise ConfigError(f"inputs.path={path!r} holds no tensors: save named inputs such as input_ids")
    return tensors


def llava_inputs(config: Any, batch: int, length: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Prompt ids with the image's tokens right after the first token, and a random image tensor."""
    vision = config.vision_config
    image_tokens = (vision.image_size // vision.patch_size) ** 2
    if config.vision_feature_select_strategy != "default":
        image_tokens += 1
    image_token = config.image_token_index
    vocab = config.text_config.vocab_size
    ids = torch.randint(0, vocab - 1, (batch, length + image_tokens), generator=generator)
    ids[ids >= image_token] += 1  # never the image token by chance
    ids[:, 1 : 1 + image_tokens] = image_token
    pixels = torch.randn(batch, 3, vision.image_size, vision.image_size, generator=generator)
    return {"input_ids": ids, "pixel_values": pixels, "attention_mask": torch.ones_like(ids)}


def processor_inputs(cfg: Any, pretrained: str | None) -> dict[str, torch.Tensor]:
    """The model's own processor applied to an image file and a prompt (``model.build.pretrained`` needed)."""
    if not pretrained:
        raise ConfigError("inputs=image uses the model's processor: set model.build.pretrained=<local dir or hub id>")
    from PIL import Image
    from transformers import AutoProcessor

    image_path = Path(cfg.image) if cfg.image else SAMPLE_IMAGE
    if not image_path.is_file():
        raise ConfigError(f"inputs.image={str(image_path)!r} does not exist: pass an image file")
    processor = AutoProcessor.from_pretrained(pretrained)
    image = Image.open(image_path).convert("RGB")
    encoded = processor(
        images=[image] * cfg.batch_size, text=[cfg.prompt] * cfg.batch_size, return_tensors="pt", padding=True
    )
    return {key: value for key, value in encoded.items() if isinstance(value, torch.Tensor)}
