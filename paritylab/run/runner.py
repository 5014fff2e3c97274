"""The parity run: build reference and candidate, trace both, compare, report, log to MLflow.

Every phase writes its results to the run directory before the next starts, so a failure at any point
leaves everything produced so far on disk, and it is logged to MLflow with the run marked FAILED (or
KILLED on SIGTERM / Ctrl-C). Exit codes: 0 parity holds, 1 it does not, 2 an error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from paritylab.comparison.alignment import Rule, load_rules
from paritylab.comparison.lifted import LiftedReplay, lifts
from paritylab.comparison.metrics import Tolerances
from paritylab.comparison.report import Report, compare_traces
from paritylab.distributed import DistributedError
from paritylab.reports.plots import write_plots
from paritylab.reports.render import headline, rows_table, to_console, to_html, to_json, to_markdown
from paritylab.run import distributed_phase
from paritylab.run.budget import (
    MemoryPlan,
    Sizes,
    disk_free,
    measure_reference,
    meta_forward,
    plan,
)
from paritylab.run.candidates import Candidate, build_candidate, instantiate, resolve_path
from paritylab.run.config import check_targets, check_writable, one_line, unmatched_patterns
from paritylab.run.errors import ConfigError
from paritylab.run.identity import run_name, run_tags
from paritylab.run.import_time import counting_imports
from paritylab.run.inputs import build_inputs
from paritylab.run.lifting import lift
from paritylab.run.parity import (
    EXIT_ERROR,
    EXIT_FAIL,
    EXIT_PASS,
    Floors,
    ParityResult,
    compare_against_floors,
    drill_into_origin,
    estimate_floors,
    judge_whole_graph,
    judge_with_replay,
    low_precision,
    match_weight_grids,
    rejudging,
)
from paritylab.run.resident import available_memory, model_bytes, offload, release_freed_memory
from paritylab.run.workload import CallSpec, check_output, infer_call, output_choice
from paritylab.sink.connection import Connection, Opening
from paritylab.sink.dashboard import final_tags, report_metrics, run_verdict, write_key_map
from paritylab.sink.history import FINGERPRINT, Regression
from paritylab.sink.interrupts import EXIT_INTERRUPTED, signals_ignored, sigterm_as_interrupt
from paritylab.sink.publish import RunRecord, upload_tensors
from paritylab.sink.sweep import sweep_state
from paritylab.sink.tracking import Metric, TrackingError, flatten
from paritylab.sink.worker import connect
from paritylab.tracing.files import no_space
from paritylab.tracing.tracefile import Trace, display_path, printable, write_json
from paritylab.tracing.tracer import TraceOptions, is_compiled, trace_run

RESIDENT_DIR = ".resident"
"""Run subdirectory holding the mapped weights of resident=one; removed before the run is published."""


@dataclass
class RunResult:
    exit_code: int
    directory: Path
    report: Report | None = None
    run_id: str | None = None
    error: str | None = None
    tracking_error: str | None = None
    notes: list[str] = field(default_factory=list)
    parity: ParityResult | None = None
    """The pipeline's result (None when the run stopped before the comparison finished)."""


def run(cfg: DictConfig, directory: str | Path | None = None, echo: Callable[[str], None] = print) -> RunResult:
    """Run one parity comparison as configured; never raises for bad input or a failing forward."""
    out = Path(directory or cfg.output_dir or _hydra_dir() or _default_dir(cfg)).resolve()
    try:
        check_writable("output directory", out)
        out.mkdir(parents=True, exist_ok=True)
        claim_directory(out)
    except (ConfigError, OSError) as error:
        message = one_line(error) if isinstance(error, ConfigError) else f"cannot create {out}: {error}"
        echo(f"paritylab: {message}")
        return RunResult(EXIT_ERROR, out, error=message)
    try:
        check_targets(cfg)
        _device(cfg)
    except ConfigError as error:
        echo(f"paritylab: {one_line(error)}")
        write_json(out / "run.json", {"exit_code": EXIT_ERROR, "verdict": "error", "error": one_line(error)}, indent=1)
        return RunResult(EXIT_ERROR, out, error=str(error))
    session = _Session(cfg, out, echo)
    with sigterm_as_interrupt():
        return session.execute()


class _Session:
    """The shell around one run: its directory, MLflow tracker, notes and phase timings.

    The phases are functions returning values (:mod:`paritylab.run.parity`); :meth:`_phases` threads them as
    local variables. The session keeps only the latest report, written to disk as soon as it exists, so a
    fault in a later phase still leaves and logs it.
    """

    def __init__(self, cfg: DictConfig, directory: Path, echo: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.directory = directory
        self.echo = echo
        self.device = _device(cfg)
        self.connection = Connection()
        self.tracking_error: str | None = None
        self.report: Report | None = None
        self.parity: ParityResult | None = None
        self.notes: list[str] = []
        self.started = time.perf_counter()
        self.regression: Regression | None = None
        self.memory: MemoryPlan | None = None
        self.sweep = sweep_state()
        self._disk_full: str | None = None
        """The one line said when the disk filled up (later writes that fail for the same reason stay quiet)."""
        self.timings: dict[str, float] = {}
        """Seconds per phase, in order. A run from the command line starts with ``imports`` (paritylab's first
        import to the run's start: torch, Hydra, the configuration); a run in a longer-lived process (a sweep, a
        notebook) has none."""
        if not self.sweep:
            self.timings.update(start_up_phases())
        self._clock = time.perf_counter()

    def _mark(self, phase: str, imported: float = 0.0) -> None:
        """The time since the previous mark belongs to ``phase``, less ``imported`` seconds of importing the
        model's code (:mod:`paritylab.run.import_time`), which go to ``model imports``."""
        now = time.perf_counter()
        if imported:
            self.timings["model imports"] = self.timings.get("model imports", 0.0) + imported
        self.timings[phase] = self.timings.get(phase, 0.0) + now - self._clock - imported
        self._clock = now

    def execute(self) -> RunResult:
        status, code, error = "FINISHED", EXIT_PASS, None
        # Opening the MLflow run starts first; in a child process (tracking.process) it then runs beside the
        # phases, and the run waits for it only when it first needs the run's id (see _run_id).
        try:
            self._start_tracking()
        except Exception as failure:  # a bug in tracking set-up must not take the parity run down
            self.tracking_error = f"tracking set-up failed: {type(failure).__name__}: {failure}"
            self.echo(f"paritylab: {self.tracking_error}")
        self._mark("tracking start")
        try:
            self.parity = self._phases()
            code = self.parity.exit_code
        except KeyboardInterrupt:
            status, code, error = "KILLED", EXIT_INTERRUPTED, "interrupted"
            self.echo("paritylab: interrupted; logging what was produced")
        except ConfigError as failure:
            status, code, error = "FAILED", EXIT_ERROR, one_line(failure)
            self.echo(f"paritylab: {error}")
        except DistributedError as failure:  # a candidate's rank produced no trace: one line naming the rank
            status, code, error = "FAILED", EXIT_ERROR, str(failure)
            self.echo(f"paritylab: {error}")
        except Exception as failure:  # a forward or a build raised: keep and log everything produced
            status, code, error = "FAILED", EXIT_ERROR, f"{type(failure).__name__}: {failure}"
            if no_space(failure):  # one line that says what to do; the later writes that fail too say nothing more
                error = self._disk_full = (
                    f"the disk is full (no space left on device) under {self.directory}: free space or set "
                    "output_dir elsewhere, then run again; what was written is kept"
                )
            self.echo(f"paritylab: error: {error}")
        if self.report is not None and self.report.errors:
            status, code = "FAILED", EXIT_ERROR
        shutil.rmtree(self.directory / RESIDENT_DIR, ignore_errors=True)  # mapped weights stay valid until unmapped
        self._mark("report")
        try:
            self._finish_tracking(status, error)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM while publishing: the results are on disk; say so, exit 130
            with signals_ignored():
                self.tracking_error = "interrupted while publishing to MLflow"
                self.echo(f"paritylab: {self.tracking_error}; the run is marked KILLED")
                with suppress(Exception):
                    self.connection.end("KILLED")
                self._keep_for_upload()
                status, code, error = "KILLED", EXIT_INTERRUPTED, error or "interrupted while publishing"
        except Exception as failure:  # a full disk, a bug: what is on disk stays; the MLflow run is not left RUNNING
            self.tracking_error = f"publishing failed: {type(failure).__name__}: {failure}"
            if not (self._disk_full and no_space(failure)):
                self.echo(f"paritylab: {self.tracking_error}")
            with suppress(Exception):
                self.connection.end("FAILED")
        if self.tracking_error and code in (EXIT_PASS, EXIT_FAIL):
            code = EXIT_ERROR  # the verdict is printed and kept on disk, but the run is not where it belongs
        if code == EXIT_PASS and self.regression is not None and self.regression.regressed:
            code = EXIT_FAIL
        self._mark("publish")
        self.echo("paritylab: seconds: " + ", ".join(f"{phase} {value:.1f}" for phase, value in self.timings.items()))
        with signals_ignored():  # a second signal must not lose the summary
            try:
                self._write_run_summary(status, code, error)
            except OSError as failure:  # a full disk: say so in one line; the exit code still tells
                if not (self._disk_full and no_space(failure)):
                    self.echo(f"paritylab: could not write {self.directory / 'run.json'}: {failure}")
                code = code if code != EXIT_PASS else EXIT_ERROR
        run_id = self._run_id()
        self.connection.close()
        return RunResult(code, self.directory, self.report, run_id, error, self.tracking_error, self.notes, self.parity)

    def _write_run_summary(self, status: str, code: int, error: str | None) -> None:
        """``run.json``: the outcome in one small file (sweeps summarise these)."""

        report = self.report
        summary = {
            "model": str(self.cfg.model.name),
            "candidate": str(self.cfg.candidate.name),
            "status": status,
            "exit_code": code,
            "verdict": run_verdict(report, status),
            "first_divergence": report.summary()["first_divergence"] if report is not None else None,
            "regression": self.regression.verdict if self.regression else None,
            "regressed_layers": self.regression.regressed if self.regression else [],
            "run_id": self._run_id(),
            "link": self.connection.link(),
            "error": error,
            "tracking_error": self.tracking_error,
            "notes": self.notes,
            "seconds": {phase: round(value, 3) for phase, value in self.timings.items()},
            "memory": {"plan": self.memory.summary() if self.memory else None, "peak": peak_memory(self.device)},
        }
        write_json(self.directory / "run.json", summary, indent=1)

    # -- phases ---------------------------------------------------------------------------------------------

    def _phases(self) -> ParityResult:
        cfg = self.cfg
        self.echo(f"paritylab: {cfg.model.name} vs {cfg.candidate.name} on {self.device} -> {self.directory}")
        with counting_imports() as imported:  # the model's code, imported by whichever builds it first
            self.memory = self._plan_memory()
        self._mark("memory plan", imported.seconds)
        torch.manual_seed(int(cfg.seed))
        with counting_imports() as imported:
            reference = self._build_reference()
            inputs = build_inputs(cfg.inputs, cfg.model.family, reference, cfg.model.build.get("pretrained"))
        inputs = {key: value.to(self.device) for key, value in inputs.items()}
        ref_run = self._bind("model", reference, inputs)
        self._mark("build reference", imported.seconds)
        ref_trace = self._trace("reference", reference, ref_run)
        self._check_output("model", ref_trace)
        for note in unmatched_patterns(cfg.compare.modules, (call.path for call in ref_trace.calls)):
            self.notes.append(note)  # a per-module tolerance that applies nowhere is said, never silently dropped
            self.echo(f"paritylab: note: {note}")
        self._mark("trace reference")
        if distributed_phase.is_distributed(cfg.candidate):
            return self._distributed(reference, inputs, ref_trace)
        one_resident = self._one_resident(reference)
        if one_resident:
            self._offload("reference", reference)
        candidate = build_candidate(cfg.candidate, cfg.model.family, reference)
        candidate.model.to(self.device)
        self._note_weights(candidate)
        cand_run = self._bind("candidate", candidate.model, inputs)
        self._mark("build candidate")
        cand_trace = self._trace("candidate", candidate.model, cand_run)
        self._check_output("candidate", cand_trace)
        match_weight_grids(reference, candidate.model, ref_trace, cand_trace)
        self._mark("trace candidate")
        if one_resident:
            self._offload("candidate", candidate.model)
        floors = self._noise_floor(reference, candidate, ref_run, ref_trace, cand_trace)
        self._mark("noise floor")
        rules = self._rules(candidate.rules, ref_trace, cand_trace.calls[0].path if cand_trace.calls else None)
        tolerances = Tolerances.from_config(OmegaConf.to_container(cfg.compare, resolve=True))  # type: ignore[arg-type]
        self.echo("paritylab: comparing")
        frozen = self._frozen_alignment()
        if frozen is not None:
            rules = load_rules(frozen)
        given = floors

        def estimating(line: str) -> None:  # the first comparison failed: its time is the compare phase's
            self.echo(line)
            self._mark("compare")

        free_run, floors = compare_against_floors(
            ref_trace, cand_trace, floors, reference=reference, reference_call=ref_run, candidate=candidate.model,
            directory=self.directory, noise_floor=str(cfg.compare.noise_floor), notes=self.notes, echo=estimating,
            rules=rules, tolerances=tolerances, noise_multiple=float(cfg.compare.noise_multiple),
            pinned=frozen is not None,
        )  # fmt: skip
        report = self._keep(free_run)
        self._mark("float32 noise floor" if floors is not given else "compare")
        lifted = None
        if cfg.compare.replay and floors is not None and floors.from_candidate:
            self.notes.append(
                "isolated replay not run: the candidate is the reference's own code cast to "
                f"{str(floors.dtype).removeprefix('torch.')}, so each module's own error is that precision's "
                "rounding by definition (a replay would be judged against itself); the free run is judged against "
                "the noise floor, and NaN/Inf show there"
            )
        elif cfg.compare.replay and not report.errors and report.alignment.pairs:
            if candidate.cast_of is None and lifts(reference, candidate.model) is not None:
                self.echo("paritylab: lifted replay (both sides in float32 with the candidate's weights)")
                lifted = lift(
                    reference.to(self.device), ref_run, candidate.model.to(self.device), cand_run, ref_trace,
                    cand_trace, report.alignment, self.directory, notes=self.notes,
                )  # fmt: skip
                self._mark("lifted replay")
            self.echo("paritylab: isolated replay")
            report, floors = judge_with_replay(
                report, candidate.model.to(self.device), cand_run, ref_trace, cand_trace, self.directory,
                tolerances=tolerances, floors=floors, lifted=lifted, reference=reference, reference_call=ref_run,
                noise_floor=str(cfg.compare.noise_floor), notes=self.notes, echo=self.echo,
            )  # fmt: skip
            self._keep(report)
            self._mark("replay")
            if not report.passed and not report.errors:
                report, cand_run, cand_trace, lifted = self._decisions(
                    report, reference, ref_run, candidate.model, cand_run, ref_trace, cand_trace, floors, lifted,
                    rules, tolerances, frozen is not None,
                )  # fmt: skip
        if is_compiled(candidate.model) and not report.errors:
            if cfg.compare.whole_graph:
                self.echo("paritylab: the compiled candidate as one graph (untraced)")
            report = self._keep(
                judge_whole_graph(
                    report, candidate.model.to(self.device), cand_run, ref_trace, cand_trace,
                    bool(cfg.compare.whole_graph), "compare.whole_graph=false",
                )
            )  # fmt: skip
            self._mark("whole graph")
        if cfg.compare.drilldown and report.first_divergence is not None and not report.passed:
            found = self._drill_down(
                report, reference, ref_run, candidate.model, cand_run, ref_trace, cand_trace, lifted
            )
            report = self._keep(found)
            self._mark("drill-down")
        if int(cfg.generate.steps) > 0 and not report.errors:
            report = self._keep(self._generate(report, reference, candidate.model, inputs, rules, tolerances))
            self._mark("generate")
        self.echo(to_console(report))
        return ParityResult(report, free_run, ref_trace, cand_trace, floors, self.directory)

    def _distributed(self, reference: nn.Module, inputs: dict[str, torch.Tensor], ref_trace: Trace) -> ParityResult:
        """``candidate.kind=distributed``: the candidate on its ranks, their traces merged and compared, the first
        divergence named by module and rank (:mod:`paritylab.run.distributed_phase`); free run only."""
        self.notes.append(distributed_phase.FREE_RUN_ONLY)
        self.echo(f"paritylab: {distributed_phase.FREE_RUN_ONLY}")
        launched = distributed_phase.launch(self.cfg, reference, inputs, self.directory, self.echo)
        self._mark("ranks")
        frozen = self._frozen_alignment()
        own = load_rules(resolve_path(self.cfg.candidate.rules)) if self.cfg.candidate.rules else []
        rules = load_rules(frozen) if frozen is not None else self._rules(own, ref_trace, "")  # a rank's root: ""
        self.echo("paritylab: merging the ranks' traces and comparing")
        result = distributed_phase.judge(self.cfg, launched, ref_trace, self.directory, rules, frozen is not None)
        report = self._keep(result.report)
        self._mark("compare")
        self.notes.extend(distributed_phase.summary_notes(result))
        self.record.tags.update(distributed_phase.summary_tags(result))
        self.echo(to_console(report))
        line = distributed_phase.finding_line(result)
        if line:
            self.echo(line)
        if result.verdict == "error" and not report.errors:  # a rank failed after its forward was traced
            raise DistributedError(launched.error_line())
        return ParityResult(report, report, ref_trace, result.candidate.trace, None, self.directory)

    def _keep(self, report: Report) -> Report:
        """``report`` is the run's latest: written to disk now (a later fault keeps it) and logged at the end."""
        self.report = report
        self._write_report(report)
        return report

    def _frozen_alignment(self) -> Path | None:
        """The alignment to pin: ``compare.alignment=<file>``; by default (``baseline``) the alignment of the
        pair's baseline run in MLflow, so runs of one pair never re-pair modules (a module paired then and
        missing now fails its row); ``fresh`` aligns anew."""
        choice = str(self.cfg.compare.alignment or "baseline")
        if choice not in ("baseline", "fresh"):
            return Path(resolve_path(choice))
        if choice == "fresh" or self._run_id() is None:
            return None
        try:
            found = self.connection.baseline_alignment(self.record.tags[FINGERPRINT], self.directory / "baseline")
        except TrackingError as failure:
            self.notes.append(f"alignment: aligned anew (the baseline's could not be read: {failure})")
            return None
        if found is None:
            return None
        baseline_id, path = found
        self.notes.append(f"alignment: pinned to that of baseline run {baseline_id}")
        self.record.tags["paritylab.alignment_from"] = baseline_id
        return path

    def _build_reference(self) -> nn.Module:
        self.echo("paritylab: building the reference")
        model = instantiate("model.build", self.cfg.model.build)
        return model.to(self.device)

    def _bind(self, key: str, model: nn.Module, inputs: dict[str, torch.Tensor]) -> Callable[[nn.Module], Any]:
        """The side's forward call: its ``call`` config checked against the forward, else read from it."""
        spec = self._spec(key, model, inputs)
        self.notes.append(f"{key}: {spec.describe()}")
        return spec.bind(inputs)

    def _spec(self, key: str, model: nn.Module, inputs: dict[str, torch.Tensor]) -> CallSpec:
        call = self.cfg[key].call
        given = bool(call.args or call.kwargs)
        args, kwargs = (list(call.args), dict(call.kwargs)) if given else (None, None)
        spec = infer_call(model, inputs, key, args, kwargs, list(call.drop))
        return dataclasses.replace(spec, cast=bool(call.cast), output=self._output(key))

    def _output(self, key: str) -> int | str | None:
        """``{key}.call.output``: which part of that side's return value is "the output"."""
        return output_choice(self.cfg[key].call.get("output"), key)

    def _check_output(self, key: str, trace: Trace) -> None:
        """``{key}.call.output`` names a part of what the side's forward returned (known once it ran)."""
        if trace.calls and not trace.meta.get("error"):
            root = trace.calls[0]
            check_output(root.outputs, self._output(key), key, root.cls)

    def _trace(self, side: str, model: nn.Module, run: Callable[[nn.Module], Any]) -> Trace:
        from tqdm.auto import tqdm

        self.echo(f"paritylab: tracing the {side}")
        modules = sum(1 for _ in getattr(model, "_orig_mod", model).modules())
        bar = tqdm(total=modules, desc=f"tracing {side}", unit="call", leave=False, disable=None)
        options = TraceOptions(
            save_tensors=bool(self.cfg.compare.save_tensors),
            max_bytes=self.cfg.compare.max_bytes,
            capture="auto" if self.cfg.compare.capture else None,
            metadata={"side": side, "seed": self.cfg.seed, "model": self.cfg.model.name},
            on_call=None if bar.disable else lambda _: bar.update(),
        )
        try:
            with bar:
                tracer = trace_run(model, run, self.directory / side, options)
        except Exception as error:
            self._compare_partial(side, error)
            raise
        trace = Trace.load(self.directory / side)
        untraced = trace.uncalled
        if tracer.fullgraph:
            self.notes.append(f"{side}: compiled with fullgraph=True: traced eagerly, its one graph checked by output")
        elif tracer.compiled:
            self.notes.append(f"{side}: compiled model, {trace.meta['calls']} calls traced with graph breaks")
        if untraced:
            self.notes.append(f"{side}: {len(untraced)} selected modules were never called")
        return trace

    def _plan_memory(self) -> MemoryPlan | None:
        """What the run will need, found before building (:mod:`paritylab.run.budget`); refuses in one line what
        cannot fit. ``None`` (nothing refused) when the reference cannot be sized before it is built."""
        cfg = self.cfg
        if not cfg.memory_check:
            return None
        dtype = getattr(torch, str(cfg.dtype))
        pretrained = cfg.model.build.get("pretrained")
        meta, sizes = measure_reference(
            lambda: instantiate("model.build", cfg.model.build), str(pretrained) if pretrained else None, dtype
        )
        if sizes is None:
            self.notes.append("memory plan: the reference could not be sized before building it (not checked)")
            return None
        candidate = self._candidate_bytes(sizes)
        forward = None
        if meta is not None:
            with suppress(Exception):  # inputs that cannot be made for a meta model: the forward is unmeasured
                inputs = build_inputs(cfg.inputs, cfg.model.family, meta, None)
                inputs = {key: value.to("meta") for key, value in inputs.items()}
                forward = meta_forward(meta, self._spec("model", meta, inputs).bind(inputs))
        memory = plan(
            sizes.total, candidate, forward, self.device, available_memory(self.device), str(cfg.resident),
            disk_free(self.directory),
        )  # fmt: skip
        self.echo(f"paritylab: {memory.describe()}")
        self.notes.append(memory.describe())
        return memory

    def _candidate_bytes(self, reference: Sizes) -> int:
        """The candidate's size before it is built: the reference's, cast as configured (a port holds the same
        weights, fused or split; its builder is not run twice to find out); none here for a candidate run on
        ranks, whose weights live in their own processes."""
        cfg = self.cfg.candidate
        if distributed_phase.is_distributed(cfg):
            return 0
        dtype = cfg.get("dtype")
        return (reference.cast(getattr(torch, str(dtype))) if dtype else reference).total

    def _one_resident(self, reference: nn.Module) -> bool:
        mode = str(self.cfg.resident)
        if self.memory is not None:
            return self.memory.resident == "one"
        if mode != "auto":
            return mode == "one"
        available = available_memory(self.device)
        return available is not None and model_bytes(reference) > available / 4

    def _offload(self, side: str, model: nn.Module) -> None:
        """resident=one: move ``model``'s weights to a mapped file (deleted when the run ends)."""
        self.echo(f"paritylab: moving the {side}'s weights to a memory-mapped file (resident=one)")
        try:
            moved = offload(getattr(model, "_orig_mod", model), self.directory / RESIDENT_DIR / side)
        except OSError as error:  # only memory is at stake: run on with the model resident
            self.notes.append(f"resident=one: {side} weights kept in memory: {error}")
            return
        release_freed_memory()
        self.notes.append(f"resident=one: {side} weights ({moved / 2**20:.1f} MiB) memory-mapped after tracing")

    def _compare_partial(self, side: str, error: Exception) -> None:
        """A forward raised: compare what both sides produced so far, so the report names the module."""
        try:
            reference = Trace.load(self.directory / "reference")
            candidate = Trace.load(self.directory / "candidate") if side == "candidate" else Trace()
            self.echo(headline(self._keep(compare_traces(reference, candidate))))
        except Exception as nested:  # the partial report is a bonus: never mask the forward's error
            self.notes.append(f"no partial report: {type(nested).__name__}: {nested}")

    def _note_weights(self, candidate: Candidate) -> None:
        weights = candidate.weights
        self.notes.extend(candidate.notes)
        if weights is None:
            return
        self.notes.append(f"weight parity: {weights.summary()}")
        if not weights.ok:
            problems = [f"{name} (max |diff| {diff:.3g})" for name, diff in weights.mismatched[:5]]
            problems += weights.unmapped_candidate[:5] + weights.shape_errors[:5]
            self.echo(f"paritylab: weight parity fails before any forward: {'; '.join(problems)}")

    def _noise_floor(
        self,
        reference: nn.Module,
        candidate: Candidate,
        run: Callable[[nn.Module], Any],
        ref_trace: Trace,
        cand_trace: Trace,
    ) -> Floors | None:
        mode = str(self.cfg.compare.noise_floor)
        low = low_precision(reference, candidate.model)
        if mode == "off" or (mode == "auto" and low is None):
            return None
        low = low or torch.bfloat16
        self.echo(f"paritylab: estimating the noise floors (float32 vs {str(low).removeprefix('torch.')})")
        if candidate.cast_of == low:  # the candidate is the reference at that precision: reuse, don't re-run it
            self.notes.append(
                f"noise floor: the candidate is the reference in {str(low).removeprefix('torch.')}; its trace "
                "serves as the floor's low-precision side (two forwards saved)"
            )
            return estimate_floors(reference, run, ref_trace, low, self.directory, low_trace=cand_trace)
        return estimate_floors(reference, run, ref_trace, low, self.directory)

    def _rules(self, own: list[Rule], reference: Trace, root: str | None) -> list[Rule]:
        """``compare.rules``, "the output" of each side (``root``: the candidate's root call path) and the
        candidate's ``own`` rules, in that order."""
        extra = load_rules(resolve_path(self.cfg.compare.rules)) if self.cfg.compare.rules else []
        chosen = [self._output(key) for key in ("model", "candidate")]
        if chosen != [None, None] and reference.calls and root is not None:  # "the output", as each side's call says
            extra = [Rule(reference.calls[0].path, root, chosen[0], chosen[1]), *extra]
        return extra + own

    def _decisions(
        self,
        report: Report,
        reference: nn.Module,
        ref_run: Callable[[nn.Module], Any],
        candidate: nn.Module,
        cand_run: Callable[[nn.Module], Any],
        ref_trace: Trace,
        cand_trace: Trace,
        floors: Floors | None,
        lifted: LiftedReplay | None,
        rules: list[Rule],
        tolerances: Tolerances,
        pinned: bool,
    ) -> tuple[Report, Callable[[nn.Module], Any], Trace, LiftedReplay | None]:
        """``report`` judged again with the reference's discrete decisions where near ties flipped them
        (:func:`~paritylab.run.decisions.judge_decisions`), and the candidate's call and trace it was judged with."""
        from paritylab.run.decisions import judge_decisions

        cfg = self.cfg
        rejudge = rejudging(
            reference, ref_run, candidate.to(self.device), ref_trace, self.directory, floors=floors, rules=rules,
            tolerances=tolerances, noise_multiple=float(cfg.compare.noise_multiple),
            noise_floor=str(cfg.compare.noise_floor), pinned=pinned,
        )  # fmt: skip
        decided = judge_decisions(
            report, reference, ref_run, candidate.to(self.device), cand_run, ref_trace, cand_trace, rejudge, lifted
        )
        if decided.plan:
            self.echo("paritylab: discrete decisions flipped on near ties: judged again with the reference's")
            self.notes.append(
                "decisions: judged with the reference's discrete decisions fed to the candidate in "
                + ", ".join(sorted(decided.plan))
            )
            self._mark("decisions")
        return self._keep(decided.report), decided.candidate_call, decided.candidate_trace, decided.lifted

    def _drill_down(
        self,
        report: Report,
        reference: nn.Module,
        ref_run: Callable[[nn.Module], Any],
        candidate: nn.Module,
        cand_run: Callable[[nn.Module], Any],
        ref_trace: Trace,
        cand_trace: Trace,
        lifted: LiftedReplay | None = None,
    ) -> Report:
        """``report`` with, inside its origin module, the first operation that differs
        (:func:`~paritylab.run.parity.drill_into_origin`), written to ``report/drilldown.json``."""
        first = report.first_divergence
        if first is None or first.candidate is None or first.status != "compared":
            return report  # an unmatched module has no counterpart to open
        self.echo(f"paritylab: drilling into {display_path(first.path)}")
        found = drill_into_origin(
            report, reference.to(self.device), ref_run, candidate.to(self.device), cand_run, ref_trace, cand_trace,
            lifted, echo=self.echo, notes=self.notes,
        )  # fmt: skip
        if found.drilldown is not None:
            write_json(self.directory / "report" / "drilldown.json", found.drilldown, indent=1)
        return found

    def _generate(
        self,
        report: Report,
        reference: nn.Module,
        candidate: nn.Module,
        inputs: dict[str, torch.Tensor],
        rules: list[Rule],
        tolerances: Tolerances,
    ) -> Report:
        """``report`` with decode-step parity after the forward (:mod:`paritylab.run.generate`)."""
        from paritylab.run.generate import generate_parity, step_heatmap

        steps = int(self.cfg.generate.steps)
        self.echo(f"paritylab: {steps} decode steps with a KV cache on both sides")
        generation = generate_parity(
            reference.to(self.device), candidate.to(self.device), inputs,
            self._spec("model", reference, inputs), self._spec("candidate", candidate, inputs), self.directory, steps,
            rules=rules, tolerances=tolerances, top_k=int(self.cfg.generate.top_k),
            drilldown=bool(self.cfg.compare.drilldown), echo=self.echo,
        )  # fmt: skip
        decode = generation.to_dict()
        folder = self.directory / "report"
        write_json(folder / "decode.json", decode, indent=1)
        (folder / "decode_heatmap.svg").write_text(step_heatmap(generation), encoding="utf-8")
        return dataclasses.replace(report, decode=decode)

    # -- outputs --------------------------------------------------------------------------------------------

    def _write_report(self, report: Report) -> None:
        folder = self.directory / "report"
        folder.mkdir(exist_ok=True)
        (folder / "report.json").write_text(to_json(report), encoding="utf-8")
        (folder / "report.md").write_text(to_markdown(report), encoding="utf-8")
        (folder / "alignment.yaml").write_text(report.alignment.to_yaml(), encoding="utf-8")
        _write_csv(folder / "comparison.csv", rows_table(report))
        figures = write_plots(report, folder)
        if report.decode and (folder / "decode_heatmap.svg").exists():
            figures.append(folder / "decode_heatmap.svg")
        images = {path.stem.replace("_", " "): path.read_text(encoding="utf-8") for path in figures}
        title = f"{self.cfg.model.name} vs {self.cfg.candidate.name}"
        (folder / "report.html").write_text(to_html(report, title, images), encoding="utf-8")

    # -- tracking -------------------------------------------------------------------------------------------

    def _start_tracking(self) -> None:
        tracking = self.cfg.tracking
        self.start_ms = int(time.time() * 1000)
        self.record = RunRecord(
            run_name=run_name(self.cfg, _hydra_overrides()),
            experiment=str(tracking.experiment),
            uri=tracking.uri,
            tags=run_tags(self.cfg, self.device, self.directory, self.start_ms, self.sweep),
            params={k: str(v) for k, v in flatten(OmegaConf.to_container(self.cfg, resolve=True)).items()},
            log_tensors=str(tracking.log_tensors) != "never",
            log_tensors_mode=str(tracking.log_tensors),
            regression_factor=float(tracking.regression_factor),
            regression_floor=float(tracking.regression_floor),
            trend=bool(tracking.trend),
            start_ms=self.start_ms,
            keep_local=bool(tracking.keep_local),
        )
        if not tracking.enabled:
            return
        try:
            opening = Opening(
                self.record,
                float(tracking.timeout),
                int(tracking.retries),
                (self.sweep or {}).get("parent_run_id"),
                close_stale=not self.sweep,  # a sweep closes them once, before its jobs start
            )
            self.connection = connect(opening, str(tracking.process), self.echo)
        except TrackingError as error:
            self._without_tracking(error)

    def _run_id(self) -> str | None:
        """The MLflow run's id, once the connection has opened it (a child's set-up is waited for here, when
        the run first needs it); ``None`` without tracking, or when the run could not be opened."""
        try:
            return self.connection.ready()
        except TrackingError as error:
            self._without_tracking(error)
            return None

    def _without_tracking(self, error: TrackingError) -> None:
        self.tracking_error = str(error)
        self.echo(f"paritylab: {error}; continuing without tracking")
        self.connection.close()
        self.connection = Connection()

    def _finish_tracking(self, status: str, error: str | None) -> None:
        verdict = run_verdict(self.report, status)
        record = self.record
        record.status = status
        record.tags.update(final_tags(self.report, verdict, error, self.notes))
        if _hydra_overrides():
            record.tags["paritylab.overrides"] = " ".join(_hydra_overrides())
        if self.report is not None:
            record.metrics = report_metrics(self.report)
            record.metrics += [
                Metric(f"seconds/{phase.replace(' ', '_')}", value) for phase, value in self.timings.items()
            ]
            record.table = rows_table(self.report)
            write_key_map(self.directory, record.metrics)
        record.log_tensors = upload_tensors(record.log_tensors_mode, verdict, None)
        record.save(self.directory)
        if self._run_id() is None:
            if self.tracking_error:
                self._keep_for_upload()
            return
        try:
            self.regression = self.connection.publish(self.directory)
            if self.regression is not None and self.regression.regressed:
                regressed = ", ".join(self.regression.regressed)
                self.echo(f"paritylab: REGRESSED against {self.regression.baseline_run_id}: {regressed}")
            self.echo(f"paritylab: logged to MLflow: {self.connection.link()}")
        except TrackingError as failure:
            self.tracking_error = str(failure)
            self.echo(f"paritylab: {failure}")
            self._keep_for_upload()
            with suppress(TrackingError):
                self.connection.end("FAILED")

    def _keep_for_upload(self) -> None:
        self.echo(
            f"paritylab: results kept in {self.directory}; publish them later with: paritylab-upload {self.directory}"
        )


def _hydra_overrides() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    return [str(item) for item in HydraConfig.get().overrides.task]


CLAIM = ".paritylab-run"
"""The marker a run creates, exclusively, in its directory before writing anything there."""


def claim_directory(directory: Path) -> None:
    """Make ``directory`` this run's alone: its marker is created exclusively, so a directory that another run
    holds or held (started in the same second, or named again on purpose) is refused, never shared or reused,
    and nothing an earlier run wrote is overwritten."""
    try:
        with open(directory / CLAIM, "x", encoding="utf-8") as handle:
            handle.write(json.dumps({"pid": os.getpid(), "started": time.time()}))
    except FileExistsError:
        raise ConfigError(
            f"{printable(str(directory))} already holds another paritylab run: pass a new directory "
            "(hydra.run.dir=... or output_dir=...), or remove that one"
        ) from None


def start_up_phases() -> dict[str, float]:
    """``imports`` seconds (see :attr:`_Session.timings`): from paritylab's first import to the run's start, for a
    run from the command line (the interpreter's own start, some 30 ms, comes before and is not counted)."""
    import paritylab

    if not paritylab.FROM_COMMAND_LINE:
        return {}
    return {"imports": time.perf_counter() - paritylab.IMPORTED_AT}


def peak_memory(device: torch.device) -> int | None:
    """The run's peak bytes where its models lived: the CUDA allocator's peak on a GPU, else the process's
    peak resident set (Linux reports kilobytes)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except (ImportError, OSError):
        return None


def _write_csv(path: Path, table: dict[str, list[Any]]) -> None:
    import csv

    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(list(table))
        writer.writerows(zip(*table.values(), strict=True))


def _device(cfg: DictConfig) -> torch.device:
    name = str(cfg.device)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ConfigError(f"device={name!r} is not a device: use auto, cpu, cuda or cuda:N") from error
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} but CUDA is not available here: use device=cpu or device=auto")
    return device


def _hydra_dir() -> str | None:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else None


def _default_dir(cfg: DictConfig) -> Path:
    return Path("outputs") / time.strftime("%Y-%m-%d/%H-%M-%S") / f"{cfg.model.name}-{cfg.candidate.name}"
