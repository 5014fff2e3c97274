"""The ledger's records: a tensor one side holds (:class:`Held`), a finding (:class:`WeightFinding`), the ledger
(:class:`WeightLedger`), and the thresholds the matching uses."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from paritylab.tracing.structure import ModulePrint, ParamPrint

NEAR = 0.5
"""A candidate tensor whose sketch lies within this relative distance of a reference tensor's holds that tensor
with a defect (two unrelated tensors of one shape lie about ``sqrt(2)`` apart)."""


NEAR_NAMESAKE = 1.0
"""The same for a tensor of the same name, and the only one of its shape left open on either side: a table built
from a wrong constant (rotary frequencies from base 500000 against 10000 lie 0.7 apart)."""


UNIQUE = 0.5
"""A near match must be at most this fraction of the distance to the second-nearest reference tensor."""


ROUNDING = 2.0**-7
"""Two values closer than this (relative) are equal up to a low-precision copy's rounding."""


MAX_LISTED = 4


@dataclass(frozen=True)
class Held:
    """One parameter or buffer of one side: the module holding it and its fingerprint."""

    module: str
    print: ParamPrint

    @property
    def name(self) -> str:
        return _named(self.module, self.print)


@dataclass(frozen=True)
class WeightFinding:
    """A candidate tensor that holds a reference tensor with a defect, or in another layout."""

    candidate: str
    reference: str
    candidate_module: str
    reference_module: str
    kind: str
    """``differs`` (the values differ beyond rounding), ``layout`` (the same values, in another order: transposed
    or rows reordered; a port may mean it, so it is printed only where divergence starts) or ``folded`` (the values
    with the norm that follows folded into them: :mod:`._folds`; printed there too)."""
    detail: str
    rel_l2: float | None = None
    certain: bool = False
    """The values prove a defect whatever its size (a block held twice, the one it stands for held nowhere): the run
    fails even where every output agrees (:func:`~paritylab.comparison.report.charge_quiet_weights`)."""

    def line(self) -> str:
        verb = "differs from" if self.kind == "differs" else "holds"
        return f"{self.candidate} {verb} the reference's {self.reference}: {self.detail}"

    def to_json(self) -> dict[str, Any]:
        return {
            "candidate": self.candidate,
            "reference": self.reference,
            "candidate_module": self.candidate_module,
            "reference_module": self.reference_module,
            "kind": self.kind,
            "detail": self.detail,
            "rel_l2": self.rel_l2,
        } | ({"certain": True} if self.certain else {})


@dataclass
class WeightLedger:
    """What every candidate tensor is, against the reference's."""

    matched: int = 0
    """Candidate tensors holding a reference tensor's values exactly (up to layout and rounding)."""
    findings: list[WeightFinding] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)
    """Candidate tensors near no reference tensor (a port's own tables, extra parameters)."""
    part_pairs: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    """Reference module -> (candidate module, first, last + 1 output feature): a fused candidate weight one of whose
    row blocks is the reference module's weight with a defect (the k rows of a ``[q; k; v]`` projection)."""
    near_modules: dict[str, set[str]] = field(default_factory=dict)
    """Candidate module -> the reference modules holding the tensor (or one of the identical copies of the tensor) a
    tensor of it is a near copy of: evidence for the ordered pass where copies make the module pair ambiguous."""
    twin_digests: dict[str, int] = field(default_factory=dict)
    """Candidate tensor -> the fingerprint it would have without its defect, where it is a part or a composite of the
    reference's tensors (:func:`as_twins`)."""
    module_pairs: dict[str, str] = field(default_factory=dict)
    """Reference module -> candidate module, for modules whose own tensors match one to one with at least one
    differing: the alignment pairs them whatever their names and classes."""
    orders: dict[tuple[str, str], tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    """(Reference module, candidate module) -> (axis, order), where the candidate's weight is a near copy of the
    reference's with its rows (axis 0: output features) or columns (1: input features) in another order: for each
    of the reference's features, where the candidate holds it. Output projections reading attention heads in their
    own order keep it with a defect on top; the alignment compares their inputs (or outputs) in that order."""
    turned: dict[tuple[str, str], tuple[int, ...]] = field(default_factory=dict)
    """(Reference module, candidate module) -> for each of the reference's input features, the candidate's, where the
    candidate's weight holds the reference's values (or a near copy) transposed with its lines in another order.
    Whether the port reads its input in that order (its input arrives so) or a conversion transposed the weight,
    only the input's values tell: the comparison takes that order where the input's features arrive in it."""
    folds: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Candidate module -> (reference layer, reference norm): the candidate's weight is the layer's with the norm that
    normalises its output folded into it (:mod:`._folds`); the alignment pairs the module with the norm's output."""

    @property
    def differing(self) -> list[WeightFinding]:
        return [finding for finding in self.findings if finding.kind == "differs"]

    def at(self, *modules: str) -> list[WeightFinding]:
        """The findings held by any of ``modules`` (paths on either side)."""
        wanted = set(modules)
        return [
            finding
            for finding in self.findings
            if finding.reference_module in wanted
            or finding.candidate_module in wanted
            or (finding.kind == "differs" and wanted & self.near_modules.get(finding.candidate_module, set()))
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "matched": self.matched,
            "findings": [finding.to_json() for finding in self.findings],
            "unmatched": list(self.unmatched),
        }


def held(prints: Mapping[str, ModulePrint]) -> list[Held]:
    """Every parameter and floating-point buffer a side's modules hold directly (each once)."""
    found: list[Held] = []
    for path, item in prints.items():
        found += [Held(path, tensor) for tensor in (*item.params, *item.buffers)]
    return found


def _named(path: str, param: ParamPrint) -> str:
    return f"{path}.{param.name}" if path else param.name


def _numel(item: Held) -> int:
    return math.prod(item.print.shape)


def _value_key(param: ParamPrint) -> tuple[int, int]:
    return param.digest, math.prod(param.shape)
