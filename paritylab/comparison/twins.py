"""What the two sides of a low-precision pair provably share: weights and state, whatever the cast did to them.

The lifted replay (:mod:`paritylab.comparison.lifted`) judges a bfloat16/float16 candidate's code in float32 with
the very weights it holds; that only holds where the two sides' weights and state are provably the same. Here: the
candidate's parameters kept wider or stored minus one and the buffers a cast rounded, each proven from the values
against a reference tensor (:func:`twins`), the modules holding state a cast rounded (:func:`rounded_state`), and
the modules whose values are the candidate's own in float32 whatever their counterpart (:func:`exact_sources`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from paritylab.tracing.initial import initial_state
from paritylab.tracing.structure import MASK, ModulePrint
from paritylab.tracing.tracefile import Trace
from paritylab.tracing.values import iter_tensors

LIFTED_DTYPE = torch.float32
"""What both sides compute in: wide enough that rounding is far below any error worth naming (fp32 pairs of
independent implementations agree to about 1e-6), and as fast as the plain forward."""


@dataclass(frozen=True)
class Twins:
    """Candidate parameters that hold a reference parameter's values otherwise than rounded to the candidate's
    precision, proven from the values (:func:`twins`)."""

    given: dict[int, torch.Tensor] = field(default_factory=dict)
    """id of a reference parameter -> the value the lifted reference holds instead of its rounded one: its exact
    value where the candidate keeps it wider, or the candidate's ``g`` plus one where the candidate stores a norm's
    scale as ``g = w - 1`` (x-transformers' and Gemma's norms multiply by ``1 + g``, and ``g`` rounds finer than
    ``w``): both lifted sides then compute with the very same scale. Also id of a reference buffer holding a table
    the candidate holds rounded -> its rounded values (:func:`rounded_tables`)."""
    shifted: frozenset[int] = frozenset()
    """ids of the reference parameters the candidate stores minus one: fingerprinted as :attr:`ParamPrint.shifted`
    when the two sides' weights are compared."""
    proven: frozenset[int] = frozenset()
    """ids of the candidate's parameters kept wider than its precision, and of its buffers a cast rounded, whose
    values are proven (not state a cast rounded, or restored)."""
    restored: dict[int, torch.Tensor] = field(default_factory=dict)
    """id of a candidate buffer a cast rounded (a rotary ``inv_freq``) -> the reference buffer it is the rounding
    of: the lifted candidate holds that buffer's values, as it did before the cast."""
    rounded_outputs: dict[str, frozenset[str]] = field(default_factory=dict)
    """Reference module path -> the output slots the lifted reference rounds to the candidate's precision: a table
    the candidate holds rounded by a cast and the reference computes as it runs (rotary sin and cos by position,
    :func:`rounded_tables`); a reference buffer holding such a table is rounded through :attr:`given`."""
    folded: frozenset[str] = frozenset()
    """Candidate modules whose weight folds a reference norm into a reference layer (:func:`with_folds`): the lifted
    reference's layer and norm hold what computes the candidate's very output."""


def twins(
    reference: nn.Module, candidate: nn.Module, dtype: torch.dtype, reference_trace: Trace | None = None
) -> Twins:
    """The candidate's parameters kept wider than ``dtype`` (norms held in float32 inside a bfloat16 model), or
    stored as a reference parameter minus one, whose values a reference parameter provably holds (see
    :class:`Twins`). A wide parameter holding the reference's exact values keeps its twin unrounded; one holding
    its rounded values (a norm cast and then widened) needs nothing; one matching neither is not proven, and its
    module is not lifted. Buffers a cast rounded are proven by a reference buffer they are the rounding of, or
    by a table the reference holds or computes (``reference_trace``'s outputs) that rounds to them
    (:func:`rounded_tables`)."""
    params = [p for p in unwrap(candidate).parameters() if p.is_floating_point()]
    wide = [p for p in params if p.dtype != dtype]
    flat = [p for p in params if p.dim() == 1]  # a norm's scale
    sizes = {p.numel() for p in (*wide, *flat)}
    exact: dict[tuple[object, ...], nn.Parameter] = {}
    rounded: dict[tuple[object, ...], tuple[object, ...]] = {}  # rounded values -> exact values
    minus_one: dict[tuple[object, ...], nn.Parameter] = {}
    widths = {p.dtype for p in flat}
    for param in unwrap(reference).parameters():
        if not param.is_floating_point() or param.numel() not in sizes:
            continue
        exact.setdefault(values_key(param), param)
        rounded.setdefault(values_key(param.detach().to(dtype)), values_key(param))
        if param.dim() == 1:
            for width in widths:
                minus_one.setdefault(values_key((param.detach().to(LIFTED_DTYPE) - 1).to(width)), param)
    keys = {id(param): values_key(param) for param in params}
    held = set(keys.values())
    given: dict[int, torch.Tensor] = {}
    shifted, proven = set(), set()
    for param in params:
        key = keys[id(param)]
        if param.dtype != dtype and key in exact:
            given[id(exact[key])] = exact[key].detach()
            proven.add(id(param))
        elif param.dtype != dtype and key in rounded:
            proven.add(id(param))
        elif param.dim() == 1 and key in minus_one and key not in rounded and not _held(minus_one[key], dtype, held):
            # only a shift explains these values: no reference parameter holds them, and the candidate does not
            # hold the reference's own (zeros are a norm of ones shifted, or an unshifted bias: the second wins)
            twin = minus_one[key]
            given[id(twin)] = param.detach().to(LIFTED_DTYPE) + 1
            shifted.add(id(twin))
            proven.add(id(param))
    restored = _rounded_buffers(reference, candidate, dtype)
    tables, rounded_tables_held, outputs = rounded_tables(reference, reference_trace, candidate, dtype, set(restored))
    given.update(rounded_tables_held)
    return Twins(given, frozenset(shifted), frozenset(proven | set(restored) | tables), restored, outputs)


TABLE_SOURCES = 4096
"""Reference values examined as tables (:func:`rounded_tables`): its buffers and its parameterless modules' outputs,
first called first."""


def with_folds(found: Twins, reference: nn.Module, candidate: nn.Module, folds: Mapping[str, tuple[str, str]]) -> Twins:
    """``found`` with every fold of the weight ledger (candidate module -> the reference layer and the norm it folds
    in) unfolded into the lifted reference: the layer holds the candidate's weight over the norm's per-channel scale
    ``s = γ/√(σ² + ε)``, the norm its exact ``γ`` and the shift that gives the candidate's bias, so the layer and the
    norm, run in float32, compute what the candidate's module computes there (up to float32's rounding). A fold whose
    modules hold other tensors than a weight, a bias and a norm's ``γ``, ``β``, running mean and variance is left
    out (its modules are then not lifted)."""
    given, folded = dict(found.given), set()
    for path, (layer_path, norm_path) in folds.items():
        try:
            module, layer, norm = (
                model.get_submodule(name)
                for model, name in ((candidate, path), (reference, layer_path), (reference, norm_path))
            )
        except AttributeError:
            continue
        unfolded = _unfolded(module, layer, norm)
        if unfolded is None:
            continue
        for tensor, value in unfolded:
            given[id(tensor)] = value
        folded.add(path)
    if not folded:
        return found
    return replace(found, given=given, folded=frozenset(folded))


def _unfolded(module: nn.Module, layer: nn.Module, norm: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """(reference tensor, the float32 value the lifted reference holds instead) for one fold, or ``None``."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    scale, shift = getattr(norm, "weight", None), getattr(norm, "bias", None)
    mean, var, eps = getattr(norm, "running_mean", None), getattr(norm, "running_var", None), getattr(norm, "eps", None)
    own, own_bias = getattr(layer, "weight", None), getattr(layer, "bias", None)
    tensors = (weight, scale, shift, mean, var, own)
    if not all(isinstance(t, torch.Tensor) for t in tensors) or not isinstance(eps, float):
        return None
    assert weight is not None and scale is not None and shift is not None and mean is not None and var is not None
    assert own is not None
    if weight.shape != own.shape and not (weight.dim() == 2 and weight.shape == own.shape[::-1]):
        return None
    wide = LIFTED_DTYPE
    factor = scale.detach().to(wide) / torch.sqrt(var.detach().to(wide) + eps)
    folded = weight.detach().to(wide)
    if folded.shape != own.shape:
        folded = folded.t()
    if bool((factor == 0).any()):
        return None
    rows = (-1,) + (1,) * (own.dim() - 1)
    found = [(own, (folded / factor.reshape(rows)).contiguous()), (scale, scale.detach().to(wide).clone())]
    held = bias.detach().to(wide) if isinstance(bias, torch.Tensor) else torch.zeros_like(factor)
    if isinstance(own_bias, torch.Tensor):  # the layer adds the norm's mean back: the norm's shift is the bias
        found += [(own_bias, mean.detach().to(wide).clone()), (shift, held)]
    else:
        found.append((shift, held + factor * mean.detach().to(wide)))
    return found


def rounded_tables(
    reference: nn.Module,
    reference_trace: Trace | None,
    candidate: nn.Module,
    dtype: torch.dtype,
    restored: set[int],
) -> tuple[set[int], dict[int, torch.Tensor], dict[str, frozenset[str]]]:
    """Candidate buffers a cast rounded that hold, row for row, the rounding of a table the reference holds or
    computes as it runs, in any order of columns, a column repeated or not (TransformerLens' rotary ``sin`` and
    ``cos`` by position, interleaved or not, against transformers' rotary module's outputs or GPT-J's
    ``embed_positions``): ``(the candidate buffers proven, reference buffer id -> its rounded values, reference
    module path -> its output slots to round)``. The lifted reference then computes with the very values the
    candidate holds, as the low-precision reference does (its tables rounded by its own cast). The rows compared
    are the first ones both hold (a table's rows beyond the positions run are never read); a buffer that matches
    no table, or only some of its columns, is not proven, and its module is not lifted."""
    tables = [
        b
        for b in unwrap(candidate).buffers()
        if b.is_floating_point() and b.dtype == dtype and b.dim() >= 2 and id(b) not in restored and not cast_proof(b)
    ]
    if not tables:
        return set(), {}, {}
    rows = max(t.reshape(-1, t.shape[-1]).shape[0] for t in tables)
    width = TABLE_WIDTH * max(t.shape[-1] for t in tables)
    sources = _table_sources(unwrap(reference), reference_trace, rows, width)
    proven: set[int] = set()
    rounded: dict[int, torch.Tensor] = {}
    outputs: dict[str, set[str]] = {}
    columns: dict[tuple[int, int], set[bytes]] = {}  # (source, rows) -> its rounded columns
    found: dict[tuple[object, ...], list[int]] = {}  # a table's values -> the sources it is the rounding of
    for table in tables:
        key = values_key(table)
        if key not in found:  # one table per layer, the same values: examined once
            found[key] = [n for n, (*_, value) in enumerate(sources) if _rounds_to(value, table, dtype, columns, n)]
        if found[key]:
            proven.add(id(table))
        for source in found[key]:  # every one the reference holds (a rotary module per layer, or one per model)
            where, held, value = sources[source]
            if where == "buffer":
                rounded[int(held)] = value.to(dtype)
            else:
                outputs.setdefault(where, set()).add(str(held))
    return proven, rounded, {path: frozenset(slots) for path, slots in outputs.items()}


TABLE_WIDTH = 4
"""A table is looked for among reference values at most this many times as wide as the widest candidate table (a
rotary table's columns repeated, or sin and cos side by side): activations and attention weights are not read."""


def _table_sources(
    reference: nn.Module, trace: Trace | None, rows: int, width: int
) -> list[tuple[str, str | int, torch.Tensor]]:
    """What a table may be the rounding of: ``("buffer", id, value)`` for the reference's buffers, ``(path, slot,
    value)`` for the outputs of its parameterless modules (a table is made from positions, with no weight), in
    the order they ran; at most ``width`` columns wide, their first ``rows`` rows (of a batch's first item) kept:
    a copy only of what a table is compared with, not of every output (at most :data:`TABLE_SOURCES`). A
    buffer's value is the buffer itself (the lifted reference's rounded copy is made from it)."""
    sources: list[tuple[str, str | int, torch.Tensor]] = [
        ("buffer", id(b), b.detach())
        for b in reference.buffers()
        if b.is_floating_point() and b.dim() >= 2 and b.shape[-1] <= width
    ]
    if trace is None:
        return sources
    for call in trace.calls:
        try:
            module = reference.get_submodule(call.path)
        except AttributeError:
            continue
        if next(module.parameters(), None) is not None:
            continue
        for slot, node in iter_tensors(call.outputs, "outputs"):
            shape = node.get("shape") or []
            if len(shape) < 2 or shape[-1] > width or not str(node.get("dtype", "")).startswith("float"):
                continue
            value = trace.tensor(node)
            if value is not None:
                sources.append((call.path, slot, value.reshape(-1, *value.shape[-2:])[0, :rows].cpu().clone()))
        if len(sources) > TABLE_SOURCES:
            break
    return sources


def _rounds_to(
    value: torch.Tensor, table: torch.Tensor, dtype: torch.dtype, columns: dict[tuple[int, int], set[bytes]], index: int
) -> bool:
    """Every column of ``table``'s first rows is, value for value, a column of ``value``'s first rows rounded to
    ``dtype`` (the rows both hold, at least two). ``columns`` keeps each source's rounded columns (``index``)."""
    rows = min(value.reshape(-1, value.shape[-1]).shape[0], table.reshape(-1, table.shape[-1]).shape[0])
    if rows < 2 or value.dtype == dtype:
        return False
    if (index, rows) not in columns:
        wide = value.reshape(-1, value.shape[-1])[:rows].to(device="cpu", dtype=dtype).T.contiguous()
        columns[index, rows] = {column.numpy().tobytes() for column in wide.view(torch.int16)}
    held = table.detach().reshape(-1, table.shape[-1])[:rows].cpu().T.contiguous()
    return all(column.numpy().tobytes() in columns[index, rows] for column in held.view(torch.int16))


def _rounded_buffers(reference: nn.Module, candidate: nn.Module, dtype: torch.dtype) -> dict[int, torch.Tensor]:
    """The candidate's ``dtype`` buffers whose values a cast rounded (:func:`cast_proof`), each the rounding of a
    wider reference buffer of its shape: candidate buffer id -> that reference buffer."""
    rounded = [
        b for b in unwrap(candidate).buffers() if b.is_floating_point() and b.dtype == dtype and not cast_proof(b)
    ]
    if not rounded:
        return {}
    shapes = {tuple(b.shape) for b in rounded}
    wide: dict[tuple[object, ...], torch.Tensor] = {}
    for buffer in unwrap(reference).buffers():
        if buffer.is_floating_point() and buffer.dtype != dtype and tuple(buffer.shape) in shapes:
            wide.setdefault(values_key(buffer.detach().to(dtype)), buffer.detach())
    return {id(b): wide[key] for b in rounded if (key := values_key(b)) in wide}


def _held(param: torch.Tensor, dtype: torch.dtype, held: set[tuple[object, ...]]) -> bool:
    """The candidate holds ``param``'s values, exact or rounded to ``dtype``."""
    return values_key(param) in held or values_key(param.detach().to(dtype)) in held


def shifted_prints(prints: dict[str, ModulePrint], model: nn.Module, shifted: frozenset[int]) -> dict[str, ModulePrint]:
    """``prints`` with the ``shifted`` parameters counted by their values minus one (:attr:`ParamPrint.shifted`),
    as the candidate stores them: a parameter of ones shifts to zeros, which no fingerprint counts."""
    if not shifted:
        return prints
    found: dict[int, tuple[int, int, int]] = {}  # id -> (digest, shifted digest, size)
    for path, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in shifted:
                own = next((p for p in prints[path].params if p.name == name), None)
                if own is not None:
                    found[id(param)] = (own.digest, own.shifted, param.numel())
    result = dict(prints)
    for path, module in model.named_modules():
        moved = [found[id(p)] for p in module.parameters() if id(p) in found]
        if moved:
            before = prints[path]
            digest = (before.digest + sum(after - was for was, after, _ in moved)) & MASK
            numel = before.numel - sum(size for _, after, size in moved if not after)
            result[path] = ModulePrint(before.path, digest if numel else 0, numel, before.params)
    return result


def values_key(tensor: torch.Tensor) -> tuple[object, ...]:
    """Shape and a digest of the float32 values: equal keys, equal values (a collision is 2**-128)."""
    import hashlib

    values = tensor.detach().to(device="cpu", dtype=torch.float32).contiguous().reshape(-1)
    return tuple(tensor.shape), hashlib.blake2b(values.numpy().tobytes(), digest_size=16).digest()


def rounded_state(model: nn.Module, dtype: torch.dtype, proven: frozenset[int] = frozenset()) -> set[str]:
    """Paths of the modules whose subtree holds a floating-point parameter not in ``dtype`` (unless ``proven``:
    see :func:`twins`), or another floating-point tensor (buffer, or attribute held before the first traced run:
    :mod:`paritylab.tracing.initial`) whose values a cast may have rounded."""
    flagged = []
    for path, module in model.named_modules():
        params = [p for p in module.parameters(recurse=False) if p.is_floating_point() and p.dtype != dtype]
        params = [p for p in params if id(p) not in proven]
        others = [b for b in module.buffers(recurse=False) if b is not None and id(b) not in proven]
        state = initial_state(model, path)  # as before its first run: a cache a forward made is made afresh
        state = vars(module) if state is None else state
        others += [v for v in state.values() if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)]
        if params or any(t.is_floating_point() and not cast_proof(t) for t in others):
            flagged.append(path)
    paths = [path for path, _ in model.named_modules()]
    return {path for path in paths if any(_within(found, path) for found in flagged)}


def _within(path: str, ancestor: str) -> bool:
    return not ancestor or path == ancestor or path.startswith(ancestor + ".")


def exact_sources(candidate: nn.Module, proven: frozenset[int], dtype: torch.dtype) -> frozenset[str]:
    """Paths of the candidate's modules whose subtree holds no parameter and no state a cast rounded (buffers
    restored from the reference excepted: ``proven``, :attr:`Twins.proven`): see :attr:`LiftedReplay.sources`."""
    unsafe = rounded_state(candidate, dtype, proven)
    return frozenset(
        path
        for path, module in unwrap(candidate).named_modules()
        if path not in unsafe and next(module.parameters(), None) is None
    )


def cast_proof(tensor: torch.Tensor) -> bool:
    """Every value is one a cast to bfloat16 or float16 keeps: zero, small integers, powers of two, and the
    huge fills of attention masks (whose effect no rounding changes)."""
    values = tensor.detach().reshape(-1).to(torch.float64)
    values = values[values.isfinite() & (values.abs() < 1e4)]
    mantissa, _ = torch.frexp(values)
    small_integer = (values == values.round()) & (values.abs() <= 256)
    return bool((small_integer | (mantissa.abs() == 0.5)).all())


def unwrap(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper holds, else ``model``: the lifted copies run eagerly."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else model
