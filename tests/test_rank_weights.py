"""Each rank's own weights against the reference's: a hand-written Megatron-style port (experiments/megatron_tiny.py)
whose ranks each hold a fused ``[q_r; k_r; v_r]``, on 2 gloo processes. Its merged qkv output is no reference value;
the clean port passes with every rank's shards matched, and a block loaded wrong on rank 1 is named with its rank,
its rows and the reference projection it stands for."""

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
    assert scaled.finding.module in ("blocks.0.attn", "blocks.0.attn.o", "blocks.0")
    assert "rank 1: blocks.0.attn.qkv.weight rows 16-31" in headline(scaled.report)

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
