"""A table one side holds cut to a run of the other's rows: OPT's position table has two offset rows
transformers never reads, and TransformerLens keeps it without them; a port may trim a padded vocabulary. The
weights are the same where they are used, so the modules pair, and a bug there is named in fp32 and, through the
lifted replay, under bf16's rounding."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from paritylab.run.parity import check
from paritylab.tracing.structure import fingerprint, rows_of

WIDTH, TOKENS, VOCAB, OFFSET = 16, 12, 40, 2


class OffsetPositions(nn.Embedding):
    """OPT's learned positions: a table with ``OFFSET`` extra rows, indexed from an attention mask."""

    def forward(self, mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        positions = (torch.cumsum(mask, dim=1) * mask).long() - 1
        return super().forward(positions + OFFSET)


class Reference(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, WIDTH)
        self.embed_positions = OffsetPositions(TOKENS + OFFSET, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(ids.shape, dtype=self.embed_tokens.weight.dtype)
        return self.head(self.norm(self.embed_tokens(ids) + self.embed_positions(mask)))


class Positions(nn.Module):
    """TransformerLens' way: the used rows only, read by position from the tokens' length."""

    def __init__(self) -> None:
        super().__init__()
        self.W_pos = nn.Parameter(torch.zeros(TOKENS, WIDTH))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.W_pos[: tokens.shape[1]].expand(tokens.shape[0], -1, -1)


class Candidate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos_embed = Positions()
        self.ln_final = nn.LayerNorm(WIDTH)
        self.unembed = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.unembed(self.ln_final(self.embed(tokens) + self.pos_embed(tokens)))


def _pair(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    reference = Reference().eval()
    for parameter in reference.parameters():
        nn.init.normal_(parameter, std=0.5)
    candidate = Candidate().eval()
    with torch.no_grad():
        candidate.embed.weight.copy_(reference.embed_tokens.weight)
        candidate.pos_embed.W_pos.copy_(reference.embed_positions.weight[OFFSET:])
        candidate.ln_final.load_state_dict(reference.norm.state_dict())
        candidate.unembed.load_state_dict(reference.head.state_dict())
    return reference, candidate.to(dtype), torch.randint(0, VOCAB, (2, TOKENS))


def test_a_table_cut_to_a_run_of_rows_holds_the_same_weights():
    reference, candidate, _ = _pair()
    whole, part = fingerprint(reference)["embed_positions"], fingerprint(candidate)["pos_embed"]
    assert rows_of(whole, part) and not rows_of(part, whole)  # the cut side holds the whole side's rows
    with torch.no_grad():
        candidate.pos_embed.W_pos[[3, 4]] = candidate.pos_embed.W_pos[[4, 3]].clone()  # two rows swapped
    assert not rows_of(whole, fingerprint(candidate)["pos_embed"])
    with torch.no_grad():
        candidate.pos_embed.W_pos.copy_(reference.embed_positions.weight[OFFSET:] * 1.01)  # other values
    assert not rows_of(whole, fingerprint(candidate)["pos_embed"])
    assert not rows_of(whole, whole)  # nothing cut: the same weights, which the digests say already


def _planted(module: nn.Module, factor: float) -> None:
    module.register_forward_hook(lambda _m, _a, out: out * factor)


@pytest.mark.parametrize(("dtype", "size"), [(torch.float32, 1e-2), (torch.bfloat16, 1e-3)])
def test_a_bug_in_a_cut_table_is_named_at_its_counterpart(dtype, size, tmp_path):
    """The modules pair (their inputs, a float mask and token ids, are not compared as one value); the clean
    candidate passes, and a gain in the cut table's output is named there: in fp32 directly, in bf16 (where
    x1.001 hides under the rounding) by the lifted replay, the two holding the same rows."""
    reference, candidate, ids = _pair(dtype)
    calls = {"reference_call": lambda m: m(ids), "candidate_call": lambda m: m(ids)}
    clean = check(reference, candidate, tmp_path / "clean", **calls)
    assert clean.passed and clean.report.first_divergence is None
    pairs = {(pair.reference, pair.candidate) for pair in clean.report.alignment.pairs}
    assert ("embed_positions#0", "pos_embed#0") in pairs
    _planted(candidate.pos_embed, 1 + size)
    buggy = check(reference, candidate, tmp_path / "buggy", **calls)
    culprit = buggy.report.first_divergence
    assert not buggy.passed and culprit.path == "embed_positions"
    if dtype == torch.bfloat16:
        assert "with the same bfloat16 weights computed in float32" in culprit.note
        assert math.isclose(culprit.local["lifted_rel_l2"], size, rel_tol=0.05)
