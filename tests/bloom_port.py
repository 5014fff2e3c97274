"""A BLOOM port written as one is written into another codebase, against transformers' ``BloomForCausalLM``.

Where transformers' ``BloomAttention`` and ``BloomMLP`` each add the residual to what they return (``residual +
dense(...)``, the residual handed in as an argument), this port's attention and feed-forward return their
projection's output and its block adds the residual, as most ports write a pre-norm block. The rest as a BLOOM port
has it: a fused ``qkv`` laid out head by head (``[h0: q k v][h1: q k v]...``), ALiBi slopes computed once by the
port's own code and held as a buffer (transformers computes them in ``BloomModel.forward``, with no module and no
tensor to compare them with), BLOOM's tanh GELU as a function, the embedding's layer norm, a head tied to the
embedding. ``from_bloom`` converts a reference's state dict; its arguments plant the code bugs the tests name.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn


def bloom_gelu(x: torch.Tensor) -> torch.Tensor:
    """BLOOM's GELU: the tanh approximation, with its constants."""
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1.0 + 0.044715 * x * x)))


def slopes(heads: int, base: float = 8.0) -> torch.Tensor:
    """ALiBi's slope per head: ``2**(-base/n)`` to the powers 1..n for the largest power of two ``n`` not above
    ``heads``, and every other slope of ``2n``'s sequence for the heads past it."""

    def sequence(count: int) -> list[float]:
        first = 2.0 ** (-base / count)
        return [first**power for power in range(1, count + 1)]

    closest = 2 ** int(math.log2(heads))
    values = sequence(closest) + sequence(2 * closest)[0::2][: heads - closest]
    return torch.tensor(values, dtype=torch.float32)


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads, self.size = heads, width // heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        fused = self.qkv(x).view(batch, length, self.heads, 3, self.size)
        q, k, v = (fused[:, :, :, part].transpose(1, 2) for part in range(3))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.size) + bias
        future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        weights = scores.float().masked_fill(future, torch.finfo(torch.float32).min).softmax(-1).to(v.dtype)
        return self.proj((weights @ v).transpose(1, 2).reshape(batch, length, width))


class FeedForward(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(bloom_gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, eps: float, residual: bool = True) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width, eps=eps), nn.LayerNorm(width, eps=eps)
        self.attn, self.ffn = Attention(width, heads), FeedForward(width)
        self.residual = residual
        """``False``: the attention's residual is left out (a bug)."""

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        attended = self.attn(self.norm1(x), bias)
        x = x + attended if self.residual else attended
        return x + self.ffn(self.norm2(x))


class BloomPort(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int, eps: float, base: float = 8.0) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.emb_norm = nn.LayerNorm(width, eps=eps)
        self.blocks = nn.ModuleList(Block(width, heads, eps) for _ in range(layers))
        self.out_norm = nn.LayerNorm(width, eps=eps)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.register_buffer("alibi", slopes(heads, base), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb_norm(self.tok(ids))
        positions = torch.arange(ids.shape[1], device=ids.device, dtype=torch.float32)
        bias = (self.alibi.float()[:, None, None] * positions)[None].to(x.dtype)  # [1, heads, 1, keys]
        for block in self.blocks:
            x = block(x, bias)
        return self.head(self.out_norm(x))


RENAMED = {
    "word_embeddings": "tok", "word_embeddings_layernorm": "emb_norm", "ln_f": "out_norm",
    "input_layernorm": "norm1", "post_attention_layernorm": "norm2", "self_attention.query_key_value": "attn.qkv",
    "self_attention.dense": "attn.proj", "mlp.dense_h_to_4h": "ffn.up", "mlp.dense_4h_to_h": "ffn.down",
}  # fmt: skip


def from_bloom(
    reference: nn.Module,
    base: float = 8.0,
    convert: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> BloomPort:
    """The port of a ``BloomForCausalLM``, its weights converted by name; ``base`` is the ALiBi constant (8), and
    ``convert`` changes the converted state dict before it is loaded (a conversion bug)."""
    config = reference.config
    port = BloomPort(config.vocab_size, config.hidden_size, config.n_layer, config.n_head, config.layer_norm_epsilon)
    port.alibi.copy_(slopes(config.n_head, base))
    state: dict[str, torch.Tensor] = {}
    for name, value in reference.state_dict().items():
        name = name.removeprefix("transformer.").replace("lm_head.", "head.")
        module, _, parameter = name.rpartition(".")
        if module.startswith("h."):
            _, layer, inner = module.split(".", 2)
            module = f"blocks.{layer}.{RENAMED[inner]}"
        state[f"{RENAMED.get(module, module)}.{parameter}"] = value.detach().clone()
    if convert is not None:
        convert(state)
    port.load_state_dict(state)
    return port.eval()


def sites(layers: int) -> tuple[dict[str, tuple[str, ...]], tuple[str, ...]]:
    """The port's planting sites and the reference modules each one's change is named at; and the sites with no
    counterpart (each block's attention and feed-forward, which return what the reference's return less the
    residual: a change to their output is the last projection's, named there or at the module holding it). The
    blocks are no sites here: the reference's block hands on its MLP's value, so a change to the port's block
    output is named at either (``tests/test_residual_placement.py``), where a site has one counterpart."""
    found: dict[str, tuple[str, ...]] = {
        "tok": ("transformer.word_embeddings",), "emb_norm": ("transformer.word_embeddings_layernorm",),
    }  # fmt: skip
    unpaired = []
    for layer in range(layers):
        ours, theirs = f"blocks.{layer}", f"transformer.h.{layer}"
        found[f"{ours}.norm1"] = (f"{theirs}.input_layernorm",)
        found[f"{ours}.attn.qkv"] = (f"{theirs}.self_attention.query_key_value",)
        found[f"{ours}.attn.proj"] = (f"{theirs}.self_attention.dense",)
        found[f"{ours}.attn"] = (f"{theirs}.self_attention.dense", f"{theirs}.self_attention")
        found[f"{ours}.norm2"] = (f"{theirs}.post_attention_layernorm",)
        found[f"{ours}.ffn.up"] = (f"{theirs}.mlp.dense_h_to_4h",)
        found[f"{ours}.ffn.down"] = (f"{theirs}.mlp.dense_4h_to_h",)
        found[f"{ours}.ffn"] = (f"{theirs}.mlp.dense_4h_to_h", f"{theirs}.mlp")
        unpaired += [f"{ours}.attn", f"{ours}.ffn"]
    found["out_norm"] = ("transformer.ln_f",)
    found["head"] = ("lm_head",)
    return found, tuple(unpaired)
