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


class Journal:
    """One journal file, opened for appending; each :meth:`add` is one line, one ``write``."""

    def __init__(self, path: Path, first: dict[str, Any]) -> None:
        self.path = path
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        self.add(first)

    def add(self, item: dict[str, Any]) -> None:
        if self._fd is None:
            return
        line = json.dumps(item, separators=(",", ":"), allow_nan=True) + "\n"
        try:
            os.write(self._fd, line.encode())
        except OSError:  # a full disk: the journal is a safety net, never the reason a trace fails
            self.close()

    def close(self, remove: bool = False) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if remove:
            self.path.unlink(missing_ok=True)
