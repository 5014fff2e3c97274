"""Weights of three or more dimensions against fused 2-D ones, and parts against blocks: a per-head ``W_Q [heads,
d_model, d_head]`` (TransformerLens' layout) against a fused ``qkv`` projection, per-expert Linears against a fused
MoE's ``[experts, 2 * inner, d_model]``. Their fibers are the reference's rows; a defect in one is named as the block
of the reference tensor it stands for, and a weight whose defect these inputs cannot show still fails the run."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paritylab.comparison.weights import weight_ledger
from paritylab.reports.render import headline
from paritylab.run.parity import check
from paritylab.tracing.structure import ModulePrint, fingerprint

WIDTH, HEADS, INNER, EXPERTS = 32, 4, 16, 4
HEAD = WIDTH // HEADS


class FusedAttention(nn.Module):
    """Attention with one ``[3 * width, width]`` projection, as transformers' fused ports hold it."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (part.unflatten(-1, (HEADS, HEAD)).transpose(1, 2) for part in self.qkv(x).chunk(3, dim=-1))
        mixed = F.softmax(q @ k.transpose(-1, -2) / HEAD**0.5, dim=-1) @ v
        return self.out(mixed.transpose(1, 2).flatten(2))


class PerHeadAttention(nn.Module):
    """The same attention in TransformerLens' layout: ``W_Q [heads, width, head]``, ``b_Q [heads, head]``."""

    def __init__(self) -> None:
        super().__init__()
        for name in "QKV":
            setattr(self, f"W_{name}", nn.Parameter(torch.empty(HEADS, WIDTH, HEAD)))
            setattr(self, f"b_{name}", nn.Parameter(torch.empty(HEADS, HEAD)))
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (
            torch.einsum("bsd,hde->bhse", x, getattr(self, f"W_{name}")) + getattr(self, f"b_{name}")[:, None]
            for name in "QKV"
        )
        mixed = F.softmax(q @ k.transpose(-1, -2) / HEAD**0.5, dim=-1) @ v
        return self.out(mixed.transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.norm, self.attention, self.head = nn.LayerNorm(WIDTH), attention, nn.Linear(WIDTH, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.attention(self.norm(x)))


def attention_pair(plant: str = "") -> tuple[Block, Block]:
    torch.manual_seed(0)
    reference = Block(FusedAttention())
    candidate = Block(PerHeadAttention())
    candidate.norm.load_state_dict(reference.norm.state_dict())
    candidate.head.load_state_dict(reference.head.state_dict())
    candidate.attention.out.load_state_dict(reference.attention.out.state_dict())
    fused = reference.attention
    assert isinstance(fused, FusedAttention)
    with torch.no_grad():
        weights = fused.qkv.weight.unflatten(0, (3, HEADS, HEAD))  # [3, heads, head, width]
        biases = fused.qkv.bias.unflatten(0, (3, HEADS, HEAD))
        for index, name in enumerate("QKV"):
            getattr(candidate.attention, f"W_{name}").copy_(weights[index].transpose(1, 2))
            getattr(candidate.attention, f"b_{name}").copy_(biases[index])
        w_q = candidate.attention.W_Q
        if plant == "scaled":
            w_q *= 1.01
        elif plant == "element":
            w_q[1, 5, 3] *= 1.01
        elif plant == "heads":  # the first head loaded with the second's weights
            w_q[0] = w_q[1].clone()
    return reference, candidate


def ledger_of(reference: nn.Module, candidate: nn.Module):
    prints: tuple[dict[str, ModulePrint], dict[str, ModulePrint]] = (fingerprint(reference), fingerprint(candidate))
    return weight_ledger(*prints)


def test_a_per_head_layout_holds_the_fused_projections_rows_exactly():
    ledger = ledger_of(*attention_pair())
    assert ledger.findings == [] and ledger.matched == 8  # the norm's weight (its bias is zeros), W_Q, W_K, W_V, 2, 2
    # b_Q [heads, head] against stretches of a 1-D bias: a 1-D fingerprint keeps no fibers to hold them by (yet)
    assert ledger.unmatched == ["attention.b_Q", "attention.b_K", "attention.b_V"]


def test_a_scaled_per_head_weight_is_the_block_of_the_fused_projection_it_stands_for():
    (finding,) = ledger_of(*attention_pair("scaled")).differing
    assert finding.line() == (
        "attention.W_Q differs from the reference's attention.qkv.weight rows 0-31: scaled by 1.01, rel_l2 0.01"
    )
    assert (finding.candidate_module, finding.reference_module) == ("attention", "attention.qkv")


def test_one_element_of_a_per_head_weight_is_located_as_its_fiber():
    (finding,) = ledger_of(*attention_pair("element")).differing
    assert finding.candidate == "attention.W_Q [1, :, 3]"  # head 1, its 4th output feature: the fused row 11
    assert finding.reference == "attention.qkv.weight row 11"
    assert finding.rel_l2 is not None and 0 < finding.rel_l2 < 0.05


def test_a_head_loaded_from_the_wrong_place_says_which_rows_it_holds():
    (finding,) = ledger_of(*attention_pair("heads")).differing
    assert finding.candidate == "attention.W_Q [0, :, :]"
    assert finding.reference == "attention.qkv.weight rows 0-7"
    assert finding.detail == "they hold the reference's attention.qkv.weight rows 8-15"


def run(reference: nn.Module, candidate: nn.Module, tmp_path, dtype: torch.dtype, x: torch.Tensor):
    candidate = candidate.to(dtype)
    return check(reference, candidate, tmp_path, reference_call=lambda m: m(x.to(next(m.parameters()).dtype)))


def test_a_scaled_per_head_weight_fails_at_the_attention_in_fp32_and_bf16(tmp_path):
    x = torch.randn(2, 6, WIDTH, generator=torch.Generator().manual_seed(1))
    for dtype in (torch.float32, torch.bfloat16):
        report = run(*attention_pair("scaled"), tmp_path / str(dtype), dtype, x).report
        assert report.verdict == "fail"
        # the reference's qkv has no counterpart call (the candidate projects inside its attention's own code): the
        # value the attention's own code hands on is wrong while every module before it was given the reference's,
        # so the qkv is named, by the isolated replay in fp32 and by the lifted replay in bf16 (which named the
        # attention around it before it used the same rule), with the weight ledger's finding
        line = headline(report)
        assert report.summary()["first_divergence"] == "attention.qkv", line
        said = "attention.W_Q differs from the reference's attention.qkv.weight rows 0-31: scaled by 1.01, rel_l2 0.0"
        assert f"its weight differs, {said}" in line or f"its weights differ: {said}" in line
    clean = run(*attention_pair(), tmp_path / "clean", torch.bfloat16, x).report
    assert clean.verdict == "pass" and clean.alignment.weights.findings == []


class FusedExperts(nn.Module):
    """An MoE's experts as transformers fuses them: one 3-D parameter per projection."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(EXPERTS, 2 * INNER, WIDTH) / WIDTH**0.5)
        self.down_proj = nn.Parameter(torch.randn(EXPERTS, WIDTH, INNER) / INNER**0.5)


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(WIDTH, INNER, bias=False), nn.Linear(WIDTH, INNER, bias=False)
        self.down = nn.Linear(INNER, WIDTH, bias=False)


class PerExpert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))


def moe_pair() -> tuple[FusedExperts, PerExpert]:
    torch.manual_seed(0)
    fused, split = FusedExperts(), PerExpert()
    with torch.no_grad():
        for index, expert in enumerate(split.experts):
            gate, up = fused.gate_up_proj[index].chunk(2)
            expert.gate.weight.copy_(gate)
            expert.up.weight.copy_(up)
            expert.down.weight.copy_(fused.down_proj[index])
    return fused, split


def test_per_expert_linears_hold_a_fused_moes_blocks_and_a_wrong_one_names_its_expert():
    fused, split = moe_pair()
    clean = ledger_of(fused, split)
    assert clean.findings == [] and clean.matched == 3 * EXPERTS
    with torch.no_grad():
        split.experts[2].up.weight.mul_(1.01)
    (finding,) = ledger_of(fused, split).differing
    assert finding.line() == (
        "experts.2.up.weight differs from the reference's gate_up_proj [2, 16:32, :]: scaled by 1.01, rel_l2 0.01"
    )
    with torch.no_grad():
        split.experts[2].up.weight.div_(1.01)
        split.experts[1].down.weight.mul_(1.01)  # its rows and its columns are both fibers of down_proj: one block
    (finding,) = ledger_of(fused, split).differing
    assert finding.line() == (
        "experts.1.down.weight differs from the reference's down_proj [1, :, :]: scaled by 1.01, rel_l2 0.01"
    )


def test_a_fused_moe_against_per_expert_linears_names_the_expert_block_that_differs():
    fused, split = moe_pair()
    assert ledger_of(split, fused).findings == []
    with torch.no_grad():
        fused.down_proj[1].mul_(1.01)
    (finding,) = ledger_of(split, fused).differing
    assert finding.line() == (
        "down_proj [1, :, :] differs from the reference's experts.1.down.weight: scaled by 1.01, rel_l2 0.01"
    )


def test_fibers_survive_the_trace_file_and_a_damaged_one_is_no_evidence():
    from paritylab.tracing.structure import prints_from_meta

    fused, _ = moe_pair()
    prints = fingerprint(fused)
    entries = [item.to_json() for item in prints.values()]
    assert prints_from_meta({"structure": entries}) == prints
    (param,) = [p for p in prints[""].params if p.name == "down_proj"]
    assert [fibers.axis for fibers in param.fibers] == [0, 1, 2]
    assert [len(fibers.hashes) // 8 for fibers in param.fibers] == [WIDTH * INNER, EXPERTS * INNER, EXPERTS * WIDTH]
    entries[0]["params"][1]["fibers"][0]["hashes"] = entries[0]["params"][1]["fibers"][0]["hashes"][:-4]
    assert prints_from_meta({"structure": entries}) == {}


def reference_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


def test_a_wrong_weight_these_inputs_cannot_show_still_fails_at_its_module(tmp_path):
    reference = reference_mlp()
    candidate = reference_mlp()
    with torch.no_grad():
        candidate[0].weight[:, 0] *= 1.01  # a column no input reaches: feature 0 is zero below
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    x[:, 0] = 0
    report = run(reference, candidate, tmp_path, torch.float32, x).report
    assert all(row.rel_l2 == 0.0 for row in report.rows if row.status == "compared")  # every output is the same
    assert report.verdict == "fail"
    assert report.first_divergence is not None and report.first_divergence.path == "0"
    assert report.culprit_reason == (
        "its output agrees within tolerance on these inputs, but it computes with a weight that is not the reference's"
    )
    assert "its weights differ: 0.weight differs from the reference's 0.weight: columns 0 of 16 differ" in headline(
        report
    )


class ShiftedNorm(nn.Module):
    """An RMSNorm storing its scale as ``g = w - 1`` (it multiplies by ``1 + g``: Gemma's, x-transformers')."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.zeros(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (WIDTH,)) * (1 + self.g)


def test_a_norm_scale_stored_as_w_minus_one_with_a_defect_is_near_its_twin():
    torch.manual_seed(0)
    reference, candidate = nn.RMSNorm(WIDTH), ShiftedNorm()
    with torch.no_grad():
        reference.weight.copy_(1 + 0.1 * torch.randn(WIDTH))
        candidate.g.copy_(reference.weight - 1)
    assert ledger_of(reference, candidate).findings == []  # the same scale, stored the other way: exact
    with torch.no_grad():
        candidate.g.mul_(1.01)
    (finding,) = ledger_of(reference, candidate).differing
    assert finding.line().startswith("g differs from the reference's weight: scaled by 1.01 (as w - 1), rel_l2 0.01")


class RotaryReference(nn.Module):
    """Frequencies as transformers keeps them (``inv_freq``); the angles are made in the forward."""

    def __init__(self, base: float = 10000.0) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, HEAD, 2).float() / HEAD))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        angles = torch.arange(x.shape[1]).float()[:, None] * self.inv_freq
        return x * torch.cat([angles, angles], -1).sin()


class RotaryTable(nn.Module):
    """The same with a precomputed ``sin`` table, as TransformerLens keeps it (``rotary_sin [positions, head]``)."""

    def __init__(self, base: float = 10000.0, scale: float = 1.0) -> None:
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, HEAD, 2).float() / HEAD)
        angles = torch.arange(32).float()[:, None] * inv_freq
        self.register_buffer("rotary_sin", torch.cat([angles, angles], -1).sin() * scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.rotary_sin[: x.shape[1]]


def test_a_precomputed_rotary_table_is_matched_with_the_frequencies_it_is_built_from():
    assert ledger_of(RotaryReference(), RotaryTable()).findings == []
    assert ledger_of(RotaryReference(), RotaryTable()).matched == 1
    (scaled,) = ledger_of(RotaryReference(), RotaryTable(scale=1.01)).differing
    assert scaled.line() == (
        "rotary_sin differs from the reference's inv_freq: as sin(position x inv_freq), from row sums: "
        "scaled by 1.01, rel_l2 0.01"
    )
    (based,) = ledger_of(RotaryReference(), RotaryTable(base=20000.0)).differing
    assert based.candidate == "rotary_sin" and based.detail.startswith("as sin(position x inv_freq), from row sums")


def test_a_per_head_weight_against_q_rows_interleaved_head_by_head_is_the_gaps_its_peers_leave():
    reference, candidate = attention_pair("scaled")
    fused = reference.attention
    assert isinstance(fused, FusedAttention)
    with torch.no_grad():  # GPT-NeoX's layout: [q_h; k_h; v_h] for each head h in turn
        order = torch.arange(3 * WIDTH).unflatten(0, (3, HEADS, HEAD)).transpose(0, 1).flatten()
        fused.qkv.weight.copy_(fused.qkv.weight[order].clone())
        fused.qkv.bias.copy_(fused.qkv.bias[order].clone())
    (finding,) = ledger_of(reference, candidate).differing
    assert finding.line() == (
        "attention.W_Q differs from the reference's attention.qkv.weight rows 0-7, rows 24-31, rows 48-55, "
        "rows 72-79: scaled by 1.01, rel_l2 0.01"
    )


def _interleaved_heads(reference: Block) -> None:
    """GPT-NeoX's layout of the fused projection: ``[q_h; k_h; v_h]`` for each head ``h`` in turn."""
    fused = reference.attention
    assert isinstance(fused, FusedAttention)
    with torch.no_grad():
        order = torch.arange(3 * WIDTH).unflatten(0, (3, HEADS, HEAD)).transpose(0, 1).flatten()
        fused.qkv.weight.copy_(fused.qkv.weight[order].clone())
        fused.qkv.bias.copy_(fused.qkv.bias[order].clone())


def test_a_head_copied_over_another_where_no_neighbour_places_it_is_a_certain_finding(tmp_path):
    """Head 0's query loaded with head 1's where the fused rows interleave q, k and v head by head: no neighbouring
    block tells which rows the copy stands for, but head 1's rows are held twice and head 0's by no candidate tensor.
    A finding whatever its size (the run fails at the attention even where near uniform attention hides the wrong
    query: the NeoX pair's bf16 plant passed before), named where the fused rows are read. Repeating rows while holding
    every row (a port repeating key heads) is no finding."""
    reference, candidate = attention_pair("heads")
    _interleaved_heads(reference)
    (finding,) = ledger_of(reference, candidate).differing
    assert finding.certain and finding.rel_l2 is None and finding.candidate_module == "attention"
    assert finding.candidate in ("attention.W_Q [0, :, :]", "attention.W_Q [1, :, :]")
    assert finding.detail.startswith("a copy of the reference's attention.qkv.weight rows 24-31, which attention.W_Q [")
    assert finding.detail.endswith("while 8 fibers of attention.qkv.weight are held by no candidate tensor: a block "
                                   "loaded from the wrong place")  # fmt: skip
    x = torch.randn(2, 6, WIDTH, generator=torch.Generator().manual_seed(1)) * 0.1
    report = run(reference, candidate, tmp_path, torch.bfloat16, x).report
    assert report.first_divergence is not None, headline(report)
    assert report.first_divergence.path in ("attention", "attention.qkv") and "a copy of the reference's" in headline(
        report
    )

    keys, repeated = nn.Linear(WIDTH, 2 * HEAD, bias=False), nn.Linear(WIDTH, 4 * HEAD, bias=False)
    with torch.no_grad():  # two key heads, each held twice (a port repeating grouped key heads): every row held
        repeated.weight.copy_(keys.weight.unflatten(0, (2, HEAD)).repeat_interleave(2, dim=0).flatten(0, 1))
    assert ledger_of(keys, repeated).differing == []
