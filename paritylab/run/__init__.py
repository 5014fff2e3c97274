"""The run: configuration, workload, models, and the parity pipeline from build to publish.

The phases as functions (:mod:`.parity`, :mod:`.generate`), what both sides are fed (:mod:`.workload`,
:mod:`.inputs`), the models (:mod:`.references`, :mod:`.candidates`, :mod:`.weights`, :mod:`.resident`), and
the configured run that chains them and hands results to the sink (:mod:`.runner`).
"""
