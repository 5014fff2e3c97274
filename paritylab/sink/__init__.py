"""The MLflow sink: runs, metrics, artifacts, baselines, regressions, trends and sweeps in MLflow.

:mod:`.tracking` logs one run; :mod:`.store` is the :class:`~paritylab.sink.store.Store` interface (baselines,
promotion, the trend run, stale runs, sweep numbers) with its MLflow implementation. They are the only modules
that talk to MLflow's client. :mod:`.publish` is the one way results reach it (a live run and
``paritylab-upload`` alike), with the baseline, regression and trend steps; :mod:`.history` decides what is a
baseline and what regressed, :mod:`.processes` which runs' processes are gone. Imports :mod:`paritylab.tracing`,
and :mod:`paritylab.reports` for the trend heatmap.
"""
