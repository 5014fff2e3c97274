"""Fused functions written out as the operations they perform, for the operation-level drill-down.

One implementation calls ``scaled_dot_product_attention`` or ``layer_norm``; another writes the same out as a
matmul, a scaling, a softmax, or a mean, a subtraction and an ``eps``. Recorded as one fused call, the reference
forms none of the intermediates the written-out side does, and a wrong scale or eps can only be named as the
whole stretch. Recorded through these expansions (on both sides), each intermediate has a counterpart, and the
one operation that differs is named, with its constant: ``mul(matmul, 0.194) vs mul(matmul, 0.177)``.

An expansion is used only when it reproduces the fused result (:func:`faithful`): a dropout, an unusual
argument, or a kernel whose numerics differ keeps the fused call as it is. Low-precision inputs are expanded in
float32, as the fused kernels accumulate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

Call = Callable[..., Any]
"""``call(function, *args, **kwargs)``: run one operation (and record it, when the recorder runs the expansion)."""

_LOW_PRECISION = (torch.bfloat16, torch.float16)
_FAITHFUL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
"""Per result dtype, the relative L2 distance within which an expansion reproduces the fused result."""


def plain(function: Any, *args: Any, **kwargs: Any) -> Any:
    return function(*args, **kwargs)


def scaled_dot_product_attention(
    call: Call, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
) -> torch.Tensor | None:  # fmt: skip
    """What the math backend computes: ``softmax(q @ k^T * scale + mask) @ v`` (``None``: a dropout)."""
    if dropout_p:
        return None
    dtype = query.dtype
    if dtype in _LOW_PRECISION:
        query, key, value = (call(torch.Tensor.float, tensor) for tensor in (query, key, value))
    if enable_gqa:
        repeat = query.size(-3) // key.size(-3)
        key = call(torch.repeat_interleave, key, repeat, -3)
        value = call(torch.repeat_interleave, value, repeat, -3)
    scores = call(torch.matmul, query, call(torch.transpose, key, -2, -1))
    scores = call(torch.mul, scores, scale if scale is not None else query.size(-1) ** -0.5)
    if is_causal:
        allowed = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device).tril()
        scores = call(torch.Tensor.masked_fill, scores, allowed.logical_not(), -math.inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = call(torch.Tensor.masked_fill, scores, call(torch.logical_not, attn_mask), -math.inf)
        else:
            scores = call(torch.add, scores, attn_mask)
    out = call(torch.matmul, call(torch.softmax, scores, -1), value)
    return call(torch.Tensor.to, out, dtype) if out.dtype != dtype else out


def layer_norm(
    call: Call, input: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None, eps: float = 1e-5,
) -> torch.Tensor:  # fmt: skip
    """``(x - mean) * rsqrt(var + eps) * weight + bias`` over the trailing ``normalized_shape`` dimensions."""
    x, dims, dtype = _upcast(call, input, normalized_shape)
    centred = call(torch.sub, x, call(torch.mean, x, dims, keepdim=True))
    variance = call(torch.mean, call(torch.mul, centred, centred), dims, keepdim=True)
    out = call(torch.mul, centred, call(torch.rsqrt, call(torch.add, variance, eps)))
    out = call(torch.Tensor.to, out, dtype) if out.dtype != dtype else out
    if weight is not None:
        out = call(torch.mul, out, weight)
    return call(torch.add, out, bias) if bias is not None else out


def rms_norm(
    call: Call, input: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """``x * rsqrt(mean(x^2) + eps) * weight`` (``eps`` defaults to the input dtype's machine epsilon)."""
    x, dims, dtype = _upcast(call, input, normalized_shape)
    eps = torch.finfo(input.dtype).eps if eps is None else eps
    mean_square = call(torch.mean, call(torch.mul, x, x), dims, keepdim=True)
    out = call(torch.mul, x, call(torch.rsqrt, call(torch.add, mean_square, eps)))
    out = call(torch.Tensor.to, out, dtype) if out.dtype != dtype else out
    return call(torch.mul, out, weight) if weight is not None else out


def _upcast(call: Call, x: torch.Tensor, shape: Any) -> tuple[torch.Tensor, tuple[int, ...], torch.dtype]:
    count = len(shape) if isinstance(shape, tuple | list | torch.Size) else 1
    dtype = x.dtype
    if dtype in _LOW_PRECISION:
        x = call(torch.Tensor.float, x)
    return x, tuple(range(-count, 0)), dtype


EXPANSIONS: Mapping[str, Callable[..., torch.Tensor | None]] = {
    "scaled_dot_product_attention": scaled_dot_product_attention,
    "layer_norm": layer_norm,
    "rms_norm": rms_norm,
}
"""Fused function name -> its expansion, ``expansion(call, *args, **kwargs)`` with the function's signature."""


def faithful(expansion: Callable[..., Any], function: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether ``expansion`` reproduces ``function(*args, **kwargs)`` (same shape and dtype, and values within
    :data:`_FAITHFUL`); computed without recording. Arguments it does not understand make it unfaithful."""
    try:
        with torch.no_grad():
            written = expansion(plain, *args, **kwargs)
            fused = function(*args, **kwargs)
    except (TypeError, ValueError, RuntimeError, IndexError):
        return False
    if not (isinstance(written, torch.Tensor) and isinstance(fused, torch.Tensor)):
        return False
    if written.shape != fused.shape or written.dtype != fused.dtype or fused.dtype not in _FAITHFUL:
        return False
    reference = fused.detach().to(torch.float64)
    difference = torch.linalg.vector_norm(written.detach().to(torch.float64) - reference)
    scale = max(float(torch.linalg.vector_norm(reference)), 1e-30)
    distance = float(difference) / scale
    return math.isfinite(distance) and distance <= _FAITHFUL[fused.dtype]
