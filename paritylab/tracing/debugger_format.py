"""transformers' ``model_addition_debugger_context`` call-tree format: write it, and read its traces.

Written files: ``{RootClass}_debug_tree_SUMMARY.json`` and ``{RootClass}_debug_tree_FULL_TENSORS.json``.
Unlike the debugger, outputs of non-leaf modules are kept, and a saved tensor's ``value`` is
``./{shard}#{key}`` (a tensor inside a shard) rather than one file per tensor.

Read traces: the debugger's ``value`` is ``./{file}.safetensors`` holding one tensor under ``data``.
It writes one file per module path, so when a module runs several times only its last call's value
survives; earlier calls are marked as such rather than silently given the wrong tensor.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from paritylab.tracing.storage import StorageError, TensorReader
from paritylab.tracing.tracefile import (
    OTHER_FORMATS,
    CallRecord,
    Trace,
    TraceFormatError,
    as_float,
    read_json,
    write_json,
)
from paritylab.tracing.values import Node

FULL_SUFFIX = "_debug_tree_FULL_TENSORS.json"
SUMMARY_SUFFIX = "_debug_tree_SUMMARY.json"
_STATS = ("mean", "std", "min", "max")
_NUMBER = re.compile(r"tensor\(\s*([-+]?(?:nan|inf|[0-9.]+(?:e[-+]?[0-9]+)?))", re.IGNORECASE)
_INTS = re.compile(r"\d+")
OVERWRITTEN = "overwritten by a later call (transformers' debugger keeps one file per module path)"
MAX_DEPTH = 200


# -- writing -----------------------------------------------------------------------------------------------


def write_debugger_files(trace: Trace, directory: Path) -> tuple[Path, Path]:
    """Write the trace's call tree in the debugger's layout (compact JSON); returns (summary, full) paths."""
    root_name = trace.meta.get("model_class") or "Model"
    roots: list[dict[str, Any]] = []
    nodes: dict[int, dict[str, Any]] = {}
    for call in trace.calls:
        node = nodes[call.index] = _tree(trace, call, root_name)
        parent = nodes.get(call.parent) if call.parent is not None else None
        (parent.setdefault("children", []) if parent is not None else roots).append(node)
    tree = roots[0] if len(roots) == 1 else {"module_path": root_name, "children": roots}
    if not roots:
        tree = {"module_path": root_name}
    full = directory / f"{root_name}{FULL_SUFFIX}"
    summary = directory / f"{root_name}{SUMMARY_SUFFIX}"
    write_json(full, tree)
    write_json(summary, _strip_values(tree))
    return summary, full


def _tree(trace: Trace, call: CallRecord, root_name: str) -> dict[str, Any]:
    node: dict[str, Any] = {"module_path": f"{root_name}.{call.path}" if call.path else root_name}
    if call.inputs is not None:
        inputs = {k: _hf_value(trace, v) for k, v in call.inputs["items"].items() if v.get("items")}
        if inputs:
            node["inputs"] = inputs
    if call.outputs is not None:
        node["outputs"] = _hf_value(trace, call.outputs)
    if call.error is not None:
        node["error"] = call.error
    return node


def _hf_value(trace: Trace, node: Node) -> Any:
    kind = node.get("t")
    if kind == "tensor":
        out: dict[str, Any] = {"shape": f"torch.Size({node['shape']})", "dtype": f"torch.{node['dtype']}"}
        if "ref" in node and node["ref"] in trace.files:
            file_name, key = trace.files[node["ref"]]
            out["value"] = f"./{file_name}#{key}"
        suffix = "" if node.get("device", "cpu") == "cpu" else f", device='{node['device']}'"
        for name in _STATS:
            value = (node.get("stats") or {}).get(name)
            if value is not None:
                out[name] = f"tensor({as_float(value):.4e}{suffix})"
        return out
    if kind in ("tuple", "list"):
        return [_hf_value(trace, item) for item in node["items"]]
    if kind == "dict":
        return {key: _hf_value(trace, item) for key, item in node["items"].items()}
    if kind == "none":
        return "None"
    if kind == "scalar":
        return repr(node["v"])
    return node.get("repr", "")


def _strip_values(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_values(v) for k, v in value.items() if k != "value"}
    if isinstance(value, list):
        return [_strip_values(v) for v in value]
    return value


# -- reading -----------------------------------------------------------------------------------------------


def find_debugger_file(directory: Path) -> Path | None:
    """The debugger's FULL_TENSORS file in ``directory`` (else its SUMMARY file), or ``None``."""
    for suffix in (FULL_SUFFIX, SUMMARY_SUFFIX):
        found = sorted(directory.glob(f"*{suffix}"))
        if found:
            return found[0]
    return None


def read_debugger_trace(directory: Path) -> Trace:
    """Read a trace written by ``model_addition_debugger_context`` (any ``use_repr``) or by paritylab."""
    path = find_debugger_file(directory)
    if path is None:
        raise TraceFormatError(f"{directory} holds no *{FULL_SUFFIX} or *{SUMMARY_SUFFIX} file")
    tree = read_json(path)
    if not isinstance(tree, dict) or not isinstance(tree.get("module_path"), str):
        raise TraceFormatError(f"{path} is not a debugger call tree (no top-level 'module_path')")
    reader = _Reader(directory, tree["module_path"])
    reader.walk(tree, parent=None, depth=0)
    reader.mark_overwritten()
    trace = Trace(calls=reader.calls, files=reader.files, directory=directory)
    trace.meta = {"format": "transformers-debugger", "model_class": tree["module_path"], "status": "complete"}
    return trace


class _Reader:
    def __init__(self, directory: Path, root_name: str) -> None:
        self.directory = directory
        self.root_name = root_name
        self.calls: list[CallRecord] = []
        self.files: dict[str, tuple[str, str]] = {}
        self.counts: dict[str, int] = {}
        self.last_ref_of_file: dict[str, str] = {}
        self.confine = TensorReader(directory)

    def walk(self, node: Any, parent: int | None, depth: int) -> None:
        if not isinstance(node, dict) or not isinstance(node.get("module_path"), str):
            raise TraceFormatError(f"malformed call-tree node {str(node)[:80]!r}")
        if depth > MAX_DEPTH:
            raise TraceFormatError(f"call tree deeper than {MAX_DEPTH} levels")
        path = self._path(node["module_path"])
        call_index = self.counts.get(path, 0)
        self.counts[path] = call_index + 1
        record = CallRecord(len(self.calls), path, call_index, "", parent, depth)
        if "inputs" in node and node["inputs"] is not None:
            raw = node["inputs"] if isinstance(node["inputs"], dict) else {"args": node["inputs"]}
            record.inputs = {
                "t": "dict",
                "items": {
                    "args": self.value(raw.get("args", []), "list"),
                    "kwargs": self.value(raw.get("kwargs", {}), "dict"),
                },
            }
        if node.get("outputs") is not None:
            record.outputs = self.value(node["outputs"])
        self.calls.append(record)
        children = node.get("children") or []
        if not isinstance(children, list):
            raise TraceFormatError(f"'children' of {node['module_path']!r} is not a list")
        for child in children:
            self.walk(child, record.index, depth + 1)

    def _path(self, module_path: str) -> str:
        name = module_path.removesuffix(" (top-level)")
        if name == self.root_name:
            return ""
        return name.removeprefix(self.root_name + ".")

    def value(self, raw: Any, expect: str | None = None) -> Node:
        if isinstance(raw, dict) and isinstance(raw.get("shape"), str) and isinstance(raw.get("dtype"), str):
            return self.tensor(raw)
        if isinstance(raw, dict):
            return {"t": "dict", "items": {str(k): self.value(v) for k, v in raw.items()}}
        if isinstance(raw, list):
            return {"t": "list", "items": [self.value(v) for v in raw]}
        if raw is None or raw == "None":
            return {"t": "none"}
        return {"t": "object", "repr": str(raw)[:200]}

    def tensor(self, raw: dict[str, Any]) -> Node:
        shape = [int(x) for x in _INTS.findall(raw["shape"])]
        node: Node = {
            "t": "tensor",
            "shape": shape,
            "dtype": raw["dtype"].removeprefix("torch."),
            "device": "",
        }
        stats = {name: _number(raw.get(name)) for name in _STATS}
        if all(v is not None for v in stats.values()):
            stats["absmax"] = max(abs(stats["min"]), abs(stats["max"]))  # type: ignore[arg-type]
            node["stats"] = stats
        value = raw.get("value")
        if isinstance(value, str):
            self._attach_file(node, value)
        elif value is not None:
            node["skipped"] = "the debugger stored a repr, not the tensor (use_repr=True)"
        return node

    def _attach_file(self, node: Node, value: str) -> None:
        file_name, _, key = value.removeprefix("./").partition("#")
        try:
            self.confine.resolve(file_name)
        except StorageError as error:
            raise TraceFormatError(str(error)) from error
        ref = f"f{len(self.files)}"
        self.files[ref] = (file_name, key or "data")
        node["ref"] = ref
        if not key:  # one file per module path: a later call of the same path rewrites it
            self.last_ref_of_file[file_name] = ref

    def mark_overwritten(self) -> None:
        """Refs to a file that a later call rewrote point at the wrong value: drop them."""
        stale = {
            ref
            for ref, (file_name, key) in self.files.items()
            if key == "data" and self.last_ref_of_file.get(file_name, ref) != ref
        }
        for call in self.calls:
            for side in ("inputs", "outputs"):
                for _, node in call.tensors(side):
                    if node.get("ref") in stale:
                        del node["ref"]
                        node["skipped"] = OVERWRITTEN
        self.files = {ref: loc for ref, loc in self.files.items() if ref not in stale}


def _number(text: object) -> float | None:
    if not isinstance(text, str):
        return None
    match = _NUMBER.search(text)
    if match is None:
        return None
    value = float(match.group(1))
    return value if not math.isnan(value) or "nan" in text.lower() else None


def _read_if_debugger(directory: Path) -> Trace | None:
    return read_debugger_trace(directory) if find_debugger_file(directory) is not None else None


OTHER_FORMATS.append(_read_if_debugger)
