"""Tracing: every module call of a forward recorded into a trace directory.

The bottom layer: hooks (:mod:`.tracer`), named captures (:mod:`.capture`), statistics (:mod:`.stats`), tensors
streamed to safetensors (:mod:`.storage`), the trace format and its reader (:mod:`.tracefile`), transformers'
debugger format (:mod:`.debugger_format`), weight fingerprints (:mod:`.structure`), the files of trace and run
directories (:mod:`.files`, without torch). Imports nothing above it.
"""
