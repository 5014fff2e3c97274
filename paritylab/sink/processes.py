"""Which process a run belongs to, and whether that process is gone (runs it left RUNNING are stale).

A run is tagged with its host, pid and the process's start time: on this host, a dead pid, or a pid now
held by another process (started at another time), is gone; on another host only age can tell.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path

STALE_AFTER = 24 * 3600
"""Runs of other hosts left RUNNING this long are considered dead."""


def process_start(pid: int) -> str | None:
    """When process ``pid`` started, as a token that differs between two processes that held the same pid
    (Linux: field 22 of ``/proc/PID/stat``, clock ticks since boot); None where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # the command name may hold spaces and parentheses
    return fields[19] if len(fields) > 19 else None


def owner_tags() -> dict[str, str]:
    """This process as a run's owner: host, pid and start (see :func:`owner_gone`)."""
    return {
        "paritylab.host": socket.gethostname(),
        "paritylab.pid": str(os.getpid()),
        "paritylab.process_start": process_start(os.getpid()) or "unknown",
    }


def owner_gone(tags: Mapping[str, str], start_ms: int) -> bool:
    """Whether the process that started a run (its ``paritylab.host``/``pid``/``process_start`` tags) is gone."""
    pid = int(tags.get("paritylab.pid", "0") or 0)
    if tags.get("paritylab.host") == socket.gethostname():
        return bool(pid) and not _same_process(pid, tags.get("paritylab.process_start"))
    return time.time() - start_ms / 1000 > STALE_AFTER


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _same_process(pid: int, started: str | None) -> bool:
    if not _alive(pid):
        return False
    now = process_start(pid)
    return started is None or now is None or now == started
