"""What a comparison found, in one place at the bottom of the comparison layer: a :class:`Row` per reference call
(its pair, measurements, verdict and evidence), the :class:`Report` over all rows (its verdict read once, from the
rows, the alignment and the two ledgers), and the small walks over rows every judge shares (:func:`ancestors`,
:func:`producer_row`, :func:`innermost`). The judges (:mod:`.report` measuring and localising, :mod:`.verify`
checking pairs, :mod:`.attribution` replaying) are passes over these rows; none of them imports another's module to
read a row.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from paritylab.comparison.alignment import Alignment
from paritylab.comparison.metrics import Tolerance
from paritylab.comparison.outputs import NOT_COMPARED, OutputCheck
from paritylab.comparison.weights import WeightFinding
from paritylab.tracing.structure import module_ancestors
from paritylab.tracing.tracefile import CallRecord, Trace
from paritylab.tracing.values import Node, first_tensor_slot, iter_tensors

NOISE_MULTIPLE = 4.0
"""With a noise floor, a row also passes when its error is at most this multiple of the floor."""
DIVERGENCE_MARGIN = 4.0
"""A row diverges (for localisation) when its relative L2 error exceeds this multiple of ``rtol``."""
NO_VALUES = "no values to compare"
JUMP = 10.0
"""A diverging row whose input already diverged still starts divergence if its error is this much larger."""


@dataclass
class Side:
    """What one side of a row compared: call key, slot, dtype and shape."""

    key: str
    slot: str | None = None
    dtype: str | None = None
    shape: list[int] | None = None


@dataclass
class Row:
    """One aligned pair (or an unmatched reference call) with its divergence and verdict."""

    index: int
    """Position of the reference call in execution order."""
    path: str
    reference: Side
    candidate: Side | None
    status: str
    """``compared``, ``stats-only``, ``shape-mismatch``, ``missing``, ``error``, ``unmatched`` or ``identity``
    (the call returned its own input: folded into the call that produced it, never an origin)."""
    verdict: str
    """``pass``, ``fail`` or ``skip`` (nothing to judge)."""
    metrics: dict[str, float] = field(default_factory=dict)
    tolerance: Tolerance | None = None
    input_metrics: dict[str, float] = field(default_factory=dict)
    input_verdict: str = "skip"
    diverged: bool = False
    """Scale-free divergence used for localisation (see the module docstring)."""
    input_diverged: bool = False
    input_known: bool = True
    """Whether the input's state is known: compared directly, or read from the row that produced it."""
    cause: str = ""
    """For diverging rows: ``origin``, ``contains-origin`` or ``inherited``."""
    floor: float | None = None
    source: str = ""
    depth: int = 0
    parent: int | None = None
    note: str = ""
    local: dict[str, float] = field(default_factory=dict)
    """Isolated replay: ``local_rel_l2``, ``inherited_rel_l2``, ``amplification`` (when replay ran)."""
    input_index: int | None = None
    """The reference call whose input stands for this row's (a ``run`` pair: the run's first module), when
    not the row's own call."""
    outputs: list[OutputCheck] = field(default_factory=list)
    """Its call's other outputs, beside the compared slot (:mod:`paritylab.comparison.outputs`)."""
    observed: bool = False
    """Its counterpart is handed this call's output (a hook point paired with the module whose value it hands
    on): its input was compared with this call's output (:mod:`paritylab.comparison.verify`)."""

    @property
    def input_call(self) -> int:
        return self.index if self.input_index is None else self.input_index

    @property
    def rel_l2(self) -> float | None:
        value = self.metrics.get("rel_l2")
        return None if value is None else float(value)

    @property
    def floor_ratio(self) -> float | None:
        if self.floor is None or self.rel_l2 is None:
            return None
        return self.rel_l2 / self.floor if self.floor > 0 else (math.inf if self.rel_l2 > 0 else 1.0)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "index": self.index,
            "path": self.path,
            "reference": vars(self.reference),
            "candidate": vars(self.candidate) if self.candidate else None,
            "status": self.status,
            "verdict": self.verdict,
            "diverged": self.diverged,
            "cause": self.cause,
            "source": self.source,
            "metrics": self.metrics,
            "input_metrics": self.input_metrics,
            "input_verdict": self.input_verdict,
            "tolerance": vars(self.tolerance) if self.tolerance else None,
        }
        if self.floor is not None:
            data["noise_floor"] = self.floor
            data["floor_ratio"] = self.floor_ratio
        if self.local:
            data["replay"] = self.local
        if self.note:
            data["note"] = self.note
        if self.outputs:
            data["outputs"] = [check.to_json() for check in self.outputs]
        return data


@dataclass(frozen=True)
class CallLedger:
    """Every reference call in exactly one state (:attr:`Report.ledger`)."""

    compared: list[str]
    """Paired and judged on their values (or statistics)."""
    covered: dict[str, str]
    """Call key -> the compared call around it whose input and output agree: whatever it computed is within what
    that call's agreement allows."""
    folded: list[str]
    """Calls that return their own input (hook points, ``nn.Identity``): nothing of their own to check."""
    ignored: list[str]
    """Left unmatched on purpose by a rule."""
    unaccounted: list[str]
    """None of the above: nothing the run compared says anything of them."""
    differing: list[str]
    """Unaccounted calls of a module holding a weight the weight ledger found to differ: a difference nothing
    checked, never a pass."""

    def to_json(self) -> dict[str, Any]:
        return {
            "compared": len(self.compared),
            "covered": len(self.covered),
            "folded": len(self.folded),
            "ignored": len(self.ignored),
            "unaccounted": list(self.unaccounted),
            "unaccounted_with_differing_weights": list(self.differing),
        }


@dataclass
class Report:
    """The comparison of two traces; render with :mod:`paritylab.reports.render`."""

    rows: list[Row]
    alignment: Alignment
    first_divergence: Row | None
    origins: list[Row]
    reference_meta: dict[str, Any] = field(default_factory=dict)
    candidate_meta: dict[str, Any] = field(default_factory=dict)
    first_nonfinite: dict[str, str | None] = field(default_factory=dict)
    replay_origins: list[Row] = field(default_factory=list)
    """Rows whose own (isolated replay) error diverges, once
    :func:`~paritylab.comparison.attribution.attach_replay` ran."""
    culprit_reason: str = ""
    """Why :attr:`first_divergence` was named (free-run origin, unmatched stretch, isolated replay, ...)."""
    decode: dict[str, Any] | None = None
    """Decode-step parity (``Generation.to_dict()``: its summary and every step), when it ran."""
    drilldown: dict[str, Any] | None = None
    """Inside :attr:`first_divergence`, the first operation that differs (``Drilldown.to_dict()``)."""
    decisions: list[dict[str, Any]] = field(default_factory=list)
    """Discrete decisions (a router's top-k) whose choices differed between the two sides, inside the modules where
    divergence started (``Differing.to_dict()``, :mod:`paritylab.run.decisions`): near ties were fed the reference's
    choices and the run judged again."""
    whole_graph: dict[str, Any] | None = None
    """A compiled candidate run once more untraced, as one graph (``paritylab.run.whole_graph``): ``verdict``
    (``pass``, ``fail``, ``unchecked``), its output's error against the reference and its traced run, ``message``."""

    @property
    def passed(self) -> bool:
        """Parity holds: no failing row, neither forward raised, and every aligned output was compared by value."""
        return self.verdict == "pass"

    @property
    def verdict(self) -> str:
        """``error`` (a forward raised), ``fail``, ``inconclusive`` (nothing failed, but some aligned output
        could not be compared by value, or nothing was compared at all) or ``pass``."""
        if self.errors:
            return "error"
        decode = (self.decode or {}).get("summary", {}).get("verdict", "pass")
        graph = (self.whole_graph or {}).get("verdict", "pass")
        if self.failing or decode in ("fail", "error") or graph == "fail":
            return "fail"
        if self.not_compared or not any(row.status == "compared" for row in self.rows) or decode != "pass":
            return "inconclusive"
        if self.ledger.differing:
            return "inconclusive"
        return "inconclusive" if graph != "pass" else "pass"

    @property
    def ledger(self) -> CallLedger:
        """Every reference call accounted for: compared, covered by a compared call around it that agrees, folded,
        ignored by a rule, or unaccounted (and then, with a differing weight in its module, no pass)."""
        by_index = {row.index: row for row in self.rows}
        compared, folded, ignored, unaccounted, differing = [], [], [], [], []
        covered: dict[str, str] = {}
        ignored_keys = set(self.alignment.ignored_reference)
        weights = {finding.reference_module for finding in self.alignment.weights.differing}
        for row in self.rows:
            key = row.reference.key
            if row.status == "identity":
                folded.append(key)
            elif row.status != "unmatched":
                compared.append(key)
            elif key in ignored_keys:
                ignored.append(key)
            else:
                around = next(
                    (by_index[i] for i in ancestors(row, by_index) if by_index[i].status != "unmatched"), None
                )
                agrees = around is not None and around.verdict == "pass" and not around.input_diverged
                if around is not None and agrees and around.status in ("compared", "stats-only"):
                    covered[key] = around.path
                else:
                    unaccounted.append(key)
                    if row.path in weights:
                        differing.append(key)
        return CallLedger(compared, covered, folded, ignored, unaccounted, differing)

    @property
    def not_compared(self) -> list[Row]:
        """Aligned rows judged without values (on statistics only, or with no values saved on a side), and rows
        with an output that could not be compared (:mod:`paritylab.comparison.outputs`)."""
        return [
            row
            for row in self.rows
            if row.status == "stats-only"
            or (row.status == "missing" and row.note.startswith(NO_VALUES))
            or any(check.verdict == NOT_COMPARED for check in row.outputs)
        ]

    @property
    def failing(self) -> list[Row]:
        return [row for row in self.rows if row.verdict == "fail"]

    @property
    def errors(self) -> dict[str, Any]:
        return {
            side: meta["error"]
            for side, meta in (("reference", self.reference_meta), ("candidate", self.candidate_meta))
            if meta.get("error")
        }

    @property
    def inputs_changed(self) -> dict[str, list[str]]:
        """Per side, the inputs its forward changed in place (each side had its own copy: see
        :attr:`~paritylab.tracing.tracer.TraceOptions.private_inputs`)."""
        return {
            side: list(meta["inputs_changed"])
            for side, meta in (("reference", self.reference_meta), ("candidate", self.candidate_meta))
            if meta.get("inputs_changed")
        }

    @property
    def buffers_changed(self) -> dict[str, list[str]]:
        """Per side, the buffers its forward changed in place (state later forwards will see)."""
        return {
            side: list(meta["buffers_changed"])
            for side, meta in (("reference", self.reference_meta), ("candidate", self.candidate_meta))
            if meta.get("buffers_changed")
        }

    @property
    def output_row(self) -> Row | None:
        """The row of the model's output (the outermost call that was compared)."""
        compared = [row for row in self.rows if row.status in ("compared", "stats-only", "shape-mismatch")]
        return min(compared, key=lambda row: (row.depth, row.index)) if compared else None

    def copy(self) -> Report:
        """A report whose rows can be re-judged without touching this one's (metrics and alignment shared:
        later phases add to a row's verdict, note, cause and ``local``, never to what the comparison measured)."""
        copies = {id(row): replace(row, local=dict(row.local)) for row in self.rows}
        first = self.first_divergence
        return replace(
            self,
            rows=list(copies.values()),
            first_divergence=None if first is None else copies.get(id(first), first),
            origins=[copies.get(id(row), row) for row in self.origins],
            replay_origins=[copies.get(id(row), row) for row in self.replay_origins],
        )

    @property
    def origin(self) -> str | None:
        """The reference module the run names as where divergence starts, as its headline and ``report.json`` do
        (``""`` is the model itself; ``None`` when nothing diverges): a weight no call judges is named at the module
        holding it (:attr:`weight_origin`), else :attr:`first_divergence`'s path."""
        table = self.weight_origin  # a property that walks the rows: read once
        if table is not None:
            return table[0].reference_module
        return self.first_divergence.path if self.first_divergence else None

    @property
    def weight_origin(self) -> tuple[WeightFinding, Row] | None:
        """Where divergence starts when it is a weight no module call judges: a tensor the weight ledger found to
        differ, held by a module that never runs (a position table its container's own code reads) or whose calls
        have no counterpart (the candidate's own code reads that weight), and the row of the nearest called module
        around it (the reader), when that row is where divergence starts, contains it, or diverges before it. The
        table's module is named, whatever order the container's inputs come in."""
        first = self.first_divergence
        if first is None or self.passed:
            return None
        by_path: dict[str, Row] = {}
        judged: set[str] = set()
        paired_with: dict[str, set[int]] = {}  # candidate module -> the judged rows of its calls
        for row in self.rows:
            by_path.setdefault(row.path, row)  # its first call
            if row.status in ("compared", "stats-only", "shape-mismatch", "error"):
                judged.add(row.path)
                if row.candidate is not None:
                    paired_with.setdefault(row.candidate.key.rsplit("#", 1)[0], set()).add(row.index)
        by_index = {row.index: row for row in self.rows}
        around = {first.index, *ancestors(first, by_index)}
        found: list[tuple[int, WeightFinding, Row]] = []
        for finding in self.alignment.weights.differing:
            if finding.reference_module in judged:
                continue  # a module whose call was paired: its own row judges it
            reader = next(
                (by_path[path] for path in module_ancestors(finding.reference_module) if path in by_path), None
            )
            if reader is None:
                continue
            own = by_path.get(finding.reference_module)
            if own is not None:  # it runs, unpaired: the candidate computes it in the code of another module
                elsewhere = first.index != own.index and first.index not in set(ancestors(own, by_index))
                if elsewhere and not _unchecked_after(first, own, self.rows, judged):
                    continue  # divergence starting elsewhere, its input agreeing, says it agrees
                if first.index in paired_with.get(finding.candidate_module, set()):
                    continue  # the candidate module holding the tensor is paired, and divergence starts there
            encloses = reader.index in around
            earlier = reader.diverged and reader.index < first.index
            if encloses or first.index in set(ancestors(reader, by_index)) or earlier:
                found.append((reader.index, finding, reader))
        if not found:
            return None
        _, finding, reader = min(found, key=lambda entry: entry[0])
        return finding, reader

    def summary(self) -> dict[str, Any]:
        judged = [row for row in self.rows if row.verdict != "skip"]
        worst = max((row for row in judged if row.rel_l2 is not None), key=lambda r: r.rel_l2 or 0.0, default=None)
        output = self.output_row
        return {
            "verdict": self.verdict,
            "rows": len(self.rows),
            "not_compared": len(self.not_compared),
            "passed": sum(row.verdict == "pass" for row in self.rows),
            "failed": len(self.failing),
            "skipped": sum(row.verdict == "skip" for row in self.rows),
            "origins": [row.path for row in self.origins],
            "replay_origins": [row.path for row in self.replay_origins],
            "first_divergence": self.origin,
            "first_divergence_index": self.first_divergence.index if self.first_divergence else None,
            "culprit_reason": self.culprit_reason,
            "first_operation": self.drilldown.get("operation") if self.drilldown else None,
            "decode": self.decode["summary"] if self.decode else None,
            "whole_graph": self.whole_graph.get("verdict") if self.whole_graph else None,
            "worst_rel_l2": worst.rel_l2 if worst else None,
            "worst_module": worst.path if worst else None,
            "output_module": output.path if output else None,
            "output_rel_l2": output.rel_l2 if output else None,
            "output_max_abs": output.metrics.get("max_abs") if output else None,
            "unmatched_reference": len(self.alignment.unmatched_reference),
            "unmatched_candidate": len(self.alignment.unmatched_candidate),
            "weights_differing": len(self.alignment.weights.differing),
            "unaccounted_calls": len(self.ledger.unaccounted),
            "first_nonfinite": self.first_nonfinite,
            "inputs_changed": self.inputs_changed,
            "buffers_changed": self.buffers_changed,
            "errors": self.errors,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "summary": self.summary(),
            "rows": [row.to_json() for row in self.rows],
            "drilldown": self.drilldown,
            "decisions": self.decisions,
            "whole_graph": self.whole_graph,
            "unmatched_candidate": self.alignment.unmatched_candidate,
            "weights": self.alignment.weights.to_json(),
            "calls": self.ledger.to_json(),
        }


def relative_error(metrics: Mapping[str, float]) -> float | None:
    """Relative error of a row: rel_l2 from values, else the largest relative stats difference."""
    if "rel_l2" in metrics:
        return metrics["rel_l2"]
    relative = [value for key, value in metrics.items() if key.endswith("_rel")]
    return max(relative) if relative else None


def producer_row(rows_by_index: dict[int, Row], reference: Trace, row: Row) -> Row | None:
    """The row of the call that produced ``row``'s primary input, looking through folded identity calls."""
    seen: set[int] = set()
    current = row
    while True:
        where = current.input_call
        node = primary_input(reference.calls[where]) if where < len(reference.calls) else None
        origin = node.get("from") if node else None
        if not isinstance(origin, int) or origin in seen or origin not in rows_by_index:
            return None
        seen.add(origin)
        producer = rows_by_index[origin]
        if producer.status != "identity":
            return producer
        current = producer


def ancestors(row: Row, by_index: Mapping[int, Row]) -> Iterator[int]:
    """The call indices above ``row``, innermost first (as far as ``by_index`` knows them)."""
    parent = row.parent
    while parent is not None:
        yield parent
        parent = by_index[parent].parent if parent in by_index else None


def innermost(rows: list[Row], everything: list[Row]) -> list[Row]:
    """``rows`` without those that have another of ``rows`` below them (modules, not their parents), in
    execution order."""
    chosen = {row.index for row in rows}
    by_index = {row.index: row for row in everything}
    above = {index for row in rows for index in ancestors(row, by_index) if index in chosen}
    return sorted((row for row in rows if row.index not in above), key=lambda row: row.index)


def primary_input(call: CallRecord) -> Node | None:
    slot = first_tensor_slot(call.inputs, "inputs")
    return dict(iter_tensors(call.inputs, "inputs")).get(slot) if slot else None


def output_at(call: CallRecord, slot: str | None) -> Node | None:
    """The tensor node of ``call``'s output at ``slot`` (``outputs.0``); ``None`` when there is none."""
    if slot is None:
        return None
    return dict(iter_tensors(call.outputs, "outputs")).get(slot)


def _unchecked_after(first: Row, own: Row, rows: list[Row], judged: set[str]) -> bool:
    """``first`` (where divergence was found to start) is a module with no counterpart that runs after ``own`` with
    no judged module between them that agrees: nothing shows ``first``'s input agreeing, so ``own``'s differing weight
    (a norm the candidate's own code applies, its scale held by the candidate's root) is where the values part."""
    if first.status != "unmatched" or first.index <= own.index:
        return False
    return all(row.diverged for row in rows if own.index < row.index < first.index and row.path in judged)
