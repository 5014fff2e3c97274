"""paritylab: prove a port computes what the original does, layer by layer.

The public names load on first use (PEP 562), so ``import paritylab.cli.compare`` or a bisect step does not
import torch, transformers and the whole pipeline before it needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
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
