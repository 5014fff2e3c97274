"""The trace: one record per module call, and its versioned JSON file with safetensors shards beside it."""

from __future__ import annotations

import json
import math
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from paritylab.tracing.files import (  # noqa: F401  (re-exported: readers import them from here)
    MAX_ENTRIES,
    UPLOADED_FILE,
    WITHHELD_FILE,
    TraceFormatError,
    check_directory,
    json_safe,
    write_json,
)
from paritylab.tracing.storage import StorageError, TensorReader
from paritylab.tracing.structure import Fingerprints
from paritylab.tracing.values import Node, iter_tensors

SCHEMA_VERSION = 1
TRACE_FILE = "trace.json"
INDEX_FILE = "tensors.index.json"
MAX_TRACE_JSON_BYTES = 512 * 1024 * 1024
MAX_TRACE_JSON_ELEMENTS = 16_000_000
"""Values (counted as ``,``, ``[`` and ``{`` bytes) a trace JSON may hold. Python spends up to about 90 bytes
per parsed value (a trace of 80,000 calls holds 4 million and takes 350 MB), so this caps a load at about
1.5 GB whatever the file's shape: 168 MB of ``[{},{},...]`` would otherwise take 4.5 GB."""


@dataclass
class CallRecord:
    """One call of one module during a traced forward."""

    index: int
    """Position in execution order (call start)."""
    path: str
    """Dotted module path as in ``named_modules()``; ``""`` is the root module."""
    call_index: int
    """How many calls of the same path came before this one."""
    cls: str
    parent: int | None
    depth: int
    inputs: Node | None = None
    outputs: Node | None = None
    error: str | None = None
    identity: bool = False
    """The call returned (a view of) its own input unchanged: hook points, ``nn.Identity``, eval dropout."""

    @property
    def key(self) -> str:
        """Stable key of the call: ``path#call_index``."""
        return f"{self.path}#{self.call_index}"

    def tensors(self, side: str = "outputs") -> list[tuple[str, Node]]:
        """``(slot, tensor_node)`` for each tensor of the call's ``inputs`` or ``outputs``."""
        return list(iter_tensors(getattr(self, side), side))

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "index": self.index,
            "path": self.path,
            "call_index": self.call_index,
            "cls": self.cls,
            "parent": self.parent,
            "depth": self.depth,
        }
        for name in ("inputs", "outputs", "error"):
            value = getattr(self, name)
            if value is not None:
                data[name] = value
        if self.identity:
            data["identity"] = True
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CallRecord:
        try:
            return cls(
                index=int(data["index"]),
                path=str(data["path"]),
                call_index=int(data["call_index"]),
                cls=str(data.get("cls", "")),
                parent=None if data.get("parent") is None else int(data["parent"]),
                depth=int(data.get("depth", 0)),
                inputs=_node_or_none(data.get("inputs")),
                outputs=_node_or_none(data.get("outputs")),
                error=None if data.get("error") is None else str(data["error"]),
                identity=data.get("identity") is True,
            )
        except (KeyError, TypeError, ValueError, OverflowError) as error:  # "index": Infinity
            raise TraceFormatError(f"malformed call record {str(data)[:120]!r}: {error}") from error


def display_path(path: str) -> str:
    """A module path for people: the root module shows as ``<root>``; control characters (a module named
    ``"\r\x1b[2K"`` would rewrite a terminal line) are shown escaped, never sent raw."""
    return printable(path) if path else "<root>"


def printable(text: str) -> str:
    """``text`` with control characters shown escaped (safe to print to a terminal)."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


@dataclass
class Trace:
    """The calls of one traced forward, with lazy access to their saved tensors."""

    calls: list[CallRecord] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    captures: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    """Capture name -> entries ``{"call": key, "slot": slot, "ref": ref}`` in execution order."""
    files: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Tensor reference -> ``(file name, key in file)``."""
    directory: Path | None = None
    live: dict[str, list[torch.Tensor]] = field(default_factory=dict, repr=False)
    """Captured values held in memory by the tracer (empty after :meth:`load`)."""
    _reader: TensorReader | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.calls)

    def __iter__(self) -> Iterator[CallRecord]:
        return iter(self.calls)

    @property
    def keys(self) -> list[str]:
        """Call keys in execution order."""
        return [call.key for call in self.calls]

    @property
    def uncalled(self) -> list[str]:
        """Paths of the traced model's modules that were never called (their weights may still be read)."""
        return [str(path) for path in self.meta.get("modules_not_called") or []]

    def call(self, key: str) -> CallRecord:
        """The call with this key (``path#n``)."""
        index = self.__dict__.get("_by_key")
        if index is None or len(index) != len(self.calls):
            index = self.__dict__["_by_key"] = {call.key: call for call in self.calls}
        found = index.get(key)
        if found is None:
            raise KeyError(f"no call {key!r} in this trace; keys look like {self.keys[:3]}")
        return found

    def tensor(self, node: Node) -> torch.Tensor | None:
        """The saved value of a tensor node, read lazily; ``None`` when it was not saved."""
        ref = node.get("ref")
        if ref is None or ref not in self.files:
            return None
        if self._reader is None:
            if self.directory is None:
                return None
            self._reader = TensorReader(self.directory)
        file_name, key = self.files[ref]
        value = self._reader.load(file_name, key)
        if "shape" in node and list(value.shape) != list(node["shape"]):
            raise StorageError(
                f"tensor {key!r} in {file_name} has shape {list(value.shape)}, the trace says {node['shape']}"
            )
        return value

    @property
    def captured(self) -> dict[str, list[torch.Tensor]]:
        """Named captures as tensors in execution order (from memory, else from the saved files)."""
        if self.live:
            return self.live
        loaded: dict[str, list[torch.Tensor]] = {}
        for name, entries in self.captures.items():
            values = [self.tensor({"ref": entry.get("ref")}) for entry in entries]
            loaded[name] = [value for value in values if value is not None]
        return loaded

    def save(self, directory: str | os.PathLike[str] | None = None) -> Path:
        """Write ``trace.json`` and the slot index into ``directory`` (default: the trace's own)."""
        target = Path(directory) if directory is not None else self.directory
        if target is None:
            raise ValueError("this trace has no directory: pass one to save(directory)")
        target.mkdir(parents=True, exist_ok=True)
        meta, fragments = self.meta, {}
        structure = meta.get("structure")
        if isinstance(structure, Fingerprints):  # encoded once for the model's weights (see Fingerprints)
            placeholder = f"paritylab-fragment-{uuid.uuid4().hex}"
            meta, fragments = {**meta, "structure": placeholder}, {placeholder: structure.json_text()}
        document = {
            "schema_version": SCHEMA_VERSION,
            "format": "paritylab",
            "meta": meta,
            "files": {ref: list(location) for ref, location in self.files.items()},
            "captures": self.captures,
            "calls": [call.to_json() for call in self.calls],
        }
        write_json(target / TRACE_FILE, document, fragments=fragments)
        write_json(target / INDEX_FILE, self.slot_index())
        return target / TRACE_FILE

    def slot_index(self) -> dict[str, Any]:
        """Which file holds the tensor of every call's input/output slot."""
        slot_map: dict[str, str] = {}
        for call in self.calls:
            for side in ("inputs", "outputs"):
                for slot, node in call.tensors(side):
                    ref = node.get("ref")
                    if ref in self.files:
                        slot_map[f"{call.key}/{slot}"] = ref
        weight_map = {ref: location[0] for ref, location in self.files.items()}
        return {
            "metadata": {"schema_version": SCHEMA_VERSION},
            "slot_map": slot_map,
            "tensor_map": weight_map,
        }

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> Trace:
        """Read a trace directory: paritylab's own, or one written by transformers' debugger."""
        path = Path(directory)
        if not path.is_dir():
            raise TraceFormatError(f"{path} is not a directory: pass the directory a trace was written to")
        check_directory(path)
        found = _load_paritylab(path) if (path / TRACE_FILE).is_file() else None
        for reader in _other_formats():
            if found is not None:
                break
            found = reader(path)
        if found is None:
            raise TraceFormatError(
                f"{path} holds no trace: expected {TRACE_FILE} or a transformers *_debug_tree_FULL_TENSORS.json"
            )
        if not found.calls:
            raise TraceFormatError(f"{path} holds a trace with no module calls: nothing to compare; re-trace the model")
        return found


OTHER_FORMATS: list[Callable[[Path], Trace | None]] = []
"""Readers of other trace formats, tried in order when a directory holds no ``trace.json``; each returns
``None`` for a directory that is not in its format. :mod:`.recovery` registers the reader of killed traces and
:mod:`.debugger_format` transformers' format, each when imported (:func:`_other_formats` imports them)."""


def _other_formats() -> list[Callable[[Path], Trace | None]]:
    from paritylab.tracing import debugger_format, recovery  # noqa: F401  (importing each registers its reader)

    return OTHER_FORMATS


def _load_paritylab(path: Path) -> Trace:
    document = read_json(path / TRACE_FILE)
    if not isinstance(document, dict):
        raise TraceFormatError(f"{path / TRACE_FILE} is not a JSON object")
    version = document.get("schema_version")
    if version != SCHEMA_VERSION:
        raise TraceFormatError(
            f"{path / TRACE_FILE} has schema_version {version!r}; this paritylab reads {SCHEMA_VERSION}"
        )
    calls = document.get("calls")
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise TraceFormatError(f"{path / TRACE_FILE}: 'calls' must be a list of objects")
    files = document.get("files") or {}
    if not isinstance(files, dict):
        raise TraceFormatError(f"{path / TRACE_FILE}: 'files' must be an object")
    trace = Trace(
        calls=[CallRecord.from_json(c) for c in calls],
        meta=meta if isinstance(meta := document.get("meta"), dict) else {},
        captures=_captures(document.get("captures")),
        files={str(ref): _location(ref, loc) for ref, loc in files.items()},
        directory=path,
    )
    reader = TensorReader(path)
    notes = (path / WITHHELD_FILE, path / UPLOADED_FILE)
    withheld = any(note.is_file() and not note.is_symlink() for note in notes)
    for file_name in {location[0] for location in trace.files.values()}:
        try:
            reader.resolve(file_name)
        except StorageError as error:
            if not (withheld and not (path / file_name).exists()):
                raise TraceFormatError(str(error)) from error
            # shards not uploaded, or uploaded and deleted here: statistics only, and comparisons say so
            trace.files = {ref: loc for ref, loc in trace.files.items() if loc[0] != file_name}
    return trace


def _location(ref: object, location: object) -> tuple[str, str]:
    if not (isinstance(location, list) and len(location) == 2 and all(isinstance(x, str) for x in location)):
        raise TraceFormatError(f"tensor {ref!r}: location must be [file, key], got {str(location)[:80]}")
    return location[0], location[1]


def _captures(data: object) -> dict[str, list[dict[str, str]]]:
    if not isinstance(data, dict):
        return {}
    return {
        str(name): [entry for entry in entries if isinstance(entry, dict)]
        for name, entries in data.items()
        if isinstance(entries, list)
    }


MAX_NODE_DEPTH = 64
MAX_DIMS = 32
_KINDS = {"tensor", "tuple", "list", "dict", "none", "scalar", "object"}


def _node_or_none(value: object) -> Node | None:
    if value is None:
        return None
    validate_node(value)
    return value  # type: ignore[return-value]


def validate_node(node: object, depth: int = 0) -> None:
    """Check a value node read from a file, so later code can trust its fields."""
    if depth > MAX_NODE_DEPTH:
        raise TraceFormatError(f"value nested deeper than {MAX_NODE_DEPTH} levels")
    if not isinstance(node, dict) or node.get("t") not in _KINDS:
        raise TraceFormatError(f"malformed value node {str(node)[:80]!r}")
    kind = node["t"]
    if kind == "tensor":
        _validate_tensor(node)
    elif kind in ("tuple", "list"):
        if not isinstance(node.get("items"), list):
            raise TraceFormatError(f"a {kind} node needs a list of items, got {str(node)[:80]!r}")
        for item in node["items"]:
            validate_node(item, depth + 1)
    elif kind == "dict":
        if not isinstance(node.get("items"), dict):
            raise TraceFormatError(f"a dict node needs a mapping of items, got {str(node)[:80]!r}")
        for item in node["items"].values():
            validate_node(item, depth + 1)


def _validate_tensor(node: dict[str, Any]) -> None:
    shape = node.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**48 for n in shape)
    ):
        raise TraceFormatError(f"tensor shape must be a list of at most {MAX_DIMS} sizes, got {str(shape)[:80]}")
    if not isinstance(node.get("dtype"), str) or len(node["dtype"]) > 32:
        raise TraceFormatError(f"tensor dtype must be a short string, got {str(node.get('dtype'))[:40]!r}")
    stats = node.get("stats")
    if stats is not None and not (isinstance(stats, dict) and all(isinstance(k, str) for k in stats)):
        raise TraceFormatError("tensor stats must be an object")
    if stats is not None and not all(v is None or isinstance(v, int | float | str) for v in stats.values()):
        raise TraceFormatError("tensor stats values must be numbers")
    for key in ("ref", "skipped", "device"):
        if key in node and not isinstance(node[key], str):
            raise TraceFormatError(f"tensor {key} must be a string")
    origin = node.get("from")
    if origin is not None and (not isinstance(origin, int) or isinstance(origin, bool) or origin < 0):
        raise TraceFormatError(f"tensor 'from' must be a call index, got {str(origin)[:40]!r}")


def as_float(value: object) -> float:
    """A stats value read back from JSON (inverse of :func:`json_safe`)."""
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return math.nan
    return math.nan


def read_json(path: Path, limit: int = MAX_TRACE_JSON_BYTES) -> Any:
    """Read a JSON file with a size limit and a one-line error on malformed content."""
    try:
        size = path.stat().st_size
    except OSError as error:
        raise TraceFormatError(f"cannot read {path}: {error.strerror}") from error
    if size > limit:
        raise TraceFormatError(f"{path} is {size} bytes, over the {limit}-byte limit for trace JSON")
    try:
        with open(path, "rb") as handle:
            data = handle.read(limit + 1)
    except OSError as error:
        raise TraceFormatError(f"cannot read {path}: {error.strerror}") from error
    if len(data) > limit:
        raise TraceFormatError(f"{path} grew past the {limit}-byte limit for trace JSON while being read")
    values = data.count(b",") + data.count(b"[") + data.count(b"{")
    if values > MAX_TRACE_JSON_ELEMENTS:
        raise TraceFormatError(
            f"{path} holds about {values} JSON values, over the {MAX_TRACE_JSON_ELEMENTS} a trace may hold "
            "(memory is bounded per value): split the trace (trace fewer modules or steps)"
        )
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TraceFormatError(f"{path} is not valid JSON: {error}") from error
    except RecursionError as error:
        raise TraceFormatError(f"{path} nests JSON deeper than any trace does: not a trace file") from error
