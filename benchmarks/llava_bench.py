"""llava-bench: the model and inputs every benchmark measures, built exactly as ``python -m paritylab`` builds them.

transformers' LlavaForConditionalGeneration, random init: a CLIP vision tower and a Llama text model with hidden
size 512, 8 + 8 layers, 8 heads, a 224x224 image with patch 14 (256 image tokens) plus 64 text tokens, fp32. The
model comes from the run's own configuration (``conf/model/llava.yaml`` with :data:`SIZE`): the same text MLP, the
same attention implementation (eager, unless ``attention`` says otherwise) and the same inputs, attention mask
included, as the whole-run benchmark's ``python -m paritylab`` runs.
"""

from __future__ import annotations

from typing import Any

import torch

SIZE = dict(hidden_size=512, layers=8, heads=8, image_size=224, patch_size=14, vocab_size=32064)
QUICK_SIZE = dict(hidden_size=128, layers=2, heads=4, image_size=56)
"""``--quick``: a smaller model, for a smoke run of a benchmark."""


def overrides(quick: bool = False, attention: str | None = None) -> list[str]:
    """The Hydra overrides that make ``model=llava`` llava-bench (``quick``: its small variant)."""
    size = {**SIZE, **(QUICK_SIZE if quick else {})}
    chosen = [
        "model=llava", "inputs.prompt_length=64", "+model.build.intermediate_size=null",
        *(f"model.build.{key}={value}" for key, value in size.items()),
    ]  # fmt: skip
    if attention:
        chosen.append(f"model.build.attn_implementation={attention}")
    return chosen


def build(
    quick: bool = False, attention: str | None = None, device: str = "cpu"
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """llava-bench's reference model and inputs, through the run's own configuration and builders."""
    from paritylab.cli.app import compose
    from paritylab.run.candidates import instantiate
    from paritylab.run.inputs import build_inputs

    cfg = compose([*overrides(quick, attention), "candidate=port"])
    torch.manual_seed(0)
    model = instantiate("model.build", cfg.model.build).to(device).eval()
    inputs = build_inputs(cfg.inputs, cfg.model.family, model, None)
    return model, {key: value.to(device) if torch.is_tensor(value) else value for key, value in inputs.items()}
