"""paritylab: prove a port computes what the original does, layer by layer."""

from paritylab.capture import CaptureSpec
from paritylab.parity import check
from paritylab.tracefile import CallRecord, Trace, TraceFormatError
from paritylab.tracing import TraceOptions, Tracer, trace

__version__ = "0.1.0"
__all__ = ["CallRecord", "CaptureSpec", "Trace", "TraceFormatError", "TraceOptions", "Tracer", "check", "trace"]
