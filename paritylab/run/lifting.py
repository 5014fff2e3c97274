"""The lifted replay as a run phase: the two float32 copies made, run and checked (the judgement itself is
:mod:`paritylab.comparison.lifted`).

A bfloat16/float16 candidate's code is replayed in float32 with the very weights it holds, against the
reference run in float32 with its parameters rounded the same way. This module makes those copies (one alive
at a time, and only when one fits in memory), gives them the calls they need (floating inputs rounded to the
candidate's precision, then widened), lifts a precision named in a config, and sets the replay aside when
it cannot be trusted: a copy that fails or calls other modules, or most modules differing at once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paritylab.comparison.alignment import Alignment
from paritylab.comparison.lifted import LiftedReplay, lifts, same_weights, weightless
from paritylab.comparison.replay import fed_value, isolated_replay
from paritylab.comparison.twins import LIFTED_DTYPE, Twins, exact_sources, twins, unwrap
from paritylab.comparison.verify import handing_on, hands_on_output
from paritylab.run.resident import available_memory, converted_copy
from paritylab.tracing.initial import reset_caches
from paritylab.tracing.tracefile import Trace
from paritylab.tracing.tracer import TraceOptions, Tracer

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
    float32 copy cannot run as its original did (said in ``notes``: the lifted replay only adds findings, so
    the low-precision judgement then stands alone)."""
    dtype = lifts(reference, candidate)
    if dtype is None:
        return None
    reference, candidate = unwrap(reference), unwrap(candidate)
    needed = max(_float32_bytes(reference), _float32_bytes(candidate))  # one copy alive at a time
    device = next(candidate.parameters()).device
    free = available_memory(device)
    if free is not None and needed > LIFTED_MEMORY_SHARE * free:
        if notes is not None:
            notes.append(
                f"lifted replay skipped: a float32 copy ({needed / 2**30:.1f} GiB) does not fit in the "
                f"{free / 2**30:.1f} GiB available on {device}"
            )
        return None
    try:
        found = twins(reference, candidate, dtype, reference_trace)  # what the copies and the weights check share
        eligible = same_weights(reference, candidate, reference_trace, candidate_trace, alignment, dtype, found)
    except Exception as error:  # parameters fingerprinting cannot read (a tensor subclass): nothing to lift
        if notes is not None:
            notes.append(f"lifted replay skipped: weights not comparable: {type(error).__name__}: {error}")
        return None
    if not eligible:
        return None
    traces: list[Trace] = []
    steps = (  # one float32 copy alive at a time
        lambda: _traced(
            lifted_reference(reference, dtype, candidate, found),
            widened(reference_call, dtype),
            directory / "lifted-reference",
        ),
        lambda: isolated_replay(
            lifted_candidate(candidate, dtype, reference, found), widened(candidate_call, dtype), traces[0],
            candidate_trace, alignment, directory / "lifted-candidate",
            fed=_fed_leaves(traces[0], candidate_trace, alignment, eligible),
        ),
    )  # fmt: skip
    for step, own_trace in zip(steps, (reference_trace, candidate_trace), strict=True):
        try:
            made = step()
        except Exception as error:  # the user's code, run in float32
            problem = f"{type(error).__name__}: {error}"
        else:
            if [c.key for c in made.calls] == [c.key for c in own_trace.calls]:
                traces.append(made)
                continue
            problem = "a float32 copy made other module calls than its original"
        if notes is not None:
            notes.append(f"lifted replay skipped: {problem}")
        return None
    observers = weightless(candidate, candidate_trace, alignment, dtype)
    fed = _fed_leaves(traces[0], candidate_trace, alignment, eligible)
    forced = frozenset(pair.reference for pair in alignment.pairs if pair.candidate in fed)
    sources = exact_sources(candidate, found.proven, dtype)
    lifted = LiftedReplay(
        str(dtype).removeprefix("torch."), traces[0], traces[1], eligible, alignment, observers, forced, sources,
        handing_on(candidate_trace), found,
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
"""A float32 copy larger than this share of the memory available is not made (a large bf16 model's copy is
twice its size): the lifted replay is skipped with a note rather than the run killed for memory."""


def _float32_bytes(model: nn.Module) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * (4 if t.is_floating_point() else t.element_size()) for t in tensors)


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


def _rounding(slots: frozenset[str], dtype: torch.dtype) -> Callable[[nn.Module, Any, Any], Any]:
    """A forward hook that rounds the output ``slots`` (``outputs.0``: a tuple's first item) to ``dtype``, kept in
    the dtype they were computed in: a table the candidate holds rounded (:attr:`Twins.rounded_outputs`)."""

    def rounded(value: Any, slot: str) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(dtype).to(value.dtype) if slot in slots and value.is_floating_point() else value
        if isinstance(value, tuple | list):
            return type(value)(rounded(item, f"{slot}.{index}") for index, item in enumerate(value))
        if isinstance(value, dict):
            return type(value)({key: rounded(item, f"{slot}.{key}") for key, item in value.items()})
        return value

    return lambda _module, _args, output: rounded(output, "outputs")


def lifted_candidate(
    candidate: nn.Module, dtype: torch.dtype, reference: nn.Module | None = None, found: Twins | None = None
) -> nn.Module:
    """A float32 copy of the ``dtype`` candidate (its weights exact there), a configured ``dtype`` lifted too, the
    buffers a cast rounded that a ``reference`` buffer provably held before (:attr:`~paritylab.comparison.
    twins.Twins.restored`) holding those values again, and the attributes its traced runs cached put back as
    they were before them (:func:`~paritylab.tracing.initial.reset_caches`)."""
    restored = (found or twins(reference, candidate, dtype)).restored if reference is not None else None
    copy = converted_copy(unwrap(candidate), LIFTED_DTYPE, given=restored)
    reset_caches(copy, unwrap(candidate))  # what its low-precision runs cached is made afresh, in float32
    return configured_wide(copy, dtype)


def configured_wide(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` with every attribute naming ``dtype`` as the precision to compute in, on its modules and on
    the objects they hold (a config such as TransformerLens' ``cfg.dtype``, which its norms and attention cast
    to), set to float32: the lifted copy's code then rounds nowhere. ``model`` is a copy: changed in place."""
    seen: set[int] = set()
    names = {name for base in _NAMES.get(dtype, ()) for name in (base, f"torch.{base}")}
    for module in model.modules():
        for owner in (module, *(v for v in vars(module).values() if _plain_object(v))):
            if id(owner) in seen:
                continue
            seen.add(id(owner))
            for name, value in list(vars(owner).items()):
                if isinstance(value, torch.dtype) and value == dtype:
                    object.__setattr__(owner, name, LIFTED_DTYPE)
                elif type(value) is str and value in names:  # "bfloat16", "bf16", "torch.bfloat16"
                    object.__setattr__(owner, name, _WIDE_NAMES[value.removeprefix("torch.")])
    return model


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

    def run(model: nn.Module) -> Any:
        def cast(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
            return _cast(args, dtype, rounded_to), _cast(kwargs, dtype, rounded_to)

        handle = model.register_forward_pre_hook(cast, with_kwargs=True, prepend=True)  # before the tracer's
        try:
            return call(model)
        finally:
            handle.remove()

    return run


def _cast(value: Any, dtype: torch.dtype, rounded_to: torch.dtype | None) -> Any:
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            return value
        return (value.to(rounded_to) if rounded_to is not None else value).to(dtype)
    if isinstance(value, tuple | list):
        return type(value)(_cast(item, dtype, rounded_to) for item in value)
    if isinstance(value, dict):
        return {key: _cast(item, dtype, rounded_to) for key, item in value.items()}
    return value


def _traced(model: nn.Module, call: Call, directory: Path) -> Trace:
    with Tracer(model, directory, TraceOptions(save_tensors=True, capture=None, fingerprint=False)):
        call(model)
    return Trace.load(directory)
