"""paritylab: prove a port computes what the original does, layer by layer."""

from paritylab.run.parity import check
from paritylab.tracing.capture import CaptureSpec
from paritylab.tracing.tracefile import CallRecord, Trace, TraceFormatError
from paritylab.tracing.tracer import TraceOptions, Tracer, trace

__version__ = "0.1.0"
__all__ = ["CallRecord", "CaptureSpec", "Trace", "TraceFormatError", "TraceOptions", "Tracer", "check", "trace"]
