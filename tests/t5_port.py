"""A T5 encoder-decoder written from scratch: the candidate of the T5 pair.

Written as a port would be, not as transformers writes it: each stack computes its relative position bias once from
a table it holds itself (transformers' first attention of each stack computes it and holds the table, the later ones
receive it), self-attention is one fused ``qkv`` projection and cross-attention one ``q`` and one fused ``kv``, both
run by torch's ``scaled_dot_product_attention`` (with T5's unit scale), the norms are RMS norms holding a ``scale``,
the decoder reads the encoder's token embedding and the logits are a function of that embedding's weight (no head
module: T5's tied head, ``d_model ** -0.5`` folded in). The buckets are computed from the distances by a function
of our own. :func:`from_t5` converts a transformers ``T5ForConditionalGeneration`` (gated-GELU feed-forward) into it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class T5PortConfig:
    vocab: int
    width: int
    heads: int
    head_width: int
    hidden: int
    encoder_layers: int
    decoder_layers: int
    buckets: int
    max_distance: int
    eps: float


def _log_buckets(distance: torch.Tensor, exact: int, buckets: int, max_distance: int) -> torch.Tensor:
    """Distances below ``exact`` are their own bucket; longer ones share ``buckets - exact`` logarithmic ones up to
    ``max_distance`` (the last bucket beyond it)."""
    far = (
        exact
        + (torch.log(distance.clamp(min=1).float() / exact) / math.log(max_distance / exact) * (buckets - exact)).long()
    )
    return torch.where(distance < exact, distance, far.clamp(max=buckets - 1))


def encoder_buckets(length: int, buckets: int, max_distance: int, device: torch.device) -> torch.Tensor:
    """Each query's bucket for each key, both directions: keys after the query take the upper half."""
    offset = torch.arange(length, device=device)[None, :] - torch.arange(length, device=device)[:, None]
    half = buckets // 2
    return torch.where(offset > 0, half, 0) + _log_buckets(offset.abs(), half // 2, half, max_distance)


def decoder_buckets(length: int, buckets: int, max_distance: int, device: torch.device) -> torch.Tensor:
    """Each query's bucket for each earlier key (later keys are masked, their bucket is zero's)."""
    distance = (torch.arange(length, device=device)[:, None] - torch.arange(length, device=device)[None, :]).clamp(
        min=0
    )
    return _log_buckets(distance, buckets // 2, buckets, max_distance)


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.scale * normed.to(self.scale.dtype)


def _heads(x: torch.Tensor, parts: int, heads: int, head_width: int) -> torch.Tensor:
    """``[batch, tokens, parts * heads * head_width]`` as ``[parts, batch, heads, tokens, head_width]``."""
    batch, tokens, _ = x.shape
    return x.view(batch, tokens, parts, heads, head_width).permute(2, 0, 3, 1, 4)


def _merged(x: torch.Tensor) -> torch.Tensor:
    batch, _, tokens, _ = x.shape
    return x.transpose(1, 2).reshape(batch, tokens, -1)


class SelfAttention(nn.Module):
    def __init__(self, config: T5PortConfig) -> None:
        super().__init__()
        self.heads, self.head_width = config.heads, config.head_width
        self.scale = 1.0  # T5 does not scale its scores (a port taking SDPA's default 1/sqrt(d) is wrong)
        inner = config.heads * config.head_width
        self.qkv = nn.Linear(config.width, 3 * inner, bias=False)
        self.out = nn.Linear(inner, config.width, bias=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        q, k, v = _heads(self.qkv(x), 3, self.heads, self.head_width)
        return self.out(_merged(F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), scale=self.scale)))


class CrossAttention(nn.Module):
    def __init__(self, config: T5PortConfig) -> None:
        super().__init__()
        self.heads, self.head_width = config.heads, config.head_width
        self.scale = 1.0
        inner = config.heads * config.head_width
        self.q = nn.Linear(config.width, inner, bias=False)
        self.kv = nn.Linear(config.width, 2 * inner, bias=False)
        self.out = nn.Linear(inner, config.width, bias=False)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        q = _heads(self.q(x), 1, self.heads, self.head_width)[0]
        k, v = _heads(self.kv(memory), 2, self.heads, self.head_width)
        return self.out(_merged(F.scaled_dot_product_attention(q, k, v, scale=self.scale)))


class FeedForward(nn.Module):
    def __init__(self, config: T5PortConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.width, config.hidden, bias=False)
        self.up = nn.Linear(config.width, config.hidden, bias=False)
        self.down = nn.Linear(config.hidden, config.width, bias=False)
        self.approximate = "tanh"  # T5 v1.1's gelu_new (the exact GELU is a port's bug)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.gate(x), approximate=self.approximate) * self.up(x))


class EncoderLayer(nn.Module):
    def __init__(self, config: T5PortConfig) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(config.width, config.eps), SelfAttention(config)
        self.ff_norm, self.ff = RMSNorm(config.width, config.eps), FeedForward(config)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), bias)
        return x + self.ff(self.ff_norm(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: T5PortConfig) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(config.width, config.eps), SelfAttention(config)
        self.cross_norm, self.cross = RMSNorm(config.width, config.eps), CrossAttention(config)
        self.ff_norm, self.ff = RMSNorm(config.width, config.eps), FeedForward(config)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), bias)
        x = x + self.cross(self.cross_norm(x), memory)
        return x + self.ff(self.ff_norm(x))


class Encoder(nn.Module):
    def __init__(self, config: T5PortConfig) -> None:
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab, config.width)
        self.position_bias = nn.Embedding(config.buckets, config.heads)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.encoder_layers))
        self.norm = RMSNorm(config.width, config.eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        buckets = encoder_buckets(ids.shape[1], self.config.buckets, self.config.max_distance, ids.device)
        bias = self.position_bias(buckets).permute(2, 0, 1)[None]
        x = self.tok(ids)
        for layer in self.layers:
            x = layer(x, bias)
        return self.norm(x)


class Decoder(nn.Module):
    def __init__(self, config: T5PortConfig) -> None:
        super().__init__()
        self.config = config
        self.position_bias = nn.Embedding(config.buckets, config.heads)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.decoder_layers))
        self.norm = RMSNorm(config.width, config.eps)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        buckets = decoder_buckets(length, self.config.buckets, self.config.max_distance, x.device)
        causal = torch.full((length, length), float("-inf"), device=x.device).triu(1)
        bias = self.position_bias(buckets).permute(2, 0, 1)[None] + causal.to(self.position_bias.weight.dtype)
        for layer in self.layers:
            x = layer(x, bias, memory)
        return self.norm(x)


class T5Port(nn.Module):
    def __init__(self, config: T5PortConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)

    def forward(self, ids: torch.Tensor, decoder_ids: torch.Tensor) -> torch.Tensor:
        memory = self.encoder(ids)
        hidden = self.decoder(self.encoder.tok(decoder_ids), memory)
        return (hidden * self.config.width**-0.5) @ self.encoder.tok.weight.T


LAYERS = {  # the port's modules under {encoder,decoder}.layers.{i} and transformers' under {stack}.block.{i}
    "encoder": {
        "attn_norm": "layer.0.layer_norm",
        "attn.out": "layer.0.SelfAttention.o",
        "ff_norm": "layer.1.layer_norm",
        "ff.gate": "layer.1.DenseReluDense.wi_0",
        "ff.up": "layer.1.DenseReluDense.wi_1",
        "ff.down": "layer.1.DenseReluDense.wo",
    },
    "decoder": {
        "attn_norm": "layer.0.layer_norm",
        "attn.out": "layer.0.SelfAttention.o",
        "cross_norm": "layer.1.layer_norm",
        "cross.q": "layer.1.EncDecAttention.q",
        "cross.out": "layer.1.EncDecAttention.o",
        "ff_norm": "layer.2.layer_norm",
        "ff.gate": "layer.2.DenseReluDense.wi_0",
        "ff.up": "layer.2.DenseReluDense.wi_1",
        "ff.down": "layer.2.DenseReluDense.wo",
    },
}
_QKV = ("layer.0.SelfAttention.q", "layer.0.SelfAttention.k", "layer.0.SelfAttention.v")
FUSED = {  # per stack, the port's fused projections and the transformers projections whose rows they hold, in order
    "encoder": {"attn.qkv": _QKV},
    "decoder": {"attn.qkv": _QKV, "cross.kv": ("layer.1.EncDecAttention.k", "layer.1.EncDecAttention.v")},
}


def config_of(t5: nn.Module) -> T5PortConfig:
    """The port's configuration of a transformers ``T5ForConditionalGeneration``."""
    config = t5.config
    if not config.is_gated_act or config.dense_act_fn != "gelu_new" or not config.tie_word_embeddings:
        raise ValueError("the port implements T5 v1.1's gated-GELU feed-forward with the head tied to the embedding")
    return T5PortConfig(
        vocab=config.vocab_size, width=config.d_model, heads=config.num_heads, head_width=config.d_kv,
        hidden=config.d_ff, encoder_layers=config.num_layers, decoder_layers=config.num_decoder_layers,
        buckets=config.relative_attention_num_buckets, max_distance=config.relative_attention_max_distance,
        eps=config.layer_norm_epsilon,
    )  # fmt: skip


def from_t5(t5: nn.Module) -> T5Port:
    """The port holding ``t5``'s weights: fused projections concatenated in q, k, v order, each stack's position
    table taken from its first attention."""
    config = config_of(t5)
    with torch.random.fork_rng(devices=[]):  # every initial weight is replaced below
        port = T5Port(config).eval()
    weights = t5.state_dict()
    converted = {"encoder.tok.weight": weights["shared.weight"]}
    for stack, layers in (("encoder", config.encoder_layers), ("decoder", config.decoder_layers)):
        table = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        converted[f"{stack}.position_bias.weight"] = weights[table]
        converted[f"{stack}.norm.scale"] = weights[f"{stack}.final_layer_norm.weight"]
        for i in range(layers):
            ours, theirs = f"{stack}.layers.{i}", f"{stack}.block.{i}"
            for mine, source in LAYERS[stack].items():
                name = "scale" if mine.endswith("norm") else "weight"
                converted[f"{ours}.{mine}.{name}"] = weights[f"{theirs}.{source}.weight"]
            for mine, sources in FUSED[stack].items():
                parts = [weights[f"{theirs}.{source}.weight"] for source in sources]
                converted[f"{ours}.{mine}.weight"] = torch.cat(parts)
    port.load_state_dict({name: tensor.clone() for name, tensor in converted.items()})
    return port
