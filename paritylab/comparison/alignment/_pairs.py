"""One pair of calls and what of their outputs it compares: which element (:data:`Index`, :func:`primary_slot`)
and which part of the last dimension (:class:`Part`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paritylab.tracing.tracefile import CallRecord
from paritylab.tracing.values import first_tensor_slot

Index = int | str | None


@dataclass(frozen=True)
class Part:
    """Part of the last dimension: ``[start, stop)``, the ``index``-th of ``count`` equal chunks, or the
    positions ``indices`` (a fused projection whose parts are interleaved, e.g. grouped-query qkv)."""

    start: int = 0
    stop: int | None = None
    index: int | None = None
    count: int | None = None
    indices: tuple[int, ...] | None = None
    whole: bool = False
    """``indices`` reorder the whole last dimension: the module's own output with its features in another order
    (query rows laid out for another rotary convention), not a part of a fused one."""

    def select(self, value: Any) -> Any:
        """The part of ``value`` (a tensor) along its last dimension."""
        if self.indices is not None:
            import torch

            return value.index_select(-1, torch.tensor(self.indices, device=value.device))
        start, stop = self.bounds(value.shape[-1])
        return value[..., start:stop]

    def size(self, size: int) -> int:
        if self.indices is not None:
            return len(self.indices)
        start, stop = self.bounds(size)
        return max(0, stop - start)

    def bounds(self, size: int) -> tuple[int, int]:
        if self.index is not None and self.count:
            step = size // self.count
            return self.index * step, (self.index + 1) * step
        return slice(self.start, self.stop).indices(size)[:2]

    def to_yaml(self) -> dict[str, list[int | None]]:
        if self.indices is not None:  # a whole dimension in another order, or a fused module's interleaved part
            return {"order" if self.whole else "indices": list(self.indices)}
        if self.index is not None:
            return {"chunk": [self.index, self.count]}
        return {"slice": [self.start, self.stop]}


@dataclass(frozen=True)
class Pair:
    """One aligned pair of calls, and which output element of each to compare."""

    reference: str
    candidate: str
    source: str
    """``rule``, ``identity``, ``structure`` (equal weights), ``run`` (one side's weights are those of a run of
    modules on the other, paired with the run's last: outputs compare, inputs do not) or ``auto``."""
    score: float = 1.0
    reference_index: Index = None
    candidate_index: Index = None
    reference_part: Part | None = None
    candidate_part: Part | None = None
    reference_input: str | None = None
    """For a ``run`` pair: the call whose input stands for the reference side's input (the run's first)."""
    candidate_input: str | None = None
    """The same on the candidate side."""
    candidate_input_part: Part | None = None
    """Where each of the reference's input features sits in the candidate's input, when the two modules hold the
    same weights with the input columns in another order (an output projection reading attention heads in another
    order): the inputs are compared in the reference's order."""


def primary_slot(call: CallRecord, index: Index) -> str | None:
    """The output slot compared for ``call``: element ``index`` if given, else the first tensor."""
    from paritylab.tracing.values import select

    outputs = call.outputs
    if index is None:
        return first_tensor_slot(outputs, "outputs")
    chosen = select(outputs, index)
    if chosen is None or outputs is None:
        return None
    if outputs.get("t") == "tensor":
        return "outputs"
    if outputs.get("t") == "dict" and isinstance(index, int):
        index = list(outputs["items"])[index]
    return first_tensor_slot(chosen, f"outputs.{index}")
