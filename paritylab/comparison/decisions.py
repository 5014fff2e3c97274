"""Discrete decisions: operations whose outputs are choices (indices, masks) made from floating-point scores.

A top-k router, an ``argmax``, a ``sort``, a comparison ``scores > threshold``: their outputs are integers or
booleans, so a score that moves by one unit of rounding can change them entirely. Two correct implementations in
bfloat16 then disagree wherever two scores nearly tie (a token whose second and third router logits differ by
less than bfloat16 resolves): one token takes another expert, and the module's output differs by far more than
any rounding. That is a difference by design, not a bug; a wrong routing rule is one.

This module reads two recordings of one module call (:mod:`paritylab.comparison.operations`), finds the
*primary* decisions on each side (an operation taking a floating-point tensor and returning integer or boolean
tensors; what is then computed from those, such as ``chosen == expert``, is derived and follows), pairs them in
call order by kind and shape, and measures each choice that differs: its margin, the gap between the reference's
scores of what the reference chose and what the candidate chose instead, measured on the scores before any
monotone map (a softmax, a cast), against the resolution of the candidate's dtype at those scores' magnitude.
:func:`forced_decisions` then runs a candidate with the reference's choices substituted, in call order, for its
own (teacher-forced decisions), so the module can be judged again on everything else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from paritylab.comparison.operations import Op, Recording, split_key

SELECTIONS = frozenset({"topk", "sort", "argsort", "argmax", "argmin", "max", "min", "kthvalue", "msort"})
"""Operations choosing positions by their scores (their integer outputs are indices)."""
COMPARISONS = frozenset(
    {"gt", "lt", "ge", "le", "greater", "less", "greater_equal", "less_equal", "eq", "ne"}
    | {"__gt__", "__lt__", "__ge__", "__le__", "__eq__", "__ne__"}
)
"""Operations deciding, element by element, on which side of another value a score lies (boolean outputs)."""
MONOTONE = frozenset(
    {"softmax", "log_softmax", "sigmoid", "exp", "float", "to", "type_as", "half", "bfloat16", "double"}
    | {"contiguous", "clone", "detach"}
)
"""Maps that keep the order of scores along the decision's dimension: the margin is measured before them (a
router's logits, not the probabilities a softmax made of them, whose gaps shrink with the probabilities)."""
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24, "float64": 2.0**-53}
TIE = 4.0
"""A choice that differs is a near tie when the reference's scores of the two choices differ by at most this many
units of the candidate dtype's rounding at the scores' magnitude (the largest score of that row, in absolute
value): a dot product of rounded inputs moves its result by several such units."""


def _integral(tensor: torch.Tensor) -> bool:
    return not (tensor.is_floating_point() or tensor.is_complex())


@dataclass
class Decision:
    """One primary decision on one side of a recorded call."""

    ordinal: int
    """Its place among the call's primary decisions, in call order."""
    op: Op
    kind: str
    """``select`` (indices) or ``compare`` (a mask)."""
    choice: int
    """The value index of its integer or boolean output."""
    scores: int
    """The value index of its floating-point input."""
    values: int | None = None
    """The value index of the selected scores, for operations returning them beside their indices."""


def is_decision(name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> str | None:
    """The kind of a primary decision (``select``, ``compare``) an operation is, or ``None``: it is one of
    :data:`SELECTIONS` or :data:`COMPARISONS`, a floating-point tensor goes in and an integer or boolean one comes
    out. The recorder and :func:`forced_decisions` ask this of the same operations, so their ordinals agree."""
    kind = "select" if name in SELECTIONS else "compare" if name in COMPARISONS else None
    if kind is None or not any(t.is_floating_point() for t in inputs):
        return None
    return kind if any(_integral(t) for t in outputs) else None


def primary_decisions(recording: Recording) -> list[Decision]:
    """The recording's primary decisions (:func:`is_decision`), in call order."""
    found: list[Decision] = []
    for op in recording.ops:
        ins = [recording.tensors[n] for n in op.inputs]
        outs = [recording.tensors[n] for n in op.outputs]
        if any(t is None for t in (*ins, *outs)):
            continue
        inputs = [t for t in ins if t is not None]
        outputs = [t for t in outs if t is not None]
        kind = is_decision(op.name, inputs, outputs)
        if kind is None:
            continue
        choice = next(n for n, t in zip(op.outputs, outputs, strict=True) if _integral(t))
        scores = next(n for n, t in zip(op.inputs, inputs, strict=True) if t.is_floating_point())
        values = next((n for n, t in zip(op.outputs, outputs, strict=True) if t.is_floating_point()), None)
        found.append(Decision(len(found), op, kind, choice, scores, values))
    return found


def _signature(recording: Recording, decision: Decision) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    return (
        decision.kind,
        tuple(recording.values[decision.choice].shape),
        tuple(recording.values[decision.scores].shape),
    )


def pair_decisions(reference: Recording, candidate: Recording) -> list[tuple[Decision, Decision]]:
    """Each candidate decision with the reference's of the same kind and shapes (of its choice and of its scores)
    at the same place among those: the n-th top-2 of ``[24, 8]`` scores with the n-th, whatever each side
    computed around it (a top-k of logits against a top-k of probabilities)."""
    theirs: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[Decision]] = {}
    for decision in primary_decisions(reference):
        theirs.setdefault(_signature(reference, decision), []).append(decision)
    taken: dict[tuple[str, tuple[int, ...], tuple[int, ...]], int] = {}
    pairs = []
    for decision in primary_decisions(candidate):
        key = _signature(candidate, decision)
        number = taken.get(key, 0)
        if number < len(theirs.get(key, [])):
            pairs.append((theirs[key][number], decision))
            taken[key] = number + 1
    return pairs


@dataclass
class Differing:
    """A paired decision whose choices differ between the two sides."""

    reference: str
    """The reference's operation, as recorded (``topk(softmax[24, 8], 2, dim=-1)``)."""
    candidate: str
    candidate_ordinal: int
    kind: str
    differing: int
    """Rows (tokens, for a router) whose choice differs; elements, for a comparison."""
    rows: int
    margins: list[float] = field(default_factory=list)
    """Per differing row, the gap between the reference's scores of its choice and the candidate's."""
    resolutions: list[float] = field(default_factory=list)
    """Per differing row, one unit of the candidate dtype's rounding at that row's largest score."""
    dtype: str = "float32"
    module: str = ""
    """The candidate module taking the decision, relative to the recorded one (``""``: that module itself)."""
    reference_module: str = ""
    """The reference module taking it, relative to the recorded one."""

    @property
    def near_tie(self) -> bool:
        """Every differing choice is a near tie (:data:`TIE`): a difference of rounding, not of rule."""
        return bool(self.margins) and all(
            margin <= TIE * resolution for margin, resolution in zip(self.margins, self.resolutions, strict=True)
        )

    @property
    def margin(self) -> float:
        return max(self.margins, default=0.0)

    def flipped(self) -> str:
        """How many choices differ: ``routing flipped for 21 of 24 tokens``."""
        what = "routing" if self.kind == "select" else "a comparison"
        unit = "tokens" if self.kind == "select" else "elements"
        return f"{what} flipped for {self.differing} of {self.rows} {unit}"

    def describe(self) -> str:
        ratio = max((m / r for m, r in zip(self.margins, self.resolutions, strict=True) if r > 0), default=0.0)
        text = (
            f"{self.flipped()} ({self.candidate} against the reference's {self.reference}), margin {self.margin:.2g} "
            f"({ratio:.2g} units of {self.dtype} rounding at those scores)"
        )
        return text + (": a near tie" if self.near_tie else f": {RULE_DIFFERS}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"near_tie": self.near_tie, "message": self.describe(), "flipped": self.flipped()}


RULE_DIFFERS = "beyond what rounding flips, the decision rule differs"
"""What a differing decision that is no near tie says (unless the scores it read are in another order)."""
REORDERED_SCORES = "beyond what rounding flips: the scores it chose from are in another order"
"""What it says instead where the module making those scores holds the reference's weight rows reordered."""
INPUT_DIFFERS = "beyond what rounding flips, on scores whose input already differs"
"""What it says instead where the module taking the decision was handed a value that differs (past the origin)."""


def compare_decisions(reference: Recording, candidate: Recording, dtype: torch.dtype | str) -> list[Differing]:
    """The paired decisions (:func:`pair_decisions`) whose choices differ, each measured (:class:`Differing`);
    ``dtype`` is the candidate's, whose rounding the margins are set against."""
    name = str(dtype).removeprefix("torch.")
    unit = UNIT_ROUNDOFF.get(name, UNIT_ROUNDOFF["float32"])
    found = []
    for theirs, ours in pair_decisions(reference, candidate):
        mine, other = candidate.tensors[ours.choice], reference.tensors[theirs.choice]
        if mine is None or other is None:
            continue
        measured = _measure(reference, theirs, other.to(mine.device), mine, unit)
        if measured is None:
            continue
        differing, rows, margins, resolutions = measured
        if differing:
            found.append(Differing(theirs.op.arguments, ours.op.arguments, ours.ordinal, ours.kind, differing, rows))
            found[-1].margins, found[-1].resolutions, found[-1].dtype = margins, resolutions, name
            found[-1].module, found[-1].reference_module = ours.op.module, theirs.op.module
    return found


def _base(recording: Recording, number: int) -> torch.Tensor | None:
    """The scores a decision was taken on, followed back through order-keeping maps (:data:`MONOTONE`)."""
    tensor = recording.tensors[number]
    while tensor is not None:
        value = recording.values[number]
        op = recording.ops[value.op] if value.op is not None else None
        if op is None or op.name not in MONOTONE:
            break
        floats = [n for n in op.inputs if (t := recording.tensors[n]) is not None and t.is_floating_point()]
        earlier = recording.tensors[floats[0]] if len(floats) == 1 else None
        if earlier is None or earlier.shape != tensor.shape:
            break
        number, tensor = floats[0], earlier
    return tensor


def decision_dim(scores: torch.Tensor, choice: torch.Tensor, values: torch.Tensor | None = None) -> int | None:
    """The dimension of ``scores`` a selection chose along, from the shapes (and, where the selected scores are
    given, their values): ``None`` for a choice over every element (``argmax()`` with no dimension)."""
    if choice.dim() == 0 and scores.dim() > 0:
        return None
    fitting = []
    for dim in range(scores.dim()):
        kept = choice.dim() == scores.dim() and all(
            c == s for d, (c, s) in enumerate(zip(choice.shape, scores.shape, strict=True)) if d != dim
        )
        reduced = choice.dim() == scores.dim() - 1 and list(choice.shape) == [
            s for d, s in enumerate(scores.shape) if d != dim
        ]
        if kept or reduced:
            fitting.append(dim)
    if values is not None and len(fitting) > 1:
        for dim in fitting:
            if values.shape == choice.shape and torch.equal(_gather(scores, dim, choice), values):
                return dim
    return fitting[-1] if fitting else None


def _gather(scores: torch.Tensor, dim: int, choice: torch.Tensor) -> torch.Tensor:
    index = choice.long()
    if index.dim() < scores.dim():
        return scores.gather(dim, index.unsqueeze(dim)).squeeze(dim)
    return scores.gather(dim, index)


def _measure(
    reference: Recording, decision: Decision, theirs: torch.Tensor, ours: torch.Tensor, unit: float
) -> tuple[int, int, list[float], list[float]] | None:
    """(differing rows, rows, margins, resolutions) of one paired decision; ``None`` when the two cannot be set
    side by side (other shapes)."""
    if theirs.shape != ours.shape:
        return None
    scores = reference.tensors[decision.scores]
    base = _base(reference, decision.scores)
    if scores is None or base is None:
        return None
    base = base.detach().to(torch.float64)
    if decision.kind == "compare":
        differ = theirs != ours
        if base.shape != differ.shape:
            return int(differ.sum()), differ.numel(), [], []
        other = _threshold(reference, decision)
        gaps = (base - other).abs() if other is not None else base.abs()
        scale = torch.maximum(base.abs(), other.abs() if other is not None else base.abs())
        return (int(differ.sum()), differ.numel(), gaps[differ].tolist(), (unit * scale[differ]).tolist())
    values = reference.tensors[decision.values] if decision.values is not None else None
    dim = decision_dim(scores, theirs, values)
    rows_scores = base.reshape(1, -1) if dim is None else base.movedim(dim, -1).reshape(-1, base.shape[dim])
    chosen = [side.long().reshape(1, -1) if dim is None else _rows(side, base, dim) for side in (theirs, ours)]
    ordered = decision.op.name in ("sort", "argsort", "msort")  # a whole order: compared place by place
    margins, resolutions = [], []
    differing = 0
    for row in range(rows_scores.shape[0]):
        ours_row: list[int] = chosen[1][row].tolist()
        theirs_row: list[int] = chosen[0][row].tolist()
        if ordered:
            swapped = [(a, b) for a, b in zip(theirs_row, ours_row, strict=True) if a != b]
        else:
            lost, gained = sorted(set(theirs_row) - set(ours_row)), sorted(set(ours_row) - set(theirs_row))
            swapped = [(a, b) for a in lost for b in gained]
        if not swapped:
            continue
        differing += 1
        row_scores = rows_scores[row]
        margins.append(max(abs(float(row_scores[a]) - float(row_scores[b])) for a, b in swapped))
        resolutions.append(unit * float(row_scores.abs().max()))
    return differing, rows_scores.shape[0], margins, resolutions


def _rows(choice: torch.Tensor, scores: torch.Tensor, dim: int) -> torch.Tensor:
    """A selection's indices as one row per decision (the chosen dimension last)."""
    index = choice.long()
    if index.dim() < scores.dim():
        index = index.unsqueeze(dim)
    return index.movedim(dim, -1).reshape(-1, index.shape[dim])


def _threshold(recording: Recording, decision: Decision) -> torch.Tensor | None:
    """What a comparison compared its scores with: its other floating-point tensor, or its scalar."""
    others = [
        t
        for n in decision.op.inputs
        if n != decision.scores and (t := recording.tensors[n]) is not None and t.is_floating_point()
    ]
    if others:
        return others[0].detach().to(torch.float64)
    try:
        return torch.tensor(float(decision.op.scalars[0]), dtype=torch.float64) if decision.op.scalars else None
    except ValueError:
        return None


# -- teacher-forced decisions ------------------------------------------------------------------------------------


Choices = Mapping[int, Mapping[str, torch.Tensor]]
"""Per primary decision of a call (by :attr:`Decision.ordinal`), the reference's choice to substitute, by the dtype
of the scores the candidate decides on: the lifted replay runs the candidate in float32 against a reference of its
own (float32 with rounded weights), whose choices it is given there; ``"*"`` where no dtype is named."""
Plan = Mapping[str, Choices]
"""Per candidate call key (``path#n``), the reference's choices (:data:`Choices`)."""


class _Substitute(TorchFunctionMode):
    """Inside one module call: each primary decision's output replaced, in call order, by the reference's."""

    def __init__(self, choices: Choices) -> None:
        super().__init__()
        self.choices = choices
        self.seen = 0
        self.replaced = 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        result = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name not in SELECTIONS and name not in COMPARISONS:
            return result
        inputs = [t for t in _flat_tensors((args, kwargs))]
        outputs = [t for t in _flat_tensors(result)]
        if not outputs or is_decision(name, inputs, outputs) is None:
            return result
        ordinal, self.seen = self.seen, self.seen + 1
        by_dtype = self.choices.get(ordinal, {})
        scores = next(t for t in inputs if t.is_floating_point())
        choice = by_dtype.get(str(scores.dtype).removeprefix("torch."), by_dtype.get("*"))
        if choice is None:
            return result
        substituted = _substitute(result, inputs, choice)
        if substituted is not None:
            self.replaced += 1
            return substituted
        return result


def _flat_tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, tuple | list):
        for item in value:
            yield from _flat_tensors(item)
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _flat_tensors(item)


def _substitute(result: Any, inputs: list[torch.Tensor], choice: torch.Tensor) -> Any:
    """``result`` with its choice replaced by ``choice`` (and, for a selection returning its scores too, those
    scores gathered at the new choice from the operation's own input); ``None`` when the shapes do not fit."""
    if isinstance(result, torch.Tensor):
        if result.shape != choice.shape:
            return None
        return choice.to(device=result.device, dtype=result.dtype)
    if not isinstance(result, tuple) or len(result) != 2:
        return None
    values, indices = result
    scores = next((t for t in inputs if t.is_floating_point()), None)
    if scores is None or indices.shape != choice.shape:
        return None
    dim = decision_dim(scores, indices, values)
    index = choice.to(device=indices.device, dtype=indices.dtype)
    gathered = _gather(scores, dim, index) if dim is not None else scores.reshape(-1)[index]
    made: Any = type(result)  # torch.return_types.topk and its kind: built from a (values, indices) sequence
    return made((gathered.to(values.dtype), index))


@contextmanager
def forced_decisions(model: nn.Module, plan: Plan) -> Iterator[dict[str, int]]:
    """While inside, each planned call of ``model``'s modules computes with the reference's choices in place of its
    own primary decisions (:data:`Plan`). Yields, per planned key, how many decisions were replaced (updated as
    the calls run)."""
    counts: dict[str, int] = {}
    replaced: dict[str, int] = {}
    handles = []
    by_path: dict[str, dict[int, Choices]] = {}
    for key, choices in plan.items():
        path, number = split_key(key)
        by_path.setdefault(path, {})[number] = choices
    active: list[tuple[str, _Substitute]] = []
    for path, calls in by_path.items():
        try:
            module = model.get_submodule(path) if path else model
        except AttributeError:
            continue

        def enter(module: nn.Module, args: tuple[Any, ...], path: str = path, calls: Any = calls) -> None:
            number = counts.get(path, 0)
            counts[path] = number + 1
            if number in calls:
                mode = _Substitute(calls[number])
                mode.__enter__()
                active.append((f"{path}#{number}", mode))

        def leave(module: nn.Module, args: tuple[Any, ...], output: Any, path: str = path) -> None:
            if active and active[-1][0].rsplit("#", 1)[0] == path:
                key, mode = active.pop()
                mode.__exit__(None, None, None)
                replaced[key] = replaced.get(key, 0) + mode.replaced

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        yield replaced
    finally:
        while active:  # a forward that raised inside a planned call
            active.pop()[1].__exit__(None, None, None)
        for handle in handles:
            handle.remove()


class _Capture(TorchFunctionMode):
    """Every primary decision's choice, in call order."""

    def __init__(self) -> None:
        super().__init__()
        self.choices: list[torch.Tensor] = []

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        result = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in SELECTIONS or name in COMPARISONS:
            outputs = list(_flat_tensors(result))
            if outputs and is_decision(name, list(_flat_tensors((args, kwargs))), outputs) is not None:
                self.choices.append(next(t for t in outputs if _integral(t)).detach().clone())
        return result


def captured(model: nn.Module, call: Callable[[nn.Module], Any]) -> list[torch.Tensor]:
    """The choices of every primary decision ``call(model)`` takes, in call order."""
    capture = _Capture()
    with torch.no_grad(), capture:
        call(model)
    return capture.choices


def everywhere(call: Callable[[nn.Module], Any], choices: list[torch.Tensor]) -> Callable[[nn.Module], Any]:
    """``call`` with the model's primary decisions, over its whole first forward, replaced in call order by
    ``choices`` (:func:`captured` from another run of the same code: the reference's own low-precision copy fed
    the float32 reference's decisions, so its noise floors measure rounding, not a router's near ties flipping)."""
    if not choices:
        return call
    plan = {"#0": {number: {"*": choice} for number, choice in enumerate(choices)}}

    def run(model: nn.Module) -> Any:
        with forced_decisions(model, plan):
            return call(model)

    return run
