"""Each rank's own weights against the reference's: a shard loaded wrong is named with its rank.

A rank holds pieces of the reference's tensors: rows of a column-parallel projection, columns of a row-parallel
one, a Megatron-style fused ``[q_r; k_r; v_r]`` whose three blocks are rows of three reference projections, replicas
of the rest. The weight ledger (:mod:`paritylab.comparison.weights`) reads pieces as they are (fibers held, blocks of
a reference tensor), so each rank's fingerprints (its trace's, a DTensor's local shard) are matched with the
reference's on their own. A finding names the rank, the tensor, the block and what differs; a run whose every
merged output agrees still fails at the module holding it, and a module the merge found wrong on every rank (or on
no rank it could name) is charged to the rank whose weight differs.
"""

from __future__ import annotations

import dataclasses

from paritylab.comparison.report import Report, charge_quiet_weights
from paritylab.comparison.weights import WeightFinding, weight_ledger
from paritylab.distributed.localise import RankFinding
from paritylab.distributed.merge import MergedTrace
from paritylab.tracing.structure import module_ancestors, prints_from_meta
from paritylab.tracing.tracefile import Trace, display_path

CHARGEABLE = ("all-ranks", "unattributed", "rank")
"""Kinds of merge finding a differing rank weight inside the module replaces: the merge saw the effect, the weight is
its cause."""


def rank_weight_findings(reference: Trace, merged: MergedTrace) -> list[tuple[int, WeightFinding]]:
    """Every rank's differing tensors, as ``(rank, finding)``; none where either side carries no fingerprints."""
    ref_prints = prints_from_meta(reference.meta)
    if not ref_prints:
        return []
    found: list[tuple[int, WeightFinding]] = []
    for rank in range(merged.world_size):
        prints = prints_from_meta(merged.rank_trace(rank).meta)
        if prints:
            found += [(rank, finding) for finding in weight_ledger(ref_prints, prints).differing]
    return found


def add_rank_weights(report: Report, found: list[tuple[int, WeightFinding]]) -> None:
    """Put the ranks' weight findings into ``report``'s weight ledger (named ``rank r: ...``); a run whose every
    merged output agrees then fails at the module holding one (:func:`charge_quiet_weights`)."""
    report.alignment.weights.findings.extend(
        dataclasses.replace(weight, candidate=f"rank {rank}: {weight.candidate}") for rank, weight in found
    )
    if found:
        charge_quiet_weights(report)


def charge_rank_weights(
    report: Report, finding: RankFinding | None, found: list[tuple[int, WeightFinding]]
) -> RankFinding | None:
    """The finding to report: where divergence starts at (or around) the module holding a rank's differing weight,
    and the merge named every rank, no rank, or ranks by their outputs, the ranks whose weight differs."""
    row = report.first_divergence
    if not found or row is None or row.candidate is None or (finding is not None and finding.kind not in CHARGEABLE):
        return finding
    module = row.candidate.key.rsplit("#", 1)[0]
    inside = [
        (rank, weight)
        for rank, weight in found
        if module == weight.candidate_module or module in set(module_ancestors(weight.candidate_module))
    ]
    if not inside:
        return finding
    ranks = sorted({rank for rank, _ in inside})
    lines = "; ".join(f"rank {rank}'s {weight.line()}" for rank, weight in inside[:3])
    message = f"{display_path(row.path)}: {lines}"
    row.note = "; ".join(filter(None, [row.note, message]))
    evidence = {"weights": [{"rank": rank, **weight.to_json()} for rank, weight in inside]}
    return RankFinding(row.path, "weight", ranks, message, row.candidate.key, row.candidate.slot, evidence=evidence)
