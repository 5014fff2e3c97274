"""The files of trace and run directories, without torch: atomic JSON writes, the check that a directory holds only
regular files, and the names of marker files. MLflow's child process publishes a run with these alone."""

from __future__ import annotations

import errno
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class TraceFormatError(ValueError):
    """A trace directory or file cannot be read as a trace."""


WITHHELD_FILE = "TENSORS_NOT_UPLOADED.txt"
"""Written beside an uploaded trace whose safetensors shards were not uploaded: the trace then loads with
statistics only (its values are in the run directory it was uploaded from)."""

UPLOADED_FILE = "TENSORS_UPLOADED.txt"
"""Written in a run directory's trace once its safetensors shards are safely in MLflow and deleted locally
(``tracking.keep_local=false``): the trace then loads with statistics only, and the note says how to fetch them."""


def json_safe(value: Any) -> Any:
    """Replace non-finite floats (which JSON cannot hold) by the strings ``nan``, ``inf``, ``-inf``."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(item) for item in value]
    return value


def json_text(document: Any, indent: int | None = None) -> str:
    """Standard JSON of ``document`` (a non-finite float spelled as a string: see :func:`json_safe`); compact
    unless ``indent``."""
    separators = (",", ":") if indent is None else None
    try:
        return json.dumps(document, separators=separators, indent=indent, allow_nan=False)
    except ValueError:  # a non-finite float somewhere: spell it as a string
        return json.dumps(json_safe(document), separators=separators, indent=indent, allow_nan=False)


def write_json(
    path: Path, document: Any, indent: int | None = None, fragments: Mapping[str, str] | None = None
) -> None:
    """Write standard JSON atomically (a reader never sees half a file); compact unless ``indent``.

    ``fragments`` maps a placeholder string in ``document`` (a value, unique in it) to JSON text already encoded,
    which takes its place in the file: a large part that does not change between writes is encoded once."""
    text = json_text(document, indent)
    for placeholder, fragment in (fragments or {}).items():
        marker = json.dumps(placeholder)
        if text.count(marker) != 1:
            raise ValueError(f"write_json: placeholder {placeholder!r} must occur once in the document")
        text = text.replace(marker, fragment)
    partial = path.with_name(path.name + ".partial")
    try:
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)
    except OSError:  # a full disk: leave no half-written file behind (the old one, if any, stays whole)
        partial.unlink(missing_ok=True)
        raise


MAX_ENTRIES = 100_000
"""Entries a trace or run directory may hold (a directory with millions of files is not one of ours)."""


def check_directory(path: Path, kind: str = "trace") -> None:
    """Refuse a directory holding anything but regular files and directories: a symlink can lead outside it
    (``trace.json -> /etc/...``), a FIFO blocks a reader forever, a device file reads without end."""
    pending, seen = [path], 0
    while pending:
        folder = pending.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                seen += 1
                if seen > MAX_ENTRIES:
                    raise TraceFormatError(f"{path} holds over {MAX_ENTRIES} entries: not a {kind} directory")
                where = Path(entry.path).relative_to(path)
                if entry.is_symlink():
                    raise TraceFormatError(
                        f"{path}: {where} is a symbolic link; a {kind} directory holds only real files: copy them in"
                    )
                if entry.is_dir(follow_symlinks=False):
                    pending.append(Path(entry.path))
                elif not entry.is_file(follow_symlinks=False):
                    raise TraceFormatError(
                        f"{path}: {where} is not a regular file (a FIFO, socket or device); remove it and retry"
                    )


def no_space(error: BaseException) -> bool:
    """Whether ``error`` is a full disk (or a full quota): a fault of the place, not of the run."""
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
