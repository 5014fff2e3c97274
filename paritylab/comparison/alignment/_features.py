"""Structural evidence that two calls are the same computation: output shape, layer numbers, names, class and
weights, scored for the ordered pass and the rescue."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from paritylab.comparison.alignment._shapes import _primary, merged, transposed
from paritylab.tracing.structure import ModulePrint, rows_of
from paritylab.tracing.tracefile import CallRecord

_TOKEN = re.compile(r"[a-z]+|\d+")

MIN_AUTO_SCORE = 0.3
"""Between anchors, calls of equal output shape pair with at least this score (more with name evidence)."""
MIN_STRUCTURE = 0.3
"""Name evidence needed to pair two modules whose parameters differ."""
WRAPPER_SCORE = 0.9
"""Two modules holding the same weights, one computing with them itself and the other through a child (a
wrapper that adds a residual or rescales): paired when nothing better is there, after the module's own child."""


@dataclass
class _Features:
    shape: tuple[int, ...] | None
    tokens: frozenset[str]
    name: frozenset[str]
    cls: str
    numbers: tuple[str, ...]
    depth: int
    weights: int | None = None
    """The module's parameter fingerprint, when it holds parameters and the trace carries fingerprints."""
    inner: frozenset[int] = frozenset()
    """The fingerprints of its descendants that hold parameters."""
    numel: int = 0
    """How many parameter values its subtree holds (with :attr:`weights`)."""
    own: bool = False
    """Every weight value it holds is one of its own parameters (no module inside it holds one): it computes with
    its weights itself, where a module holding the same weights through a child wraps that child's computation
    in code of its own (a residual addition, a rescaling)."""
    held: ModulePrint | None = None
    """Its fingerprint, row by row: a table one side holds cut to a run of the other's rows is the same weights
    (:func:`~paritylab.tracing.structure.rows_of`)."""
    holds: bool | None = None
    """Whether its subtree holds weights its code reads (``None``: the trace carries no fingerprints, or the call is
    an observer's: :func:`observer_classes`)."""

    @classmethod
    def of(
        cls,
        call: CallRecord,
        item: ModulePrint | None = None,
        inner: frozenset[int] = frozenset(),
        observers: frozenset[str] = frozenset(),
    ) -> _Features:
        node = _primary(call.outputs)
        leaf = call.path.rsplit(".", 1)[-1] if call.path else ""
        return cls(
            shape=tuple(node["shape"]) if node else None,
            tokens=frozenset(_TOKEN.findall(f"{call.path} {call.cls}".lower())),
            name=_bigrams(leaf.lower()),
            cls=call.cls.lower(),
            numbers=_layer_numbers(call.path),
            depth=call.depth,
            weights=item.digest if item is not None and item.numel else None,
            inner=inner,
            numel=item.numel if item is not None else 0,
            own=item is not None and bool(item.numel) and _own_values(item) == item.numel,
            held=item if item is not None and item.numel else None,
            holds=None if item is None or call.cls in observers else bool(item.numel),
        )

    def unlike(self, other: _Features) -> bool:
        """One module holds weights and the other none (both traces fingerprinted): not one computation, whatever
        order and shape say. A module computing with weights (a projection, an expert) is not an activation that
        holds none, even where the activation's output has the projection's shape (transformers' Mixtral calls its
        weightless ``act_fn`` once per expert inside the fused experts module, where a per-expert port calls each
        expert's ``w1``). A weightless wrapper around a module holding weights holds them too (its subtree's), and a
        weight its code reads without calling the module holding it counts as its own
        (:func:`~paritylab.comparison.alignment._weight_reads._read_prints`)."""
        return self.holds is not None and other.holds is not None and self.holds != other.holds

    def contradicts(self, other: _Features) -> bool:
        """The weights rule the pair out: they differ, and either they are not even as many values (a
        projection against a norm of the same output shape: a wrong weight conversion keeps the count, a
        different module does not), or one side's weights are exactly those of a part of the other (a wrapper
        around what the other computes plus more, such as a patch projection against a patch embedding that
        also adds position embeddings)."""
        if self.weights is None or other.weights is None or self.weights == other.weights:
            return False
        if self.cut(other):
            return False
        if self.numel != other.numel:
            return True
        return self.weights in other.inner or other.weights in self.inner

    def similarity(self, other: _Features) -> float:
        """0 unless output shapes agree and layer numbers do not rule the pair out; else structural
        evidence, in (0, 1]. Modules of the same shape in the same place in the order pair on shape and
        position alone, unless both hold parameters that differ: then names must agree too (a weight
        conversion bug still pairs with its namesake, a different computation does not)."""
        if self.shape is None or other.shape is None:
            return 0.0
        if (
            self.shape != other.shape
            and not merged(self.shape, other.shape)
            and not transposed(self.shape, other.shape)
        ):
            return 0.0
        if self.numbers and other.numbers and self.numbers[-1] != other.numbers[-1]:
            return 0.0
        if self.unlike(other):
            return 0.0
        if self.weights is not None and (self.weights == other.weights or self.cut(other)):
            # the same weights: as strong as evidence gets (a group the weights alone could not order), strongest
            # between two modules that both compute with them directly, or both through a child
            return 1.0 if self.own == other.own else WRAPPER_SCORE
        structure = self.structure(other)
        differ = self.weights is not None and other.weights is not None and self.weights != other.weights
        if differ and (structure < MIN_STRUCTURE or self.contradicts(other)):
            return 0.0
        return MIN_AUTO_SCORE + (1 - MIN_AUTO_SCORE) * structure

    def cut(self, other: _Features) -> bool:
        """One side holds the other's weights with a table cut to a run of its rows (a position table without
        its offset rows, a trimmed vocabulary)."""
        if self.held is None or other.held is None or self.numel == other.numel:
            return False
        return rows_of(self.held, other.held) or rows_of(other.held, self.held)

    def structure(self, other: _Features) -> float:
        """Evidence from names alone: equal layer numbers, similar leaf names, shared tokens, same class."""
        if self.numbers and other.numbers and self.numbers[-1] != other.numbers[-1]:
            return 0.0  # layer 3 is not layer 4, whatever the names say
        numbers = 1.0 if self.numbers and self.numbers == other.numbers else 0.0
        overlap = len(self.tokens & other.tokens) / max(1, min(len(self.tokens), len(other.tokens)))
        return 0.5 * numbers + 0.3 * _dice(self.name, other.name) + 0.1 * overlap + 0.1 * (self.cls == other.cls)


def _own_values(item: ModulePrint) -> int:
    return sum(math.prod(param.shape) for param in item.params if param.digest)


def _layer_numbers(path: str) -> tuple[str, ...]:
    """Numeric path components followed by more components (``layers.3.mlp``): layer numbers. A numeric
    leaf is a position inside a ``Sequential`` (``mlp.1``), not a layer."""
    parts = path.split(".")
    return tuple(part for part in parts[:-1] if part.isdigit())


def _dice(a: frozenset[str], b: frozenset[str]) -> float:
    return 2 * len(a & b) / (len(a) + len(b)) if a and b else 0.0


def _bigrams(name: str) -> frozenset[str]:
    padded = f"^{name}$"
    return frozenset(padded[i : i + 2] for i in range(len(padded) - 1))


def observer_classes(calls: list[CallRecord]) -> frozenset[str]:
    """The classes of module that hand a value on unchanged in at least one call of this trace (TransformerLens' hook
    points, ``nn.Identity``, dropout in eval). A call of such a class that changes its value (a hook attached to it)
    stands for the value it was handed: the output of a module that may well hold weights, so whether it holds any
    says nothing about what it pairs with (:meth:`_Features.unlike`)."""
    return frozenset(call.cls for call in calls if call.identity)
