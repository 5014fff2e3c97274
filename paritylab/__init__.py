"""paritylab: prove a port computes what the original does, layer by layer.

The public names load on first use (PEP 562), so ``import paritylab.cli.compare`` or a bisect step does not
import torch, transformers and the whole pipeline before it needs them.
"""

from __future__ import annotations

import time

IMPORTED_AT = time.perf_counter()
"""When paritylab was first imported: a run from the command line times its start-up (``imports``) from here.
Not from the process's start: ``bash -c "pip install ... && python -m paritylab"`` runs the last command in the
shell's own process, whose start was the whole chain's (a first run once read 98.8 s of start-up that way)."""

import importlib  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

__version__ = "0.1.0"
FROM_COMMAND_LINE = False
"""Set by the ``paritylab`` command: only then is the process's start the run's start."""
_PUBLIC = {
    "check": "paritylab.run.parity",
    "CaptureSpec": "paritylab.tracing.capture",
    "CallRecord": "paritylab.tracing.tracefile",
    "Trace": "paritylab.tracing.tracefile",
    "TraceFormatError": "paritylab.tracing.tracefile",
    "TraceOptions": "paritylab.tracing.tracer",
    "Tracer": "paritylab.tracing.tracer",
    "trace": "paritylab.tracing.tracer",
}
__all__ = ["CallRecord", "CaptureSpec", "Trace", "TraceFormatError", "TraceOptions", "Tracer", "check", "trace"]

if TYPE_CHECKING:
    from paritylab.run.parity import check
    from paritylab.tracing.capture import CaptureSpec
    from paritylab.tracing.tracefile import CallRecord, Trace, TraceFormatError
    from paritylab.tracing.tracer import TraceOptions, Tracer, trace


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'paritylab' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
