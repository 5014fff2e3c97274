"""Model inputs: seeded synthetic tensors for tiny models, an image and a prompt through the model's processor, a
safetensors file of named tensors, or a JSONL file of prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from paritylab.run.errors import ConfigError
from paritylab.run.workload import synthetic_inputs

SAMPLE_IMAGE = Path(__file__).resolve().parents[1] / "assets" / "sample.png"


def build_inputs(cfg: Any, family: str, model: nn.Module, pretrained: str | None) -> dict[str, torch.Tensor]:
    """Keyword inputs for ``model(**inputs)`` (on the CPU; the runner moves them)."""
    if cfg.batch_size < 1 or cfg.prompt_length < 1:
        raise ConfigError(
            f"inputs.batch_size={cfg.batch_size} and inputs.prompt_length={cfg.prompt_length} must be at least 1"
        )
    return not_empty(_inputs(cfg, family, model, pretrained), str(cfg.kind))


def _inputs(cfg: Any, family: str, model: nn.Module, pretrained: str | None) -> dict[str, torch.Tensor]:
    if str(cfg.kind) == "processor":
        return processor_inputs(cfg, pretrained)
    if str(cfg.kind) == "file":
        return file_inputs(cfg.path)
    if str(cfg.kind) == "prompts":
        return prompt_inputs(cfg.path, cfg.get("tokenizer") or pretrained, model)
    generator = torch.Generator().manual_seed(int(cfg.seed))
    config = getattr(model, "config", None)
    if family == "llava":
        return llava_inputs(config, cfg.batch_size, cfg.prompt_length, generator)
    return synthetic_inputs(model, cfg.batch_size, cfg.prompt_length, generator)


def not_empty(inputs: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """``inputs``, refused (:class:`ConfigError`) when one holds no elements: a run over nothing never PASSes."""
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.numel() == 0:
            raise ConfigError(
                f"inputs={kind}: {name} has no elements (shape {list(value.shape)}); a comparison over nothing "
                "proves nothing: give inputs with at least one element each"
            )
    return inputs


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


MAX_PROMPTS_BYTES = 64 << 20


def prompt_inputs(path: str | None, tokenizer: str | None, model: nn.Module) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` from a JSONL file of prompts, one per line: ``{"prompt": text}``
    (tokenized with ``tokenizer``) or ``{"input_ids": [ids]}``; right-padded into one batch."""
    import json

    where = f"inputs.path={path!r}"
    if not path or not Path(path).is_file():
        raise ConfigError(f'inputs=prompts needs inputs.path=<a JSONL file of {{"prompt": ...}} lines>; got {path!r}')
    if Path(path).stat().st_size > MAX_PROMPTS_BYTES:
        raise ConfigError(f"{where} is over {MAX_PROMPTS_BYTES >> 20} MB: a prompt file holds one batch")
    rows: list[list[int]] = []
    encode = None
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as error:
            raise ConfigError(f"{where}, line {number}, is not JSON: {error}") from error
        ids = item.get("input_ids") if isinstance(item, dict) else None
        text = (item.get("prompt") or item.get("text")) if isinstance(item, dict) else None
        if isinstance(ids, list) and ids and all(type(i) is int and i >= 0 for i in ids):
            rows.append(ids)
        elif isinstance(text, str) and text:
            encode = encode or _tokenizer(tokenizer, where)
            rows.append(list(encode(text)))
        else:
            raise ConfigError(
                f'{where}, line {number}: expected {{"prompt": "<text>"}} or {{"input_ids": [<token ids>]}}'
            )
    if not rows:
        raise ConfigError(f"{where} holds no prompts")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocab, int) and (largest := max(max(row) for row in rows)) >= vocab:
        raise ConfigError(f"{where}: token id {largest} is outside the model's vocabulary of {vocab}")
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, : len(row)] = torch.tensor(row)
        mask[index, : len(row)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def _tokenizer(name: str | None, where: str) -> Any:
    if not name:
        raise ConfigError(
            f"{where} holds text prompts but no tokenizer is known: set inputs.tokenizer=<dir or hub id> "
            '(or model.build.pretrained), or give token ids as {"input_ids": [...]}'
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise ConfigError(f"inputs.tokenizer={name!r} cannot be loaded: {str(error).splitlines()[0]}") from error
    return lambda text: tokenizer(text)["input_ids"]


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
