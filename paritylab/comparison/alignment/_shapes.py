"""A call's primary input and output tensors, its output shape, and when two output shapes hold the same values."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from paritylab.tracing.tracefile import CallRecord
from paritylab.tracing.values import Node, iter_tensors


def _primary_input(call: CallRecord) -> Node | None:
    return next((node for _, node in iter_tensors(call.inputs, "inputs")), None)


def _fits(ref: CallRecord, cand: CallRecord) -> bool:
    """Output shapes that hold the same values (see :func:`shapes_fit`)."""
    a, b = _shape(ref), _shape(cand)
    return a is not None and b is not None and shapes_fit(a, b)


def shapes_fit(a: Sequence[int], b: Sequence[int]) -> bool:
    """Equal, equal but for dimensions one side kept at 1 (:func:`broadcastable`), equal but for leading
    dimensions one side merged (:func:`merged`), or the same leading dimensions in another order
    (:func:`transposed`)."""
    return list(a) == list(b) or broadcastable(a, b) or merged(a, b) or transposed(a, b) is not None


def transposed(reference: Sequence[int], candidate: Sequence[int]) -> tuple[int, ...] | None:
    """The order of ``candidate``'s dimensions that gives ``reference``'s shape, where its leading dimensions are
    the reference's in another order and its last (the features) the same: ``[12, 2, 64]`` against ``[2, 12, 64]``
    (a sequence-first implementation: fairseq, ``nn.MultiheadAttention`` without ``batch_first``, Megatron, the
    original CLIP); or where one side holds its channels last and the other second (:func:`channels_moved`).
    ``None`` when the shapes are equal, differ otherwise, or repeat a leading size (which of two equal dimensions
    is which is not knowable from shapes)."""
    a, b = list(reference), list(candidate)
    if len(a) != len(b) or a == b or not a:
        return None
    if a[-1] != b[-1] or sorted(a[:-1]) != sorted(b[:-1]):
        return channels_moved(a, b)
    if len(set(a[:-1])) != len(a) - 1:
        return None
    return (*(b.index(size) for size in a[:-1]), len(b) - 1)


def channels_moved(reference: Sequence[int], candidate: Sequence[int]) -> tuple[int, ...] | None:
    """The order of ``candidate``'s dimensions that gives ``reference``'s shape where one holds its channels last
    and the other second, every other dimension in its place: ``[2, 7, 7, 96]`` against ``[2, 96, 7, 7]`` (a
    ConvNeXt block's channels-last norm and linear layers against a port's channels-first ones, a convolution's
    ``[batch, channels, time]`` against ``[batch, time, channels]``). Which dimension moved is known from the
    convention, not guessed from sizes, so spatial dimensions of one size are no ambiguity. ``None`` otherwise
    (and for fewer than three dimensions)."""
    a, b = list(reference), list(candidate)
    if len(a) != len(b) or len(a) < 3 or a == b:
        return None
    last = len(b) - 1
    if b == [a[0], *a[2:], a[1]]:  # the candidate holds its channels last
        return (0, last, *range(1, last))
    if b == [a[0], a[-1], *a[1:-1]]:  # the candidate holds them second
        return (0, *range(2, last + 1), 1)
    return None


def in_layout(value: Any, shape: Sequence[int]) -> Any:
    """``value`` (a tensor) with its dimensions in the order of ``shape`` where :func:`transposed` finds one (made
    contiguous: the code that receives it may ``view`` it), else ``value`` itself."""
    order = transposed(shape, value.shape)
    return value if order is None else value.permute(order).contiguous()


def broadcastable(a: Sequence[int], b: Sequence[int]) -> bool:
    """Same rank, and every dimension equal or 1 on one side: the same values, one side repeated."""
    return len(a) == len(b) and all(x == y or x == 1 or y == 1 for x, y in zip(a, b, strict=True))


def merged(a: Sequence[int], b: Sequence[int]) -> bool:
    """The same values in the same order, one side with consecutive leading dimensions merged: ``[24, 64]``
    against ``[2, 12, 64]`` (an implementation that flattens batch and sequence before its MLP)."""
    if len(a) == len(b) or not a or not b or a[-1] != b[-1]:
        return False
    longer, shorter = (a, b) if len(a) > len(b) else (b, a)
    position = 0
    for size in shorter[:-1]:
        product = 1
        while position < len(longer) - 1 and (product < size or longer[position] == 1):
            product *= longer[position]
            position += 1
        if product != size:
            return False
    return all(size == 1 for size in longer[position:-1])


def _shape(call: CallRecord) -> tuple[int, ...] | None:
    node = _primary(call.outputs)
    return tuple(node["shape"]) if node else None


def _primary(outputs: Node | None) -> Node | None:
    return next((node for _, node in iter_tensors(outputs, "outputs")), None)
