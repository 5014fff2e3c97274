"""The lifted replay as a run phase: the two float32 sides made, run and checked (the judgement itself is
:mod:`paritylab.comparison.lifted`).

A bfloat16/float16 candidate's code is replayed in float32 with the very weights it holds, against the
reference run in float32 with its parameters rounded the same way. Neither side is copied: each module's
tensors are rounded or widened while it runs (:func:`lifted_reference_call`, :func:`lifted_candidate_call`,
through :func:`~paritylab.run.widening.converted_in_place`), so only the running modules' float32 tensors are
alive at a time. A model that reads a weight outside its module's call, which a converted copy would give it
converted, runs on float32 copies instead (:func:`lifted_reference`, :func:`lifted_candidate`; one alive at a
time, and only when one fits in memory). This module gives both the calls they need (floating inputs rounded
to the candidate's precision, then widened), lifts a precision named in a config, and sets the replay aside
when it cannot be trusted: a side that fails or calls other modules, or most modules differing at once.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paritylab.comparison.alignment import Alignment
from paritylab.comparison.lifted import LiftedReplay, lifts, same_weights, weightless
from paritylab.comparison.replay import fed_value, isolated_replay
from paritylab.comparison.twins import LIFTED_DTYPE, Twins, exact_sources, twins, unwrap, with_folds
from paritylab.comparison.verify import handing_on, hands_on_output
from paritylab.run.resident import Slot, available_memory, converted_bytes, converted_copy, stored_ids
from paritylab.run.widening import converted_in_place
from paritylab.tracing.initial import caches_reset, reset_caches
from paritylab.tracing.tracefile import Trace
from paritylab.tracing.tracer import TraceOptions, Tracer
from paritylab.tracing.values import map_tensors

Call = Callable[[nn.Module], Any]


def lift(
    reference: nn.Module,
    reference_call: Call,
    candidate: nn.Module,
    candidate_call: Call,
    reference_trace: Trace,
    candidate_trace: Trace,
    alignment: Alignment,
    directory: Path,
    notes: list[str] | None = None,
) -> LiftedReplay | None:
    """The lifted replay (:mod:`paritylab.comparison.lifted`): when the candidate holds bfloat16 or float16
    weights and the reference wider ones, both replayed in float32 with the candidate's weights (the reference's
    parameters rounded), so each module's code is judged without its precision's rounding. ``None`` when it
    does not apply: no low-precision candidate, or no pair whose weights are provably the same; or when a
    side cannot run in float32 as its original did (said in ``notes``: the lifted replay only adds findings, so
    the low-precision judgement then stands alone)."""
    dtype = lifts(reference, candidate)
    if dtype is None:
        return None
    reference, candidate = unwrap(reference), unwrap(candidate)
    try:
        found = twins(reference, candidate, dtype, reference_trace)  # what the copies and the weights check share
        ledger = alignment.weights  # norms a port folded without a defect the ledger found: unfolded
        defective = {finding.candidate_module for finding in ledger.differing}
        found = with_folds(found, reference, candidate, {c: f for c, f in ledger.folds.items() if c not in defective})
        eligible = same_weights(reference, candidate, reference_trace, candidate_trace, alignment, dtype, found)
    except Exception as error:  # parameters fingerprinting cannot read (a tensor subclass): nothing to lift
        if notes is not None:
            notes.append(f"lifted replay skipped: weights not comparable: {type(error).__name__}: {error}")
        return None
    if not eligible:
        return None
    needed = max(converted_bytes(model, LIFTED_DTYPE) for model in (reference, candidate))  # one copy at a time
    free = available_memory(next(candidate.parameters()).device)
    fits = free is None or needed <= LIFTED_MEMORY_SHARE * free
    uncalled = (reference_trace.uncalled, candidate_trace.uncalled)
    traces, problem = _lifted_traces(
        reference, reference_call, candidate, candidate_call, reference_trace, candidate_trace, alignment, eligible,
        dtype, found, uncalled, directory, copies=False,
    )  # fmt: skip
    copies = traces is None or _narrowed(traces, dtype)
    if copies and fits:  # in place could not run as a copy does (a module reads weights it does not hold)
        why = problem or f"a value left in {str(dtype).removeprefix('torch.')} or on no device"
        traces, problem = _lifted_traces(
            reference, reference_call, candidate, candidate_call, reference_trace, candidate_trace, alignment,
            eligible, dtype, found, uncalled, directory, copies=True,
        )  # fmt: skip
        if traces is not None and notes is not None:
            notes.append(f"lifted replay on float32 copies ({needed / 2**30:.2f} GiB): in place, {why}")
    if traces is None:
        if notes is not None:
            notes.append(f"lifted replay skipped: {problem}")
            if not fits:
                notes.append(
                    f"lifted replay: a float32 copy ({needed / 2**30:.1f} GiB), which might have run, does not fit"
                    f" in the {free / 2**30 if free else 0:.1f} GiB available"
                )
        return None
    observers = weightless(candidate, candidate_trace, alignment, dtype)
    fed = _fed_leaves(traces[0], candidate_trace, alignment, eligible)
    forced = frozenset(pair.reference for pair in alignment.pairs if pair.candidate in fed)
    sources = exact_sources(candidate, found.proven, dtype)
    lifted = LiftedReplay(
        str(dtype).removeprefix("torch."), traces[0], traces[1], eligible, alignment, observers, forced, sources,
        handing_on(candidate_trace), found, copies and fits,
    )  # fmt: skip
    rows = lifted.judged()
    differing = sum(lifted.own_error(row) is not None for row in rows.values())
    if differing >= max(SYSTEMIC_MODULES, SYSTEMIC_SHARE * len(rows)):
        if notes is not None:
            notes.append(
                f"lifted replay not used: {differing} of {len(rows)} modules differ in float32, which no bug in one"
                " place does: the candidate's code rounds to low precision where a copy cannot lift it (a hard-coded"
                " dtype); the low-precision judgement stands alone"
            )
        return None
    return lifted


def _lifted_traces(
    reference: nn.Module,
    reference_call: Call,
    candidate: nn.Module,
    candidate_call: Call,
    reference_trace: Trace,
    candidate_trace: Trace,
    alignment: Alignment,
    eligible: frozenset[str],
    dtype: torch.dtype,
    found: Twins,
    uncalled: tuple[Collection[str], Collection[str]],
    directory: Path,
    copies: bool,
) -> tuple[list[Trace] | None, str]:
    """The lifted reference's trace and the lifted candidate's replay, made in place (``copies`` false: each
    module's tensors converted while it runs) or on float32 copies (one alive at a time); ``None`` and the
    reason when either could not run as its original did."""
    traces: list[Trace] = []

    def lifted_reference_trace() -> Trace:
        model, call = lifted_reference_side(reference, reference_call, dtype, found, copies, uncalled[0])
        return _traced(model, call, directory / "lifted-reference")

    def lifted_candidate_trace() -> Trace:
        model, call = lifted_candidate_side(candidate, candidate_call, dtype, found, copies, uncalled[1])
        fed = _fed_leaves(traces[0], candidate_trace, alignment, eligible)
        return isolated_replay(
            model, call, traces[0], candidate_trace, alignment, directory / "lifted-candidate", fed=fed
        )

    for name in ("lifted-reference", "lifted-candidate"):  # an attempt in place before these copies
        shutil.rmtree(directory / name, ignore_errors=True)
    for step, own_trace in ((lifted_reference_trace, reference_trace), (lifted_candidate_trace, candidate_trace)):
        try:
            made = step()
        except Exception as error:  # the user's code, run in float32
            return None, f"{type(error).__name__}: {error}"
        if [c.key for c in made.calls] != [c.key for c in own_trace.calls]:
            return None, "the float32 run made other module calls than its original"
        traces.append(made)
    return traces, ""


def _narrowed(traces: list[Trace], dtype: torch.dtype) -> bool:
    """Whether a lifted trace made in place holds a value in ``dtype`` or on the meta device: code that read a
    weight's dtype or device from a module that was not running (its weights stood in for) and followed it, where a
    float32 copy would have computed in float32."""
    name = str(dtype).removeprefix("torch.")
    return any(
        node.get("dtype") == name or node.get("device") == "meta"
        for trace in traces
        for call in trace.calls
        for _, node in call.tensors("outputs")
    )


def _fed_leaves(
    reference_trace: Trace, candidate_trace: Trace, alignment: Alignment, eligible: frozenset[str]
) -> frozenset[str]:
    """Candidate call keys of the pairs with the same weights whose candidate module calls no other and has an
    input to feed (:func:`~paritylab.comparison.replay.fed_value`): fed the reference's input in the lifted
    replay, each is judged on its own code whatever the code before it made of its input in float32 (a rotary
    table a cast rounded, cached by the low-precision run)."""
    parents = {call.parent for call in candidate_trace.calls if call.parent is not None}
    return frozenset(
        pair.candidate
        for pair in alignment.pairs
        if pair.reference in eligible
        and candidate_trace.call(pair.candidate).index not in parents
        and fed_value(reference_trace, candidate_trace, pair) is not None
        and not hands_on_output(reference_trace, candidate_trace, pair)  # a hook point handed its pair's output
    )


LIFTED_MEMORY_SHARE = 0.8
"""A copy larger than this share of the memory available is not made (a large bf16 model's float32 copy is twice
its size): where a model cannot run converted in place, the phase that needs the copy (the lifted replay, a noise
floor) is skipped with a note rather than the run killed for memory."""


SYSTEMIC_MODULES, SYSTEMIC_SHARE = 4, 0.5
"""A lifted replay in which at least this many modules, and this share of those it judges, show their own
code differing is taken for a precision the copy could not lift, not for bugs, and is not used."""


def lifted_reference(
    reference: nn.Module, dtype: torch.dtype, candidate: nn.Module | None = None, found: Twins | None = None
) -> nn.Module:
    """A float32 copy of the reference with its parameters rounded to ``dtype`` (buffers as they are), except
    those ``candidate`` provably holds otherwise (:func:`~paritylab.comparison.twins.twins`: kept wider, or
    stored minus one), which hold what the candidate computes with; the tables the candidate holds rounded by a
    cast (rotary sin and cos), buffers or outputs, rounded as well."""
    found = found or (twins(reference, candidate, dtype) if candidate is not None else None)
    copy = converted_copy(unwrap(reference), LIFTED_DTYPE, rounded_to=dtype, given=found.given if found else None)
    for path, slots in found.rounded_outputs.items() if found else ():
        copy.get_submodule(path).register_forward_hook(_rounding(slots, dtype))
    return copy


def lifted_reference_side(
    reference: nn.Module,
    call: Call,
    dtype: torch.dtype,
    found: Twins | None,
    copy: bool,
    uncalled: Collection[str] = (),
) -> tuple[nn.Module, Call]:
    """The lifted reference as a model and the call that runs it: :func:`lifted_reference`'s copy (``copy``), or
    the reference itself, each module's parameters rounded while it runs (:func:`lifted_reference_call`)."""
    if copy:
        return lifted_reference(reference, dtype, found=found), widened(call, dtype)
    return unwrap(reference), lifted_reference_call(call, dtype, found, uncalled)


def lifted_candidate_side(
    candidate: nn.Module,
    call: Call,
    dtype: torch.dtype,
    found: Twins | None,
    copy: bool,
    uncalled: Collection[str] = (),
) -> tuple[nn.Module, Call]:
    """The lifted candidate as a model and the call that runs it: :func:`lifted_candidate`'s copy (``copy``), or
    the candidate itself, each module's tensors widened while it runs (:func:`lifted_candidate_call`)."""
    if copy:
        return lifted_candidate(candidate, dtype, found=found), widened(call, dtype)
    return unwrap(candidate), lifted_candidate_call(call, dtype, found.restored if found else None, uncalled)


def lifted_reference_call(
    call: Call, dtype: torch.dtype, found: Twins | None = None, uncalled: Collection[str] = ()
) -> Call:
    """``call`` for the reference itself, computing what :func:`lifted_reference`'s copy computes without a copy:
    while each module runs, its parameters (and its direct children's) are float32 tensors rounded to ``dtype``
    (those ``found`` gives held as given), its buffers float32 copies, the tables :attr:`Twins.rounded_outputs`
    names rounded as they leave; and the inputs are :func:`widened`. Only the running modules' copies are alive
    at a time (:func:`~paritylab.run.widening.converted_in_place`); the model is unchanged afterwards."""
    given = found.given if found is not None else {}

    def run(model: nn.Module) -> Any:
        stored = stored_ids(model)

        def convert(_: Slot, tensor: torch.Tensor) -> torch.Tensor | None:
            if id(tensor) not in stored:
                return None  # a plain tensor attribute, held as it is (as ``Module.to`` and the copy do)
            source = given.get(id(tensor), tensor).detach()
            if id(tensor) not in given and isinstance(tensor, nn.Parameter) and tensor.is_floating_point():
                source = source.to(dtype)
            return source.to(LIFTED_DTYPE if tensor.is_floating_point() else tensor.dtype, copy=True)

        rounding = [  # before the tracer's hooks: it records the table as it leaves
            model.get_submodule(path).register_forward_hook(_rounding(slots, dtype), prepend=True)
            for path, slots in (found.rounded_outputs.items() if found is not None else ())
        ]
        try:
            with converted_in_place(model, convert, uncalled, stand_in=LIFTED_DTYPE):
                return widened(call, dtype)(model)
        finally:
            for handle in rounding:
                handle.remove()

    return run


def lifted_candidate_call(
    call: Call,
    dtype: torch.dtype,
    restored: Mapping[int, torch.Tensor] | None = None,
    uncalled: Collection[str] = (),
) -> Call:
    """``call`` for the ``dtype`` candidate itself, computing what :func:`lifted_candidate`'s copy computes without
    a copy: while each module runs, its parameters and buffers (and its direct children's) are float32 copies
    (``restored``: ``id`` of a buffer -> the values it held before a cast rounded it), its caches as before its
    first traced run and its configured ``dtype`` float32; the inputs are :func:`widened`. Everything is put back
    afterwards: attributes the run set, settings, tensors."""
    given = restored or {}

    def run(model: nn.Module) -> Any:
        stored = stored_ids(model)

        def convert(_: Slot, tensor: torch.Tensor) -> torch.Tensor | None:
            if id(tensor) not in stored:
                return None
            target = LIFTED_DTYPE if tensor.is_floating_point() else tensor.dtype
            return given.get(id(tensor), tensor).detach().to(target, copy=True)  # a copy: the run may write to it

        with (
            caches_reset(model),
            configured_wide_in_place(model, dtype),
            converted_in_place(model, convert, uncalled, stand_in=LIFTED_DTYPE),
        ):
            return widened(call, dtype)(model)

    return run


def _rounding(slots: frozenset[str], dtype: torch.dtype) -> Callable[[nn.Module, Any, Any], Any]:
    """A forward hook that rounds the output ``slots`` (``outputs.0``: a tuple's first item) to ``dtype``, kept in
    the dtype they were computed in: a table the candidate holds rounded (:attr:`Twins.rounded_outputs`)."""

    def rounded(value: torch.Tensor, slot: str) -> torch.Tensor:
        return value.to(dtype).to(value.dtype) if slot in slots and value.is_floating_point() else value

    return lambda _module, _args, output: map_tensors(output, rounded, "outputs")


def lifted_candidate(
    candidate: nn.Module, dtype: torch.dtype, reference: nn.Module | None = None, found: Twins | None = None
) -> nn.Module:
    """A float32 copy of the ``dtype`` candidate (its weights exact there), a configured ``dtype`` lifted too, the
    buffers a cast rounded that a ``reference`` buffer provably held before (:attr:`~paritylab.comparison.
    twins.Twins.restored`) holding those values again, and the attributes its traced runs cached put back as
    they were before them (:func:`~paritylab.tracing.initial.reset_caches`)."""
    found = found or (twins(reference, candidate, dtype) if reference is not None else None)
    copy = converted_copy(unwrap(candidate), LIFTED_DTYPE, given=found.restored if found else None)
    reset_caches(copy, unwrap(candidate))  # what its low-precision runs cached is made afresh, in float32
    return configured_wide(copy, dtype)


def configured_wide(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` with every attribute naming ``dtype`` as the precision to compute in, on its modules and on
    the objects they hold (a config such as TransformerLens' ``cfg.dtype``, which its norms and attention cast
    to), set to float32: the lifted copy's code then rounds nowhere. ``model`` is a copy: changed in place."""
    for owner, name, value, _ in _wide_settings(model, dtype):
        object.__setattr__(owner, name, value)
    return model


@contextmanager
def configured_wide_in_place(model: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """While inside, :func:`configured_wide`'s settings hold on ``model`` itself; the originals are put back
    afterwards (a config object may be shared with another model)."""
    changes = _wide_settings(model, dtype)
    for owner, name, value, _ in changes:
        object.__setattr__(owner, name, value)
    try:
        yield
    finally:
        for owner, name, _, before in reversed(changes):
            object.__setattr__(owner, name, before)


def _wide_settings(model: nn.Module, dtype: torch.dtype) -> list[tuple[Any, str, Any, Any]]:
    """``(owner, name, float32 setting, setting now)`` for each attribute naming ``dtype`` (:func:`configured_wide`)."""
    seen: set[int] = set()
    changes: list[tuple[Any, str, Any, Any]] = []
    names = {name for base in _NAMES.get(dtype, ()) for name in (base, f"torch.{base}")}
    for module in model.modules():
        for owner in (module, *(v for v in vars(module).values() if _plain_object(v))):
            if id(owner) in seen:
                continue
            seen.add(id(owner))
            for name, value in list(vars(owner).items()):
                if isinstance(value, torch.dtype) and value == dtype:
                    changes.append((owner, name, LIFTED_DTYPE, value))
                elif type(value) is str and value in names:  # "bfloat16", "bf16", "torch.bfloat16"
                    changes.append((owner, name, _WIDE_NAMES[value.removeprefix("torch.")], value))
    return changes


_NAMES = {torch.bfloat16: ("bfloat16", "bf16"), torch.float16: ("float16", "fp16", "half")}
_WIDE_NAMES = {"bfloat16": "float32", "bf16": "fp32", "float16": "float32", "fp16": "fp32", "half": "float"}


def _plain_object(value: Any) -> bool:
    """An object holding settings (a config), not a module, tensor, container or class."""
    return hasattr(value, "__dict__") and not isinstance(value, nn.Module | torch.Tensor | type)


def widened(call: Call, dtype: torch.dtype) -> Call:
    """``call`` for a lifted copy: every floating-point tensor it passes to the model's forward rounded to
    ``dtype`` (what the low-precision candidate itself is given) and then given in float32, so both lifted
    copies start from the same values, whether a call passes float32 inputs or already rounded ones."""
    return cast_call(call, LIFTED_DTYPE, rounded_to=dtype)


def cast_call(call: Call, dtype: torch.dtype, rounded_to: torch.dtype | None = None) -> Call:
    """``call``, with every floating-point tensor it passes to the model's forward given in ``dtype`` (first
    rounded to ``rounded_to``): the call a copy of the model converted to ``dtype`` needs."""
    return mapped_call(call, lambda value: _cast(value, dtype, rounded_to))


def mapped_call(call: Call, convert: Callable[[Any], Any]) -> Call:
    """``call``, with the arguments it passes to the model's forward replaced by ``convert(arguments)`` (a hook run
    before any other, the tracer's included)."""

    def run(model: nn.Module) -> Any:
        def converted(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
            return convert(args), convert(kwargs)

        handle = model.register_forward_pre_hook(converted, with_kwargs=True, prepend=True)  # before the tracer's
        try:
            return call(model)
        finally:
            handle.remove()

    return run


def private_call(call: Call) -> Call:
    """``call``, with every tensor it hands the model's forward copied first: a forward that changes its input in
    place (a preprocessing step) changes the copy, never the caller's tensor, however often the model runs again."""
    return mapped_call(call, lambda value: map_tensors(value, lambda tensor, _: tensor.detach().clone()))


def _cast(value: Any, dtype: torch.dtype, rounded_to: torch.dtype | None) -> Any:
    """Every floating-point tensor in ``value`` in ``dtype`` (first rounded to ``rounded_to``), every container kept
    the type it was (a ``BaseModelOutput`` passed as ``encoder_outputs`` is still one)."""

    def cast(tensor: torch.Tensor, _: str) -> torch.Tensor:
        if not tensor.is_floating_point():
            return tensor
        return (tensor.to(rounded_to) if rounded_to is not None else tensor).to(dtype)

    return map_tensors(value, cast)


def _traced(model: nn.Module, call: Call, directory: Path) -> Trace:
    with Tracer(model, directory, TraceOptions(save_tensors=True, capture=None, fingerprint=False)):
        call(model)
    return Trace.load(directory)
