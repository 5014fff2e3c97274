"""The public entry, :func:`align`: the pairing stages in order of precedence, each a named function over one
shared :class:`_Pairing` (what both sides hold and what is paired so far)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from paritylab.comparison.alignment._fingerprints import _by_fingerprint, _input_shape
from paritylab.comparison.alignment._folds import folded_calls, read_folds
from paritylab.comparison.alignment._fused import _by_parts
from paritylab.comparison.alignment._pairs import Pair, Part
from paritylab.comparison.alignment._rescue import _rescue, _weightless_at_home
from paritylab.comparison.alignment._result import Alignment, _alignment
from paritylab.comparison.alignment._rules import Rule, _by_rule
from paritylab.comparison.alignment._runs import _by_runs
from paritylab.comparison.alignment._sequence import _align_segments, _monotone_chain
from paritylab.comparison.alignment._shapes import _primary_input, _shape
from paritylab.comparison.alignment._weight_reads import _read_prints, held_elsewhere
from paritylab.comparison.weights import WeightLedger, as_twins, weight_ledger
from paritylab.tracing.structure import ModulePrint
from paritylab.tracing.tracefile import CallRecord, Trace


def align(reference: Trace, candidate: Trace, rules: Iterable[Rule] = (), *, pinned: bool = False) -> Alignment:
    """Align the calls of two traces from evidence a numerical bug cannot change.

    In order: the user's rules; parameter fingerprints (equal weights, up to layout and cast, are the same
    module; a module whose weight rows are part of a fused one is paired with that part); identical paths
    where fingerprints do not contradict them; then order, shape, class and names between those anchors.
    Output statistics never decide a pair. Calls that return their own input (hook points, ``nn.Identity``,
    eval dropout) are folded: listed, never paired.

    ``pinned``: ``rules`` are a frozen alignment (``report/alignment.yaml`` of an earlier run) and the only
    evidence: nothing else is paired, and a rule whose candidate call no longer exists is listed in
    :attr:`Alignment.lost`.
    """
    rules = list(rules)
    state = _Pairing.of(reference, candidate)
    _propose(state, rules, pinned=pinned)
    return state.alignment(pinned=pinned)


def _propose(state: _Pairing, rules: list[Rule], *, pinned: bool) -> None:
    """Every pairing stage, in order of precedence: each pairs only what the ones before it left open."""
    _pair_by_rules(state, rules)
    if pinned:
        return
    state.open_ref = state.left_by_rules()
    if state.structured:
        _pair_by_folds(state)
        _pair_by_fingerprints(state)
        _pair_by_near_weights(state)
    _pair_by_paths(state)
    if state.structured:
        _pair_by_parts(state)
        _pair_by_runs(state)
    _pair_in_order(state)
    _pair_out_of_order(state)
    if state.structured:
        _orders_from_weights(state)


def _orders_from_weights(state: _Pairing) -> None:
    """Pairs of modules whose weights the weight ledger found near with one axis in another order
    (:attr:`WeightLedger.orders`), and which the fingerprints could not prove so (their values changed): their
    outputs (rows reordered) or inputs (columns) are compared in the order the weights give."""
    orders = state.weights.orders
    if not orders:
        return

    def ordered(i: int, pair: Pair) -> Pair:
        if pair.candidate_part is not None or pair.candidate_input_part is not None or pair.reference_part is not None:
            return pair
        ref, cand = state.ref_calls[i], state.cand_by_key.get(pair.candidate)
        found = orders.get((ref.path, cand.path)) if cand is not None else None
        if found is None:
            return pair
        axis, order = found
        shape = _shape(ref) if axis == 0 else _input_shape(ref)
        if not shape or shape[-1] != len(order) or sorted(order) != list(range(len(order))):
            return pair
        part = Part(indices=order, whole=True)
        return replace(pair, candidate_part=part) if axis == 0 else replace(pair, candidate_input_part=part)

    state.fixed = {i: (j, ordered(i, pair)) for i, (j, pair) in state.fixed.items()}
    state.automatic = {i: ordered(i, pair) for i, pair in state.automatic.items()}


@dataclass
class _Pairing:
    """Both sides' calls and fingerprints, and what the stages have paired so far (by position in each side's
    call list)."""

    ref_calls: list[CallRecord]
    cand_calls: list[CallRecord]
    folded_ref: set[int]
    folded_cand: set[int]
    cand_by_key: dict[str, CallRecord]
    ref_keys: set[str]
    cand_position: dict[str, int]
    ref_prints: dict[str, ModulePrint]
    cand_prints: dict[str, ModulePrint]
    taken: set[int]
    """Candidate calls no longer open: folded, or paired whole (a pair with a candidate part leaves it open)."""
    fixed: dict[int, tuple[int, Pair]] = field(default_factory=dict)
    """Pairs from rules and weights: the anchors of the ordered pass."""
    ignored: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    open_ref: list[int] = field(default_factory=list)
    """Reference calls no stage has paired yet (from the rules on)."""
    automatic: dict[int, Pair] = field(default_factory=dict)
    """Pairs from order and structure: the ordered pass between anchors, then the rescue."""
    weights: WeightLedger = field(default_factory=WeightLedger)
    """Every candidate tensor against the reference's: near weights pair their modules."""
    inside: set[int] = field(default_factory=set)
    """Reference calls inside a pair of one module against a run (a layer whose norm the candidate folded into it):
    computed by the candidate module, never paired themselves."""

    @classmethod
    def of(cls, reference: Trace, candidate: Trace) -> _Pairing:
        ref_calls, cand_calls = reference.calls, candidate.calls
        folded_ref, folded_cand = _folded(ref_calls), _folded(cand_calls)
        cand_by_key = {call.key: call for i, call in enumerate(cand_calls) if i not in folded_cand}
        ref_keys = {call.key for call in ref_calls}
        cand_position = {call.key: position for position, call in enumerate(cand_calls)}
        ref_prints, cand_prints = _read_prints(reference, candidate)
        ledger = weight_ledger(ref_prints, cand_prints) if ref_prints and cand_prints else WeightLedger()
        if ref_prints and cand_prints:
            read_folds(
                ref_calls, cand_calls, ref_prints, cand_prints, ledger
            )  # batch norms folded into the layer before
        cand_prints = as_twins(cand_prints, ref_prints, ledger)  # near copies count as their twins for pairing
        ref_prints, cand_prints = held_elsewhere(reference, candidate, ref_prints, cand_prints)  # T5's bias table
        return cls(
            ref_calls,
            cand_calls,
            folded_ref,
            folded_cand,
            cand_by_key,
            ref_keys,
            cand_position,
            ref_prints,
            cand_prints,
            taken=set(folded_cand),
            weights=ledger,
        )

    @property
    def structured(self) -> bool:
        """Both traces carry parameter fingerprints."""
        return bool(self.ref_prints and self.cand_prints)

    def fix(self, i: int, j: int, pair: Pair) -> None:
        self.fixed[i] = (j, pair)
        if pair.candidate_part is None or pair.candidate_part.whole:
            self.taken.add(j)

    def left_by_rules(self) -> list[int]:
        skipped = set(self.fixed) | self.folded_ref
        return [i for i in range(len(self.ref_calls)) if i not in skipped and self.ref_calls[i].key not in self.ignored]

    def close(self) -> None:
        """Drop what the last stage paired from :attr:`open_ref`."""
        self.open_ref = [i for i in self.open_ref if i not in self.fixed and i not in self.inside]

    def skipped_ref(self) -> set[int]:
        """Reference calls the ordered pass leaves alone: fixed, folded or left unmatched by a rule."""
        ignored = {i for i, call in enumerate(self.ref_calls) if call.key in self.ignored}
        return set(self.fixed) | self.folded_ref | ignored | self.inside

    def skipped_cand(self) -> set[int]:
        return set(self.taken) | {c for c, _ in self.fixed.values()}

    def alignment(self, *, pinned: bool) -> Alignment:
        lost = self.lost if pinned else []
        return _alignment(
            self.ref_calls,
            self.cand_calls,
            self.fixed,
            self.ignored,
            self.folded_ref,
            self.folded_cand,
            lost,
            self.automatic,
            self.weights,
        )


def _folded(calls: list[CallRecord]) -> set[int]:
    """Calls that compute nothing new: those returning their own input, and a module called again on the
    very tensor an earlier call of it received (TransformerLens normalises the same residual for q, k and v)."""
    folded: set[int] = set()
    seen: set[tuple[str, str]] = set()
    for position, call in enumerate(calls):
        if call.identity:
            folded.add(position)
            continue
        node = _primary_input(call)
        ref = node.get("ref") if node else None
        if ref is None:
            continue
        if (call.path, ref) in seen:
            folded.add(position)
        seen.add((call.path, ref))
    return folded


def _pair_by_rules(state: _Pairing, rules: list[Rule]) -> None:
    """The user's rules (or a pinned alignment): a pair, a call left unmatched on purpose, or a lost call."""
    for position, call in enumerate(state.ref_calls):
        if position in state.folded_ref:
            continue
        pair = _by_rule(call, rules, state.cand_by_key, state.lost, state.ref_keys)
        if pair is None:
            state.ignored.append(call.key)
        elif isinstance(pair, Pair) and state.cand_position[pair.candidate] not in state.taken:
            state.fix(position, state.cand_position[pair.candidate], pair)


def _pair_by_fingerprints(state: _Pairing) -> None:
    """Modules holding equal weights (:mod:`._fingerprints`); then norms whose scales one side stores as ``w - 1``;
    then equal weights again, where the norms just paired confirm by data flow what was ambiguous before."""
    for shift in ("", "candidate", "reference", ""):
        known = {i: j for i, (j, _) in state.fixed.items()}
        for i, j, pair in _by_fingerprint(
            state.ref_calls, state.cand_calls, state.open_ref, state.taken, state.ref_prints, state.cand_prints, known,
            shift,
        ):  # fmt: skip
            state.fix(i, j, pair)
        state.close()


def _pair_by_folds(state: _Pairing) -> None:
    """Modules whose weight is a reference layer's with the norm after it folded in (:mod:`._folds`): paired with
    the norm's output, their input compared with the layer's; the layer's own call stays inside the pair."""
    if not state.weights.folds:
        return
    open_ref = set(state.open_ref)
    for k, j, i in folded_calls(state.ref_calls, state.cand_calls, state.weights.folds):
        if k not in open_ref or i not in open_ref or j in state.taken:
            continue
        ref, cand = state.ref_calls[k], state.cand_calls[j]
        state.fix(k, j, Pair(ref.key, cand.key, "run", 1.0, reference_input=state.ref_calls[i].key))
        state.inside.add(i)
    state.close()


def _pair_by_near_weights(state: _Pairing) -> None:
    """Modules whose weights are the reference's with a defect (:attr:`WeightLedger.module_pairs`): a weight scaled,
    an element changed, a table built from a wrong constant. The bug a module's weights carry must not cost it its
    pair, whatever its code is called; the calls of the two modules are paired in order."""
    if not state.weights.module_pairs and not state.weights.part_pairs:
        return
    ref_calls_of: dict[str, list[int]] = {}
    for i in state.open_ref:
        ref_calls_of.setdefault(state.ref_calls[i].path, []).append(i)
    cand_calls_of: dict[str, list[int]] = {}
    for j, call in enumerate(state.cand_calls):
        if j not in state.taken:
            cand_calls_of.setdefault(call.path, []).append(j)
    for ref_path, cand_path in state.weights.module_pairs.items():
        for i, j in zip(ref_calls_of.get(ref_path, ()), cand_calls_of.get(cand_path, ()), strict=False):
            ref, cand = state.ref_calls[i], state.cand_calls[j]
            state.fix(i, j, Pair(ref.key, cand.key, "weights", 1.0))
    for ref_path, (cand_path, start, stop) in state.weights.part_pairs.items():
        # the reference module's weight is a block of the candidate's fused one: that block of its output features
        for i, j in zip(ref_calls_of.get(ref_path, ()), cand_calls_of.get(cand_path, ()), strict=False):
            ref, cand = state.ref_calls[i], state.cand_calls[j]
            state.fix(i, j, Pair(ref.key, cand.key, "weights", 1.0, candidate_part=Part(start=start, stop=stop)))
    state.close()


def _pair_by_paths(state: _Pairing) -> None:
    """Identical paths, where the stages before left both calls open."""
    for i in state.open_ref:
        call = state.ref_calls[i]
        other = state.cand_by_key.get(call.key)
        if other is not None and state.cand_position[other.key] not in state.taken:
            state.fix(i, state.cand_position[other.key], Pair(call.key, other.key, "identity"))
    state.close()


def _pair_by_parts(state: _Pairing) -> None:
    """Parts of fused outputs (:mod:`._fused`)."""
    for i, j, pair in _by_parts(
        state.ref_calls, state.cand_calls, state.open_ref, state.taken, state.ref_prints, state.cand_prints
    ):
        state.fix(i, j, pair)
    state.close()


def _pair_by_runs(state: _Pairing) -> None:
    """One module against a run of modules on the other side (:mod:`._runs`)."""
    for i, j, pair in _by_runs(
        state.ref_calls, state.cand_calls, state.open_ref, state.taken, state.ref_prints, state.cand_prints
    ):
        state.fix(i, j, pair)
    state.close()


def _pair_in_order(state: _Pairing) -> None:
    """Order, shape, class and names between the anchors the stages before fixed (:mod:`._sequence`)."""
    anchors = _monotone_chain(sorted((r, c) for r, (c, _) in state.fixed.items()))
    state.automatic = _align_segments(
        state.ref_calls,
        state.cand_calls,
        anchors,
        state.skipped_ref(),
        state.skipped_cand(),
        state.ref_prints,
        state.cand_prints,
        state.weights.near_modules,
    )


def _pair_out_of_order(state: _Pairing) -> None:
    """What the ordered pass left, matched best-first on structure alone (:mod:`._rescue`)."""
    taken_cand = state.skipped_cand() | {state.cand_position[pair.candidate] for pair in state.automatic.values()}
    skip_ref = state.skipped_ref() | set(state.automatic)
    state.automatic |= _rescue(
        state.ref_calls, state.cand_calls, skip_ref, taken_cand, state.ref_prints, state.cand_prints
    )
    paired = {i: state.cand_position[pair.candidate] for i, pair in state.automatic.items() if _whole(pair)}
    paired |= {i: j for i, (j, pair) in state.fixed.items() if _whole(pair)}
    state.automatic |= _weightless_at_home(
        state.ref_calls, state.cand_calls, paired, state.skipped_ref(), state.skipped_cand(),
        state.ref_prints, state.cand_prints,
    )  # fmt: skip


def _whole(pair: Pair) -> bool:
    """A pair of whole outputs: the candidate call computes all the reference call does, and nothing else."""
    return pair.candidate_part is None or pair.candidate_part.whole
