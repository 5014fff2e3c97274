"""paritylab: prove a port computes what the original does, layer by layer.

The public names load on first use (PEP 562), so ``import paritylab.cli.compare`` or a bisect step does not
import torch, transformers and the whole pipeline before it needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from paritylab.sink.processes import process_age

__version__ = "0.1.0"
IMPORTED_AT_AGE = process_age()
"""How old the process was when paritylab was first imported: the interpreter's own start-up and whatever ran
before (the ``interpreter`` timing of a run from the command line; the rest of its start-up is ``imports``)."""
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
