"""Signals while results are produced or published: SIGTERM as an exception, and a window where none lands.

A run or an upload turns SIGTERM into :class:`Interrupted` (a ``KeyboardInterrupt``, like Ctrl-C) so it can
close its MLflow run KILLED and keep what it wrote; while it does so, further signals are ignored.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

EXIT_INTERRUPTED = 130
"""The shell's code for a process ended by SIGINT; used for SIGTERM too, after the run was closed."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM, turned into an exception so the run can be closed as KILLED with what it produced."""


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises :class:`Interrupted` in the main thread for the duration (so the run ends KILLED)."""
    if not _can_handle():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise Interrupted()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def signals_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM ignored for the duration (closing a run and writing its summary after a signal)."""
    if not _can_handle():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _can_handle() -> bool:
    """Python runs signal handlers in the main thread only, and Windows has no SIGTERM to catch."""
    return sys.platform != "win32" and threading.current_thread() is threading.main_thread()
