"""Tracing: every module call of a forward recorded into a trace directory.

The bottom layer: hooks (:mod:`.tracer`), named captures (:mod:`.capture`), statistics (:mod:`.stats`), tensors
streamed to safetensors (:mod:`.storage`), the trace format and its reader (:mod:`.tracefile`), transformers'
debugger format (:mod:`.debugger_format`), weight fingerprints (:mod:`.structure`). Imports nothing above it.
"""

from paritylab.tracing import debugger_format as _debugger_format  # noqa: F401  (registers its reader)
from paritylab.tracing import recovery as _recovery  # noqa: F401  (registers the reader of killed traces)
