"""A sparse mixture-of-experts decoder written from scratch, one module per expert: the candidate of the MoE pair.

Written in the style of Mistral's own reference code, not transformers': the router is a plain ``nn.Linear``, the
top-k is taken on the router's logits and only those k logits are softmaxed (transformers softmaxes every logit in
float32, takes the top-k of the probabilities and renormalises them: the same weights, computed otherwise), each
expert is its own ``w2(silu(w1(x)) * w3(x))`` module called on the tokens routed to it, and the results are added
into place by index. Rotary angles are computed in the forward from the positions (no table), attention is torch's
``scaled_dot_product_attention`` with repeated key/value heads. :func:`from_mixtral` converts a transformers
``MixtralForCausalLM`` (whose experts are one 3-D parameter per projection) into it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MoeConfig:
    vocab: int
    width: int
    layers: int
    heads: int
    kv_heads: int
    hidden: int
    """Each expert's inner width."""
    experts: int
    top_k: int
    eps: float
    theta: float


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """``x`` (``[batch, heads, tokens, dim]``) turned by its positions' angles, each head's halves as one pair."""
    dim, tokens = x.shape[-1], x.shape[-2]
    inverse = 1.0 / theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(tokens, device=x.device, dtype=torch.float32), inverse)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: MoeConfig) -> None:
        super().__init__()
        self.config = config
        head = config.width // config.heads
        self.wq = nn.Linear(config.width, config.heads * head, bias=False)
        self.wk = nn.Linear(config.width, config.kv_heads * head, bias=False)
        self.wv = nn.Linear(config.width, config.kv_heads * head, bias=False)
        self.wo = nn.Linear(config.heads * head, config.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        config = self.config
        head = config.width // config.heads
        q = self.wq(x).view(batch, tokens, config.heads, head).transpose(1, 2)
        k = self.wk(x).view(batch, tokens, config.kv_heads, head).transpose(1, 2)
        v = self.wv(x).view(batch, tokens, config.kv_heads, head).transpose(1, 2)
        q, k = rotary(q, config.theta), rotary(k, config.theta)
        repeats = config.heads // config.kv_heads
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, tokens, -1))


class Expert(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(width, hidden, bias=False)
        self.w2 = nn.Linear(hidden, width, bias=False)
        self.w3 = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoeLayer(nn.Module):
    def __init__(self, config: MoeConfig) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.gate = nn.Linear(config.width, config.experts, bias=False)
        self.experts = nn.ModuleList(Expert(config.width, config.hidden) for _ in range(config.experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.gate(flat)
        weights, chosen = torch.topk(logits, self.top_k, dim=-1)
        weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(x.dtype)
        results = torch.zeros_like(flat)
        for number, expert in enumerate(self.experts):
            tokens, slot = torch.where(chosen == number)
            if tokens.numel():
                results[tokens] += weights[tokens, slot, None] * expert(flat[tokens])
        return results.view_as(x)


class Block(nn.Module):
    def __init__(self, config: MoeConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.width, config.eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.width, config.eps)
        self.feed_forward = MoeLayer(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class MoeDecoder(nn.Module):
    def __init__(self, config: MoeConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab, config.width)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = RMSNorm(config.width, config.eps)
        self.output = nn.Linear(config.width, config.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(ids)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


MODULES = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
LAYER = {  # under layers.{i} / model.layers.{i}
    "attention_norm": "input_layernorm",
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "feed_forward.gate": "mlp.gate",
}


def config_of(mixtral: nn.Module) -> MoeConfig:
    """The port's configuration of a transformers ``MixtralForCausalLM``."""
    config = mixtral.config
    if config.hidden_act != "silu" or getattr(config, "sliding_window", None) is not None:
        raise ValueError("the port implements silu experts and full causal attention")
    return MoeConfig(
        vocab=config.vocab_size, width=config.hidden_size, layers=config.num_hidden_layers,
        heads=config.num_attention_heads, kv_heads=config.num_key_value_heads, hidden=config.intermediate_size,
        experts=config.num_local_experts, top_k=config.num_experts_per_tok, eps=config.rms_norm_eps,
        theta=float(config.rope_parameters["rope_theta"]),
    )  # fmt: skip


def from_mixtral(mixtral: nn.Module) -> MoeDecoder:
    """The port holding ``mixtral``'s weights: each expert's rows cut from the fused 3-D projections (gate rows
    first, then up, in ``gate_up_proj[e]``; ``down_proj[e]`` whole)."""
    config = config_of(mixtral)
    with torch.random.fork_rng(devices=[]):  # every initial weight is replaced below
        port = MoeDecoder(config).eval()
    weights = mixtral.state_dict()
    converted = {f"{ours}.weight": weights[f"{theirs}.weight"] for ours, theirs in MODULES.items()}
    for i in range(config.layers):
        theirs = f"model.layers.{i}"
        for ours, source in LAYER.items():
            converted[f"layers.{i}.{ours}.weight"] = weights[f"{theirs}.{source}.weight"]
        gate_up, down = weights[f"{theirs}.mlp.experts.gate_up_proj"], weights[f"{theirs}.mlp.experts.down_proj"]
        for e in range(config.experts):
            ours = f"layers.{i}.feed_forward.experts.{e}"
            converted[f"{ours}.w1.weight"] = gate_up[e, : config.hidden]
            converted[f"{ours}.w3.weight"] = gate_up[e, config.hidden :]
            converted[f"{ours}.w2.weight"] = down[e]
    port.load_state_dict({name: tensor.clone() for name, tensor in converted.items()})
    return port
