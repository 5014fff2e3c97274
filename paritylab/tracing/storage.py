"""Streamed, sharded safetensors storage of traced tensors, and a confined lazy reader.

Each shard is written in one pass: the header space is reserved up front, tensor bytes are appended as
they arrive (so memory does not grow with the trace), and on close the header is written into the
reserved space, padded with spaces as the safetensors format allows. A shard is only renamed to its
final ``.safetensors`` name once its header is complete, so no half-written file carries that name.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import mmap
import os
import struct
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from paritylab.tracing.journal import TENSORS_JOURNAL, Journal

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}

HEADER_CAPACITY = 256 * 1024
"""Bytes reserved for each shard's JSON header; a shard rolls over before its header would exceed it."""

DEFAULT_SHARD_BYTES = 1 << 30
DEFAULT_PENDING_BYTES = 32 << 20


class StorageError(ValueError):
    """A trace's tensor files are missing, malformed or point outside the trace directory."""


@dataclass
class _Shard:
    path: Path
    handle: Any
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    size: int = 0
    header_estimate: int = 2
    allocated: int = 0
    """Bytes reserved on disk ahead of the data (``posix_fallocate``): writes then skip block allocation."""


@dataclass
class _Pending:
    """A tensor waiting to be written: ``data`` is only read on the writer thread."""

    name: str
    data: torch.Tensor
    version: int | None
    """Version counter at hand-off when ``data`` shares memory with the model's tensor, else ``None``."""
    ready: Any = None
    """A CUDA event the device-to-host copy into ``data`` completes at, or ``None``."""

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


MODIFIED_IN_PLACE = "modified in place"
"""How the reason a tensor was not stored starts when code changed it in place before the writer finished it (the
writer works beside the forward): :func:`paritylab.tracing.tracer.trace_run` traces again, copying such outputs."""


class TensorStore:
    """Writes tensors to size-bounded safetensors shards in ``directory`` as they are produced.

    ``put`` decides at once whether a tensor is stored (budget, dtype) and hands it to a writer thread,
    so file I/O overlaps the forward. At most ``pending_bytes`` wait to be written at any time (``put``
    blocks past that), which bounds the extra memory; ``pending_bytes=0`` writes synchronously.
    A tensor modified in place before it reached disk is not stored (its bytes would be wrong) and is
    listed in :attr:`skipped`. I/O errors never raise: saving stops, whole tensors already written stay
    readable, and :attr:`failure` says why.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_bytes: int | None = None,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        save_dtype: torch.dtype | None = None,
        metadata: Mapping[str, str] | None = None,
        prefix: str = "tensors",
        pending_bytes: int = DEFAULT_PENDING_BYTES,
        journal: bool = False,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.journal: Journal | None = None
        """``journal=True``: every tensor written is also listed in ``tensors.journal.jsonl`` (see :mod:`.journal`)."""
        self.max_bytes = max_bytes
        self.save_dtype = save_dtype
        self.bytes_accepted = 0
        self.files: dict[str, str] = {}
        """Reference name -> shard file name, for every tensor whose bytes are on disk."""
        self.skipped: dict[str, str] = {}
        """Reference name -> why a tensor accepted by ``put`` did not reach disk."""
        header_metadata = {str(k): str(v) for k, v in (metadata or {}).items()}
        if journal:
            self.journal = Journal(self.directory / TENSORS_JOURNAL, {"metadata": header_metadata})
        self._writer = _ShardWriter(self, shard_bytes, header_metadata, prefix)
        self._pending_limit = pending_bytes
        self._pending_size = 0
        self._condition = threading.Condition()
        self._queue: deque[_Pending | None] = deque()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def failure(self) -> str | None:
        """Why saving stopped (a disk error), or ``None``."""
        return self._writer.failure

    @property
    def bytes_written(self) -> int:
        return self._writer.bytes_written

    def put(self, tensor: torch.Tensor, name: str, *, copy: bool = False) -> tuple[str | None, str | None]:
        """Accept ``tensor`` for storage under ``name``: ``(name, None)``, or ``(None, reason)``. ``copy``: what is
        written is a copy taken now (code will change ``tensor`` in place before the writer reaches it)."""
        if self.failure is not None:
            return None, self.failure
        pending = self._prepare(tensor, name, copy)
        if isinstance(pending, str):
            return None, pending
        if self.max_bytes is not None and self.bytes_accepted + pending.nbytes > self.max_bytes:
            return None, f"byte budget of {self.max_bytes} exhausted"
        self.bytes_accepted += pending.nbytes
        if self._pending_limit <= 0:
            self._writer.write(pending)
        else:
            self._enqueue(pending)
        return name, None

    def _prepare(self, tensor: torch.Tensor, name: str, copy: bool = False) -> _Pending | str:
        data = tensor.detach()
        if data.layout != torch.strided or data.is_meta:
            return f"{data.layout} tensors are not stored"
        if self.save_dtype is not None and data.is_floating_point():
            data = data.to(self.save_dtype)
        if data.dtype not in SAFETENSORS_DTYPES:
            return f"dtype {data.dtype} cannot be stored in safetensors"
        if data.device.type != "cpu":
            return _device_to_host(data, name)
        data = data.contiguous()
        if data.data_ptr() != tensor.data_ptr() or self._pending_limit <= 0:
            return _Pending(name, data, None)  # a private copy, or written before put returns
        version = tensor_version(data)
        if version is None or copy:  # no version counter to detect a later in-place change, or one is known: copy
            return _Pending(name, data.clone(), None)
        return _Pending(name, data, version)

    def protect(self, tensor: torch.Tensor) -> None:
        """Snapshot ``tensor`` if it still waits to be written: the caller is about to change it in place."""
        if self._thread is None:
            return
        with self._condition:
            for pending in self._queue:
                if pending is not None and pending.version is not None and pending.data.data_ptr() == tensor.data_ptr():
                    pending.data = pending.data.clone()
                    pending.version = None

    def _enqueue(self, pending: _Pending) -> None:
        with self._condition:
            while self._pending_size > 0 and self._pending_size + pending.nbytes > self._pending_limit:
                self._condition.wait()
            self._queue.append(pending)
            self._pending_size += pending.nbytes
            if self._thread is None:
                self._thread = threading.Thread(target=self._drain, name="paritylab-writer", daemon=True)
                self._thread.start()
            self._condition.notify_all()

    def _drain(self) -> None:
        _lower_priority()
        while True:
            with self._condition:
                while not self._queue:
                    self._condition.wait()
                pending = self._queue.popleft()
            if pending is None:
                return
            try:
                self._writer.write(pending)
            except Exception as error:  # never leave put() waiting on a dead thread
                self._writer.failure = self._writer.failure or f"writer error: {type(error).__name__}: {error}"
                self.skipped[pending.name] = self._writer.failure
            with self._condition:
                self._pending_size -= pending.nbytes
                self._condition.notify_all()

    def close(self) -> None:
        """Wait for pending writes and finish the open shard. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            with self._condition:
                self._queue.append(None)
                self._condition.notify_all()
            self._thread.join()
        self._writer.close()
        if self.journal is not None:
            self.journal.close()  # kept until the trace that owns it is saved (see :mod:`.journal`)


class _ShardWriter:
    """Appends tensors to the current shard; only one thread at a time calls it."""

    def __init__(self, store: TensorStore, shard_bytes: int, metadata: dict[str, str], prefix: str) -> None:
        self.store = store
        self.shard_bytes = shard_bytes
        self.metadata = metadata
        self.prefix = prefix
        self.failure: str | None = None
        self.bytes_written = 0
        self._shard: _Shard | None = None
        self._count = 0
        self._metadata_bytes = len(json.dumps({"__metadata__": metadata}))

    def write(self, pending: _Pending) -> None:
        name, data = pending.name, pending.data
        if self.failure is not None:
            self.store.skipped[name] = self.failure
            return
        if pending.ready is not None:
            pending.ready.synchronize()
        nbytes = pending.nbytes
        entry: dict[str, Any] = {"dtype": SAFETENSORS_DTYPES[data.dtype], "shape": list(data.shape)}
        try:
            shard = self._shard_for(name, entry, nbytes)
            if pending.version is not None and tensor_version(data) != pending.version:
                self.store.skipped[name] = f"{MODIFIED_IN_PLACE} before it was written"
                return
            if nbytes:
                _reserve(shard, nbytes)
                _write_all(shard.handle, data.reshape(-1).view(torch.uint8).numpy().data)
        except OSError as error:
            self._fail(f"disk error: {error.strerror or error}")
            self.store.skipped[name] = self.failure or "disk error"
            return
        if pending.version is not None and tensor_version(data) != pending.version:
            self._discard_last(shard)
            self.store.skipped[name] = f"{MODIFIED_IN_PLACE} while it was written"
            return
        entry["data_offsets"] = [shard.size, shard.size + nbytes]
        shard.entries[name] = entry
        if self.store.journal is not None:
            self.store.journal.add({"file": shard.path.name, "name": name, **entry})
        shard.size += nbytes
        self.bytes_written += nbytes
        self.store.files[name] = shard.path.name

    def _discard_last(self, shard: _Shard) -> None:
        try:
            shard.handle.seek(8 + HEADER_CAPACITY + shard.size)
            shard.handle.truncate()
        except OSError as error:
            self._fail(f"disk error: {error.strerror or error}")

    def _shard_for(self, name: str, entry: dict[str, Any], nbytes: int) -> _Shard:
        entry_bytes = len(json.dumps({name: {**entry, "data_offsets": [2**62, 2**62]}}))
        shard = self._shard
        full = shard is not None and shard.size > 0 and shard.size + nbytes > self.shard_bytes
        if shard is not None and shard.header_estimate + entry_bytes + self._metadata_bytes > HEADER_CAPACITY:
            full = True
        if shard is None or full:
            self._close_shard()
            shard = self._open_shard()
        shard.header_estimate += entry_bytes
        return shard

    def _open_shard(self) -> _Shard:
        final = self.store.directory / f"{self.prefix}-{self._count:05d}.safetensors"
        self._count += 1
        partial = final.with_name(final.name + ".partial")
        handle = open(partial, "wb", buffering=0)  # noqa: SIM115 - closed in _close_shard
        try:
            _write_all(handle, memoryview(b" " * (8 + HEADER_CAPACITY)))
        except OSError:
            handle.close()
            partial.unlink(missing_ok=True)
            raise
        self._shard = _Shard(path=final, handle=handle)
        return self._shard

    def _close_shard(self) -> None:
        shard, self._shard = self._shard, None
        if shard is None:
            return
        partial = shard.path.with_name(shard.path.name + ".partial")
        try:
            if not shard.entries:
                shard.handle.close()
                partial.unlink(missing_ok=True)
                return
            finish_shard(shard.handle, self.metadata, shard.entries, shard.size)
            shard.handle.close()
            os.replace(partial, shard.path)
        except OSError as error:
            shard.handle.close()
            partial.unlink(missing_ok=True)
            self.failure = self.failure or f"disk error: {error.strerror or error}"
            for name in shard.entries:
                self.store.files.pop(name, None)
                self.store.skipped[name] = self.failure

    def _fail(self, reason: str) -> None:
        """Stop saving: keep what was fully written (the shard is cut back to its last whole tensor)."""
        self.failure = reason
        self._close_shard()

    def close(self) -> None:
        self._close_shard()


PREALLOCATE = 64 << 20


def finish_shard(handle: Any, metadata: Mapping[str, str], entries: Mapping[str, Any], size: int) -> None:
    """Cut a shard's file to its header space plus ``size`` data bytes and write the header into that space
    (padded with spaces, as the safetensors format allows)."""
    header = json.dumps({"__metadata__": dict(metadata), **entries}, separators=(",", ":")).encode()
    if len(header) > HEADER_CAPACITY:
        raise OSError(errno.EOVERFLOW, "shard header larger than its reserved space")
    handle.truncate(8 + HEADER_CAPACITY + size)
    handle.seek(0)
    _write_all(handle, memoryview(struct.pack("<Q", HEADER_CAPACITY) + header.ljust(HEADER_CAPACITY)))


def _reserve(shard: _Shard, nbytes: int) -> None:
    """Reserve disk space ahead of the write position, 64 MiB at a time; when that much is not free, only
    what this tensor needs (a nearly full disk still stores what fits; a full one fails here, early)."""
    end = 8 + HEADER_CAPACITY + shard.size + nbytes
    if end <= shard.allocated or not hasattr(os, "posix_fallocate"):
        return
    for step in (max(PREALLOCATE, nbytes), 0):
        try:
            os.posix_fallocate(shard.handle.fileno(), shard.allocated, end - shard.allocated + step)
        except OSError as error:
            if error.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):  # filesystem without it
                shard.allocated = 1 << 62
                return
            if error.errno != errno.ENOSPC or step == 0:
                raise
            continue
        shard.allocated = end + step
        return


def _lower_priority() -> None:
    """Run the writer thread at the lowest CPU priority: it fills the forward's idle gaps instead of
    competing with the compute threads (the bounded queue makes it catch up when it must)."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not permitted: normal priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def tensor_version(tensor: torch.Tensor) -> int | None:
    """The tensor's in-place version counter, or ``None`` for inference tensors, which have none."""
    try:
        return tensor._version
    except RuntimeError:  # inference-mode tensors have no version counter
        return None


def _device_to_host(data: torch.Tensor, name: str) -> _Pending:
    """Start an asynchronous copy into pinned host memory; the writer waits on its event."""
    host = torch.empty(data.shape, dtype=data.dtype, device="cpu", pin_memory=torch.cuda.is_available())
    host.copy_(data, non_blocking=data.device.type == "cuda")
    ready = None
    if data.device.type == "cuda":
        ready = torch.cuda.Event()
        ready.record()
    return _Pending(name, host, None, ready)


def _write_all(handle: Any, data: memoryview) -> None:
    """Write every byte of ``data`` to an unbuffered file (raw writes may be short)."""
    while data:
        written = handle.write(data)
        if not written:
            raise OSError(28, "no space left on device")
        data = data[written:]


MAX_HEADER = 100 * 1024 * 1024
TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


class TensorReader:
    """Reads tensors named by ``(file, key)`` pairs from safetensors files confined to one directory.

    Files are memory-mapped and every header field is validated before use (length, dtypes, shapes,
    offsets inside the file and consistent with the shape), so a hostile or truncated file gives a
    :class:`StorageError`, never a read outside the file or an allocation its header dictates.
    Tensors are zero-copy views of the mapping (copy-on-write: the file is never modified).
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory).resolve()
        self._files: dict[str, _MappedFile] = {}

    def resolve(self, file_name: str) -> Path:
        """The path of ``file_name`` inside the directory; raises if it would leave it."""
        path = (self.directory / file_name).resolve()
        if not path.is_relative_to(self.directory):
            raise StorageError(f"tensor file {file_name!r} points outside the trace directory {self.directory}")
        if not path.is_file():
            raise StorageError(f"tensor file {file_name!r} is missing from {self.directory}")
        return path

    def load(self, file_name: str, key: str) -> torch.Tensor:
        """Tensor ``key`` of ``file_name``."""
        return self._file(file_name).tensor(key)

    def metadata(self, file_name: str) -> dict[str, str]:
        """The ``__metadata__`` of a tensor file."""
        return dict(self._file(file_name).metadata)

    def _file(self, file_name: str) -> _MappedFile:
        found = self._files.get(file_name)
        if found is None:
            found = self._files[file_name] = _MappedFile(self.resolve(file_name), file_name)
        return found


class _MappedFile:
    def __init__(self, path: Path, name: str) -> None:
        self.name = name
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise StorageError(f"{name!r} is truncated: no safetensors header")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER or 8 + length > size:
                raise StorageError(f"{name!r} has a header of {length} bytes, beyond the file or the limit")
            try:
                header = json.loads(handle.read(length))
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise StorageError(f"{name!r} has a malformed safetensors header: {error}") from error
            if not isinstance(header, dict):
                raise StorageError(f"{name!r} has a malformed safetensors header (not an object)")
            self.start = 8 + length
            self.data_size = size - self.start
            metadata = header.pop("__metadata__", None) or {}
            self.metadata = {str(k): str(v) for k, v in metadata.items()} if isinstance(metadata, dict) else {}
            self.entries = header
            self.map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY) if size else None

    def tensor(self, key: str) -> torch.Tensor:
        dtype, shape, begin, end = self._entry(key)
        count = math.prod(shape)
        if count == 0 or self.map is None:
            return torch.empty(shape, dtype=dtype)
        offset = self.start + begin
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if offset % itemsize:  # unaligned after an odd-sized tensor: copy rather than view
            return torch.frombuffer(bytearray(self.map[offset : self.start + end]), dtype=dtype).view(shape)
        return torch.frombuffer(self.map, dtype=dtype, count=count, offset=offset).view(shape)

    def _entry(self, key: str) -> tuple[torch.dtype, list[int], int, int]:
        entry = self.entries.get(key)
        if not isinstance(entry, dict):
            raise StorageError(f"{self.name!r} holds no tensor {key!r}")
        dtype = TORCH_DTYPES.get(entry.get("dtype"))  # type: ignore[arg-type]
        shape = entry.get("shape")
        offsets = entry.get("data_offsets")
        if (
            dtype is None
            or not isinstance(shape, list)
            or not isinstance(offsets, list)
            or len(shape) > 32
            or len(offsets) != 2
            or not all(_count(n) for n in (*shape, *offsets))
        ):
            raise StorageError(f"{self.name!r}: malformed entry for {key!r}: {str(entry)[:120]}")
        begin, end = offsets
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if not begin <= end <= self.data_size or end - begin != math.prod(shape) * itemsize:
            raise StorageError(
                f"{self.name!r}: tensor {key!r} has offsets {offsets} that do not fit its shape or the file"
            )
        return dtype, shape, begin, end


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**48
