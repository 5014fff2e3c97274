"""Each rank's own weights against the reference's: a hand-written Megatron-style port (experiments/megatron_tiny.py)
whose ranks each hold a fused ``[q_r; k_r; v_r]`` (and, gated, ``[gate_r; up_r]``), on 2 gloo processes. The weights'
row maps put the ranks' fused outputs in the reference's feature order, so each reference projection is compared
with its part of the merged output: the clean port passes with every call compared, and a block loaded wrong on
rank 1 fails at its projection, named with its rank, its rows and the reference projection it stands for."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from experiments import megatron_tiny
from paritylab.comparison.weights import weight_ledger
from paritylab.distributed import check_variants
from paritylab.reports.render import headline
from paritylab.tracing.structure import prints_from_meta
from paritylab.tracing.tracefile import Trace

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


def test_a_fused_shard_loaded_wrong_on_one_rank_is_named_with_its_rank_and_block(tmp_path: Path) -> None:
    variants = {
        "clean": {},
        "scaled": {"defect": "k_block_scaled"},
        "moved": {"defect": "k_block_from_v"},
        "bias": {"defect": "k_bias_scaled"},
    }
    x = torch.randn(2, 5, megatron_tiny.WIDTH, generator=torch.Generator().manual_seed(3))
    results = check_variants(
        megatron_tiny.reference(), "experiments.megatron_tiny:build", tmp_path, variants, world_size=2,
        inputs={"x": x}, timeout_s=240,
    )  # fmt: skip

    clean = results["clean"]
    assert clean.verdict == "pass", clean.summary()
    assert clean.finding is None and clean.report.alignment.weights.findings == []
    ledger = clean.report.ledger
    assert ledger.unaccounted == [] and ledger.differing == [] and ledger.covered == {}
    assert len(ledger.compared) == len(clean.reference.calls)  # every reference call compared, q, k and v included
    for index in range(megatron_tiny.LAYERS):
        for part, (start, stop) in zip("qkv", ((0, 32), (32, 64), (64, 96)), strict=True):
            row = next(row for row in clean.report.rows if row.path == f"blocks.{index}.attn.{part}")
            assert (row.status, row.verdict, row.source) == ("compared", "pass", "weights")
            assert row.candidate is not None and row.candidate.key == f"blocks.{index}.attn.qkv#0"
            assert row.candidate.shape == [2, 5, 32] and (row.metrics["rel_l2"] < 1e-6)
            part_of = clean.report.alignment.by_reference()[f"blocks.{index}.attn.{part}#0"].candidate_part
            assert part_of is not None and part_of.bounds(96) == (start, stop)
    merged = clean.candidate.slot("blocks.0.attn.qkv#0", "outputs")
    assert merged is not None and merged.rule == "rows" and merged.agrees == [True, True]
    assert merged.reference_shape == [2, 5, 96]  # [q; k; v] in the reference's order, not [q_0; k_0; v_0; q_1; ...]
    assert "rank 1 rows 0-15 = blocks.0.attn.q rows 16-31, 16-31 = blocks.0.attn.k rows 16-31" in merged.note
    assert clean.candidate.row_maps["blocks.0.attn.qkv"].segments == [
        ("blocks.0.attn.q", 32), ("blocks.0.attn.k", 32), ("blocks.0.attn.v", 32)
    ]  # fmt: skip
    assert "blocks.0.mlp.up" not in clean.candidate.row_maps  # a plain shard: merged by concatenation, as before
    for rank in range(2):  # every shard of every rank holds the reference's values: rows, columns, stretches of biases
        ledger = weight_ledger(
            prints_from_meta(clean.reference.meta), prints_from_meta(clean.candidate.rank_trace(rank).meta)
        )
        assert ledger.unmatched == [] and ledger.findings == [], rank
    rank1 = prints_from_meta(Trace.load(tmp_path / "ranks" / "clean" / "rank1").meta)  # its own shards, hashed
    assert [param.shape for param in rank1["blocks.0.attn.qkv"].params] == [(48, 32), (48,)]

    scaled = results["scaled"]
    assert scaled.verdict == "fail"
    assert scaled.finding is not None and (scaled.finding.kind, scaled.finding.ranks) == ("weight", [1])
    (weight,) = scaled.report.alignment.weights.differing
    assert weight.line() == (
        "rank 1: blocks.0.attn.qkv.weight rows 16-31 differs from the reference's blocks.0.attn.k.weight rows 16-31: "
        "scaled by 1.01, rel_l2 0.01"
    )
    assert weight.reference_module == "blocks.0.attn.k"
    assert "rank 1's blocks.0.attn.qkv.weight rows 16-31 differs" in scaled.finding.message
    assert "rank 1: blocks.0.attn.qkv.weight rows 16-31" in headline(scaled.report)
    for result in (scaled, results["moved"], results["bias"]):  # the k projection's part of rank 1's qkv fails
        row = result.report.first_divergence
        assert row is not None and row.path == "blocks.0.attn.k" and row.candidate is not None
        assert row.candidate.key == "blocks.0.attn.qkv#0" and row.verdict == "fail"
        assert result.finding is not None and result.finding.module == "blocks.0.attn.k"
        assert result.finding.call == "blocks.0.attn.qkv#0" and result.finding.ranks == [1]
        for part in "qv":  # the other parts of the same fused output agree
            other = next(item for item in result.report.rows if item.path == f"blocks.0.attn.{part}")
            assert (other.status, other.verdict) == ("compared", "pass")
        slot = result.candidate.slot("blocks.0.attn.qkv#0", "outputs")
        assert slot is not None and slot.rule == "rows" and slot.agrees == [True, False]
    assert scaled.report.first_divergence.metrics["rel_l2"] == pytest.approx(0.01 / 2**0.5 * 1.1, rel=0.5)
    moved_slot = results["moved"].candidate.slot("blocks.0.attn.qkv#0", "outputs")
    assert moved_slot is not None and "rank 1 placed by the layout the other ranks share" in moved_slot.note

    moved = results["moved"]
    assert moved.verdict == "fail"
    assert moved.finding is not None and (moved.finding.kind, moved.finding.ranks) == ("weight", [1])
    (weight,) = moved.report.alignment.weights.differing
    assert weight.candidate == "rank 1: blocks.0.attn.qkv.weight rows 16-31"
    assert weight.detail == "they hold the reference's blocks.0.attn.v.weight rows 16-31"

    bias = results["bias"]
    assert bias.verdict == "fail"
    assert bias.finding is not None and (bias.finding.kind, bias.finding.ranks) == ("weight", [1])
    (weight,) = bias.report.alignment.weights.differing
    assert weight.line() == (
        "rank 1: blocks.0.attn.qkv.bias [16:32] differs from the reference's blocks.0.attn.k.bias [16:32]: "
        "scaled by 1.01, rel_l2 0.01"
    )


def test_a_fused_gate_up_shard_per_rank_is_merged_in_the_reference_order_and_a_wrong_block_named(
    tmp_path: Path,
) -> None:
    """A second layout: each rank's MLP fuses its rows of the reference's separate gate and up projections into one
    ``gate_up`` Linear, ``[gate_r; up_r]``; the same row maps merge it, with no rule for MLPs."""
    x = torch.randn(2, 5, megatron_tiny.WIDTH, generator=torch.Generator().manual_seed(4))
    results = check_variants(
        megatron_tiny.reference(gated=True), "experiments.megatron_tiny:build", tmp_path,
        {"clean": {"mlp": "gated"}, "up": {"mlp": "gated", "defect": "up_block_scaled"}}, world_size=2,
        inputs={"x": x}, timeout_s=240,
    )  # fmt: skip

    clean = results["clean"]
    assert clean.verdict == "pass", clean.summary()
    ledger = clean.report.ledger
    assert ledger.unaccounted == [] and ledger.covered == {} and len(ledger.compared) == len(clean.reference.calls)
    for index in range(megatron_tiny.LAYERS):
        for part, start in (("gate", 0), ("up", megatron_tiny.INNER)):
            row = next(row for row in clean.report.rows if row.path == f"blocks.{index}.mlp.{part}")
            assert (row.status, row.verdict, row.source) == ("compared", "pass", "weights")
            assert row.candidate is not None and row.candidate.key == f"blocks.{index}.mlp.gate_up#0"
            assert row.candidate.shape == [2, 5, megatron_tiny.INNER]
            part_of = clean.report.alignment.by_reference()[f"blocks.{index}.mlp.{part}#0"].candidate_part
            assert part_of is not None and part_of.bounds(128) == (start, start + megatron_tiny.INNER)
    row_map = clean.candidate.row_maps["blocks.0.mlp.gate_up"]
    assert row_map.segments == [("blocks.0.mlp.gate", 64), ("blocks.0.mlp.up", 64)]
    assert row_map.positions()[1][:2] == [32, 33] and row_map.positions()[1][32:34] == [96, 97]

    up = results["up"]
    assert up.verdict == "fail"
    row = up.report.first_divergence
    assert row is not None and row.path == "blocks.0.mlp.up" and row.candidate is not None
    assert row.candidate.key == "blocks.0.mlp.gate_up#0"
    assert up.finding is not None and (up.finding.kind, up.finding.ranks) == ("weight", [1])
    assert "rank 1's blocks.0.mlp.gate_up.weight rows 32-63 differs from the reference's blocks.0.mlp.up.weight" in (
        up.finding.message
    )
    gate = next(item for item in up.report.rows if item.path == "blocks.0.mlp.gate")
    assert (gate.status, gate.verdict) == ("compared", "pass")
