"""A port built on ``torch.nn.MultiheadAttention`` (issue #27): the module reads its child ``out_proj``'s weights
directly and never calls it, so those weights count in the module's fingerprint. Its attention is then paired
with the reference's attention block (not with ``v_proj``, the last of a run of q, k and v), and clean pairs pass."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from transformers import CLIPTextConfig, CLIPTextModel

import paritylab
from paritylab.comparison.drilldown import drill_down
from paritylab.comparison.operations import record_call
from tests.pairs import planted

WIDTH, HEADS, LAYERS, LENGTH = 32, 4, 2, 8


def clip_text(seed: int = 0) -> CLIPTextModel:
    """A tiny random-init transformers CLIP text encoder (causal, pre-norm, q/k/v/out projections apart)."""
    config = CLIPTextConfig(
        vocab_size=64, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, max_position_embeddings=16, hidden_act="gelu", bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )  # fmt: skip
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return CLIPTextModel(config).eval()


def torch_attention(reference: nn.Module) -> nn.MultiheadAttention:
    """PyTorch's own attention: one ``in_proj_weight`` for q, k and v; ``out_proj`` is read, never called."""
    attention = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
    parts = [getattr(reference, f"{name}_proj") for name in "qkv"]
    with torch.no_grad():
        attention.in_proj_weight.copy_(torch.cat([part.weight for part in parts]))
        attention.in_proj_bias.copy_(torch.cat([part.bias for part in parts]))
        attention.out_proj.load_state_dict(reference.out_proj.state_dict())
    return attention


class HandAttention(nn.Module):
    """Calls its q, k and v projections, but reads its output projection's weights in its own code."""

    def __init__(self, reference: nn.Module) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
        for mine, theirs in zip("qkvo", ("q_proj", "k_proj", "v_proj", "out_proj"), strict=True):
            getattr(self, mine).load_state_dict(getattr(reference, theirs).state_dict())

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor, **_
    ) -> tuple:
        batch, length, _ = query.shape
        q, k, v = (
            proj(x).view(batch, length, HEADS, -1).transpose(1, 2)
            for proj, x in ((self.q, query), (self.k, key), (self.v, value))
        )
        heads = F.scaled_dot_product_attention(q, k, v, attn_mask=~attn_mask)
        return F.linear(heads.transpose(1, 2).reshape(batch, length, WIDTH), self.o.weight, self.o.bias), None


class Layer(nn.Module):
    def __init__(self, reference: nn.Module, attention: Callable[[nn.Module], nn.Module]) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attention = attention(reference.self_attn)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        normed = self.norm1(x)
        x = x + self.attention(normed, normed, normed, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Port(nn.Module):
    """An independent CLIP text encoder, weights copied from the reference."""

    def __init__(self, reference: CLIPTextModel, attention: Callable[[nn.Module], nn.Module]) -> None:
        super().__init__()
        self.tokens = nn.Embedding(64, WIDTH)
        self.positions = nn.Parameter(torch.zeros(16, WIDTH))
        self.blocks = nn.ModuleList(Layer(theirs, attention) for theirs in reference.encoder.layers)
        self.norm = nn.LayerNorm(WIDTH)
        embeddings = reference.embeddings
        with torch.no_grad():
            self.tokens.load_state_dict(embeddings.token_embedding.state_dict())
            self.positions.copy_(embeddings.position_embedding.weight)
            self.norm.load_state_dict(reference.final_layer_norm.state_dict())
            for block, theirs in zip(self.blocks, reference.encoder.layers, strict=True):
                block.norm1.load_state_dict(theirs.layer_norm1.state_dict())
                block.norm2.load_state_dict(theirs.layer_norm2.state_dict())
                block.mlp[0].load_state_dict(theirs.mlp.fc1.state_dict())
                block.mlp[2].load_state_dict(theirs.mlp.fc2.state_dict())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        x = self.tokens(ids) + self.positions[:length]
        mask = torch.ones(length, length, dtype=torch.bool).triu(1)  # True: not attended
        for block in self.blocks:
            x = block(x, mask)
        return self.norm(x)


IDS = torch.randint(3, 64, (2, LENGTH), generator=torch.Generator().manual_seed(1))


def _check(reference: nn.Module, candidate: nn.Module, directory) -> paritylab.run.parity.ParityResult:
    return paritylab.check(
        reference, candidate, directory, reference_call=lambda m: m(input_ids=IDS), candidate_call=lambda m: m(IDS),
        noise_floor="off",
    )  # fmt: skip


@pytest.mark.parametrize("attention", [torch_attention, HandAttention], ids=["nn.MultiheadAttention", "read-o"])
def test_an_attention_reading_its_childs_weights_is_paired_with_the_reference_attention(attention, tmp_path):
    """Clean, the pair passes with zero rules and the attention module is paired by its weights (q, k, v and
    the output projection it reads) with CLIP's attention block; bugs planted at its output, at an MLP and at a
    norm are named at their counterparts."""
    reference = clip_text()
    candidate = Port(reference, attention).eval()
    clean = _check(reference, candidate, tmp_path / "clean")
    report = clean.report
    assert clean.verdict == "pass" and report.first_divergence is None, [(r.path, r.note) for r in report.failing]
    pairs = {p.candidate.rsplit("#", 1)[0]: p for p in report.alignment.pairs}
    for layer in range(LAYERS):
        ours, theirs = f"blocks.{layer}", f"encoder.layers.{layer}"
        assert (pairs[f"{ours}.attention"].reference, pairs[f"{ours}.attention"].source) == (
            f"{theirs}.self_attn#0",
            "structure",
        )
        assert pairs[ours].reference == f"{theirs}#0"
    assert pairs["norm"].reference == "final_layer_norm#0"
    assert report.alignment.unmatched_candidate == []  # every candidate module has its counterpart
    sites = {
        "blocks.0.attention": "encoder.layers.0.self_attn",
        "blocks.1.attention": "encoder.layers.1.self_attn",
        "blocks.0.mlp": "encoder.layers.0.mlp",
        "blocks.1.norm2": "encoder.layers.1.layer_norm2",
    }
    for number, (site, expected) in enumerate(sites.items()):
        with planted(candidate, site, ("scale", "offset", "noise")[number % 3], 1e-3):
            buggy = _check(reference, candidate, tmp_path / f"bug{number}")
        named = buggy.report.first_divergence.path if buggy.report.first_divergence else None
        assert (buggy.verdict, named) == ("fail", expected), site


def test_the_drilldown_reads_a_fused_in_proj_weight_as_the_references_q_k_and_v():
    """Inside the attention, ``in_proj_weight`` [96, 32] and ``in_proj_bias`` match no reference value whole: their
    rows are CLIP's q, k and v stacked, found by their row hashes. A wrong output projection is then named as
    itself, not blamed on the fused weight."""
    reference = clip_text().encoder.layers[0].self_attn
    with torch.no_grad():  # CLIP initialises biases to zeros: give each its own values
        for projection in "qkv":
            getattr(reference, f"{projection}_proj").bias.normal_(
                generator=torch.Generator().manual_seed(ord(projection))
            )
    candidate = torch_attention(reference).eval()
    with torch.no_grad():
        candidate.out_proj.weight.mul_(1.01)
    x = torch.randn(2, LENGTH, WIDTH, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(LENGTH, LENGTH, dtype=torch.bool).triu(1)
    additive = torch.zeros(LENGTH, LENGTH).masked_fill(mask, float("-inf"))[None, None]
    mine = record_call(candidate, "", 0, lambda m: m(x, x, x, attn_mask=mask, need_weights=False))
    theirs = record_call(reference, "", 0, lambda m: m(x, attention_mask=additive))
    found = drill_down(theirs, mine, torch.float32)
    assert found.value is not None and found.value.origin == "parameter out_proj.weight", found.message
    origins = {value.origin: value for value in mine.values}
    for name in ("weight", "bias"):
        parts = [theirs.values[index].origin for index in origins[f"parameter in_proj_{name}"].parts]
        assert parts == [f"parameter {projection}_proj.{name}" for projection in "qkv"]
