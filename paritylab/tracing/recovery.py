"""Recover a trace whose process died (``kill -9``, power loss) from its journals (:mod:`.journal`).

Every tensor whose bytes and journal line reached the disk is kept: each unfinished shard
(``*.safetensors.partial``) gets its header from the journal, is cut to its last whole tensor and renamed;
``trace.json`` is rebuilt from the call records, calls that never closed marked as interrupted. The
recovered trace says so (``meta.status == "error"``, ``meta.recovered``), so it is never taken for a
finished one. :meth:`Trace.load <paritylab.tracing.tracefile.Trace.load>` does this by itself for a
directory holding journals and no ``trace.json``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any

from paritylab.tracing.journal import CALLS_JOURNAL, TENSORS_JOURNAL
from paritylab.tracing.storage import HEADER_CAPACITY, SAFETENSORS_DTYPES, finish_shard
from paritylab.tracing.tracefile import (
    MAX_TRACE_JSON_BYTES,
    OTHER_FORMATS,
    TRACE_FILE,
    CallRecord,
    Trace,
    TraceFormatError,
)
from paritylab.tracing.values import iter_tensors

KILLED = "the tracing process ended without finishing (killed); recovered from its journal"
_SHARD_NAME = re.compile(r"[A-Za-z0-9_.-]+\.safetensors")
_DTYPES = set(SAFETENSORS_DTYPES.values())


def recover(directory: Path) -> Trace:
    """Finish the shards and write ``trace.json`` of a trace left without one; returns it, loaded."""
    first, calls = _lines(directory / CALLS_JOURNAL)
    ended = [str(item["end"]) for item in calls if item.get("end")]
    calls = [item for item in calls if "end" not in item]  # the reserved slot (Journal.end), filled or blank
    cause = f"the trace could not be finished: {ended[0]}; recovered from its journal" if ended else KILLED
    records: dict[int, CallRecord] = {}
    for item in calls:
        record = CallRecord.from_json(item)
        records[record.index] = record  # the closing line replaces the opening one
    if not records:
        raise TraceFormatError(f"{directory}: the journal holds no call: the process died before the forward")
    files = _finish_shards(directory)
    open_calls = [r for r in records.values() if r.outputs is None and r.error is None]
    for record in open_calls:
        record.error = "interrupted: " + cause
    innermost = max(open_calls, key=lambda r: r.index, default=None)
    trace = Trace(calls=[records[index] for index in sorted(records)], directory=directory)
    trace.files = {ref: (file, ref) for ref, file in files.items()}
    for call in trace.calls:  # a tensor whose bytes did not reach the disk loses its ref and says why
        for side in ("inputs", "outputs"):
            for _, node in iter_tensors(getattr(call, side), side):
                if "ref" in node and node["ref"] not in files:
                    node.pop("ref")
                    node["skipped"] = f"not on disk when the {'trace ended' if ended else 'process was killed'}"
    given = first.get("meta")
    trace.meta = {
        **({str(k): str(v) for k, v in given.items()} if isinstance(given, dict) else {}),
        "status": "error",
        "recovered": True,
        "calls": len(trace.calls),
        "storage": {"bytes": 0, "files": sorted(set(files.values())), "failure": cause, "skipped": 0},
        "error": {
            "type": "Unfinished" if ended else "Killed",
            "message": cause,
            "module": innermost.path if innermost else None,
            "call": innermost.key if innermost else None,
        },
    }
    trace.save(directory)
    (directory / CALLS_JOURNAL).unlink(missing_ok=True)
    (directory / TENSORS_JOURNAL).unlink(missing_ok=True)
    return Trace.load(directory)


def _finish_shards(directory: Path) -> dict[str, str]:
    """Finish every unfinished shard the tensor journal lists; returns tensor ref -> shard file name."""
    journal = directory / TENSORS_JOURNAL
    if not journal.is_file():
        return {}
    first, entries = _lines(journal)
    given = first.get("metadata")
    metadata = {str(k): str(v) for k, v in given.items()} if isinstance(given, dict) else {}
    by_file: dict[str, dict[str, Any]] = {}
    for entry in entries:
        file, name = entry.get("file"), entry.get("name")
        offsets, shape = entry.get("data_offsets"), entry.get("shape")
        valid = (
            isinstance(file, str) and _SHARD_NAME.fullmatch(file) is not None and isinstance(name, str)
            and entry.get("dtype") in _DTYPES and isinstance(shape, list) and all(type(n) is int for n in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int and n >= 0 for n in offsets)
            and offsets[0] <= offsets[1]
        )  # fmt: skip
        if not valid or not isinstance(file, str) or not isinstance(name, str):
            raise TraceFormatError(f"{journal}: malformed tensor entry {str(entry)[:120]!r}")
        by_file.setdefault(file, {})[name] = {k: entry[k] for k in ("dtype", "shape", "data_offsets")}
    found: dict[str, str] = {}
    for file, shard_entries in by_file.items():
        final, partial = directory / file, directory / f"{file}.partial"
        if not final.is_file() and partial.is_file():
            size = partial.stat().st_size - 8 - HEADER_CAPACITY
            kept = {n: e for n, e in shard_entries.items() if e["data_offsets"][1] <= size}  # whole tensors only
            if not kept:
                continue
            work = partial if owned(partial, directory) else _private_copy(partial)
            with open(work, "r+b") as handle:
                finish_shard(handle, metadata, kept, max(e["data_offsets"][1] for e in kept.values()))
            os.replace(work, final)
            shard_entries = kept
        if final.is_file():
            found.update(dict.fromkeys(shard_entries, file))
    return found


def owned(path: Path, directory: Path) -> bool:
    """Whether ``path`` is provably the trace's own file, safe to write in place: a regular file (not a link),
    with no other name (one hard link), on the directory's device, inside the directory."""
    try:
        status, home = os.lstat(path), os.stat(directory)
    except OSError:
        return False
    inside = path.resolve().parent == directory.resolve()
    return stat.S_ISREG(status.st_mode) and status.st_nlink == 1 and status.st_dev == home.st_dev and inside


def _private_copy(path: Path) -> Path:
    """A new file in ``path``'s directory holding its bytes: a shard linked from elsewhere (a hard or symbolic
    link) is finished in this copy, so recovering never writes through to a file outside the trace."""
    copy = path.with_name(path.name + ".recovering")
    copy.unlink(missing_ok=True)  # only this name goes; whatever it pointed to is left as it is
    with open(path, "rb") as source, open(copy, "xb") as target:
        shutil.copyfileobj(source, target, 1 << 20)
    return copy


def _lines(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A journal's first line and the rest; a last line cut short by the kill is left out."""
    if path.stat().st_size > MAX_TRACE_JSON_BYTES:
        raise TraceFormatError(f"{path} is over the {MAX_TRACE_JSON_BYTES}-byte limit for trace JSON")
    # each line is written with its newline in one write: a last piece without one was cut short by the kill
    complete = path.read_bytes().split(b"\n")[:-1]
    items = []
    for number, line in enumerate(complete, 1):
        if not line.strip():
            continue  # a reserved slot left blank (Journal.end)
        try:
            item = json.loads(line)
        except (ValueError, RecursionError) as error:
            raise TraceFormatError(f"{path}, line {number}, is not valid JSON: {error}") from error
        if not isinstance(item, dict):
            raise TraceFormatError(f"{path}, line {number}, is not a JSON object")
        items.append(item)
    if not items:
        raise TraceFormatError(f"{path} is empty")
    return items[0], items[1:]


def _read_if_killed(directory: Path) -> Trace | None:
    """The :data:`OTHER_FORMATS` reader: a directory with a calls journal and no ``trace.json``."""
    if (directory / TRACE_FILE).exists() or not (directory / CALLS_JOURNAL).is_file():
        return None
    return recover(directory)


OTHER_FORMATS.insert(0, _read_if_killed)
