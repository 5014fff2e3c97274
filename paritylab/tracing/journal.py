"""Append-only JSON-lines journals: what a tracing process killed with ``kill -9`` leaves behind.

While a trace is written, every call record (when the call opens, and again when it closes) goes to
``trace.journal.jsonl`` and every tensor written into a shard to ``tensors.journal.jsonl``. Each line is
one unbuffered ``write``, so a line is on disk (in the page cache) as soon as the call or tensor is done.
A trace that finishes removes its journals; :mod:`.recovery` rebuilds ``trace.json`` and the shards'
headers from those of a trace that did not.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

CALLS_JOURNAL = "trace.journal.jsonl"
TENSORS_JOURNAL = "tensors.journal.jsonl"


END_SLOT = 512
"""Bytes reserved after a journal's first line for why its trace did not finish (:meth:`Journal.end`)."""


class Journal:
    """One journal file, opened for appending; each :meth:`add` is one line, one ``write``.

    With ``reserve_end``, a blank line of :data:`END_SLOT` bytes is reserved after the first line: :meth:`end`
    writes into it, in place, why the trace could not be finished (a full disk takes no new line).
    """

    def __init__(self, path: Path, first: dict[str, Any], reserve_end: bool = False) -> None:
        self.path = path
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        self.add(first)
        self._slot: int | None = None
        if reserve_end and self._fd is not None:
            self._slot = os.fstat(self._fd).st_size
            self.add_raw(" " * (END_SLOT - 1) + "\n")

    def add_raw(self, line: str) -> None:
        if self._fd is None:
            return
        try:
            os.write(self._fd, line.encode())
        except OSError:  # a full disk: the journal is a safety net, never the reason a trace fails
            self.close()

    def add(self, item: dict[str, Any]) -> None:
        if self._fd is None:
            return
        self.add_raw(json.dumps(item, separators=(",", ":"), allow_nan=True) + "\n")

    def end(self, reason: str) -> None:
        """Write ``{"end": reason}`` into the reserved slot, in place (it needs no free space); recovery then says
        this reason instead of "killed"."""
        if self._slot is None:
            return
        line = json.dumps({"end": reason[: END_SLOT - 40]}, separators=(",", ":"), ensure_ascii=True)
        data = line.encode()[: END_SLOT - 1].ljust(END_SLOT - 1) + b"\n"
        try:
            fd = os.open(self.path, os.O_WRONLY)  # not O_APPEND: Linux appends a pwrite on such a descriptor
            try:
                os.pwrite(fd, data, self._slot)
            finally:
                os.close(fd)
        except OSError:
            pass  # the journal still recovers, as "killed"

    def close(self, remove: bool = False) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if remove:
            self.path.unlink(missing_ok=True)
