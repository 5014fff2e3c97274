"""Parity across ranks: a tensor-parallel candidate on 2 gloo ranks against a one-device reference.

The real runs (processes, gloo, ``parallelize_module`` over transformers' Llama: experiments/tp_llama.py) plant
each defect of a split and check the module, the rank and the kind of defect named. The merge rules are also
tested on rank traces written in this process (no process group needed: each "rank" is a module that returns
a chosen piece), where every layout and failure can be set exactly.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from paritylab.distributed import DistributedError, check_distributed, check_variants, compare_ranks
from paritylab.distributed.launch import LaunchResult, LaunchSpec, RankContext, RankStatus
from paritylab.distributed.merge import MergedTrace, call_order, concat_dim, merge_ranks, same_values
from paritylab.distributed.placements import PLACEMENTS_FILE
from paritylab.run.parity import trace_model
from paritylab.tracing.tracefile import Trace
from paritylab.tracing.tracer import TraceOptions, Tracer

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)
BUILDER = "experiments.tp_llama:build"


# -- real ranks: transformers' Llama, parallelize_module, 2 gloo processes ---------------------------------


def _llama() -> nn.Module:
    """A tiny Llama with an MLP bias, set to values that are not zero (transformers initialises biases to zero,
    and a zero bias counted twice is still right)."""
    from tests.tiny import tiny_llama

    model = tiny_llama(mlp_bias=True)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.copy_(torch.randn(module.bias.shape, generator=generator) * 0.1)
    return model


def test_tensor_parallel_llama_defects_are_named_by_module_and_rank(tmp_path: Path) -> None:
    """One launch of 2 ranks runs the clean port and four planted defects in turn; each is judged against the
    same one-device reference."""
    from tests.tiny import token_ids

    reference = _llama()
    variants = {
        "clean": {},
        "missing": {"defect": "missing_all_reduce"},
        "bias": {"defect": "bias_every_rank"},
        "swapped": {"defect": "swapped_gate_shards", "layer": 1},
        "rank1": {"defect": "rank1_scaled", "layer": 1},
    }
    results = check_variants(
        reference, BUILDER, tmp_path, variants, world_size=2, inputs={"input_ids": token_ids(batch=2)},
        call_kwargs={"use_cache": False}, options={"config": reference.config.to_dict()}, timeout_s=240,
    )  # fmt: skip
    assert list(results) == list(variants)

    clean = results["clean"]
    assert clean.verdict == "pass", clean.summary()
    assert clean.finding is None
    meta = Trace.load(tmp_path / "ranks" / "clean" / "rank1").meta
    assert (meta["rank"], meta["world_size"], meta["backend"]) == ("1", "2", "gloo")
    compared = [row for row in clean.report.rows if row.status == "compared"]
    assert len(compared) == len(clean.report.rows) >= 30 and not clean.report.not_compared
    assert not clean.report.alignment.unmatched_reference  # o_proj is no identity, though the ranks' tracers said so
    rules = clean.summary()["merge_rules"]
    assert rules.get("disagree", 0) == 0 and rules.get("unresolved", 0) == 0 and rules.get("missing", 0) == 0
    q_proj = clean.candidate.slot("model.layers.0.self_attn.q_proj#0", "outputs")  # ColwiseParallel: local heads
    assert q_proj is not None and (q_proj.rule, q_proj.dim, q_proj.shapes) == ("concat", 2, [[2, 6, 8], [2, 6, 8]])
    o_input = clean.candidate.slot("model.layers.0.self_attn.o_proj#0", "inputs.args.0")  # DTensor Shard(-1)
    assert o_input is not None and (o_input.rule, o_input.dim) == ("shard", 2)
    o_output = clean.candidate.slot("model.layers.0.self_attn.o_proj#0", "outputs")  # all-reduced
    assert o_output is not None and o_output.rule == "replicated" and o_output.agrees == [True, True]
    piece = clean.candidate.rank_value("model.layers.0.mlp.up_proj#0", "outputs", 1)
    whole = clean.reference.tensor(clean.reference.call("model.layers.0.mlp.up_proj#0").outputs or {})
    assert piece is not None and whole is not None and torch.allclose(piece, whole[..., 16:], atol=1e-6)

    origin = "the earliest module whose output diverges while its input agrees"
    for name in ("missing", "bias", "swapped", "rank1"):
        first = results[name].report.first_divergence
        assert first is not None and first.status == "compared", name
        assert results[name].report.culprit_reason == origin, name
    missing = results["missing"]
    assert missing.verdict == "fail"
    assert missing.report.first_divergence is not None
    assert missing.report.first_divergence.path == "model.layers.0.self_attn.o_proj"
    assert missing.finding is not None and missing.finding.kind == "partial-sum"
    assert missing.finding.module == "model.layers.0.self_attn.o_proj" and missing.finding.ranks == [0, 1]
    assert "partial sum: missing all-reduce" in missing.finding.message
    assert missing.finding.evidence["sum_error"] < 1e-5  # the ranks' sum is the reference's output
    assert "missing all-reduce" in missing.report.first_divergence.note  # shown in the report itself

    bias = results["bias"]
    assert bias.verdict == "fail"
    assert bias.finding is not None and bias.finding.module == "model.layers.0.mlp.down_proj"
    assert bias.finding.kind == "all-ranks" and bias.finding.rule == "replicated"
    assert "bias counted more than once" in bias.finding.message
    down = reference.model.layers[0].mlp.down_proj.bias.detach()  # counted twice: the offset is one extra bias
    assert bias.finding.evidence["offset_norm"] == pytest.approx(float(down.norm()), rel=1e-4)

    swapped = results["swapped"]
    assert swapped.verdict == "fail"
    assert swapped.finding is not None and swapped.finding.module == "model.layers.1.mlp.gate_proj"
    assert swapped.finding.kind == "shard-order" and swapped.finding.evidence["holds"] == [1, 0]
    assert "rank 0 holds part 1, rank 1 holds part 0" in swapped.finding.message

    rank1 = results["rank1"]
    assert rank1.verdict == "fail"
    assert rank1.finding is not None and rank1.finding.module == "model.layers.1.mlp.down_proj"
    assert rank1.finding.kind == "rank" and rank1.finding.ranks == [1]
    assert rank1.finding.evidence["rank_errors"][0] < 1e-5 < rank1.finding.evidence["rank_errors"][1]
    after = next(row for row in rank1.report.rows if row.path == "model.layers.1")  # rank 1's value carried on
    assert re.search(r"per rank: rank 0 agrees \(rel_l2 [0-9.e-]+\), rank 1 differs \(rel_l2 0\.\d+\)", after.note)
    assert json.loads((tmp_path / "rank1" / "distributed.json").read_text())["finding"]["ranks"] == [1]


def test_an_error_on_rank_1_only_is_named_with_its_rank(tmp_path: Path) -> None:
    from tests.tiny import tiny_llama, token_ids

    reference = tiny_llama()
    result = check_distributed(
        reference, BUILDER, tmp_path, world_size=2, inputs={"input_ids": token_ids()},
        call_kwargs={"use_cache": False}, timeout_s=240,
        options={"config": reference.config.to_dict(), "defect": "rank1_raises"},
    )  # fmt: skip
    assert result.verdict == "error"
    assert result.finding is not None and result.finding.kind == "error" and result.finding.ranks == [1]
    assert result.finding.module == "model.layers.0.mlp"
    assert result.finding.message.startswith("rank 1 failed during forward in model.layers.0.mlp: RuntimeError:")
    assert "\n" not in result.finding.message
    assert result.report.errors["candidate"]["rank"] == 1
    assert result.launch is not None and result.launch.culprit() is not None


def fail_on_rank_1(context: RankContext) -> nn.Module:
    """A builder that fails on rank 1 only (imported by the ranks of the test below, which is why this module
    imports transformers only inside the tests that need it)."""
    if context.rank == 1:
        raise ValueError("no shard for rank 1")
    return nn.Linear(4, 4)


def test_a_builder_that_fails_on_one_rank_raises_one_line_naming_it(tmp_path: Path) -> None:
    with pytest.raises(DistributedError) as raised:
        check_distributed(
            nn.Linear(4, 4), "tests.test_distributed:fail_on_rank_1", tmp_path, world_size=2,
            inputs={"input": torch.ones(2, 4)}, timeout_s=120,
        )  # fmt: skip
    line = str(raised.value)
    assert line.startswith("rank 1 failed during build: ValueError: no shard for rank 1")
    assert "\n" not in line and "rank1.log" in line


# -- the merge rules, on rank traces written here -------------------------------------------------------


class Emit(nn.Module):
    """Returns a chosen value, whatever it is given: one rank's piece of an activation."""

    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.value = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.value.clone()


class Pair(nn.Module):
    """``second(keep(first(x)))``: ``first`` is the module under test, ``keep`` returns its input (an identity
    call), ``second`` consumes it."""

    def __init__(self, first: torch.Tensor, second: torch.Tensor) -> None:
        super().__init__()
        self.first = Emit(first)
        self.keep = nn.Identity()
        self.second = Emit(second)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.keep(self.first(x)))


WHOLE = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(0))
OUT = torch.randn(3, generator=torch.Generator().manual_seed(1))
X = torch.ones(2)


def _traced_ranks(
    root: Path, pieces: list[torch.Tensor], options: dict[int, dict[str, object]] | None = None
) -> tuple[Trace, list[Path]]:
    """The reference (``first`` returns WHOLE) and one trace per rank (``first`` returns that rank's piece),
    written as the worker writes them (rank and world size in the meta, no fingerprints)."""
    reference = trace_model(Pair(WHOLE, OUT), lambda model: model(X), root / "reference")
    directories = []
    for rank, piece in enumerate(pieces):
        directory = root / f"rank{rank}"
        model = Pair(piece, OUT)
        metadata = {"rank": rank, "world_size": len(pieces)}
        traced = TraceOptions(save_tensors=True, fingerprint=False, metadata=metadata, **(options or {}).get(rank, {}))
        with Tracer(model, directory, traced):
            model(X)
        directories.append(directory)
    return reference, directories


def _place(directory: Path, key: str, slot: str, placement: dict[str, object]) -> None:
    (directory / PLACEMENTS_FILE).write_text(
        json.dumps({"calls": {key: {slot: {"placements": [placement], "mesh": [2], "shape": list(WHOLE.shape)}}}})
    )


def test_pieces_concatenated_along_a_middle_dimension_unevenly_pass(tmp_path: Path) -> None:
    reference, ranks = _traced_ranks(tmp_path, [WHOLE[:, :1], WHOLE[:, 1:4], WHOLE[:, 4:]])
    result = compare_ranks(reference, ranks, tmp_path / "out")
    assert result.verdict == "pass" and result.finding is None
    merge = result.candidate.slot("first#0", "outputs")
    assert merge is not None and (merge.rule, merge.dim, merge.agrees) == ("concat", 1, [True, True, True])
    assert result.candidate.trace.call("second#0").inputs["items"]["args"]["items"][0]["from"] == 1  # data flow kept
    assert result.candidate.trace.call("keep#0").identity and not result.candidate.trace.call("first#0").identity


def test_shards_out_of_order_are_named_with_the_part_each_rank_holds(tmp_path: Path) -> None:
    parts = WHOLE.chunk(2, dim=-1)
    reference, ranks = _traced_ranks(tmp_path, [parts[1], parts[0]])
    result = compare_ranks(reference, ranks, tmp_path / "out")
    assert result.verdict == "fail"
    assert result.finding is not None and (result.finding.module, result.finding.kind) == ("first", "shard-order")
    assert result.finding.ranks == [0, 1] and result.finding.evidence["holds"] == [1, 0]


def test_one_rank_s_wrong_shard_names_that_rank(tmp_path: Path) -> None:
    parts = WHOLE.split([1, 1, 2], dim=-1)
    reference, ranks = _traced_ranks(tmp_path, [parts[0], parts[1], parts[2] * 1.5])
    result = compare_ranks(reference, ranks, tmp_path / "out")
    assert result.finding is not None and (result.finding.kind, result.finding.ranks) == ("rank", [2])
    assert result.finding.message.startswith("first (outputs): rank 2's shard differs from the reference's")
    assert "ranks 0, 1's agrees" in result.finding.message


def test_replicas_of_a_sharding_on_a_2d_mesh_merge_and_a_wrong_replica_is_named(tmp_path: Path) -> None:
    """4 ranks as 2 replicas of 2 shards (tensor parallel inside data parallel, fed the same inputs): consecutive
    ranks shard (rank r holds r % 2) or ranks 2 apart do (r // 2); a replica that differs is named, and
    shards out of order in every replica are said to be."""
    left, right = WHOLE.chunk(2, dim=-1)
    for name, pieces, layout in (
        ("inner", [left, right, left, right], [0, 1, 0, 1]),
        ("outer", [left, left, right, right], [0, 0, 1, 1]),
    ):
        reference, ranks = _traced_ranks(tmp_path / name, pieces)
        result = compare_ranks(reference, ranks, tmp_path / name / "out")
        merge = result.candidate.slot("first#0", "outputs")
        assert result.verdict == "pass" and merge is not None, name
        assert (merge.rule, merge.dim, merge.parts, merge.agrees) == ("concat", 2, layout, [True] * 4)
        assert merge.note.startswith("4 ranks as 2 replicas of 2 shards (rank r holds shard r")
    reference, ranks = _traced_ranks(tmp_path / "wrong", [left, right, left, right * 1.5])
    result = compare_ranks(reference, ranks, tmp_path / "wrong" / "out")
    merge = result.candidate.slot("first#0", "outputs")  # each part from its worst replica: a check passes only if
    assert merge is not None and merge.agrees == [True, True, True, False]  # every replica's piece passes
    assert result.verdict == "fail" and result.finding is not None
    assert (result.finding.module, result.finding.kind, result.finding.ranks) == ("first", "rank", [3])
    assert "rank 3's shard differs from the reference's (rank 3 rel_l2 0.5); ranks 0, 1, 2's agrees" in (
        result.finding.message
    )
    reference, ranks = _traced_ranks(tmp_path / "order", [right, left, right, left])
    result = compare_ranks(reference, ranks, tmp_path / "order" / "out")
    assert result.finding is not None and (result.finding.kind, result.finding.ranks) == ("shard-order", [0, 1, 2, 3])
    assert (
        "rank 0 holds part 1, rank 1 holds part 0, rank 2 holds part 1, rank 3 holds part 0 of the reference's 2"
        in (result.finding.message)
    )


def test_partial_sums_are_a_missing_all_reduce_unless_declared(tmp_path: Path) -> None:
    share = torch.rand(WHOLE.shape, generator=torch.Generator().manual_seed(2))
    pieces = [WHOLE * share, WHOLE * (1 - share)]
    reference, ranks = _traced_ranks(tmp_path, pieces)
    flagged = compare_ranks(reference, ranks, tmp_path / "flagged")
    assert flagged.verdict == "fail"
    assert flagged.finding is not None and (flagged.finding.module, flagged.finding.kind) == ("first", "partial-sum")
    merge = flagged.candidate.slot("first#0", "outputs")
    assert merge is not None and merge.rule == "disagree" and merge.sum_agrees and merge.agrees == [False, False]
    declared = compare_ranks(reference, ranks, tmp_path / "declared", partial_outputs=["first"])
    assert declared.verdict == "pass"
    merge = declared.candidate.slot("first#0", "outputs")
    assert merge is not None and merge.rule == "partial" and merge.sum_agrees


def test_a_replicated_value_one_rank_gets_wrong_names_that_rank(tmp_path: Path) -> None:
    reference, ranks = _traced_ranks(tmp_path, [WHOLE, WHOLE + 0.5])
    result = compare_ranks(reference, ranks, tmp_path / "out")
    assert result.finding is not None and (result.finding.kind, result.finding.ranks) == ("rank", [1])
    merge = result.candidate.slot("first#0", "outputs")
    assert merge is not None and merge.chosen == 1 and not merge.sum_agrees  # the wrong rank stands for both


def test_placements_decide_over_values(tmp_path: Path) -> None:
    share = torch.rand(WHOLE.shape, generator=torch.Generator().manual_seed(3))
    reference, ranks = _traced_ranks(tmp_path, [WHOLE * share, WHOLE * (1 - share)])
    for directory in ranks:  # a DTensor placed Partial: a sum by construction, not a defect
        _place(directory, "first#0", "outputs", {"kind": "partial", "op": "sum"})
    summed = compare_ranks(reference, ranks, tmp_path / "partial")
    assert summed.verdict == "pass"
    assert summed.candidate.slot("first#0", "outputs").rule == "partial"  # type: ignore[union-attr]
    for directory in ranks:  # placed Replicate, yet the ranks differ: a defect, the worst rank stands
        _place(directory, "first#0", "outputs", {"kind": "replicate"})
    replicated = compare_ranks(reference, ranks, tmp_path / "replicate")
    merge = replicated.candidate.slot("first#0", "outputs")
    assert replicated.verdict == "fail" and merge is not None and merge.rule == "disagree"
    assert merge.note.startswith("placed Replicate, but the ranks hold different values")


def test_a_placement_not_merged_by_placement_falls_back_to_the_values(tmp_path: Path) -> None:
    reference, ranks = _traced_ranks(tmp_path, [WHOLE[..., :2], WHOLE[..., 2:]])
    two_d = {"placements": [{"kind": "shard", "dim": 0}, {"kind": "replicate"}], "mesh": [2, 1], "shape": [2, 6, 4]}
    for directory in ranks:
        (directory / PLACEMENTS_FILE).write_text(json.dumps({"calls": {"first#0": {"outputs": two_d}}}))
    result = compare_ranks(reference, ranks, tmp_path / "out")
    merge = result.candidate.slot("first#0", "outputs")
    assert result.verdict == "pass" and merge is not None and (merge.rule, merge.dim) == ("concat", 2)
    assert merge.note == "placed on a 2-D mesh (only 1-D meshes are merged by placement), so merged by values"


def test_what_nothing_proves_is_not_passed(tmp_path: Path) -> None:
    reference, ranks = _traced_ranks(tmp_path / "shapes", [WHOLE[:, :2, :2], WHOLE[:, 2:, 2:]])
    result = compare_ranks(reference, ranks, tmp_path / "shapes" / "out")
    assert result.candidate.slot("first#0", "outputs").rule == "unresolved"  # type: ignore[union-attr]
    assert result.verdict == "fail"  # rank 0's piece against the whole: shapes differ
    reference, ranks = _traced_ranks(tmp_path / "unsaved", [WHOLE, WHOLE], {1: {"max_bytes": 0}})
    result = compare_ranks(reference, ranks, tmp_path / "unsaved" / "out")
    merge = result.candidate.slot("first#0", "outputs")
    assert merge is not None and merge.rule == "missing" and merge.note.startswith("no value on rank 1")
    assert result.verdict == "inconclusive"


def test_merge_reads_ranks_in_order_and_keeps_pieces_addressable(tmp_path: Path) -> None:
    reference, ranks = _traced_ranks(tmp_path, [WHOLE[..., :2], WHOLE[..., 2:]])
    with pytest.raises(ValueError, match="holds the trace of rank 1, expected rank 0"):
        merge_ranks(list(reversed(ranks)), tmp_path / "reversed", reference)
    merge_ranks(ranks, tmp_path / "merged", reference)
    loaded = MergedTrace.load(tmp_path / "merged")
    assert loaded.world_size == 2 and loaded.slot("first#0", "outputs").rule == "concat"  # type: ignore[union-attr]
    assert torch.equal(loaded.rank_value("first#0", "outputs", 1), WHOLE[..., 2:])  # type: ignore[arg-type]
    merged_value = loaded.trace.tensor(loaded.trace.call("first#0").outputs or {})
    assert merged_value is not None and torch.equal(merged_value, WHOLE)


class Stage(nn.Module):
    """``Pair`` split into two pipeline stages: rank 0 runs ``first`` and ``keep`` and returns nothing, rank 1
    runs ``second`` on the value rank 0 would have sent and returns its output."""

    def __init__(self, rank: int, second: torch.Tensor) -> None:
        super().__init__()
        self.first = Emit(WHOLE) if rank == 0 else None
        self.keep = nn.Identity() if rank == 0 else None
        self.second = Emit(second) if rank == 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.first is not None and self.keep is not None:
            self.keep(self.first(x))
            return None
        assert self.second is not None
        return self.second(WHOLE.clone())


def _traced_stages(root: Path, second: torch.Tensor) -> tuple[Trace, list[Path]]:
    reference = trace_model(Pair(WHOLE, OUT), lambda model: model(X), root / "reference")
    directories = []
    for rank in range(2):
        directory, model = root / f"rank{rank}", Stage(rank, second)
        options = TraceOptions(save_tensors=True, fingerprint=False, metadata={"rank": rank, "world_size": 2})
        with Tracer(model, directory, options):
            model(X)
        directories.append(directory)
    return reference, directories


def test_pipeline_stages_merge_from_the_ranks_that_made_each_call(tmp_path: Path) -> None:
    """Calls made on one rank only (a module that exists on one stage) are merged from that rank, in an order
    each rank's own keeps, with parents and data flow renumbered; the root's output, ``None`` on the first stage,
    is the last stage's."""
    reference, ranks = _traced_stages(tmp_path, OUT)
    result = compare_ranks(reference, ranks, tmp_path / "out")
    assert result.verdict == "pass", result.summary()
    trace = result.candidate.trace
    assert trace.keys == ["#0", "first#0", "keep#0", "second#0"] == reference.keys
    assert [call.index for call in trace.calls] == [0, 1, 2, 3] and [c.parent for c in trace.calls] == [None, 0, 0, 0]
    for key, holders in (("first#0", [0]), ("second#0", [1]), ("#0", [1])):
        merge = result.candidate.slot(key, "outputs")
        assert merge is not None and (merge.rule, merge.ranks, merge.agrees) == ("stage", holders, [True]), key
    assert trace.call("#0").outputs["from"] == 3  # type: ignore[index]  # rank 1's index 1, renumbered
    assert trace.call("keep#0").identity
    assert result.candidate.notes == [
        "2 calls made on rank 0 only (first#0, keep#0): merged from the ranks that made them",
        "1 call made on rank 1 only (second#0): merged from the ranks that made them",
    ]
    wrong = compare_ranks(*_traced_stages(tmp_path / "wrong", OUT * 1.5), tmp_path / "wrong" / "out")
    finding = wrong.finding
    assert wrong.verdict == "fail" and finding is not None and (finding.module, finding.kind) == ("second", "rank")
    assert finding.ranks == [1] and finding.message == (
        "second (outputs): computed on rank 1 alone (its pipeline stage), and its value differs from the "
        "reference's (rank 1 rel_l2 0.5)"
    )


def test_call_order_keeps_every_rank_s_order_and_puts_later_stages_after_earlier_ones() -> None:
    assert call_order([["root", "a", "b"], ["root", "c", "d"]]) == ["root", "a", "b", "c", "d"]
    assert call_order([["a", "b", "c"], ["a", "x", "c", "y"], ["z"]]) == ["a", "b", "x", "c", "y", "z"]
    assert call_order([["a", "b"], ["a", "b"]]) == ["a", "b"]


def test_same_values_is_bitwise_with_nan_in_the_same_places() -> None:
    value = torch.tensor([1.0, float("nan"), 3.0])
    assert same_values(value, value.clone()) and not torch.equal(value, value.clone())
    assert not same_values(value, torch.tensor([1.0, 2.0, 3.0]))
    assert not same_values(value, value.double())


def test_concat_dim_needs_exactly_one_dimension_that_adds_up() -> None:
    assert concat_dim([[2, 3], [2, 5]], [2, 8]) == 1
    assert concat_dim([[1, 4], [3, 4]], [4, 4]) == 0
    assert concat_dim([[2, 3], [2, 4]], [2, 8]) is None  # does not add up
    assert concat_dim([[1, 3], [2, 5]], [3, 8]) is None  # two dimensions differ
    assert concat_dim([[2, 8]], [2, 8]) is None  # one rank: nothing to concatenate


def test_the_first_failure_that_is_no_peer_s_consequence_is_the_culprit(tmp_path: Path) -> None:
    spec = LaunchSpec("x:y", 3, tmp_path)
    statuses = [
        RankStatus(0, False, "forward", "RuntimeError: Connection closed by peer", seconds=1.0, consequential=True),
        RankStatus(1, False, "forward", "ValueError: bad shard", module="layers.0", seconds=2.0),
        RankStatus(2, False, "forward", "stopped while still running", consequential=True),
    ]
    launch = LaunchResult(spec, statuses, 3.0)
    assert launch.culprit() is statuses[1]
    line = launch.error_line()
    assert line.startswith("rank 1 failed during forward in layers.0: ValueError: bad shard; then rank 0 (forward")
    assert line.endswith(f"(traceback: {tmp_path / 'rank1.log'})")


def test_a_run_past_its_time_limit_says_so(tmp_path: Path) -> None:
    spec = LaunchSpec("x:y", 2, tmp_path, timeout_s=30)
    stopped = [RankStatus(rank, False, "forward", "stopped while still running", consequential=True) for rank in (0, 1)]
    line = LaunchResult(spec, stopped, 31.0, timed_out=True).error_line()
    assert (
        line == "the ranks did not finish within timeout_s=30 s and were stopped (rank 0 in forward, rank 1 in forward)"
    )


# -- the command line: python -m paritylab model=llama candidate=tp -----------------------------------------


def _paritylab(tmp_path: Path, *overrides: str, candidate: str = "tp") -> subprocess.CompletedProcess[str]:
    """``python -m paritylab model=llama candidate=tp candidate.world_size=2`` (or another distributed
    ``candidate``) logging to a SQLite store in ``tmp_path``."""
    from tests.helpers import migrated_store

    uri = migrated_store(tmp_path / "mlflow.db")
    command = [
        sys.executable, "-m", "paritylab", "model=llama", f"candidate={candidate}", "candidate.world_size=2",
        *overrides, f"tracking.uri={uri}", f"hydra.run.dir={tmp_path / 'run'}",
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def _only_run(tmp_path: Path) -> Any:
    from mlflow.tracking import MlflowClient

    from tests.helpers import parity_runs

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (found,) = parity_runs(client)
    return client, found


def test_the_command_line_runs_a_tensor_parallel_candidate_on_2_ranks(tmp_path: Path) -> None:
    result = _paritylab(tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "PASS: 32 modules within tolerance" in result.stdout
    assert "distributed candidate: free run only (no noise floor, replay, drill-down or decode steps)" in result.stdout
    run = tmp_path / "run"
    assert Trace.load(run / "ranks" / "rank1").meta["rank"] == "1" and Trace.load(run / "candidate").calls
    assert not (run / "ranks" / "weights.safetensors").exists()  # the reference's weights are no artifact
    summary = json.loads((run / "run.json").read_text())
    assert summary["verdict"] == "pass" and summary["exit_code"] == 0 and "ranks" in summary["seconds"]
    client, found = _only_run(tmp_path)
    tags = found.data.tags
    assert tags["paritylab.verdict"] == "pass" and tags["paritylab.world_size"] == "2"
    assert tags["paritylab.distributed.ranks"] == "none" and found.data.params["candidate.world_size"] == "2"
    listed = {item.path for item in client.list_artifacts(found.info.run_id, "ranks")}
    assert {"ranks/rank0", "ranks/rank1", "ranks/rank1.log", "ranks/launch.json"} <= listed


def test_a_defect_on_one_rank_fails_the_run_naming_module_and_rank(tmp_path: Path) -> None:
    result = _paritylab(tmp_path, "+candidate.options.defect=rank1_scaled", "+candidate.options.layer=1")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    module = "model.layers.1.mlp.down_proj"
    assert f"FAIL: divergence starts at {module} (rel_l2 0.5)" in result.stdout
    assert (
        f"paritylab: ranks (rank): {module} (outputs): rank 1's value differs from the reference's "
        "(rank 1 rel_l2 0.5); rank 0's agrees"
    ) in result.stdout
    _, found = _only_run(tmp_path)
    tags, params = found.data.tags, found.data.params
    assert tags["paritylab.verdict"] == "fail" and tags["paritylab.first_divergence"] == module
    assert tags["paritylab.distributed.ranks"] == "1" and tags["paritylab.distributed.finding"] == "rank"
    assert params["candidate.world_size"] == "2" and params["candidate.options.defect"] == "rank1_scaled"
    assert found.info.run_name.startswith("FAIL layers.1.mlp.down_proj @ llama/tp")  # the full path: its tag


def test_the_command_line_names_a_pipeline_stage_s_hand_off_by_module_and_ranks(tmp_path: Path) -> None:
    result = _paritylab(tmp_path, "+candidate.options.defect=stale_handoff", candidate="pipeline")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "FAIL: divergence starts at model (" in result.stdout
    assert (
        "paritylab: ranks (handoff): model: the hand-off from rank 0 to rank 1: model.layers.0's output on rank 0 "
        "agrees with the reference, model.layers.1's input on rank 1 does not"
    ) in result.stdout
    _, found = _only_run(tmp_path)
    assert found.data.tags["paritylab.distributed.ranks"] == "0,1"
    assert found.data.tags["paritylab.distributed.finding"] == "handoff"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["candidate.world_size=0"], "candidate.world_size=0 must be 1 or more (the number of ranks)"),
        (
            ["candidate=eager", "candidate.world_size=2"],
            "candidate.world_size=2 needs candidate.kind=distributed and a candidate.builder run on every rank",
        ),
        (
            ["candidate.builder=tp_llama.build"],
            "candidate.builder='tp_llama.build': a distributed candidate needs a builder named "
            "'package.module:function'",
        ),
        (
            ["candidate.builder=paritylab.experiments.tp_llama:built"],
            "candidate.builder='paritylab.experiments.tp_llama:built': paritylab.experiments.tp_llama has no "
            "attribute 'built'",
        ),
        (["candidate.builder=no_such_package.tp:build"], "cannot import 'no_such_package.tp'"),
        (
            ["+candidate.call.kwargs.tokens=input_ids"],
            "candidate.call.args/kwargs are not used by a distributed candidate: every rank calls model(**inputs)",
        ),
        (["candidate.dtype=bfloat16"], "candidate.dtype=bfloat16 is not applied to a distributed candidate"),
        (["candidate.dist_backend=mpi"], "candidate.dist_backend='mpi' must be gloo (CPU) or nccl (one CUDA device"),
        pytest.param(
            ["candidate.dist_backend=nccl"],
            "candidate.dist_backend=nccl needs one CUDA device per rank and a torch built with NCCL (2 ranks, 0 CUDA "
            "devices here): use candidate.dist_backend=gloo",
            marks=pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has the CUDA devices"),
        ),
        (["generate.steps=2"], "generate.steps=2 needs the candidate model in this process"),
        (["compare.noise_floor=on"], "compare.noise_floor=on needs the candidate model in this process"),
    ],
)
def test_a_distributed_candidate_s_settings_are_checked_in_one_line(overrides: list[str], message: str) -> None:
    from paritylab.cli.app import compose
    from paritylab.run.config import check_targets
    from paritylab.run.errors import ConfigError

    chosen = [] if any(item.startswith("candidate=") for item in overrides) else ["candidate=tp"]
    with pytest.raises(ConfigError) as raised:
        check_targets(compose(["model=llama", *chosen, "tracking=off", *overrides]))
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_builder_options_are_an_open_section_added_with_plus(capsys: pytest.CaptureFixture[str]) -> None:
    from paritylab.cli.app import compose, preflight
    from paritylab.run.config import check_targets

    cfg = compose(["model=llama", "candidate=tp", "+candidate.options.defect=rank1_scaled", "tracking=off"])
    check_targets(cfg)
    assert cfg.candidate.options.defect == "rank1_scaled" and cfg.candidate.world_size == 2
    with pytest.raises(SystemExit):
        preflight(["model=llama", "candidate=tp", "candidate.options.defect=rank1_scaled", "tracking=off"])
    assert capsys.readouterr().err.strip() == (
        "paritylab: bad configuration: candidate.options.defect is not set yet: add it with "
        "+candidate.options.defect=<value> (candidate.options takes any key)"
    )


def test_the_exit_codes_are_the_command_line_s() -> None:
    from paritylab.distributed import EXIT_CODES
    from paritylab.run.parity import EXIT_CODES as RUN_EXIT_CODES

    assert EXIT_CODES == RUN_EXIT_CODES


def test_an_fsdp2_sharded_llama_passes_and_a_rank_local_or_wrong_shard_bug_is_named(tmp_path: Path) -> None:
    """transformers' Llama under FSDP2 ``fully_shard`` (every parameter a ``Shard(0)`` DTensor, gathered for the
    forward) on 2 gloo ranks fed the same inputs: every activation is replicated, so the clean run passes; a
    rank-local scale is named at its module and rank 1; rank 1 loading rank 0's rows of ``gate_proj`` is named
    at ``gate_proj``."""
    from tests.tiny import token_ids

    reference = _llama()
    variants = {
        "clean": {},
        "rank1": {"defect": "rank1_scaled", "layer": 1},
        "shard": {"defect": "wrong_shard", "layer": 0},
    }
    results = check_variants(
        reference, "experiments.fsdp_llama:build", tmp_path, variants, world_size=2,
        inputs={"input_ids": token_ids(batch=2)}, call_kwargs={"use_cache": False},
        options={"config": reference.config.to_dict()}, timeout_s=240,
    )  # fmt: skip
    assert results["clean"].verdict == "pass", results["clean"].summary()
    rank1 = results["rank1"]
    assert rank1.verdict == "fail" and rank1.report.first_divergence.path == "model.layers.1.mlp.down_proj"
    assert rank1.finding is not None and rank1.finding.ranks == [1]
    shard = results["shard"]
    assert shard.verdict == "fail" and shard.report.first_divergence.path == "model.layers.0.mlp.gate_proj"


def test_a_pipeline_split_llama_passes_and_stage_defects_are_named_by_module_and_rank(tmp_path: Path) -> None:
    """transformers' Llama split into 2 pipeline stages (experiments/pipeline_llama.py: layers 0-1 on rank 0,
    layers 2-3, the norm and the head on rank 1, send/recv between them): the clean split passes; a scale in
    rank 1's layer, rank 1 loading its layers by local index, and a stage boundary that sends the hidden state
    from before rank 0's last layer are each named at the module and the rank (the last as the hand-off)."""
    from tests.tiny import tiny_llama, token_ids

    reference = tiny_llama(num_hidden_layers=4)
    variants = {
        "clean": {},
        "scaled": {"defect": "stage_scaled", "layer": 3},
        "weights": {"defect": "stage_weights"},
        "handoff": {"defect": "stale_handoff"},
    }
    results = check_variants(
        reference, "experiments.pipeline_llama:build", tmp_path, variants, world_size=2,
        inputs={"input_ids": token_ids(batch=2)}, call_kwargs={"use_cache": False},
        options={"config": reference.config.to_dict()}, timeout_s=240,
    )  # fmt: skip
    clean = results["clean"]
    assert clean.verdict == "pass" and not clean.report.not_compared, clean.summary()
    merge = clean.candidate.slot("model.layers.3.mlp.down_proj#0", "outputs")
    assert merge is not None and (merge.rule, merge.ranks) == ("stage", [1])
    assert clean.candidate.trace.keys[:3] == ["#0", "model#0", "model.embed_tokens#0"]
    for name, module in (("scaled", "model.layers.3.mlp.down_proj"), ("weights", "model.layers.2.self_attn.q_proj")):
        found = results[name]
        assert found.verdict == "fail" and found.report.first_divergence.path == module, found.summary()
        assert found.finding is not None and (found.finding.kind, found.finding.ranks) == ("rank", [1])
        assert found.finding.message.startswith(f"{module} (outputs): computed on rank 1 alone (its pipeline stage)")
    handoff = results["handoff"].finding
    assert handoff is not None and (handoff.module, handoff.kind, handoff.ranks) == ("model", "handoff", [0, 1])
    assert handoff.message.startswith(
        "model: the hand-off from rank 0 to rank 1: model.layers.1's output on rank 0 agrees with the reference, "
        "model.layers.2's input on rank 1 does not"
    )


def test_ranks_launched_by_torchrun_are_traced_by_trace_rank_and_merged_by_paritylab_compare(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A launch paritylab does not control: ``torchrun`` runs experiments/torchrun_tp.py on 2 gloo ranks, each
    tracing its forward with ``trace_rank``; ``paritylab-compare REFERENCE RANKS`` merges the rank folders and
    names the module and rank 1. A folder missing a rank's trace is refused in one line."""
    import shutil

    from paritylab.cli.compare import main as compare_main

    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "experiments.torchrun_tp", str(out), "--defect", "rank1_scaled", "--layer", "1",
    ]  # fmt: skip
    root = Path(__file__).resolve().parent.parent
    scratch = tmp_path / "tmp"  # torchrun's own scratch folder (torchelastic_*) goes here, not into /tmp
    scratch.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root), "TMPDIR": str(scratch)}
    launched = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=root, env=env)
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    assert Trace.load(out / "ranks" / "rank1").meta["world_size"] == "2"
    assert Trace.load(out / "ranks" / "rank1").meta["backend"] == "gloo"
    assert compare_main([str(out / "reference"), str(out / "ranks")]) == 1
    printed = capsys.readouterr().out
    assert "FAIL: divergence starts at model.layers.1.mlp.down_proj (rel_l2 0.5)" in printed
    assert (
        "paritylab-compare: ranks (rank): model.layers.1.mlp.down_proj (outputs): rank 1's value differs from the "
        "reference's (rank 1 rel_l2 0.5); rank 0's agrees"
    ) in printed
    assert (out / "ranks" / "merged" / "candidate" / "merge.json").is_file()
    shutil.rmtree(out / "ranks" / "rank1")
    assert compare_main([str(out / "reference"), str(out / "ranks")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"paritylab-compare: {out / 'ranks' / 'rank0'} was traced with world size 2, but 1 rank traces were given"
    )


def test_tensor_parallel_inside_data_parallel_replicas_on_a_2d_mesh(tmp_path: Path) -> None:
    """4 gloo ranks on a (dp=2, tp=2) mesh, the TP port on the ``tp`` dimension: each replica holds the
    column-parallel pieces, the merge recognises 2 replicas of 2 shards (placements on a 2-rank sub-mesh fall back
    to the values); clean passes, shards swapped in every replica are named as shard order on all 4 ranks."""
    from tests.tiny import token_ids

    reference = _llama()
    results = check_variants(
        reference, BUILDER, tmp_path, {"clean": {}, "swapped": {"defect": "swapped_gate_shards", "layer": 1}},
        world_size=4, inputs={"input_ids": token_ids(batch=2)}, call_kwargs={"use_cache": False},
        options={"config": reference.config.to_dict(), "mesh": [2, 2]}, timeout_s=240,
    )  # fmt: skip
    clean = results["clean"]
    assert clean.verdict == "pass" and not clean.report.not_compared, clean.summary()
    q_proj = clean.candidate.slot("model.layers.0.self_attn.q_proj#0", "outputs")
    assert q_proj is not None and (q_proj.rule, q_proj.dim, q_proj.parts) == ("concat", 2, [0, 1, 0, 1])
    o_input = clean.candidate.slot("model.layers.0.self_attn.o_proj#0", "inputs.args.0")  # DTensor on the tp mesh
    assert o_input is not None and (o_input.rule, o_input.parts) == ("concat", [0, 1, 0, 1])
    assert o_input.note.startswith("placed on a mesh of 2 ranks and held by 4 (a sub-mesh")
    swapped = results["swapped"]
    assert swapped.verdict == "fail" and swapped.report.first_divergence.path == "model.layers.1.mlp.gate_proj"
    assert swapped.finding is not None and (swapped.finding.kind, swapped.finding.ranks) == (
        "shard-order",
        [0, 1, 2, 3],
    )


def test_trace_rank_says_in_one_line_what_it_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside a process group and without torchrun's RANK/WORLD_SIZE, ``trace_rank`` asks for them; a rank
    outside the world is refused; given both, it writes ``rank<k>/`` with rank and world size in the meta."""
    from paritylab.distributed import rank_directories, trace_rank

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = Pair(WHOLE, OUT)
    with pytest.raises(ValueError, match=r"^trace_rank: no process group is initialised and RANK/WORLD_SIZE"):
        trace_rank(model, tmp_path).__enter__()
    with pytest.raises(ValueError, match=r"^trace_rank: rank 2 is not in 0\.\.1 \(world size 2\)$"):
        trace_rank(model, tmp_path, rank=2, world_size=2).__enter__()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with trace_rank(model, tmp_path):
        model(X)
    assert Trace.load(tmp_path / "rank1").meta["rank"] == "1" and (tmp_path / "rank1" / PLACEMENTS_FILE).is_file()
    with pytest.raises(ValueError, match=r"holds rank traces up to rank2 but none for rank 1: copy every rank"):
        (tmp_path / "rank0").mkdir()
        (tmp_path / "rank0" / "trace.json").write_text((tmp_path / "rank1" / "trace.json").read_text())
        shutil.move(tmp_path / "rank1", tmp_path / "rank2")
        rank_directories(tmp_path)
    assert rank_directories(tmp_path / "nothing") is None
