"""The MLflow sink: runs, metrics, artifacts, baselines, regressions, trends and sweeps in MLflow.

:mod:`.tracking` is the only module that talks to MLflow's client; :mod:`.publish` is the one way results
reach it (a live run and ``paritylab-upload`` alike), with the baseline, regression and trend steps. Imports
:mod:`paritylab.tracing`, and :mod:`paritylab.reports` for the trend heatmap.
"""
