"""The parity check as plain functions: trace both sides, estimate noise floors, compare, replay.

>>> result = paritylab.check(reference, candidate, "runs/gpt2", reference_call=lambda m: m(ids),
...                          candidate_call=lambda m: m(ids))
>>> result.verdict, result.report.first_divergence.path if result.report.first_divergence else "-"

Each phase is a function returning a value (:func:`trace_model`, :func:`estimate_floors`, :func:`compare`,
:func:`judge_with_replay`); :func:`check` chains them into one :class:`ParityResult`. The Hydra app runs the
same functions, so the numbers a script gets are the numbers a configured run gets.
"""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paritylab.comparison.alignment import Alignment, Rule, align
from paritylab.comparison.attribution import CODE_MULTIPLE, FLOAT32_UNIT, attach_replay
from paritylab.comparison.lifted import LiftedReplay
from paritylab.comparison.metrics import Tolerance, Tolerances, divergence
from paritylab.comparison.replay import isolated_replay, layer_replay
from paritylab.comparison.report import Report, compare_traces, primary_output
from paritylab.comparison.report import noise_floor as free_run_floor
from paritylab.run.function_reads import judge_function_reads
from paritylab.run.layouts import judge_layouts
from paritylab.run.lifting import LIFTED_MEMORY_SHARE, cast_call, lift, private_call
from paritylab.run.resident import available_memory, converted_bytes, converted_copy, model_bytes
from paritylab.run.whole_graph import check_whole_graph, not_checked
from paritylab.run.widening import cast_in_place, widened_in_place
from paritylab.tracing.tracefile import Trace
from paritylab.tracing.tracer import TraceOptions, is_compiled, trace_run
from paritylab.tracing.values import floating, iter_tensors

Call = Callable[[nn.Module], Any]
EXIT_PASS, EXIT_FAIL, EXIT_ERROR, EXIT_INCONCLUSIVE = 0, 1, 2, 3
EXIT_CODES = {"pass": EXIT_PASS, "fail": EXIT_FAIL, "error": EXIT_ERROR, "inconclusive": EXIT_INCONCLUSIVE}
LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass
class Floors:
    """Numerical noise floors of the reference at a low precision, per reference call key.

    ``free_run``: the whole reference at low precision against float32 (:data:`EXACT_DTYPE`; errors accumulated
    up to each module). ``local_metrics``: each reference module at low precision fed the reference's own inputs (its
    own error alone), the yardstick for a candidate module's isolated-replay error.
    """

    dtype: torch.dtype
    free_run: dict[str, float]
    local_metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    """The reference's own low-precision replay metrics per call key (``rel_l2``, ``scale_err``, ...)."""
    local_trace: Trace | None = None
    """That replay itself: each module's low-precision output, against which a candidate's replayed output
    is tested for a systematic part (None when the candidate is the reference cast: it is the same run)."""
    loosens_only: bool = False
    """float32's floors against float64 (:func:`estimate_float32_floors`): a module passes when within its floor
    or its tolerance, and fails only when beyond both (a low-precision floor replaces the tolerance)."""
    from_candidate: bool = False
    """The low-precision side is the candidate's own trace (the candidate is the reference cast to ``dtype``):
    local floors, when a replay runs, are read from the candidate's isolated replay (:func:`judge_with_replay`;
    the Hydra run does not replay such a candidate: it would be judged against itself)."""


def trace_model(model: nn.Module, call: Call, directory: Path, **options: Any) -> Trace:
    """Trace ``call(model)`` into ``directory`` (tensors saved) and return the trace read back lazily."""
    options.setdefault("save_tensors", True)
    trace_run(model, call, directory, TraceOptions(**options))
    return Trace.load(directory)


def low_precision(*models: nn.Module) -> torch.dtype | None:
    """The lowest floating-point precision among the models' parameters (bfloat16/float16), if any."""
    for model in models:
        for parameter in model.parameters():
            if parameter.dtype in LOW_PRECISION:
                return parameter.dtype
    return None


def estimate_floors(
    reference: nn.Module,
    call: Call,
    reference_trace: Trace,
    dtype: torch.dtype,
    directory: Path,
    cast_inputs: Callable[[torch.dtype], Call] | None = None,
    low_trace: Trace | None = None,
) -> Floors:
    """The reference's free-run and local noise floors at ``dtype`` (see :class:`Floors`).

    ``cast_inputs(dtype)`` gives the call that runs a copy of the reference in ``dtype``; by default
    ``call`` with every floating-point tensor it passes to the forward cast to ``dtype``
    (:func:`cast_call`). ``low_trace``: the reference's trace at
    ``dtype`` when it exists already (a candidate that is the reference cast to ``dtype``); then only the free
    run's floor is estimated here, and the local floors come from that candidate's own isolated replay
    (:func:`local_floors`), which is the same computation.
    """
    from paritylab.comparison.decisions import captured, everywhere

    cast = cast_inputs or (lambda dtype: cast_call(call, dtype))
    exact = exact_side(reference, cast, reference_trace, directory)
    if low_trace is not None:
        return Floors(dtype, free_run_floor(exact, low_trace), from_candidate=True)
    # The low-precision copy takes the float32 reference's discrete decisions (a router's top-k): a near tie its
    # rounding flips would make the floor of that module, and of all after it, a flip's size, which hides bugs.
    choices = captured(reference, private_call(call)) if low_precision(reference) is None else []

    def runner(dtype: torch.dtype) -> Call:
        return everywhere(cast(dtype), choices)

    def measure(model: nn.Module, call: Call) -> Floors:
        low = trace_model(model, call, directory / "noise-low", capture=None)
        alignment = align(reference_trace, low)
        replayed = isolated_replay(
            model, call, reference_trace, low, alignment, directory / "noise-local", fingerprint=False
        )
        return Floors(dtype, free_run_floor(exact, low), local_floors(reference_trace, replayed, alignment), replayed)

    try:  # no copy of the reference: each module's tensors cast while it runs
        return measure(reference, cast_in_place(runner(dtype), dtype, reference_trace.uncalled))
    except Exception:
        free = available_memory(next(reference.parameters()).device)
        if free is not None and converted_bytes(reference, dtype) > LIFTED_MEMORY_SHARE * free:
            raise
    for name in ("noise-low", "noise-local"):  # a module read weights it does not hold: on a copy
        shutil.rmtree(directory / name, ignore_errors=True)
    return measure(converted_copy(reference, dtype), runner(dtype))


def estimate_float32_floors(reference: nn.Module, call: Call, reference_trace: Trace, directory: Path) -> Floors:
    """float32's own noise floors: the float32 reference against itself computed in float64, the whole forward
    (free run) and each module fed the reference's own inputs (local), without a float64 copy of the model (each
    module is widened while it runs: :func:`paritylab.run.widening.widened_in_place`); a forward that cannot run
    so (it reads a grandchild's dtype or weights) runs on a float64 copy when one fits in memory. Two float32
    programs that compute the same function in another order (a fused projection, another GPU kernel) differ by
    about this much. Raises what the widened forward raises."""
    wide = cast_call(call, torch.float64)

    def measure(model: nn.Module, run: Call) -> Floors:
        try:
            exact = trace_model(model, run, directory / "noise-exact64", capture=None)
            if [c.key for c in exact.calls] != [c.key for c in reference_trace.calls]:
                raise RuntimeError("the float64 forward made other module calls than the float32 one")
            alignment = align(reference_trace, reference_trace)
            replayed = isolated_replay(
                model, run, reference_trace, reference_trace, alignment, directory / "noise-local64"
            )
            local = local_floors(reference_trace, replayed, alignment)
            return Floors(torch.float32, free_run_floor(exact, reference_trace), local, loosens_only=True)
        finally:  # the floors are numbers: the float64 traces (twice the reference's bytes) are scratch
            for name in ("noise-exact64", "noise-local64"):
                shutil.rmtree(directory / name, ignore_errors=True)

    def widened(model: nn.Module) -> Any:  # inside the tracer: it meets the weights themselves
        with widened_in_place(model, torch.float64, reference_trace.uncalled, stand_in=True):  # none met in float32
            return wide(model)

    try:
        return measure(reference, widened)
    except Exception:
        device = next(reference.parameters()).device
        free = available_memory(device)
        if free is None or 2 * model_bytes(reference) > LIFTED_MEMORY_SHARE * free:
            raise
    return measure(converted_copy(reference, torch.float64), wide)


def compare_against_floors(
    reference_trace: Trace,
    candidate_trace: Trace,
    floors: Floors | None,
    *,
    reference: nn.Module | None = None,
    reference_call: Call | None = None,
    candidate: nn.Module | None = None,
    directory: Path | None = None,
    noise_floor: str = "auto",
    notes: list[str] | None = None,
    echo: Callable[[str], None] | None = None,
    **options: Any,
) -> tuple[Report, Floors | None]:
    """:func:`compare` (``options`` are its own); then, given both models, the reference's call and a directory, a
    float32 pair that fails its tolerance is compared once more against float32's own floors
    (:func:`estimate_float32_floors`). Returns the free run and the floors it was judged against. A forward that
    cannot run in float64 leaves the tolerance to judge alone (said in ``notes``)."""
    report = compare(reference_trace, candidate_trace, floors=floors, **options)
    if (
        floors is not None
        or reference is None
        or reference_call is None
        or candidate is None
        or directory is None
        or not _needs_float32_floors(reference, candidate, report, noise_floor)
    ):
        return report, floors
    floors = _float32_floors(
        reference, reference_call, reference_trace, directory, "the float32 pair fails its tolerance", notes, echo
    )
    if floors is None:
        return report, None
    return compare(reference_trace, candidate_trace, floors=floors, **options), floors


def _float32_floors(
    reference: nn.Module,
    reference_call: Call,
    reference_trace: Trace,
    directory: Path,
    why: str,
    notes: list[str] | None,
    echo: Callable[[str], None] | None,
) -> Floors | None:
    """:func:`estimate_float32_floors`, said (``why``) on the console and in ``notes``; ``None`` (said in
    ``notes``) when the forward cannot run in float64: the tolerance then judges alone."""
    if echo is not None:
        echo(f"paritylab: {why}: estimating float32's own noise floor (float64)")
    said = notes if notes is not None else []
    try:
        floors = estimate_float32_floors(reference, reference_call, reference_trace, directory)
    except Exception as error:  # the user's forward in float64
        said.append(f"float32 noise floor not estimated: {type(error).__name__}: {error}".splitlines()[0])
        return None
    said.append(
        f"float32 noise floor ({why}): the reference against itself in float64; a module fails beyond both its "
        f"tolerance and noise_multiple times its floor, or beyond {CODE_MULTIPLE:g} times float32's rounding of "
        "its code whatever its tolerance"
    )
    return floors


def _needs_float32_floors(reference: nn.Module, candidate: nn.Module, free_run: Report, noise_floor: str) -> bool:
    """Whether a free run is judged again against float32's own floors: both sides float32, and it fails."""
    if noise_floor == "off" or free_run.passed or free_run.errors:
        return False
    return _float32_pair(reference, candidate)


def _float32_pair(reference: nn.Module, candidate: nn.Module) -> bool:
    """Both sides compute in float32: the reference holds only float32 weights and the candidate no narrower."""
    if low_precision(reference, candidate) is not None:
        return False
    return {p.dtype for p in reference.parameters() if p.is_floating_point()} == {torch.float32}


def _float32_suspects(report: Report, reference: nn.Module | None, candidate: nn.Module) -> bool:
    """A float32 pair with a module whose own error passes its tolerance yet exceeds what float32's rounding of any
    code gives without an unusually rough floor (:data:`~paritylab.comparison.attribution.CODE_MULTIPLE` units)."""
    if reference is None or report.errors or not _float32_pair(reference, candidate):
        return False
    return any(
        row.status == "compared"
        and row.reference.dtype == "float32"
        and not row.local.get("local_diverged")
        and row.local.get("local_rel_l2", 0.0) > CODE_MULTIPLE * FLOAT32_UNIT
        for row in report.rows
    )


EXACT_DTYPE = torch.float32
"""The exact side of a free-run floor. float32 is exact enough for the precisions judged (bfloat16, float16):
its unit roundoff (2**-24, 6.0e-8) is 2**16 times finer than bfloat16's (2**-8) and 2**13 times finer than
float16's (2**-11). A floor measured against float32 instead of float64 moves by at most the float32 run's own
error, 1e-7 to 1e-5 where the floors are 1e-4 to 1e-2: measured on a three-layer Llama, no module's floor moved
by more than 1.3e-5 of itself in bfloat16 and 5.1e-5 in float16, against a noise multiple of 4
(``tests/test_floors.py`` holds every module to 1 %). And a float32
reference needs no copy at all: its own trace is the exact side."""


def exact_side(
    reference: nn.Module, runner: Callable[[torch.dtype], Call], reference_trace: Trace, directory: Path
) -> Trace:
    """The reference computed in (near) exact arithmetic (:data:`EXACT_DTYPE`), without a whole-model copy
    where the reference already computes in float32 or wider: its trace itself when every call's output
    was saved, else one more forward of the reference as it is. A low-precision reference is run as a float32
    copy (twice its size: said in the docs' memory budget)."""
    if low_precision(reference) is None:
        if _outputs_saved(reference_trace):
            return reference_trace
        return trace_model(reference, runner(EXACT_DTYPE), directory / "noise-exact", capture=None)
    exact_model = converted_copy(reference, EXACT_DTYPE)
    try:
        return trace_model(exact_model, runner(EXACT_DTYPE), directory / "noise-exact", capture=None)
    finally:
        del exact_model


def _outputs_saved(trace: Trace) -> bool:
    """Every call's first floating-point output has its value in ``trace`` (not only statistics)."""
    for call in trace.calls:
        for _, node in iter_tensors(call.outputs, "outputs"):
            if floating(node):
                if node.get("ref") is None or node["ref"] not in trace.files:
                    return False
                break
    return True


def local_floors(reference_trace: Trace, replayed: Trace, alignment: Alignment) -> dict[str, dict[str, float]]:
    """Per reference call key, the metrics of a low-precision copy's isolated replay against the reference."""
    local_metrics: dict[str, dict[str, float]] = {}
    for pair in alignment.pairs:
        ref_call, own = reference_trace.call(pair.reference), replayed.call(pair.candidate)
        ref_value, own_value = primary_output(reference_trace, ref_call), primary_output(replayed, own)
        if ref_value is None or own_value is None or ref_value.shape != own_value.shape:
            continue
        metrics = divergence(ref_value, own_value, Tolerance(0.0, 0.0))
        if metrics["rel_l2"] == metrics["rel_l2"]:  # not NaN
            local_metrics[pair.reference] = metrics
    return local_metrics


def match_weight_grids(
    reference: nn.Module, candidate: nn.Module, reference_trace: Trace, candidate_trace: Trace
) -> None:
    """Weight fingerprints hash values rounded to bfloat16, which pairs fp32 weights with their bf16 copies.
    An fp16 copy rounds through fp16 first, which changes 6 % of them; so when one side holds float16 weights
    and the other wider ones, the wider side's fingerprints (in its trace's meta, in memory) are recomputed on
    the fp16 grid before alignment."""
    from paritylab.tracing.structure import fingerprint_json

    sides = ((reference, reference_trace, candidate), (candidate, candidate_trace, reference))
    for model, trace, other in sides:
        if low_precision(other) == torch.float16 and low_precision(model) is None and "structure" in trace.meta:
            trace.meta["structure"] = fingerprint_json(model, "fp16")


@dataclass(frozen=True)
class ParityResult:
    """What a parity check produced: the final judgement and the evidence it rests on.

    ``report`` is the free-run comparison judged again with isolated replay (and, in a configured run,
    extended by the drill-down and decode steps); ``free_run`` is the comparison before replay. Both traces
    stay readable from ``directory``.
    """

    report: Report
    free_run: Report
    reference: Trace
    candidate: Trace
    floors: Floors | None
    directory: Path

    @property
    def verdict(self) -> str:
        """``pass``, ``fail``, ``inconclusive`` (some aligned output could not be compared by value) or ``error``."""
        return self.report.verdict

    @property
    def passed(self) -> bool:
        return self.report.passed

    @property
    def exit_code(self) -> int:
        """The command line's exit code for this verdict: 0 pass, 1 fail, 2 error, 3 inconclusive."""
        return EXIT_CODES[self.verdict]


def compare(
    reference_trace: Trace,
    candidate_trace: Trace,
    *,
    rules: Iterable[Rule] = (),
    tolerances: Tolerances | None = None,
    floors: Floors | None = None,
    noise_multiple: float = 4.0,
    pinned: bool = False,
) -> Report:
    """The free-run comparison: align, measure every pair, localise where divergence starts."""
    return compare_traces(
        reference_trace,
        candidate_trace,
        rules=rules,
        tolerances=tolerances,
        noise_floor=floors.free_run if floors else None,
        noise_multiple=noise_multiple,
        pinned=pinned,
    )


def judge_with_replay(
    report: Report,
    candidate: nn.Module,
    candidate_call: Call,
    reference_trace: Trace,
    candidate_trace: Trace,
    directory: Path,
    *,
    tolerances: Tolerances | None = None,
    floors: Floors | None = None,
    lifted: LiftedReplay | None = None,
    reference: nn.Module | None = None,
    reference_call: Call | None = None,
    noise_floor: str = "auto",
    notes: list[str] | None = None,
    echo: Callable[[str], None] | None = None,
) -> tuple[Report, Floors | None]:
    """Isolated replay: the candidate run again with every aligned output replaced by the reference's value.
    Returns ``report`` judged again with each module's own error (a new report) and the floors used: when the
    candidate is the reference cast to low precision (``floors.from_candidate``), its replay is also the
    reference's own low-precision replay, so the local floors are read from it here. Given the reference and
    its call, a float32 pair with a module whose own error is within its tolerance but beyond a few units of
    float32's rounding is judged once more against float32's own floors (:func:`estimate_float32_floors`): an eps
    or a constant differs there by far more than the same arithmetic done in another order."""
    replayed = isolated_replay(
        candidate, candidate_call, reference_trace, candidate_trace, report.alignment, directory / "replay"
    )
    if floors is not None and floors.from_candidate:
        floors = replace(floors, local_metrics=local_floors(reference_trace, replayed, report.alignment))
    local, own = (floors.local_metrics, floors.local_trace) if floors else (None, None)
    loosens = floors is not None and floors.loosens_only
    judged = attach_replay(
        report, reference_trace, replayed, tolerances, local, own, lifted, loosens, candidate=candidate_trace
    )
    suspect = floors is None and noise_floor != "off" and _float32_suspects(judged, reference, candidate)
    if suspect and reference is not None and reference_call is not None:
        why = "a float32 module's own error is beyond a few units of float32's rounding"
        floors = _float32_floors(reference, reference_call, reference_trace, directory, why, notes, echo)
        if floors is not None:
            judged = attach_replay(
                report,
                reference_trace,
                replayed,
                tolerances,
                floors.local_metrics,
                None,
                lifted,
                True,
                candidate=candidate_trace,
            )
    if not judged.passed:
        yardsticks = floors.local_metrics if floors is not None else None
        judged = judge_layouts(judged, candidate, candidate_call, reference_trace, candidate_trace, yardsticks)
        judged = judge_function_reads(judged, reference, candidate, candidate_call, reference_trace, candidate_trace)
        add_layer_errors(judged, candidate, candidate_call, reference_trace, candidate_trace)
    return judged, floors


def add_layer_errors(
    report: Report, candidate: nn.Module, candidate_call: Call, reference_trace: Trace, candidate_trace: Trace
) -> None:
    """Each numbered block's error fed the reference's input, everything inside it included (``layer_rel_l2`` in
    its row's ``local``; :func:`~paritylab.comparison.replay.layer_replay`): what the per-layer "own error" charts
    show, so the layer that holds a bug stands out. One more candidate forward, on failing runs only."""
    from paritylab.reports.plots import LAYER

    rows = {
        row.candidate.key: row
        for row in report.rows
        if row.candidate is not None and row.status == "compared" and LAYER.match(row.path)
    }
    if not rows:
        return
    errors = layer_replay(candidate, candidate_call, reference_trace, candidate_trace, report.alignment, set(rows))
    for key, error in errors.items():
        rows[key].local["layer_rel_l2"] = error


def judge_whole_graph(
    report: Report,
    candidate: nn.Module,
    candidate_call: Call,
    reference_trace: Trace,
    candidate_trace: Trace,
    enabled: bool = True,
    skipped_by: str = "whole_graph=False",
) -> Report:
    """For a ``torch.compile`` candidate, ``report`` with the verdict of the candidate run once more untraced,
    as one graph (:mod:`paritylab.run.whole_graph`: what the tracer's graph breaks could hide); not enabled, it
    says so (``skipped_by``) and the run is inconclusive at best. Any other candidate: ``report`` as it is."""
    if not is_compiled(candidate) or report.errors:
        return report
    graph = (
        check_whole_graph(report, candidate, candidate_call, reference_trace, candidate_trace)
        if enabled
        else not_checked(skipped_by)
    )
    return replace(report, whole_graph=graph)


def check(
    reference: nn.Module,
    candidate: nn.Module,
    directory: str | Path,
    *,
    reference_call: Call,
    candidate_call: Call | None = None,
    rules: Iterable[Rule] = (),
    tolerances: Tolerances | None = None,
    noise_floor: str = "auto",
    noise_multiple: float = 4.0,
    replay: bool = True,
    cast_inputs: Callable[[torch.dtype], Call] | None = None,
    whole_graph: bool = True,
    drilldown: bool = True,
    echo: Callable[[str], None] | None = print,
) -> ParityResult:
    """Trace both models, compare them module by module and name where divergence starts.

    ``reference_call(model)`` and ``candidate_call(model)`` run one forward each (the candidate's defaults
    to the reference's). With a bfloat16/float16 side and ``noise_floor`` ``auto`` (or ``on``), each module
    is judged against the reference's own error at that precision; a bfloat16/float16 candidate of a wider
    reference is also replayed lifted (:func:`lift`: its code in float32 with its own weights), so errors under
    the precision's rounding are found too. A failure that starts where discrete decisions (a router's top-k)
    flipped on near ties is judged again with the reference's decisions fed to the candidate
    (:func:`~paritylab.run.decisions.judge_decisions`). A ``torch.compile`` candidate is also run
    once untraced, as one graph (:mod:`paritylab.run.whole_graph`; ``whole_graph=False`` skips it, and the
    result is then inconclusive at best). When parity fails, the module where divergence starts is opened
    (:func:`drill_into_origin`, as the command line does; ``drilldown=False`` skips it). The findings are printed
    as the command line prints them, the table and the "inside <module>: ..." line (``echo=None``: nothing).
    """
    directory = Path(directory)
    candidate_call = candidate_call or reference_call
    reference_trace = trace_model(reference, reference_call, directory / "reference")
    candidate_trace = trace_model(candidate, candidate_call, directory / "candidate")
    match_weight_grids(reference, candidate, reference_trace, candidate_trace)
    dtype = low_precision(reference, candidate)
    floors = None
    if noise_floor == "on" or (noise_floor == "auto" and dtype is not None):
        floors = estimate_floors(
            reference, reference_call, reference_trace, dtype or torch.bfloat16, directory, cast_inputs
        )
    free_run, floors = compare_against_floors(
        reference_trace, candidate_trace, floors, reference=reference, reference_call=reference_call,
        candidate=candidate, directory=directory, noise_floor=noise_floor, rules=rules, tolerances=tolerances,
        noise_multiple=noise_multiple,
    )  # fmt: skip
    report, lifted = free_run, None
    if replay and not free_run.errors and free_run.alignment.pairs:
        lifted = lift(
            reference, reference_call, candidate, candidate_call, reference_trace, candidate_trace,
            free_run.alignment, directory,
        )  # fmt: skip
        report, floors = judge_with_replay(
            free_run, candidate, candidate_call, reference_trace, candidate_trace, directory,
            tolerances=tolerances, floors=floors, lifted=lifted, reference=reference, reference_call=reference_call,
            noise_floor=noise_floor,
        )  # fmt: skip
    if replay and not report.passed and not report.errors and free_run.alignment.pairs:
        from paritylab.run.decisions import judge_decisions

        rejudge = rejudging(
            reference, reference_call, candidate, reference_trace, directory, floors=floors, rules=rules,
            tolerances=tolerances, noise_multiple=noise_multiple, noise_floor=noise_floor,
        )  # fmt: skip
        decided = judge_decisions(
            report, reference, reference_call, candidate, candidate_call, reference_trace, candidate_trace, rejudge,
            lifted,
        )  # fmt: skip
        report, candidate_call, candidate_trace = decided.report, decided.candidate_call, decided.candidate_trace
        lifted = decided.lifted
    report = judge_whole_graph(report, candidate, candidate_call, reference_trace, candidate_trace, whole_graph)
    if drilldown:
        report = drill_into_origin(
            report, reference, reference_call, candidate, candidate_call, reference_trace, candidate_trace, lifted,
            echo=echo,
        )  # fmt: skip
    if echo is not None:
        from paritylab.reports.render import to_console

        echo(to_console(report))
    return ParityResult(report, free_run, reference_trace, candidate_trace, floors, directory)


def drill_into_origin(
    report: Report,
    reference: nn.Module,
    reference_call: Call,
    candidate: nn.Module,
    candidate_call: Call,
    reference_trace: Trace,
    candidate_trace: Trace,
    lifted: LiftedReplay | None = None,
    echo: Callable[[str], None] | None = None,
    notes: list[str] | None = None,
) -> Report:
    """``report`` with, inside the module where divergence starts, the first operation that differs (both sides
    run that module once more, the candidate teacher-forced: :func:`~paritylab.comparison.drilldown.drill_into`),
    in its ``drilldown``; an origin the lifted replay found is opened in the lifted copies. A report that passes,
    or whose origin has no counterpart, is returned as it is; so is one whose drill-down raised (``echo`` says
    why: the verdict stands without it). ``notes`` (the command line's run notes) gains what the drill-down noted."""
    from paritylab.comparison.drilldown import drill_into
    from paritylab.comparison.replay import teacher_forcing
    from paritylab.run.lifting import lifted_candidate_side, lifted_reference_side

    first = report.first_divergence
    if report.passed or first is None or first.candidate is None or first.status != "compared":
        return report
    reference_call, candidate_call = private_call(reference_call), private_call(candidate_call)
    key, forced_on = first.candidate.key, reference_trace
    dtype, own = first.candidate.dtype or "float32", first.local.get("local_rel_l2", first.rel_l2)
    try:
        if lifted is not None and first.local.get("lifted_diverged"):
            low, made, copies = getattr(torch, lifted.dtype), lifted.made_with, lifted.copies
            (reference, reference_call), (candidate, candidate_call) = (
                lifted_reference_side(reference, reference_call, low, made, copies, reference_trace.uncalled),
                lifted_candidate_side(candidate, candidate_call, low, made, copies, candidate_trace.uncalled),
            )
            forced_on, dtype, own = lifted.reference, "float32", first.local.get("lifted_rel_l2", own)
            if notes is not None:
                notes.append(f"drill-down: in the lifted copies (float32 with the candidate's {lifted.dtype} weights)")
        found = drill_into(
            reference, reference_call, first.reference.key, candidate, candidate_call, key,
            lambda model: teacher_forcing(model, forced_on, candidate_trace, report.alignment, within=key), dtype, own,
        )  # fmt: skip
    except Exception as failure:  # evidence on top of the verdict: its failure must not lose the verdict
        if echo is not None:
            echo(f"paritylab: the drill-down into {first.path} failed: {type(failure).__name__}: {failure}")
        return report
    if notes is not None:
        notes.extend(f"drill-down: {note}" for note in found.notes)
    return replace(report, drilldown=found.to_dict())


def compare_and_replay(
    reference_trace: Trace,
    candidate_trace: Trace,
    candidate: nn.Module | None,
    candidate_call: Call,
    directory: Path,
    *,
    rules: Iterable[Rule] = (),
    tolerances: Tolerances | None = None,
    floors: Floors | None = None,
    noise_multiple: float = 4.0,
    reference: nn.Module | None = None,
    reference_call: Call | None = None,
    decisions: bool = True,
) -> Report:
    """:func:`compare`, then (given the candidate model) :func:`judge_with_replay`: the final report. Given the
    reference model and its call too, a low-precision candidate is also judged by :func:`lift`, and a failure that
    starts in a module whose discrete decisions flipped on near ties is judged again with the reference's decisions
    (:func:`~paritylab.run.decisions.judge_decisions`; ``decisions=False`` skips it)."""
    report, floors = compare_against_floors(
        reference_trace, candidate_trace, floors, reference=reference, reference_call=reference_call,
        candidate=candidate, directory=directory, rules=rules, tolerances=tolerances, noise_multiple=noise_multiple,
    )  # fmt: skip
    if candidate is None or report.errors or not report.alignment.pairs:
        return report
    lifted = None
    if reference is not None and reference_call is not None:
        lifted = lift(
            reference, reference_call, candidate, candidate_call, reference_trace, candidate_trace,
            report.alignment, directory,
        )  # fmt: skip
    judged, floors = judge_with_replay(
        report, candidate, candidate_call, reference_trace, candidate_trace, directory,
        tolerances=tolerances, floors=floors, lifted=lifted, reference=reference, reference_call=reference_call,
    )  # fmt: skip
    if not decisions or judged.passed or reference is None or reference_call is None:
        return judged
    from paritylab.run.decisions import judge_decisions

    rejudge = rejudging(
        reference, reference_call, candidate, reference_trace, directory, floors=floors, rules=rules,
        tolerances=tolerances, noise_multiple=noise_multiple,
    )  # fmt: skip
    return judge_decisions(
        judged, reference, reference_call, candidate, candidate_call, reference_trace, candidate_trace, rejudge, lifted
    ).report


def rejudging(
    reference: nn.Module,
    reference_call: Call,
    candidate: nn.Module,
    reference_trace: Trace,
    directory: Path,
    *,
    floors: Floors | None,
    rules: Iterable[Rule] = (),
    tolerances: Tolerances | None = None,
    noise_multiple: float = 4.0,
    noise_floor: str = "auto",
    pinned: bool = False,
) -> Callable[[Call], tuple[Report, Trace, LiftedReplay | None]]:
    """The check's phases for another candidate call (the same reference side and floors): trace it, compare, lift
    and replay, each time in a directory of its own under ``directory`` (``decisions-<n>``). Returns the judged
    report, the candidate's trace and the lifted replay."""
    rounds = itertools.count()

    def rejudge(call: Call) -> tuple[Report, Trace, LiftedReplay | None]:
        where = directory / f"decisions-{next(rounds)}"
        shutil.rmtree(where, ignore_errors=True)
        trace = trace_model(candidate, call, where / "candidate")
        match_weight_grids(reference, candidate, reference_trace, trace)
        free_run, used = compare_against_floors(
            reference_trace, trace, floors, reference=reference, reference_call=reference_call, candidate=candidate,
            directory=where, noise_floor=noise_floor, rules=rules, tolerances=tolerances,
            noise_multiple=noise_multiple, pinned=pinned,
        )  # fmt: skip
        if free_run.errors or not free_run.alignment.pairs:
            return free_run, trace, None
        lifted = lift(reference, reference_call, candidate, call, reference_trace, trace, free_run.alignment, where)
        judged, _ = judge_with_replay(
            free_run, candidate, call, reference_trace, trace, where, tolerances=tolerances, floors=used,
            lifted=lifted, reference=reference, reference_call=reference_call, noise_floor=noise_floor,
        )  # fmt: skip
        return judged, trace, lifted

    return rejudge
