"""Streamed, sharded safetensors storage of traced tensors, and a confined lazy reader.

Each shard is written in one pass: the header space is reserved up front, tensor bytes are appended as
they arrive (so memory does not grow with the trace), and on close the header is written into the
reserved space, padded with spaces as the safetensors format allows. A shard is only renamed to its
final ``.safetensors`` name once its header is complete, so no half-written file carries that name.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

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


class StorageError(ValueError):
    """A trace's tensor files are missing, malformed or point outside the trace directory."""


@dataclass
class _Shard:
    path: Path
    handle: Any
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    size: int = 0
    header_estimate: int = 2


class TensorStore:
    """Writes tensors to size-bounded safetensors shards in ``directory`` as they are produced.

    ``put`` returns a reference name, or ``None`` and the reason the value was not stored (budget
    exhausted, disk error, unsupported dtype). Storing never raises on I/O errors: saving stops and
    tracing goes on.
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
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.shard_bytes = shard_bytes
        self.save_dtype = save_dtype
        self.metadata = {str(k): str(v) for k, v in (metadata or {}).items()}
        self.prefix = prefix
        self.files: dict[str, str] = {}
        """Reference name -> shard file name, for every stored tensor."""
        self.bytes_written = 0
        self.failure: str | None = None
        self._shard: _Shard | None = None
        self._shard_count = 0
        self._metadata_bytes = len(json.dumps({"__metadata__": self.metadata}))

    def put(self, tensor: torch.Tensor, name: str) -> tuple[str | None, str | None]:
        """Store ``tensor`` under ``name``; returns ``(name, None)`` or ``(None, reason)``."""
        if self.failure is not None:
            return None, self.failure
        data = self._prepare(tensor)
        if isinstance(data, str):
            return None, data
        nbytes = data.numel() * data.element_size()
        if self.max_bytes is not None and self.bytes_written + nbytes > self.max_bytes:
            return None, f"byte budget of {self.max_bytes} exhausted"
        entry = {"dtype": SAFETENSORS_DTYPES[data.dtype], "shape": list(data.shape)}
        try:
            shard = self._shard_for(name, entry, nbytes)
            if nbytes:
                _write_all(shard.handle, memoryview(data.reshape(-1).view(torch.uint8).numpy()))
        except OSError as error:
            self._fail(f"disk error: {error.strerror or error}")
            return None, self.failure
        entry["data_offsets"] = [shard.size, shard.size + nbytes]
        shard.entries[name] = entry
        shard.size += nbytes
        self.bytes_written += nbytes
        self.files[name] = shard.path.name
        return name, None

    def _prepare(self, tensor: torch.Tensor) -> torch.Tensor | str:
        data = tensor.detach()
        if data.layout != torch.strided or data.is_meta:
            return f"{data.layout} tensors are not stored"
        if self.save_dtype is not None and data.is_floating_point():
            data = data.to(self.save_dtype)
        if data.dtype not in SAFETENSORS_DTYPES:
            return f"dtype {data.dtype} cannot be stored in safetensors"
        return data.to("cpu").contiguous()

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
        final = self.directory / f"{self.prefix}-{self._shard_count:05d}.safetensors"
        self._shard_count += 1
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
            header = json.dumps({"__metadata__": self.metadata, **shard.entries}, separators=(",", ":"))
            shard.handle.truncate(8 + HEADER_CAPACITY + shard.size)
            shard.handle.seek(0)
            header_bytes = struct.pack("<Q", HEADER_CAPACITY) + header.encode().ljust(HEADER_CAPACITY)
            _write_all(shard.handle, memoryview(header_bytes))
            shard.handle.close()
            os.replace(partial, shard.path)
        except OSError as error:
            shard.handle.close()
            partial.unlink(missing_ok=True)
            for name in shard.entries:
                self.files.pop(name, None)
            self.failure = self.failure or f"disk error: {error.strerror or error}"

    def _fail(self, reason: str) -> None:
        """Stop saving: keep what was fully written (the shard is cut back to its last whole tensor)."""
        self.failure = reason
        self._close_shard()

    def close(self) -> None:
        """Finish the open shard. Safe to call twice."""
        self._close_shard()


def _write_all(handle: Any, data: memoryview) -> None:
    """Write every byte of ``data`` to an unbuffered file (raw writes may be short)."""
    while data:
        written = handle.write(data)
        if not written:
            raise OSError(28, "no space left on device")
        data = data[written:]


class TensorReader:
    """Lazily reads tensors named by ``(file, key)`` pairs, confined to one directory."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory).resolve()
        self._handles: dict[str, Any] = {}

    def resolve(self, file_name: str) -> Path:
        """The path of ``file_name`` inside the directory; raises if it would leave it."""
        path = (self.directory / file_name).resolve()
        if not path.is_relative_to(self.directory):
            raise StorageError(f"tensor file {file_name!r} points outside the trace directory {self.directory}")
        if not path.is_file():
            raise StorageError(f"tensor file {file_name!r} is missing from {self.directory}")
        return path

    def load(self, file_name: str, key: str) -> torch.Tensor:
        """Read tensor ``key`` of ``file_name`` (only that tensor's bytes are read)."""
        handle = self._handles.get(file_name)
        if handle is None:
            handle = self._open(file_name)
            self._handles[file_name] = handle
        try:
            return handle.get_tensor(key)
        except Exception as error:
            raise StorageError(f"cannot read tensor {key!r} from {file_name!r}: {error}") from error

    def _open(self, file_name: str) -> Any:
        from safetensors import safe_open

        path = self.resolve(file_name)
        try:
            return safe_open(str(path), framework="pt")
        except Exception as error:
            raise StorageError(f"{file_name!r} is not a valid safetensors file: {error}") from error

    def metadata(self, file_name: str) -> dict[str, str]:
        """The ``__metadata__`` of a tensor file."""
        handle = self._handles.get(file_name) or self._open(file_name)
        self._handles[file_name] = handle
        return dict(handle.metadata() or {})
