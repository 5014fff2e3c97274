"""Trace every module call of a forward with PyTorch hooks: a call tree, stats, captures, streamed tensors.

The tracer never replaces ``forward`` and keeps no state on the model: it registers forward pre/post
hooks on entry and removes them on exit, also when the forward raises. Outputs are untouched, so a
traced forward is bit-identical to an untraced one.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import platform
import re
import shutil
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Any, cast

import torch
from torch import nn

from paritylab.tracing.capture import CaptureSpec, resolve_specs
from paritylab.tracing.initial import remember
from paritylab.tracing.journal import CALLS_JOURNAL, TENSORS_JOURNAL, Journal
from paritylab.tracing.stats import StatsBatch, supports_stats
from paritylab.tracing.storage import (
    DEFAULT_PENDING_BYTES,
    DEFAULT_SHARD_BYTES,
    MODIFIED_IN_PLACE,
    TensorStore,
    tensor_version,
)
from paritylab.tracing.tracefile import CallRecord, Trace
from paritylab.tracing.values import Node, encode, pick

__all__ = ["TraceOptions", "Tracer", "trace"]


@dataclass(frozen=True)
class TraceOptions:
    """What to record. Patterns are ``fnmatch`` globs on dotted module paths (``""`` is the root)."""

    include: Sequence[str] = ()
    exclude: Sequence[str] = ()
    max_depth: int | None = None
    inputs: bool = True
    outputs: bool = True
    save_tensors: bool = False
    max_bytes: int | None = None
    shard_bytes: int = DEFAULT_SHARD_BYTES
    pending_bytes: int | None = None
    """Bytes that may wait for a background writer thread; 0 writes each tensor before the forward goes on.
    ``None`` chooses: a background writer when the forward leaves the CPU cores idle (a model on an accelerator,
    or fewer compute threads than cores), else synchronous writes (with every core computing, a writer thread
    only competes: llava-bench on 2 cores took 1.69x a plain forward with it, 1.51x without)."""
    save_dtype: torch.dtype | None = None
    grad: bool = False
    capture: Iterable[CaptureSpec] | str | None = "auto"
    metadata: Mapping[str, Any] = field(default_factory=dict)
    on_call: Callable[[CallRecord], None] | None = None
    """Called after each recorded call completes (progress bars); keep it cheap."""
    private_inputs: bool = True
    """The model's own call gets a private copy of every tensor it is given (in plain tuples, lists and dicts),
    so a forward that changes an input in place cannot change what the caller, and the other side of a parity
    run, feeds next; such a change is recorded in the trace's ``meta["inputs_changed"]``."""
    fingerprint: bool = True
    """Record each module's parameter fingerprint (:mod:`.structure`), the evidence alignment trusts."""
    snapshot: frozenset[str] = frozenset()
    """Module paths whose outputs are copied as they are recorded, not written from the live tensor: code after the
    call changes them in place (fairseq's ``q *= scaling`` on its query projection's output), so a writer working
    beside the forward may find other values; :func:`trace_run` finds these paths and traces again."""

    def selects(self, path: str) -> bool:
        depth = 0 if not path else path.count(".") + 1
        if self.max_depth is not None and depth > self.max_depth:
            return False
        if self.include and not any(fnmatch.fnmatchcase(path, p) for p in self.include):
            return False
        return not any(fnmatch.fnmatchcase(path, p) for p in self.exclude)


@dataclass
class _Seen:
    """What was already recorded for one tensor object, so it is summarised and stored only once."""

    ref: weakref.ReferenceType[torch.Tensor]
    version: int | None
    stats: int | None
    stored: str | None
    skipped: str | None
    producer: int | None = None
    """The innermost call that returned this tensor (dataflow: inputs point back to it)."""
    changed: bool = False
    """Recorded after code changed it in place (no call returned it since): every input node of it says so."""


class Tracer:
    """Context manager that records a :class:`~paritylab.tracing.tracefile.Trace` of the forwards run inside it.

    >>> with Tracer(model, "trace-dir") as trace:
    ...     model(inputs)
    >>> trace.calls[0].key
    '#0'
    """

    def __init__(self, model: nn.Module, directory: str | Path | None = None, options: TraceOptions | None = None):
        self.compiled = is_compiled(model)
        self.fullgraph = self.compiled and bool(getattr(getattr(model, "dynamo_ctx", None), "fullgraph", False))
        """Compiled with ``fullgraph=True``, which forbids the graph break each traced module needs: traced
        eagerly instead (``torch.compiler.set_stance("force_eager")``); its one graph is checked by output."""
        self.model: nn.Module = cast(nn.Module, model._orig_mod) if self.compiled else model
        self.options = options or TraceOptions()
        self.directory = Path(directory) if directory is not None else None
        if self.options.save_tensors and self.directory is None:
            raise ValueError("save_tensors=True needs a directory to stream tensors to: pass directory=")
        self.trace = Trace(directory=self.directory)
        self._stack: list[tuple[CallRecord, BaseException | None, dict[int, int | None]]] = []
        self._counts: dict[str, int] = {}
        self._stats = StatsBatch()
        self._stats_targets: list[tuple[Node, int]] = []
        self._seen: dict[int, _Seen] = {}
        self._stored = 0
        self._store: TensorStore | None = None
        self._exit = ExitStack()
        self._captures: dict[str, list[CaptureSpec]] = {}
        self._raised_at: str | None = None
        self._hook_error: str | None = None
        self._selected: list[str] = []
        self._inplace: set[str] = set()
        self._started = 0.0
        self._side = "inputs"
        self._out_seen: list[_Seen] = []
        self._structure: list[dict[str, Any]] | None = None
        self._journal: Journal | None = None
        self._buffers: dict[str, tuple[torch.Tensor, int | None]] = {}
        """Every buffer's version before the forward: one changed in place during it is recorded."""
        self._private: list[tuple[str, torch.Tensor, torch.Tensor, int | None]] = []
        """The root call's inputs: (slot, the caller's tensor, the private copy, the copy's version)."""
        self._inputs_changed: list[str] = []
        self._copying = False
        """The outputs being recorded are a :attr:`TraceOptions.snapshot` path's: stored as copies."""
        self.changed_outputs: set[str] = set()
        """Paths of calls whose output code changed in place after they returned (seen when the changed tensor
        was handed on): whether or not the writer stored the value first, a second trace copies them."""

    # -- context management ------------------------------------------------------------------------------

    def __enter__(self) -> Trace:
        self._started = time.perf_counter()
        remember(self.model)  # before its first traced run: what a forward caches is not the model
        specs = resolve_specs(self.model, self.options.capture)
        if self.options.fingerprint:
            from paritylab.tracing.structure import fingerprint_json

            self._structure = fingerprint_json(self.model)
        if self.directory is not None:
            self._store = TensorStore(
                self.directory,
                max_bytes=self.options.max_bytes,
                shard_bytes=self.options.shard_bytes,
                pending_bytes=_pending_bytes(self.options.pending_bytes, self.model),
                save_dtype=self.options.save_dtype,
                metadata=self._provenance(),
                journal=True,
            )
            self._journal = Journal(self.directory / CALLS_JOURNAL, {"meta": self._provenance()}, reserve_end=True)
        self._buffers = {name: (buffer, tensor_version(buffer)) for name, buffer in self.model.named_buffers()}
        try:
            self._register(specs)
        except BaseException:
            self._exit.close()
            raise
        if not self.options.grad:
            self._exit.enter_context(torch.no_grad())
        if self.fullgraph:
            self._exit.enter_context(torch.compiler.set_stance("force_eager"))
        return self.trace

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._exit.close()  # hooks first: nothing below runs inside the model
        self._finish(error)

    def _register(self, specs: list[CaptureSpec]) -> None:
        handles: list[Any] = []
        self._exit.callback(_remove_all, handles)
        options = self.options
        every = not (options.include or options.exclude or options.max_depth is not None)
        for path, module in self.model.named_modules():
            if isinstance(module, _CONTAINERS) or not (every or options.selects(path)):
                continue
            self._selected.append(path)
            if _inplace(module):  # ReLU(inplace=True) and the like
                self._inplace.add(path)
            matching = [spec for spec in specs if spec.matches(path, module)]
            if matching:
                self._captures[path] = matching
            pre_hook, post_hook = self._pre_hook(path), self._post_hook(path)
            if self.compiled and not self.fullgraph:  # graph-break at each traced module, not compile the tracer
                pre_hook, post_hook = torch.compiler.disable(pre_hook), torch.compiler.disable(post_hook)
            handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
            handles.append(module.register_forward_hook(post_hook, with_kwargs=True, always_call=True))

    # -- hooks (the hot path) ----------------------------------------------------------------------------

    def _pre_hook(self, path: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            replaced = None
            try:
                if not self._stack and self.options.private_inputs:
                    replaced = self._privatise(args, kwargs)
                    if replaced is not None:
                        args, kwargs = replaced
                self._open_call(path, module, args, kwargs)
            except Exception as error:  # a tracer bug must not break the user's forward
                self._note_hook_error(path, error)
            return replaced

        return hook

    def _privatise(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any] | None:
        """The root call's arguments with every tensor copied (see :attr:`TraceOptions.private_inputs`)."""
        self._private = []
        copied = _copied(args, "inputs.args", self._private), _copied(kwargs, "inputs.kwargs", self._private)
        return copied if self._private else None

    def _check_private(self) -> None:
        """Record the root call's inputs that its forward changed in place (by value, not by version alone)."""
        for slot, original, copy, version in self._private:
            if tensor_version(copy) != version and not _same_values(original, copy):
                self._inputs_changed.append(slot)
        self._private = []

    def _post_hook(self, path: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            try:
                self._close_call(path, output, args, kwargs)
            except Exception as error:
                self._note_hook_error(path, error)

        return hook

    def _open_call(self, path: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        call_index = self._counts.get(path, 0)
        self._counts[path] = call_index + 1
        parent = self._stack[-1][0].index if self._stack else None
        record = CallRecord(
            index=len(self.trace.calls),
            path=path,
            call_index=call_index,
            cls=type(module).__name__,
            parent=parent,
            depth=len(self._stack),
        )
        if self.options.inputs:
            self._side = "inputs"
            on_tensor = self._encode_tensor  # {"args": ..., "kwargs": ...} as encode() writes a plain dict
            items = {"args": encode(args, on_tensor), "kwargs": encode(kwargs, on_tensor)}
            record.inputs = {"t": "dict", "items": items}
        versions = {}
        store = self._store if path in self._inplace else None  # it changes its input in place: snapshot pending
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                versions[id(value)] = tensor_version(value)
                if store is not None:
                    store.protect(value)
        self.trace.calls.append(record)
        if self._journal is not None:  # the call is open: a kill -9 from here on still leaves it in the tree
            self._journal.add({"index": record.index, "path": path, "call_index": call_index, "cls": record.cls,
                               "parent": parent, "depth": record.depth})  # fmt: skip
        self._stack.append((record, sys.exc_info()[1], versions))

    def _close_call(self, path: str, output: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self._stack or self._stack[-1][0].path != path:
            return  # unbalanced (a hook of ours failed on entry); nothing to close
        record, ambient, versions = self._stack.pop()
        if not self._stack and self._private:
            self._check_private()
        raised = sys.exc_info()[1]
        if raised is not None and raised is not ambient:
            record.error = f"{type(raised).__name__}: {raised}"
            if self._raised_at is None:
                self._raised_at = record.key
            if self._journal is not None:
                self._journal.add(record.to_json())
            return
        record.identity = _returns_its_input(output, args, kwargs, versions)
        if self.options.outputs:
            self._side = "outputs"
            self._out_seen.clear()
            self._copying = path in self.options.snapshot
            record.outputs = encode(output, self._encode_tensor)
            self._copying = False
            if not record.identity:
                for seen in self._out_seen:
                    if seen.producer is None:
                        seen.producer = record.index
        for spec in self._captures.get(path, ()):
            self._capture(spec, record, output)
        if self._journal is not None:
            self._journal.add(record.to_json())
        if self.options.on_call is not None:
            self.options.on_call(record)

    def _encode_tensor(self, tensor: torch.Tensor) -> Node:
        node: Node = {
            "t": "tensor",
            "shape": list(tensor.shape),
            "dtype": _dtype_name(tensor.dtype),
            "device": _device_name(tensor.device),
        }
        seen = self._seen.get(id(tensor))
        if seen is not None and seen.ref() is not tensor:
            seen = None  # another tensor that had this one's id
        if seen is None or seen.version != tensor_version(tensor):
            moved = seen is not None  # recorded before, and its version has moved since: changed in place
            if moved:
                self._note_changed_output(tensor)
            changed = self._side == "inputs" and moved
            seen = self._record_tensor(tensor)
            seen.changed = changed  # seen before with other values: code that ran since changed it in place
        if seen.changed and self._side == "inputs" and seen.producer is None:
            node["changed"] = True
        if self._side == "outputs":
            self._out_seen.append(seen)
            if seen.producer is not None:  # returned as an inner call produced it
                node["from"] = seen.producer
        elif seen.producer is not None:
            node["from"] = seen.producer
        if seen.stats is not None:
            self._stats_targets.append((node, seen.stats))
        if seen.stored is not None:
            node["ref"] = seen.stored
        elif seen.skipped is not None:
            node["skipped"] = seen.skipped
        return node

    def _lookup(self, tensor: torch.Tensor) -> _Seen | None:
        seen = self._seen.get(id(tensor))
        if seen is None or seen.ref() is not tensor or seen.version != tensor_version(tensor):
            return None
        return seen

    def _note_changed_output(self, tensor: torch.Tensor) -> None:
        """``tensor``, recorded as a call's output, was changed in place since: that call's path joins
        :attr:`changed_outputs`."""
        producer = self._seen[id(tensor)].producer
        if producer is not None:
            self.changed_outputs.add(self.trace.calls[producer].path)

    def _record_tensor(self, tensor: torch.Tensor, save: bool | None = None) -> _Seen:
        stats = self._stats.add(tensor) if supports_stats(tensor) else None
        stored = skipped = None
        if self._store is not None and (self.options.save_tensors if save is None else save):
            stored, skipped = self._store.put(tensor, f"t{self._stored}", copy=self._copying)
            self._stored += 1
        seen = _Seen(weakref.ref(tensor), tensor_version(tensor), stats, stored, skipped)
        if seen.version is not None:  # inference tensors have no version counter: never assume them unchanged
            self._seen[id(tensor)] = seen
        return seen

    def _capture(self, spec: CaptureSpec, record: CallRecord, output: Any) -> None:
        value = pick(output, spec.index)
        if not isinstance(value, torch.Tensor):
            return
        self.trace.live.setdefault(spec.name, []).append(value.detach())
        entry = {"call": record.key, "slot": _slot(output, spec.index)}
        seen = self._lookup(value)
        if seen is None or (seen.stored is None and seen.skipped is None):
            seen = self._record_tensor(value, save=True)
        if seen.stored is not None:
            entry["ref"] = seen.stored
        self.trace.captures.setdefault(spec.name, []).append(entry)

    def _note_hook_error(self, path: str, error: Exception) -> None:
        if self._hook_error is None:
            self._hook_error = f"{path or '<root>'}: {type(error).__name__}: {error}"

    # -- finishing -----------------------------------------------------------------------------------------

    def _finish(self, error: BaseException | None) -> None:
        for call, _, _ in self._stack:  # calls still open when the forward was interrupted
            call.error = call.error or "interrupted"
        self._stack.clear()
        for (node, _), stats in zip(self._stats_targets, self._resolve_stats(), strict=True):
            node["stats"] = stats
        self._stats_targets.clear()
        self._seen.clear()
        if self._store is not None:
            self._store.close()
            self.trace.files = {ref: (name, ref) for ref, name in self._store.files.items()}
            self._mark_unsaved()
        self.trace.meta = self._meta(error)
        if self._hook_error is not None:
            warnings.warn(f"paritylab: tracing hook failed at {self._hook_error}", RuntimeWarning, stacklevel=3)
        if self.directory is not None:
            try:
                self.trace.save(self.directory)
            except OSError as failed:  # a full disk: the journals stay, and say why the trace is unfinished
                if self._journal is not None:
                    self._journal.end(f"{type(failed).__name__}: {failed.strerror or failed}")
                raise
            from paritylab.tracing.debugger_format import write_debugger_files

            write_debugger_files(self.trace, self.directory)
            if self._journal is not None:  # trace.json is written: the journals are no longer needed
                self._journal.close(remove=True)
                (self.directory / TENSORS_JOURNAL).unlink(missing_ok=True)

    def _resolve_stats(self) -> list[dict[str, float | None]]:
        resolved = self._stats.resolve()
        return [resolved[index] for _, index in self._stats_targets]

    def _mark_unsaved(self) -> None:
        """Tensors whose shard could not be finished lose their ref and say why."""
        store = self._store
        assert store is not None
        for call in self.trace.calls:
            for side in ("inputs", "outputs"):
                for _, node in call.tensors(side):
                    if "ref" in node and node["ref"] not in self.trace.files:
                        node["skipped"] = store.skipped.get(node.pop("ref")) or store.failure or "not written"
        for entries in self.trace.captures.values():
            for entry in entries:
                if entry.get("ref") not in self.trace.files:
                    entry.pop("ref", None)

    def _provenance(self) -> dict[str, str]:
        provenance = {
            "producer": "paritylab",
            "torch_version": torch.__version__,
            "model_class": type(self.model).__name__,
            "device": _model_device(self.model),
            "seed": str(torch.initial_seed()),
        }
        if self.options.save_dtype is not None:
            provenance["saved_dtype"] = _dtype_name(self.options.save_dtype)
        provenance.update({str(k): str(v) for k, v in self.options.metadata.items()})
        return provenance

    def _meta(self, error: BaseException | None) -> dict[str, Any]:
        store = self._store
        called = set(self._counts)
        meta: dict[str, Any] = {
            **self._provenance(),
            "python_version": platform.python_version(),
            "status": "complete" if error is None else "error",
            "seconds": round(time.perf_counter() - self._started, 6),
            "calls": len(self.trace.calls),
            "modules_selected": len(self._selected),
            "compiled": self.compiled,
            "traced_eagerly": self.fullgraph,
            "modules_not_called": [p for p in self._selected if p not in called],
            "options": {
                "include": list(self.options.include),
                "exclude": list(self.options.exclude),
                "max_depth": self.options.max_depth,
                "inputs": self.options.inputs,
                "outputs": self.options.outputs,
                "save_tensors": self.options.save_tensors,
                "max_bytes": self.options.max_bytes,
            },
            "storage": {
                "bytes": store.bytes_written if store else 0,
                "files": sorted(set(store.files.values())) if store else [],
                "failure": store.failure if store else None,
                "skipped": self._count_skipped(),
            },
        }
        if error is not None:
            meta["error"] = {
                "type": type(error).__name__,
                "message": str(error)[:2000],
                "module": self._raised_at.rsplit("#", 1)[0] if self._raised_at else None,
                "call": self._raised_at,
            }
        if self._hook_error is not None:
            meta["hook_error"] = self._hook_error
        if self._inputs_changed:
            meta["inputs_changed"] = sorted(set(self._inputs_changed))
        changed = [name for name, (buffer, version) in self._buffers.items() if tensor_version(buffer) != version]
        if changed:  # state the forward leaves behind (running statistics, a cache): later forwards see it
            meta["buffers_changed"] = changed
        self._buffers = {}
        if self._structure is not None:
            meta["structure"] = self._structure
        return meta

    def _count_skipped(self) -> int:
        if self._store is None:
            return 0  # only a store skips a tensor (a budget, a dtype, a failed write)
        return sum(
            1
            for call in self.trace.calls
            for side in ("inputs", "outputs")
            for _, n in call.tensors(side)
            if "skipped" in n
        )


def trace(
    model: nn.Module,
    directory: str | Path | None = None,
    **options: Any,
) -> Tracer:
    """Trace the forwards of ``model`` run inside the ``with`` block; see :class:`TraceOptions`.

    ``directory`` receives ``trace.json``, the transformers-compatible call tree and, with
    ``save_tensors=True``, the tensor shards, even when the forward raises.
    """
    return Tracer(model, directory, TraceOptions(**options))


def trace_run(
    model: nn.Module, run: Callable[[nn.Module], Any], directory: Path | None, options: TraceOptions
) -> Tracer:
    """Trace ``run(model)`` into ``directory`` and return the finished tracer. Where code after a call changed that
    call's output in place while a background writer may still have been storing it (the value is then lost, or,
    when the write ran beside the in-place kernel, kept half changed: which, depends on how fast the writer was),
    ``run`` is traced once more into a fresh ``directory`` with those modules' outputs copied as they are recorded
    (:attr:`TraceOptions.snapshot`): no value is lost or torn by the race, whichever way it goes. Synchronous writes
    (``pending_bytes=0``) store each output before the forward goes on, so they need no second trace. A forward that
    raises propagates at once."""
    for attempt in range(RETRACES + 1):
        tracer = Tracer(model, directory, options)
        with tracer:
            run(model)
        lost = lost_in_place(tracer.trace)
        # A change in place that a background writer raced: its version counter moves only when the in-place kernel
        # is done, so a write that ran beside the kernel can pass both of its checks and keep half-changed bytes
        raced = (
            tracer.changed_outputs - options.snapshot if options.save_tensors and _background(options, model) else set()
        )
        if not (lost or raced) or directory is None or attempt == RETRACES:
            return tracer
        shutil.rmtree(directory, ignore_errors=True)  # this function's own output of a moment ago, redone whole
        # every output seen changed, and every module of a lost one's kind in other blocks (the same path but for
        # its numbers): whether the writer lost them this time, the race may go the other way next
        alike = _alike(tracer.trace, lost | tracer.changed_outputs)
        options = replace(options, snapshot=options.snapshot | lost | tracer.changed_outputs | alike)
    return tracer


RETRACES = 2
"""Traces again at most this many times when outputs changed in place were lost (each copies more of them)."""


def _alike(trace: Trace, paths: Collection[str]) -> frozenset[str]:
    """The traced paths equal to one of ``paths`` but for their numbers (the same module in other blocks)."""
    patterns = {re.sub(r"\d+", "#", path) for path in paths}
    return frozenset(call.path for call in trace.calls if re.sub(r"\d+", "#", call.path) in patterns)


def lost_in_place(trace: Trace) -> frozenset[str]:
    """Paths of the calls whose output values were lost to a change in place before they were written."""
    return frozenset(
        call.path
        for call in trace.calls
        for _, node in call.tensors("outputs")
        if str(node.get("skipped", "")).startswith(MODIFIED_IN_PLACE)
    )


def _remove_all(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.cache
def _device_name(device: torch.device) -> str:
    return str(device)


def _slot(output: Any, index: int | str | None) -> str:
    if index is None or isinstance(output, torch.Tensor):
        return "outputs"
    if isinstance(output, Mapping) and isinstance(index, int):
        return f"outputs.{list(output.keys())[index]}"
    return f"outputs.{index}"


def _returns_its_input(
    output: Any, args: tuple[Any, ...], kwargs: dict[str, Any], versions: dict[int, int | None]
) -> bool:
    """Whether the call's primary output is one of its input tensors, unchanged (same version counter as when
    the call began: ``ReLU(inplace=True)`` returns its input modified), or a same-shape view of one."""
    if isinstance(output, tuple | list) and output:
        output = output[0]
    if not isinstance(output, torch.Tensor):
        return False
    for value in (*args, *kwargs.values()):
        if not isinstance(value, torch.Tensor):
            continue
        before = versions.get(id(value))
        if before is None or tensor_version(value) != before:
            continue  # changed in place (or no version counter to prove it was not)
        if value is output:
            return True
        if (
            isinstance(value, torch.Tensor)
            and value.numel() > 0
            and value.data_ptr() == output.data_ptr()
            and value.data_ptr() != 0  # wrapper tensors (DTensor, async collectives) all report address 0
            and value.shape == output.shape
            and value.stride() == output.stride()
            and value.dtype == output.dtype
        ):
            return True
    return False


def _inplace(module: nn.Module) -> bool:
    """Whether ``module`` says it changes its input in place (``inplace=True``), read from its own attributes first:
    ``getattr`` on a module without one goes through ``nn.Module.__getattr__``, which raises and catches."""
    held = vars(module).get("inplace", _NOTHING)
    if held is _NOTHING:
        if not hasattr(type(module), "inplace"):
            return False
        held = getattr(module, "inplace", False)
    return held is True


_NOTHING = object()

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
"""Holders of modules that are never called themselves: not hooked, never reported as missing."""


def _background(options: TraceOptions, model: nn.Module) -> bool:
    """Whether a trace with ``options`` writes its tensors from a background thread (see ``pending_bytes``)."""
    return _pending_bytes(options.pending_bytes, model) > 0


def _pending_bytes(chosen: int | None, model: nn.Module) -> int:
    """``TraceOptions.pending_bytes``, or when ``None`` the choice it describes."""
    if chosen is not None:
        return chosen
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    on_cpu = _model_device(model) == "cpu"
    return DEFAULT_PENDING_BYTES if not on_cpu or torch.get_num_threads() < cores else 0


def _copied(value: Any, slot: str, copies: list[tuple[str, torch.Tensor, torch.Tensor, int | None]]) -> Any:
    """``value`` with each tensor in it (through plain tuples, lists and dicts) replaced by a copy, noted in
    ``copies`` under its slot."""
    if isinstance(value, torch.Tensor):
        copy = value.detach().clone() if not value.requires_grad else value.clone()
        copies.append((slot, value, copy, tensor_version(copy)))
        return copy
    if type(value) in (tuple, list):
        return type(value)(_copied(item, f"{slot}.{index}", copies) for index, item in enumerate(value))
    if type(value) is dict:
        return {key: _copied(item, f"{slot}.{key}", copies) for key, item in value.items()}
    return value


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b.to(a.device)))
    except RuntimeError:  # a tensor subclass without equal
        return False


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` is the wrapper ``torch.compile`` returns (its module lives in ``_orig_mod``)."""
    return isinstance(getattr(model, "_orig_mod", None), nn.Module) and type(model).__name__ == "OptimizedModule"


def _model_device(model: nn.Module) -> str:
    parameter = next(model.parameters(), None)
    return str(parameter.device) if parameter is not None else "cpu"
