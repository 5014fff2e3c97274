"""Parity across ranks: a tensor-parallel or sharded candidate against a one-device reference.

>>> result = check_distributed(reference, "paritylab.experiments.tp_llama:build", "runs/tp", world_size=2,
...                            inputs={"input_ids": ids}, options={"config": reference.config.to_dict()})
>>> result.verdict, result.finding.message if result.finding else "-"

The reference is traced in this process; the candidate runs on ``world_size`` ranks under ``torch.distributed``
(gloo on the CPU, :mod:`.launch`), each rank traced into its own directory; the ranks' traces are merged into one
trace of whole tensors (:mod:`.merge`: by DTensor placements where recorded, else by what the values prove),
which paritylab's comparison judges as it judges any candidate; the first divergence is then attributed to ranks
and to a kind of split defect (:mod:`.localise`). See ``docs/distributed.md``.

Ranks launched by something else (``torchrun``, Slurm, several hosts, NCCL) trace themselves with
:func:`trace_rank`; :func:`compare_ranks` (or ``paritylab-compare REFERENCE RANKS_DIR``) merges their folders.

Layering: this package uses ``tracing`` and ``comparison`` only; the Hydra run (``paritylab.run``) sits above it
and runs a ``candidate.kind=distributed`` through :func:`compare_ranks` (``paritylab/run/distributed_phase.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paritylab.comparison.alignment import Rule
from paritylab.comparison.metrics import Tolerances
from paritylab.comparison.report import Report, compare_traces
from paritylab.distributed.launch import (
    DistributedError,
    LaunchResult,
    LaunchSpec,
    RankContext,
    prepare,
    run_ranks,
    state_dict_of,
    takes_options,
)
from paritylab.distributed.localise import RankFinding, annotate_ranks, localise
from paritylab.distributed.merge import MergedTrace, SlotMerge, merge_ranks
from paritylab.distributed.rank import rank_directories, trace_rank
from paritylab.distributed.rank_floors import apply_rank_floors
from paritylab.distributed.rank_weights import add_rank_weights, charge_rank_weights, rank_weight_findings
from paritylab.tracing.files import write_json
from paritylab.tracing.tracefile import TRACE_FILE, Trace
from paritylab.tracing.tracer import TraceOptions, Tracer

__all__ = [
    "DistributedError",
    "DistributedResult",
    "LaunchResult",
    "LaunchSpec",
    "MergedTrace",
    "RankContext",
    "RankFinding",
    "SlotMerge",
    "check_distributed",
    "check_variants",
    "compare_ranks",
    "merge_ranks",
    "rank_directories",
    "run_ranks",
    "takes_options",
    "trace_rank",
]

SUMMARY_FILE = "distributed.json"
EXIT_CODES = {"pass": 0, "fail": 1, "error": 2, "inconclusive": 3}
"""The command line's exit code per verdict: ``paritylab.run.parity.EXIT_CODES`` (which sits above this package;
``tests/test_distributed.py`` holds the two equal)."""


@dataclass(frozen=True)
class DistributedResult:
    """A distributed parity check: the comparison of the merged candidate, and who is at fault."""

    report: Report
    reference: Trace
    candidate: MergedTrace
    finding: RankFinding | None
    """The first divergence's module, ranks and kind of defect; a rank's error; ``None`` when parity holds."""
    directory: Path
    launch: LaunchResult | None = None

    @property
    def verdict(self) -> str:
        """:attr:`Report.verdict` (``pass``, ``fail``, ``inconclusive``, ``error``), and ``error`` whenever a rank
        failed, even one whose trace was whole (a finding of kind ``error`` names it)."""
        if self.launch is not None and not self.launch.ok:
            return "error"
        return self.report.verdict

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def summary(self) -> dict[str, Any]:
        """The report's summary with the world size, the merge rules used and the finding."""
        return {
            **self.report.summary(),
            "verdict": self.verdict,
            "world_size": self.candidate.world_size,
            "merge_rules": self.candidate.trace.meta.get("distributed", {}).get("rules", {}),
            "merge_notes": self.candidate.notes,
            "finding": self.finding.to_json() if self.finding else None,
        }


def check_distributed(
    reference: nn.Module,
    builder: str,
    directory: str | Path,
    *,
    world_size: int,
    inputs: Mapping[str, torch.Tensor],
    call_kwargs: Mapping[str, Any] | None = None,
    reference_call: Callable[[nn.Module], Any] | None = None,
    candidate_call: str | None = None,
    options: Mapping[str, Any] | None = None,
    share_weights: bool = True,
    rules: Iterable[Rule] = (),
    tolerances: Tolerances | None = None,
    noise_multiple: float = 4.0,
    partial_outputs: Sequence[str] = (),
    timeout_s: float = 300.0,
    trace_options: Mapping[str, Any] | None = None,
) -> DistributedResult:
    """Trace ``reference`` here and the candidate built by ``builder`` on ``world_size`` ranks; merge, compare,
    and name the module and rank where they part.

    ``builder``: ``"package.module:function"``, called on every rank with a
    :class:`~paritylab.distributed.launch.RankContext` (rank, world size, ``state_dict()`` of the reference's
    weights when ``share_weights``, ``mesh()``, ``options``); it returns the rank's module. ``inputs``: the
    forward's tensors, given to both sides (``model(**inputs, **call_kwargs)`` unless ``reference_call`` /
    ``candidate_call``, the latter ``"module:function"`` taking ``(model, inputs, **call_kwargs)``).
    ``options`` and ``call_kwargs`` travel as JSON. ``partial_outputs``: module path patterns whose plain
    outputs are partial sums by design (:func:`~paritylab.distributed.merge.merge_ranks`).

    Raises :class:`DistributedError` (one line naming the rank) when some rank produced no trace; a rank that
    raised inside its forward gives a result whose verdict is ``error`` and whose finding names the rank.
    """
    results = check_variants(
        reference, builder, directory, {}, world_size=world_size, inputs=inputs, call_kwargs=call_kwargs,
        reference_call=reference_call, candidate_call=candidate_call, options=options, share_weights=share_weights,
        rules=rules, tolerances=tolerances, noise_multiple=noise_multiple, partial_outputs=partial_outputs,
        timeout_s=timeout_s, trace_options=trace_options,
    )  # fmt: skip
    return results[""]


def check_variants(
    reference: nn.Module,
    builder: str,
    directory: str | Path,
    variants: Mapping[str, Mapping[str, Any]],
    *,
    world_size: int,
    inputs: Mapping[str, torch.Tensor],
    call_kwargs: Mapping[str, Any] | None = None,
    reference_call: Callable[[nn.Module], Any] | None = None,
    candidate_call: str | None = None,
    options: Mapping[str, Any] | None = None,
    share_weights: bool = True,
    rules: Iterable[Rule] = (),
    tolerances: Tolerances | None = None,
    noise_multiple: float = 4.0,
    partial_outputs: Sequence[str] = (),
    timeout_s: float = 300.0,
    trace_options: Mapping[str, Any] | None = None,
) -> dict[str, DistributedResult]:
    """:func:`check_distributed` for several candidates from one builder (``variants``: name -> options laid
    over ``options``: parallel plans, configurations) against one reference trace, on one set of ranks started
    once. Returns a result per variant (key ``""`` for the single candidate when ``variants`` is empty); a
    variant whose ranks produced no trace raises :class:`DistributedError` when its result is built, so
    variants before it are checked, and their results are in ``directory/<name>/distributed.json``.
    """
    directory = Path(directory)
    kwargs = dict(call_kwargs or {})
    call = reference_call or (lambda model: model(**inputs, **kwargs))
    with Tracer(reference, directory / "reference", TraceOptions(save_tensors=True)):
        call(reference)
    reference_trace = Trace.load(directory / "reference")
    ranks = directory / "ranks"
    prepare(ranks, inputs, state_dict_of(reference) if share_weights else None)
    spec = LaunchSpec(
        builder=builder,
        world_size=world_size,
        directory=ranks,
        call=candidate_call,
        call_kwargs=kwargs,
        options=dict(options or {}),
        timeout_s=timeout_s,
        trace=dict(trace_options or {}),
        variants={name: dict(values) for name, values in variants.items()},
    )
    results: dict[str, DistributedResult] = {}
    for launch in run_ranks(spec):
        name = launch.variant or ""
        results[name] = compare_ranks(
            reference_trace, launch.directories, directory / name if name else directory, launch=launch,
            rules=rules, tolerances=tolerances, noise_multiple=noise_multiple, partial_outputs=partial_outputs,
        )  # fmt: skip
    return results


def compare_ranks(
    reference: Trace,
    rank_directories: Sequence[Path],
    directory: str | Path,
    *,
    launch: LaunchResult | None = None,
    rules: Iterable[Rule] = (),
    tolerances: Tolerances | None = None,
    noise_multiple: float = 4.0,
    partial_outputs: Sequence[str] = (),
    pinned: bool = False,
) -> DistributedResult:
    """Merge rank traces already written (``rank_directories``, rank order) into ``directory/candidate``,
    compare them with ``reference`` and localise; writes ``directory/distributed.json``. ``pinned``: ``rules``
    are a frozen alignment (:func:`~paritylab.comparison.report.compare_traces`)."""
    directory = Path(directory)
    absent = [rank for rank, path in enumerate(rank_directories) if not (Path(path) / TRACE_FILE).is_file()]
    if absent:
        line = launch.error_line() if launch is not None else ""
        raise DistributedError(line or f"rank {absent[0]} wrote no trace ({rank_directories[absent[0]]})")
    merged = merge_ranks(
        [Path(path) for path in rank_directories], directory / "candidate", reference,
        tolerances=tolerances, partial_outputs=partial_outputs,
    )  # fmt: skip
    rules = [*rules, *([] if pinned else merged.rules())]  # the user's first, then what the row maps prove
    report = compare_traces(
        reference, merged.trace, rules=rules, tolerances=tolerances, noise_multiple=noise_multiple, pinned=pinned
    )
    weights = rank_weight_findings(reference, merged)
    add_rank_weights(report, weights)
    floors = apply_rank_floors(report, merged, reference)
    finding = charge_rank_weights(report, localise(report, merged, launch, reference, floors), weights)
    annotate_ranks(report, merged, floors)
    result = DistributedResult(report, reference, merged, finding, directory, launch)
    write_json(directory / SUMMARY_FILE, result.summary(), indent=1)
    return result
