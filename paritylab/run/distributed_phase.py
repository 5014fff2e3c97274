"""The run's candidate on several ranks (``candidate.kind=distributed``, e.g. ``candidate=tp``).

After the reference is traced in this process, :func:`launch` starts ``candidate.world_size`` ranks through
:mod:`paritylab.distributed` (a fresh ``python -m paritylab.distributed.worker`` process per rank, gloo on this
machine), each building its share of the candidate with ``candidate.builder`` and tracing its forward into
``<run>/ranks/rank<k>/``. :func:`judge` merges the rank traces into ``<run>/candidate/`` (one trace of whole
tensors), compares it with the reference's as any candidate is compared, and attributes the first divergence to
module, ranks and kind of split defect (``<run>/distributed.json``). The runner then reports, logs and exits as
for any run.

Free run only: the noise floor, the isolated and lifted replays, the drill-down and decode steps all run the
candidate model again in this process, and it lives on the ranks.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from paritylab.comparison.alignment import Rule
from paritylab.comparison.metrics import Tolerances
from paritylab.distributed import DistributedResult, LaunchResult, LaunchSpec, compare_ranks, run_ranks
from paritylab.distributed.launch import WEIGHTS_FILE, prepare, state_dict_of
from paritylab.run.budget import cores, plan_ranks
from paritylab.run.resident import available_memory
from paritylab.tracing.tracefile import Trace

FREE_RUN_ONLY = "distributed candidate: free run only (no noise floor, replay, drill-down or decode steps)"
RANKS_DIR = "ranks"
"""Run subdirectory of the ranks: ``launch.json``, ``inputs.safetensors``, ``rank<k>.log`` and ``rank<k>/``."""


def is_distributed(candidate: DictConfig) -> bool:
    """The candidate runs on ranks (``kind: distributed``), not in this process."""
    return str(candidate.kind) == "distributed"


def launch(
    cfg: DictConfig,
    reference: nn.Module,
    inputs: Mapping[str, torch.Tensor],
    directory: Path,
    echo: Callable[[str], None],
) -> LaunchResult:
    """Run the candidate on its ranks, each traced into ``directory/ranks/rank<k>/``; never raises for a rank's
    failure (the result says which rank failed, and how). The reference's weights are handed to the ranks as a
    safetensors file, deleted once they have run (the run directory is published: it holds no weights)."""
    candidate = cfg.candidate
    if cfg.get("memory_check", True):  # with the weights every rank reads, before any rank starts
        weights = sum(value.numel() * value.element_size() for value in state_dict_of(reference).values())
        line = plan_ranks(int(candidate.world_size), cores(), available_memory(torch.device("cpu")), weights)
        echo(f"paritylab: rank plan: {line}")
    ranks = directory / RANKS_DIR
    dropped = set(candidate.call.drop)
    prepare(ranks, {name: value for name, value in inputs.items() if name not in dropped}, state_dict_of(reference))
    spec = LaunchSpec(
        builder=str(candidate.builder),
        world_size=int(candidate.world_size),
        directory=ranks,
        options=builder_options(candidate, reference),
        timeout_s=float(candidate.timeout_s),
        trace=_trace_options(cfg),
        backend=str(candidate.get("dist_backend", "gloo")),
    )
    echo(f"paritylab: running the candidate on {spec.world_size} ranks ({spec.backend}, this machine): {spec.builder}")
    try:
        (result,) = run_ranks(spec)
    finally:
        (ranks / WEIGHTS_FILE).unlink(missing_ok=True)
    return result


def builder_options(candidate: DictConfig, reference: nn.Module) -> dict[str, Any]:
    """``candidate.options`` as JSON, with a transformers reference's ``config.to_dict()`` as ``config`` unless set
    (what a builder needs to build the same architecture on its rank)."""
    options: dict[str, Any] = OmegaConf.to_container(candidate.options, resolve=True)  # type: ignore[assignment]
    config = getattr(reference, "config", None)
    if "config" not in options and callable(getattr(config, "to_dict", None)):
        options["config"] = json.loads(json.dumps(config.to_dict(), default=str))  # type: ignore[union-attr]
    return options


def _trace_options(cfg: DictConfig) -> dict[str, Any]:
    """The ranks' trace options, as the reference's (tensors are always saved on the ranks: they are merged)."""
    options: dict[str, Any] = {"metadata": {"side": "candidate", "seed": cfg.seed, "model": cfg.model.name}}
    if cfg.compare.max_bytes is not None:
        options["max_bytes"] = int(cfg.compare.max_bytes)
    if not cfg.compare.capture:
        options["capture"] = None
    return options


def judge(
    cfg: DictConfig,
    launched: LaunchResult,
    reference: Trace,
    directory: Path,
    rules: list[Rule],
    pinned: bool,
) -> DistributedResult:
    """Merge the ranks' traces into ``directory/candidate``, compare with the ``reference`` trace and name module
    and ranks. Raises :class:`~paritylab.distributed.DistributedError` (one line naming the rank) when a rank
    wrote no trace."""
    compare = cfg.compare
    return compare_ranks(
        reference, launched.directories, directory, launch=launched, rules=rules,
        tolerances=Tolerances.from_config(OmegaConf.to_container(compare, resolve=True)),  # type: ignore[arg-type]
        noise_multiple=float(compare.noise_multiple), partial_outputs=list(cfg.candidate.partial_outputs),
        pinned=pinned,
    )  # fmt: skip


def finding_line(result: DistributedResult) -> str | None:
    """The console line naming the module and the ranks at fault (``None`` when parity holds)."""
    finding = result.finding
    if finding is None:
        return None
    return f"paritylab: ranks ({finding.kind}): {finding.message}"


def summary_notes(result: DistributedResult) -> list[str]:
    """The run's notes: how many ranks, how long they took, how their traces were merged, what was found."""
    launched = result.launch
    ran = f" of {launched.spec.builder}, each calling model(**inputs), {launched.seconds:.1f} s" if launched else ""
    rules = ", ".join(f"{rule} {count}" for rule, count in result.summary()["merge_rules"].items())
    notes = [f"distributed: {result.candidate.world_size} ranks{ran}; slots merged by rule: {rules or 'none'}"]
    notes += [f"distributed: {note}" for note in result.candidate.notes]
    if result.finding is not None:
        notes.append(f"distributed: {result.finding.kind}: {result.finding.message}")
    return notes


def summary_tags(result: DistributedResult) -> dict[str, str]:
    """MLflow tags: the world size, the ranks at fault and the kind of defect (``none`` when parity holds)."""
    finding = result.finding
    return {
        "paritylab.world_size": str(result.candidate.world_size),
        "paritylab.distributed.ranks": ",".join(map(str, finding.ranks)) if finding and finding.ranks else "none",
        "paritylab.distributed.finding": finding.kind if finding else "none",
    }
