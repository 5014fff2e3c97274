"""LLaVA written from scratch in plain PyTorch: CLIP-style vision encoder, MLP projector, rotary Llama decoder.

Module names and structure deliberately differ from transformers' (``vit.blocks.3.attn.wq`` rather than
``model.vision_tower.encoder.layers.3.self_attn.q_proj``); the text attention uses one fused ``wqkv``
projection and the MLP one fused ``w13`` (gate and up) projection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class VisionConfig:
    dim: int
    layers: int
    heads: int
    mlp_dim: int
    image_size: int
    patch_size: int
    eps: float = 1e-5

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class TextConfig:
    dim: int
    layers: int
    heads: int
    kv_heads: int
    mlp_dim: int
    vocab_size: int
    eps: float = 1e-6
    rope_theta: float = 10000.0


@dataclass(frozen=True)
class PortConfig:
    vision: VisionConfig
    text: TextConfig
    image_token_id: int
    feature_layer: int = -2
    """Which vision hidden state feeds the projector, counted like transformers' ``hidden_states``."""
    drop_cls: bool = True


class QuickGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(dim, dim)
        self.wv = nn.Linear(dim, dim)
        self.wo = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(proj(x), self.heads) for proj in (self.wq, self.wk, self.wv))
        return self.wo(merge_heads(attend(q, k, v, mask=None)))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.dim, eps=config.eps)
        self.attn = VisionAttention(config.dim, config.heads)
        self.ln2 = nn.LayerNorm(config.dim, eps=config.eps)
        self.mlp = nn.Sequential(
            nn.Linear(config.dim, config.mlp_dim), QuickGELU(), nn.Linear(config.mlp_dim, config.dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class VisionEncoder(nn.Module):
    """CLIP-style ViT returning every hidden state (embeddings first, then each block's output)."""

    def __init__(self, config: VisionConfig, depth: int) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, config.dim, config.patch_size, stride=config.patch_size, bias=False)
        self.cls_token = nn.Parameter(torch.zeros(config.dim))
        self.pos_embed = nn.Parameter(torch.zeros(config.patches + 1, config.dim))
        self.ln_pre = nn.LayerNorm(config.dim, eps=config.eps)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(depth))

    def forward(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        patches = self.patch_embed(pixels.to(self.patch_embed.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.cls_token.expand(patches.shape[0], 1, -1)
        x = self.ln_pre(torch.cat([cls, patches], dim=1) + self.pos_embed)
        states = [x]
        for block in self.blocks:
            x = block(x)
            states.append(x)
        return states


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * wide.to(x.dtype)


class Rotary(nn.Module):
    """cos/sin tables for rotary position embeddings (half-split convention)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inverse = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inverse", inverse, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = (self.inverse[None, :, None].float() @ positions[:, None, :].float()).transpose(1, 2)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + turned * sin[:, None]


class KVCache:
    """Each decoder layer's keys and values so far (after rotary, before heads are repeated), grown by every
    forward given it: what makes one-token decode steps cheap."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    @property
    def length(self) -> int:
        """Positions cached so far."""
        return self.keys[0].shape[2] if self.keys else 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's keys and values for ``layer``; returns all of them."""
        if layer in self.keys:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class Attention(nn.Module):
    def __init__(self, config: TextConfig, layer: int = 0) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads = config.heads, config.kv_heads
        self.head_dim = config.dim // config.heads
        self.scale = self.head_dim**-0.5
        self.wqkv = nn.Linear(config.dim, (config.heads + 2 * config.kv_heads) * self.head_dim, bias=False)
        self.wo = nn.Linear(config.heads * self.head_dim, config.dim, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, cache: KVCache | None = None
    ) -> torch.Tensor:
        sizes = [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]
        q, k, v = self.wqkv(x).split(sizes, dim=-1)
        q, k, v = split_heads(q, self.heads), split_heads(k, self.kv_heads), split_heads(v, self.kv_heads)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        return self.wo(merge_heads(attend(q, k, v, mask, self.scale)))


class FeedForward(nn.Module):
    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.w13 = nn.Linear(config.dim, 2 * config.mlp_dim, bias=False)
        self.w2 = nn.Linear(config.mlp_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class DecoderBlock(nn.Module):
    def __init__(self, config: TextConfig, layer: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.eps)
        self.attention = Attention(config, layer)
        self.ffn_norm = RMSNorm(config.dim, config.eps)
        self.feed_forward = FeedForward(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, cache: KVCache | None = None
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, cache)
        return x + self.feed_forward(self.ffn_norm(x))


class Decoder(nn.Module):
    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.rotary = Rotary(config.dim // config.heads, config.rope_theta)
        self.layers = nn.ModuleList(DecoderBlock(config, layer) for layer in range(config.layers))
        self.norm = RMSNorm(config.dim, config.eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(
        self, embeddings: torch.Tensor, padding: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> torch.Tensor:
        batch, length, _ = embeddings.shape
        past = cache.length if cache is not None else 0
        positions = self.positions(past, length, embeddings.device).expand(batch, length)
        cos, sin = self.rotary(positions, embeddings.dtype)
        mask = causal_mask(length, embeddings.device, padding, past)
        x = embeddings
        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache)
        return self.output(self.norm(x))

    def positions(self, past: int, length: int, device: torch.device) -> torch.Tensor:
        """The positions of ``length`` new tokens after ``past`` cached ones."""
        return torch.arange(past, past + length, device=device)[None]


class LlavaPort(nn.Module):
    """Image + prompt -> next-token logits, as transformers' ``LlavaForConditionalGeneration`` computes them."""

    def __init__(self, config: PortConfig) -> None:
        super().__init__()
        self.config = config
        self.feature_index = config.feature_layer % (config.vision.layers + 1)
        self.vit = VisionEncoder(config.vision, depth=self.feature_index)  # later blocks are not needed
        self.mm_projector = nn.Sequential(
            nn.Linear(config.vision.dim, config.text.dim), nn.GELU(), nn.Linear(config.text.dim, config.text.dim)
        )
        self.llm = Decoder(config.text)

    def new_cache(self) -> KVCache:
        """An empty cache for decoding: pass it as ``cache=`` to every step (paritylab's generate workload)."""
        return KVCache()

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Logits for every position of ``input_ids``. With ``cache``, positions continue after the cached
        ones and ``attention_mask`` covers the cached tokens too; decode steps pass no pixels."""
        text = self.llm.tok_embeddings(input_ids)
        slots = input_ids == self.config.image_token_id
        if pixel_values is None:
            if bool(slots.any()):
                raise ValueError("input_ids hold image tokens but no pixel_values were given")
            return self.llm(text, attention_mask, cache)
        features = self.vit(pixel_values)[self.feature_index]
        if self.config.drop_cls:
            features = features[:, 1:]
        image = self.mm_projector(features)
        if int(slots.sum()) != image.shape[0] * image.shape[1]:
            raise ValueError(
                f"{int(slots.sum())} image tokens in input_ids but {image.shape[0] * image.shape[1]} image features"
            )
        merged = text.masked_scatter(slots[..., None].expand_as(text), image.to(text.dtype))
        return self.llm(merged, attention_mask, cache)


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    batch, length, width = x.shape
    return x.view(batch, length, heads, width // heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    batch, heads, length, head_dim = x.shape
    return x.transpose(1, 2).reshape(batch, length, heads * head_dim)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None = None
) -> torch.Tensor:
    scores = (q @ k.transpose(-1, -2)) * (scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return weights @ v


def causal_mask(length: int, device: torch.device, padding: torch.Tensor | None, past: int = 0) -> torch.Tensor:
    """Boolean mask (batch or 1, 1, query, key): True where attention is allowed. ``length`` new queries after
    ``past`` cached keys; ``padding`` covers every key (cached and new)."""
    mask = torch.ones(length, past + length, dtype=torch.bool, device=device).tril(diagonal=past)[None, None]
    if padding is not None:
        mask = mask & padding.bool()[:, None, None, :]
    return mask
