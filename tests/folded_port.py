"""A ResNet ported for inference, every batch norm folded into the convolution before it: the candidate of the folded
ResNet pair.

Written as an inference port would be: each ``convolution → BatchNorm2d`` of transformers' ``ResNetModel`` is one
``nn.Conv2d`` with a bias, whose weight rows are scaled by the norm's ``γ/√(σ² + ε)`` and whose bias is
``β − μ·γ/√(σ² + ε)``; the activations and the pooling are functions, and a residual block is one module holding
its convolutions. :func:`from_resnet` converts a transformers ``ResNetModel`` (basic or bottleneck layers) into it;
``mistake`` plants a conversion bug in one fold.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def fold(convolution: nn.Conv2d, norm: nn.BatchNorm2d, mistake: str | None = None) -> nn.Conv2d:
    """One convolution computing ``norm(convolution(x))`` in eval mode. ``mistake``: ``std`` (the scale divides by
    the variance, not its square root), ``eps`` (ε left out), ``shift`` (the mean not subtracted from the bias)."""
    with torch.no_grad():
        var = norm.running_var.double()
        eps = 0.0 if mistake == "eps" else norm.eps
        scale = norm.weight.double() / (var + eps if mistake == "std" else torch.sqrt(var + eps))
        bias = convolution.bias.double() if convolution.bias is not None else torch.zeros_like(var)
        mean = torch.zeros_like(var) if mistake == "shift" else norm.running_mean.double()
        folded = nn.Conv2d(
            convolution.in_channels, convolution.out_channels, convolution.kernel_size, convolution.stride,
            convolution.padding, bias=True,
        )  # fmt: skip
        folded.weight.copy_(convolution.weight.double() * scale[:, None, None, None])
        folded.bias.copy_(norm.bias.double() + (bias - mean) * scale)
    return folded


class FoldedBlock(nn.Module):
    """A residual block: its convolutions (a ReLU between them), the shortcut's convolution where it projects."""

    def __init__(self, convs: list[nn.Conv2d], shortcut: nn.Conv2d | None) -> None:
        super().__init__()
        self.convs = nn.ModuleList(convs)
        self.shortcut = shortcut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x if self.shortcut is None else self.shortcut(x)
        for i, conv in enumerate(self.convs):
            x = conv(x)
            if i < len(self.convs) - 1:
                x = F.relu(x)
        return F.relu(x + residual)


class FoldedResNet(nn.Module):
    """The stem's folded convolution, then every residual block in one list; returns the last feature map and its
    average over the image (``ResNetModel``'s ``last_hidden_state`` and ``pooler_output``, as a tuple)."""

    def __init__(self, stem: nn.Conv2d, blocks: list[FoldedBlock]) -> None:
        super().__init__()
        self.stem = stem
        self.blocks = nn.ModuleList(blocks)

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = F.max_pool2d(F.relu(self.stem(pixels)), kernel_size=3, stride=2, padding=1)
        for block in self.blocks:
            x = block(x)
        return x, F.adaptive_avg_pool2d(x, 1)


def from_resnet(reference: nn.Module, mistakes: dict[str, str] | None = None) -> FoldedResNet:
    """``reference`` (a transformers ``ResNetModel``) with every norm folded. ``mistakes`` maps a candidate module
    (``blocks.1.convs.0``, ``stem``, ``blocks.1.shortcut``) to the mistake its fold makes (:func:`fold`)."""
    mistakes = mistakes or {}
    layer = reference.embedder.embedder
    stem = fold(layer.convolution, layer.normalization, mistakes.get("stem"))
    blocks = []
    for stage in reference.encoder.stages:
        for residual in stage.layers:
            index = len(blocks)
            convs = [
                fold(step.convolution, step.normalization, mistakes.get(f"blocks.{index}.convs.{i}"))
                for i, step in enumerate(residual.layer)
            ]
            shortcut = residual.shortcut
            folded = None
            if hasattr(shortcut, "convolution"):  # a projection; else the identity
                folded = fold(shortcut.convolution, shortcut.normalization, mistakes.get(f"blocks.{index}.shortcut"))
            blocks.append(FoldedBlock(convs, folded))
    return FoldedResNet(stem, blocks).eval()


def sites(reference: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each folded convolution and the reference module whose output it computes: its norm (it holds the
    convolution's weight, but the norm's output is what it returns). Blocks are left out: their output is made by a
    ReLU the port calls as a function, and an error planted there is named at the reference's activation module
    inside the residual layer (its maker, with no counterpart), not at the layer the block is paired with."""
    found = {"stem": ("embedder.embedder.normalization",)}
    index = 0
    for s, stage in enumerate(reference.encoder.stages):
        for j, residual in enumerate(stage.layers):
            theirs = f"encoder.stages.{s}.layers.{j}"
            for i in range(len(residual.layer)):
                found[f"blocks.{index}.convs.{i}"] = (f"{theirs}.layer.{i}.normalization",)
            if hasattr(residual.shortcut, "convolution"):
                found[f"blocks.{index}.shortcut"] = (f"{theirs}.shortcut.normalization",)
            index += 1
    return found
