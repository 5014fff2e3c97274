"""Fingerprints of a model's parameters: evidence for alignment that no numerical bug can change.

Two modules of different implementations compute the same thing when they hold the same weights, whatever
their names, layouts or dtypes. Each parameter is summarised by an order-free hash of its values rounded to
bfloat16 (a sum of mixed element hashes, modulo 2**64), so the fingerprint does not change under transpose,
reshape, permutation or a cast, and fused parameters hash to the sum of their parts. A module's fingerprint
is the sum over the distinct parameters of its subtree. For 2-D parameters the hash of every row and every
column is kept too, so the slice of a fused projection (qkv, gate+up) that equals a separate module's
weight can be located.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy
import torch
from torch import nn

from paritylab.tracing.files import json_text
from paritylab.tracing.sinusoids import sinusoid_frequencies

MASK = (1 << 64) - 1
MAX_AXIS = 1 << 16
"""Row/column hashes are kept for 2-D parameters with at most this many rows and columns."""
MAX_FIBERS = 1 << 18
"""Fiber hashes along an axis of a parameter of three or more dimensions are kept where it has at most this many."""


@dataclass(frozen=True)
class Fibers:
    """The fibers of a tensor of three or more dimensions along one axis (``t[i, :, k]`` for axis 1), in the C order
    of the other axes: each one's hash (the sum of its element hashes, as a row's) and float32 value sum. A per-head
    ``W_Q [heads, d_model, d_head]`` holds along axis 1 what a fused ``[d_model, 3 * d_model]`` projection holds in
    its first columns; a fused MoE's ``[experts, 2 * inner, d_model]`` holds along axis 2 the rows of each expert's
    gate and up projections."""

    axis: int
    hashes: bytes
    sums: bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "axis": self.axis,
            "hashes": base64.b64encode(self.hashes).decode("ascii"),
            "sums": base64.b64encode(self.sums).decode("ascii"),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], shape: tuple[int, ...]) -> Fibers:
        axis = int(data["axis"])
        hashes, sums = (base64.b64decode(data[key], validate=True) for key in ("hashes", "sums"))
        if not 0 <= axis < len(shape) or len(shape) < 3:
            raise ValueError(f"fibers along axis {axis} do not fit shape {shape}")
        count = math.prod(shape) // max(1, shape[axis])
        if len(hashes) != 8 * count or len(sums) != 4 * count:
            raise ValueError(f"fibers along axis {axis} do not fit shape {shape}")
        return cls(axis, hashes, sums)


@dataclass(frozen=True)
class ParamPrint:
    """One direct parameter: its value hash, shape, and for 2-D ones the hash of each row and column
    (kept as little-endian uint64 bytes, base64 in JSON: tracing never builds Python integers for them)."""

    name: str
    shape: tuple[int, ...]
    digest: int
    row_bytes: bytes = b""
    col_bytes: bytes = b""
    shifted: int = 0
    """For a 1-D parameter: the hash of its values minus one. Norm scales are stored either way, ``w`` or ``g = w - 1``
    (Gemma's and x-transformers' norms multiply by ``1 + g``): one side's ``shifted`` is the other's ``digest``. The
    side holding ``w`` is the one shifted, so a bfloat16 ``g`` (rounded after the subtraction) hashes alike; on the
    float16 grid the subtraction comes before the rounding to float16 too (``round(w) - 1`` is on a coarser grid
    than ``round(w - 1)`` near one: 45 % of a norm's elements (w = 1 + 0.1 N(0, 1)) hash differently)."""
    sketch: bytes = b""
    """How near two tensors' values are where their hashes differ (:mod:`paritylab.comparison.weights`): the float32
    sums of each row, then of each column, of the values viewed as ``(shape[0], -1)`` (a 1-D tensor: its values),
    then the L2 norm. A weight scaled by 1.01 has every sum scaled by 1.01; another weight of the same shape has
    sums of another draw. Empty where either axis is longer than :data:`MAX_AXIS`."""
    fibers: tuple[Fibers, ...] = ()
    """For a tensor of three or more dimensions: its fibers along each axis that has at most :data:`MAX_FIBERS`."""
    frequencies: bytes = b""
    """For a float32/64 sinusoid table (rotary ``sin | cos``, sinusoidal positions): the distinct angular frequencies
    its columns are built from, float64 (:func:`~paritylab.tracing.sinusoids.sinusoid_frequencies`); a port's table
    built another way is checked against them."""

    @property
    def angular(self) -> numpy.ndarray | None:
        """:attr:`frequencies` as float64 values (falling), or ``None``."""
        return numpy.frombuffer(self.frequencies, dtype="<f8") if self.frequencies else None

    @property
    def sums(self) -> tuple[numpy.ndarray, numpy.ndarray, float] | None:
        """The row sums, the column sums and the L2 norm kept in :attr:`sketch`, or ``None``."""
        if not self.sketch:
            return None
        values = numpy.frombuffer(self.sketch, dtype="<f4").astype(numpy.float64)
        rows = self.shape[0] if self.shape else 1
        return values[:rows], values[rows:-1], float(values[-1])

    @property
    def rows(self) -> tuple[int, ...]:
        return _unpack(self.row_bytes)

    @property
    def cols(self) -> tuple[int, ...]:
        return _unpack(self.col_bytes)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "shape": list(self.shape), "digest": self.digest}
        if self.shifted:
            data["shifted"] = self.shifted
        if self.row_bytes:
            data["rows"] = base64.b64encode(self.row_bytes).decode("ascii")
            data["cols"] = base64.b64encode(self.col_bytes).decode("ascii")
        if self.sketch:
            data["sketch"] = base64.b64encode(self.sketch).decode("ascii")
        if self.fibers:
            data["fibers"] = [fibers.to_json() for fibers in self.fibers]
        if self.frequencies:
            data["frequencies"] = base64.b64encode(self.frequencies).decode("ascii")
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ParamPrint:
        shape = tuple(int(v) for v in data["shape"])
        rows, cols = (base64.b64decode(data.get(key, ""), validate=True) for key in ("rows", "cols"))
        if rows and (len(shape) != 2 or len(rows) != 8 * shape[0] or len(cols) != 8 * shape[1]):
            raise ValueError(f"row/column hashes of {data.get('name')!r} do not fit its shape {shape}")
        shifted = int(data.get("shifted", 0)) & MASK
        sketch = base64.b64decode(data.get("sketch", ""), validate=True)
        if sketch and len(sketch) != 4 * (_sketch_length(shape) or -1):
            raise ValueError(f"the value sketch of {data.get('name')!r} does not fit its shape {shape}")
        fibers = tuple(Fibers.from_json(entry, shape) for entry in data.get("fibers", ()))
        frequencies = base64.b64decode(data.get("frequencies", ""), validate=True)
        if frequencies and (len(shape) != 2 or len(frequencies) % 8 or len(frequencies) > 8 * shape[1]):
            raise ValueError(f"the table frequencies of {data.get('name')!r} do not fit its shape {shape}")
        return cls(
            str(data["name"]), shape, int(data["digest"]) & MASK, rows, cols, shifted, sketch, fibers, frequencies
        )


def _sketch_length(shape: tuple[int, ...]) -> int | None:
    """How many float32 values a tensor of ``shape`` keeps in its :attr:`ParamPrint.sketch` (``None``: none)."""
    rows = shape[0] if shape else 1
    cols = math.prod(shape[1:]) if len(shape) > 1 else 0
    if max(rows, cols) > MAX_AXIS:
        return None
    return rows + cols + 1


def sketch_of(values: torch.Tensor) -> bytes:
    """:attr:`ParamPrint.sketch` of a tensor (empty where an axis is too long to keep)."""
    shape = tuple(values.shape)
    if _sketch_length(shape) is None:
        return b""
    wide = values.detach().to(torch.float32)
    if wide.dim() <= 1:
        parts = [wide.reshape(-1)]
    else:
        square = wide.reshape(shape[0], -1)
        parts = [square.sum(dim=1), square.sum(dim=0)]
    parts.append(torch.linalg.vector_norm(wide).reshape(1))
    return torch.cat(parts).cpu().numpy().astype("<f4", copy=False).tobytes()


def _unpack(raw: bytes) -> tuple[int, ...]:
    return tuple(numpy.frombuffer(raw, dtype="<u8").tolist())


@dataclass(frozen=True)
class ModulePrint:
    """A module's subtree fingerprint (``digest``, 0 when it holds no parameters) and its direct parameters."""

    path: str
    digest: int
    numel: int
    params: tuple[ParamPrint, ...] = field(default=())
    buffers: tuple[ParamPrint, ...] = field(default=())
    """Its own floating-point buffers (rotary frequencies, sinusoid tables): evidence for the weight ledger, never
    part of :attr:`digest`."""

    @property
    def shifted(self) -> int:
        """The module's fingerprint with every parameter's values minus one (see :attr:`ParamPrint.shifted`), for a
        module whose weights are only its own 1-D parameters (a norm); else 0."""
        own = [param for param in self.params if param.digest]
        if not own or any(not param.shifted for param in own) or sum(math.prod(p.shape) for p in own) != self.numel:
            return 0
        return sum(param.shifted for param in own) & MASK

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"path": self.path, "digest": self.digest, "numel": self.numel}
        if self.params:
            data["params"] = [param.to_json() for param in self.params]
        if self.buffers:
            data["buffers"] = [buffer.to_json() for buffer in self.buffers]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModulePrint:
        params = tuple(ParamPrint.from_json(p) for p in data.get("params", ()))
        buffers = tuple(ParamPrint.from_json(b) for b in data.get("buffers", ()))
        return cls(str(data["path"]), int(data["digest"]) & MASK, int(data["numel"]), params, buffers)


GRIDS = ("bf16", "fp16")
"""What values are rounded to before hashing: ``bf16`` (the default; a bf16 copy of fp32 weights hashes alike),
or ``fp16`` then bf16 (how an fp16 copy's weights hash: rounding through fp16 first changes 6 % of them)."""


def fingerprint(model: nn.Module, grid: str = "bf16") -> dict[str, ModulePrint]:
    """Module path -> fingerprint, for every module of ``model`` (computed without autograd)."""
    digests: dict[int, int] = {}
    direct: dict[str, tuple[ParamPrint, ...]] = {}
    buffers: dict[str, tuple[ParamPrint, ...]] = {}
    with torch.no_grad():
        for path, module in model.named_modules():
            prints = []
            for name, param in module.named_parameters(recurse=False):
                summary = _param_print(name, local_tensor(param), grid)
                if summary.digest == 0:
                    continue  # all zeros: computes nothing
                digests.setdefault(id(param), summary.digest)
                prints.append(summary)
            direct[path] = tuple(prints)
            buffers[path] = tuple(
                _param_print(name, local_tensor(buffer), grid)
                for name, buffer in module.named_buffers(recurse=False)
                if buffer is not None and buffer.is_floating_point() and buffer.device.type != "meta" and buffer.numel()
            )
    result: dict[str, ModulePrint] = {}
    for path, module in model.named_modules():
        total, numel = 0, 0
        for param in module.parameters():
            digest = digests.get(id(param))
            if not digest:
                continue
            total = (total + digest) & MASK
            numel += param.numel()
        result[path] = ModulePrint(path, total if numel else 0, numel, direct[path], buffers[path])
    return result


_cache: dict[tuple[int, str], tuple[weakref.ref[torch.Tensor], int, int, ParamPrint]] = {}
"""id(parameter) -> (the parameter, its version counter, its data pointer, its print): a parameter is hashed
once while its values are unchanged, so tracing the same weights again (capture loops, replay, decode
steps) costs nothing here."""


class Fingerprints(list[dict[str, Any]]):
    """The JSON-ready entries :func:`fingerprint_json` returns, a plain list to every reader, that also keeps its
    own JSON text once asked for it (:meth:`json_text`): a trace of the same weights again (capture loops, decode
    steps, replays) writes its ``trace.json`` without encoding them again (megabytes for a large model: 6 MB, about
    20 ms at llava-bench). The entries are never changed after they are made."""

    _text: str | None = None

    def json_text(self) -> str:
        """The entries as compact standard JSON (a non-finite float spelled as a string, as :func:`write_json`)."""
        if self._text is None:
            self._text = json_text(list(self))
        return self._text


_ModelEntry = tuple[weakref.ref[nn.Module], tuple[tuple[int, int, int], ...], Fingerprints]
_models: dict[tuple[int, str], _ModelEntry] = {}


def fingerprint_json(model: nn.Module, grid: str = "bf16") -> Fingerprints:
    """:func:`fingerprint` as JSON-ready entries, reused while every parameter of ``model`` is the same
    tensor with the same version and storage (tracing one model again costs microseconds here)."""
    buffers = (b for b in model.buffers() if b.is_floating_point() and b.device.type != "meta")
    tensors = [local_tensor(t) for t in (*model.parameters(), *buffers)]
    key = tuple((id(p), getattr(p, "_version", -1), p.data_ptr() if p.numel() else 0) for p in tensors)
    ident = (id(model), grid)
    cached = _models.get(ident)
    if cached is not None and cached[0]() is model and cached[1] == key and -1 not in (k[1] for k in key):
        return cached[2]
    entries = Fingerprints(item.to_json() for item in fingerprint(model, grid).values())
    _models[ident] = (weakref.ref(model, lambda _: _models.pop(ident, None)), key, entries)
    return entries


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (what a rank's fingerprint hashes: its own tensors), else the tensor."""
    to_local = getattr(type(tensor), "to_local", None)
    return tensor.to_local() if callable(to_local) else tensor  # type: ignore[attr-defined]


def _param_print(name: str, param: torch.Tensor, grid: str = "bf16") -> ParamPrint:
    version, pointer = getattr(param, "_version", -1), param.data_ptr() if param.numel() else 0
    cached = _cache.get((id(param), grid))
    if cached is not None and cached[0]() is param and cached[1:3] == (version, pointer):
        found = cached[3]
        return found if found.name == name else dataclasses.replace(found, name=name)
    values = param.detach()
    if values.is_complex():
        values = torch.view_as_real(values)
    elif not values.is_floating_point():
        values = values.to(torch.float32)
    wide = values
    if grid == "fp16" and values.dtype in (torch.float32, torch.float64):
        values = values.to(torch.float16)
    rows = cols = b""
    fibers: tuple[Fibers, ...] = ()
    if values.dim() == 2 and max(values.shape) <= MAX_AXIS:
        row_sums, col_sums = _axis_sums(values)
        digest = int(row_sums.sum()) & MASK
        rows, cols = _pack(row_sums), _pack(col_sums)
    elif values.dim() >= 3 and values.numel() and not param.is_complex():
        digest, fibers = _fibers(values, wide)
    else:
        flat = values.reshape(-1)
        digest = sum(int(element_hashes(part).sum(dtype=torch.int64)) for part in flat.split(BLOCK)) & MASK
    shifted = 0
    if values.dim() == 1 and values.is_floating_point():
        # minus one before the grid's rounding, as a copy that stores ``g = w - 1`` in float16 rounded it
        minus_one = wide.float() - 1
        if values.dtype != wide.dtype:
            minus_one = minus_one.to(values.dtype)
        shifted = int(element_hashes(minus_one).sum(dtype=torch.int64)) & MASK
    sketch = b"" if param.is_complex() else sketch_of(wide)
    frequencies = sinusoid_frequencies(wide) if values.dim() == 2 else b""
    made = ParamPrint(name, tuple(param.shape), digest, rows, cols, shifted, sketch, fibers, frequencies)
    if version != -1:
        key = (id(param), grid)
        _cache[key] = (weakref.ref(param, lambda _: _cache.pop(key, None)), version, pointer, made)
    return made


BLOCK = 1 << 19
"""Elements hashed at a time: the block's casts and gathers stay in cache (whole 16M-element weights hashed at
once took 3.4x as long, measured on llava-bench's 84M parameters: 0.89 s against 0.26 s)."""


def _axis_sums(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int64 sums of the element hashes of each row and each column of a 2-D tensor, in blocks of rows."""
    step = max(1, BLOCK // max(1, values.shape[1]))
    row_parts, col_sums = [], torch.zeros(values.shape[1], dtype=torch.int64, device=values.device)
    for part in values.split(step):
        hashed = element_hashes(part)
        row_parts.append(hashed.sum(dim=1, dtype=torch.int64))
        col_sums += hashed.sum(dim=0, dtype=torch.int64)
    rows = torch.cat(row_parts) if row_parts else torch.zeros(0, dtype=torch.int64, device=values.device)
    return rows, col_sums


def _fibers(values: torch.Tensor, wide: torch.Tensor) -> tuple[int, tuple[Fibers, ...]]:
    """The digest of a tensor of three or more dimensions and its :class:`Fibers` along every axis that has at most
    :data:`MAX_FIBERS` (hashed in blocks along the first axis, as rows are)."""
    shape = tuple(values.shape)
    axes = [axis for axis in range(len(shape)) if math.prod(shape) // max(1, shape[axis]) <= MAX_FIBERS]
    step = max(1, BLOCK // max(1, math.prod(shape[1:])))
    hash_parts: dict[int, list[torch.Tensor]] = {axis: [] for axis in axes}
    sum_parts: dict[int, list[torch.Tensor]] = {axis: [] for axis in axes}
    total = 0
    for part, wide_part in zip(values.split(step), wide.detach().split(step), strict=True):
        hashed = element_hashes(part).to(torch.int64)
        total += int(hashed.sum())
        floats = wide_part.to(torch.float32)
        for axis in axes:
            hash_parts[axis].append(hashed.sum(dim=axis))
            sum_parts[axis].append(floats.sum(dim=axis))
    found = []
    for axis in axes:
        if axis == 0:  # every block sums a share of each fiber along the first axis
            hashes, sums = torch.stack(hash_parts[0]).sum(dim=0), torch.stack(sum_parts[0]).sum(dim=0)
        else:
            hashes, sums = torch.cat(hash_parts[axis]), torch.cat(sum_parts[axis])
        raw = sums.reshape(-1).cpu().numpy().astype("<f4", copy=False).tobytes()
        found.append(Fibers(axis, _pack(hashes.reshape(-1)), raw))
    return total & MASK, tuple(found)


def _pack(sums: torch.Tensor) -> bytes:
    """int64 sums as little-endian uint64 bytes (two's complement: the same bits as the sum modulo 2**64)."""
    return sums.cpu().numpy().astype("<i8", copy=False).tobytes()


def element_hashes(values: torch.Tensor) -> torch.Tensor:
    """A random 32-bit hash of each element's bfloat16 bit pattern (a 65,536-entry table), same shape;
    zeros (either sign) hash to 0, so an all-zero bias one implementation has and the other lacks changes
    no fingerprint. One cast and one gather: about twice as fast as arithmetic mixing, measured."""
    index = values.to(torch.bfloat16).view(torch.int16).to(torch.int32).add_(32768)
    return _table(values.device).index_select(0, index.reshape(-1)).view(index.shape)


_tables: dict[torch.device, torch.Tensor] = {}


def _table(device: torch.device) -> torch.Tensor:
    table = _tables.get(device)
    if table is None:
        generator = torch.Generator().manual_seed(0x5EED)
        table = torch.randint(-(2**31), 2**31 - 1, (65536,), dtype=torch.int64, generator=generator)
        table = table.to(torch.int32)
        table[32768] = 0  # +0.0
        table[0] = 0  # -0.0 (bit pattern 0x8000, shifted)
        table = _tables[device] = table.to(device)
    return table


def prints_from_meta(meta: dict[str, Any]) -> dict[str, ModulePrint]:
    """The fingerprints a trace carries (``meta["structure"]``), or none for traces written without them."""
    raw = meta.get("structure")
    if not isinstance(raw, list):
        return {}
    prints: dict[str, ModulePrint] = {}
    for entry in raw:
        try:
            item = ModulePrint.from_json(entry)
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError, binascii.Error):
            return {}  # a damaged fingerprint is no evidence; alignment falls back to order and names
        prints[item.path] = item
    return prints


def module_ancestors(path: str) -> Iterator[str]:
    """The proper ancestors of a module path, nearest first (the root ``""`` last)."""
    while path:
        path = path.rsplit(".", 1)[0] if "." in path else ""
        yield path


def restrict_to_called(prints: dict[str, ModulePrint], called: set[str]) -> dict[str, ModulePrint]:
    """``prints`` with the parameters of modules that never ran taken out of their ancestors' fingerprints.

    An implementation may hold modules its forward never calls (a cross-attention norm kept for another
    configuration, an unused head): their weights are not part of what the ancestors compute, so they must
    not make two equal computations look different.
    """
    unused = [item for path, item in prints.items() if path not in called and item.params]
    if not unused:
        return prints
    digest = {path: item.digest for path, item in prints.items()}
    numel = {path: item.numel for path, item in prints.items()}
    for item in unused:
        own = sum(param.digest for param in item.params) & MASK
        size = sum(math.prod(param.shape) for param in item.params)
        path = item.path
        while path:
            path = path.rsplit(".", 1)[0] if "." in path else ""
            if path in digest:
                digest[path] = (digest[path] - own) & MASK
                numel[path] -= size
    return {
        path: dataclasses.replace(item, digest=digest[path] if numel[path] > 0 else 0, numel=max(0, numel[path]))
        for path, item in prints.items()
    }


def rows_of(whole: ModulePrint, part: ModulePrint) -> bool:
    """Whether ``part``'s module holds ``whole``'s parameters, each whole or, for a table, a contiguous run of its
    rows (row by row, on the grid both were hashed on), and nothing else: a position table kept without its offset
    rows (OPT's first two, which transformers never reads), a vocabulary trimmed of its padding. Both modules hold
    only parameters of their own, matched one to one, one table at least cut."""
    held = [item.params for item in (whole, part)]
    if not all(held) or len(held[0]) != len(held[1]):
        return False
    if any(item.numel != sum(math.prod(p.shape) for p in item.params) for item in (whole, part)):
        return False  # a module with parameters inside it
    unmatched = list(held[0])
    for param in held[1]:
        match = next((twin for twin in unmatched if _same_or_rows(twin, param)), None)
        if match is None:
            return False
        unmatched.remove(match)
    return whole.numel != part.numel


def _same_or_rows(whole: ParamPrint, part: ParamPrint) -> bool:
    if whole.digest == part.digest and math.prod(whole.shape) == math.prod(part.shape):
        return True
    if len(whole.shape) != 2 or len(part.shape) != 2 or not whole.row_bytes or not part.row_bytes:
        return False
    if whole.shape[1] != part.shape[1] or part.shape[0] >= whole.shape[0]:
        return False
    at = whole.row_bytes.find(part.row_bytes)
    while at != -1 and at % 8:  # a run of whole rows, not bytes straddling two
        at = whole.row_bytes.find(part.row_bytes, at + 1)
    return at != -1


def inner_digests(prints: dict[str, ModulePrint]) -> dict[str, frozenset[int]]:
    """Module path -> the fingerprints of its proper descendants that hold parameters."""
    inner: dict[str, set[int]] = {}
    for path, item in prints.items():
        if not item.numel or not path:
            continue
        parent = path
        while parent:
            parent = parent.rsplit(".", 1)[0] if "." in parent else ""
            if parent in prints:
                inner.setdefault(parent, set()).add(item.digest)
    return {path: frozenset(found) for path, found in inner.items()}
