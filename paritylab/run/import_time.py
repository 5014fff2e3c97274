"""Seconds a block of code spends importing modules: what building a model pays for its code, told apart from
the work the block does itself.

A model's builder imports its library on first use (transformers' modelling code takes seconds). Whichever
phase builds the model first pays that import, and any tool that builds the model pays it too; :func:`counting_imports`
measures it, so a run's phase timings can say it apart (``model imports``) from the phase's own work.
"""

from __future__ import annotations

import builtins
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass
class Imported:
    """Seconds spent in ``import`` statements inside a :func:`counting_imports` block (outermost ones only: an
    import inside an import counts once), on the thread that opened it."""

    seconds: float = 0.0


@contextmanager
def counting_imports(clock: Callable[[], float] = time.perf_counter) -> Iterator[Imported]:
    """Count the seconds the block's ``import`` statements take (``builtins.__import__`` is wrapped for the
    block's duration and restored after, also when the block raises). Other threads' imports are not counted."""
    imported = Imported()
    original = builtins.__import__
    owner = threading.get_ident()
    depth = [0]

    def timed(*args: Any, **kwargs: Any) -> Any:
        if depth[0] or threading.get_ident() != owner:
            return original(*args, **kwargs)
        depth[0] += 1
        started = clock()
        try:
            return original(*args, **kwargs)
        finally:
            imported.seconds += clock() - started
            depth[0] -= 1

    builtins.__import__ = timed
    try:
        yield imported
    finally:
        builtins.__import__ = original
