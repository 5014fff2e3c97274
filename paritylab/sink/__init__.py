"""The MLflow sink: runs, metrics, artifacts, baselines, regressions, trends and sweeps in MLflow.

:mod:`.tracking` is the only module that talks to MLflow's client; :mod:`.publish` is the one way results
reach it (a live run and ``paritylab-upload`` alike). Imports only :mod:`paritylab.tracing`.
"""
