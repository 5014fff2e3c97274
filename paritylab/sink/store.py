"""What paritylab asks of a tracking store beyond logging one run, behind one interface.

:class:`Store` is a pair's history (baselines, promotion, the trend run) and the store's bookkeeping (finding
a run directory's run, closing runs whose process is gone, numbering sweeps). :class:`MlflowStore` is its
MLflow implementation; with :class:`~paritylab.sink.tracking.MlflowTracker`, it is the only code that touches
MLflow's client. The decisions (which run is a baseline, whether a run can be promoted, which runs are stale)
are made by plain functions on :class:`StoredRun` values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from paritylab.sink.history import BASELINE, FINGERPRINT, TREND, promotable, usable_baseline
from paritylab.sink.processes import owner_gone
from paritylab.sink.tracking import Metric, MlflowTracker, Tracker

RUN_UID = "paritylab.run_uid"
"""A run directory's identity in the store: an upload finds the run a live run already made (and finishes it)."""
TREND_STEPS = "paritylab.trend_steps"
SWEEPS = "paritylab.sweeps"
JUDGED = ("pass", "fail")
"""The verdicts of a run that can be a pair's baseline when none is promoted."""
ENDED = "attributes.status != 'RUNNING' and attributes.status != 'KILLED'"
"""A run that ended on its own (a FAIL ends FAILED, see :func:`paritylab.sink.publish.end_status`): not RUNNING, not
KILLED."""


@dataclass(frozen=True)
class StoredRun:
    """A run as the store holds it."""

    run_id: str
    experiment_id: str
    status: str
    start_ms: int
    tags: Mapping[str, str]
    metrics: Mapping[str, float]


class Store(Protocol):
    def get_run(self, run_id: str) -> StoredRun:
        """The run; a :class:`~paritylab.sink.tracking.TrackingError` when there is none."""
        ...

    def find_run(self, uid: str) -> StoredRun | None:
        """The run made for the run directory whose :data:`RUN_UID` tag is ``uid``."""
        ...

    def find_baseline(self, fingerprint: str, exclude: str | None = None) -> StoredRun | None:
        """The pair's golden run, else its newest finished, judged run with per-layer metrics."""
        ...

    def download(self, run_id: str, artifact: str, directory: Path) -> Path: ...

    def promote(self, run_id: str, force: bool = False) -> list[str]:
        """Make ``run_id`` its pair's golden baseline; returns the runs it supersedes (``ValueError``: refused)."""
        ...

    def trend_run(self, fingerprint: str, name: str, tags: Mapping[str, str]) -> str:
        """The pair's one long-lived trend run, created on first use."""
        ...

    def next_trend_step(self, run_id: str) -> int: ...

    def log_metrics_to(self, run_id: str, metrics: Iterable[Metric]) -> None: ...

    def metric_history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        """``(timestamp ms, value)`` of every point of a metric."""
        ...

    def log_artifact_to(self, run_id: str, path: Path) -> None: ...

    def close_stale_runs(self, exclude: str | None = None) -> list[str]:
        """Mark KILLED the runs left RUNNING by processes that are gone, except ``exclude``; returns their ids."""
        ...

    def next_sweep_number(self) -> int: ...

    def close_running_children(self, parent_run_id: str) -> list[str]:
        """Mark KILLED the runs nested under ``parent_run_id`` still RUNNING (a sweep's jobs its interruption
        ended with their processes); returns their ids."""
        ...


def store_of(tracker: Tracker) -> Store | None:
    """The store behind ``tracker`` (baselines, trend runs, stale runs); ``None``: a tracker that logs nowhere
    (``tracking.enabled=false``), so no history."""
    return MlflowStore(tracker) if isinstance(tracker, MlflowTracker) else None


class MlflowStore:
    """:class:`Store` on MLflow, sharing a tracker's client, experiment and failure handling (every MLflow
    failure is a one-line :class:`~paritylab.sink.tracking.TrackingError`)."""

    def __init__(self, tracker: MlflowTracker) -> None:
        self.tracker = tracker
        self.client = tracker.client

    @property
    def experiment_id(self) -> str:
        return self.tracker.ensure_experiment()

    def _call(self, what: str, function: Any, *args: Any, **kwargs: Any) -> Any:
        return self.tracker.call(what, function, *args, **kwargs)

    def _search(self, what: str, filter_string: str, max_results: int = 100, **kwargs: Any) -> list[StoredRun]:
        runs = self._call(
            what, self.client.search_runs, [self.experiment_id], filter_string=filter_string,
            max_results=max_results, **kwargs,
        )  # fmt: skip
        return [_stored(run) for run in runs]

    def get_run(self, run_id: str) -> StoredRun:
        return _stored(self._call("read the run", self.client.get_run, run_id))

    def find_run(self, uid: str) -> StoredRun | None:
        found = self._search("find the run", f"tags.`{RUN_UID}` = '{_quote(uid)}'", 1)
        return found[0] if found else None

    def find_baseline(self, fingerprint: str, exclude: str | None = None) -> StoredRun | None:
        scope = f"tags.`{FINGERPRINT}` = '{_quote(fingerprint)}'"
        golden = self._newest(scope + f" and tags.`{BASELINE}` = 'golden'")
        found = next((run for run in golden if usable_baseline(run, exclude, judged=False)), None)
        if found is not None:
            return found
        # judged by the verdict tag, not the status (a failing run ends FAILED): pass or fail, never one still open
        judged = [
            run
            for verdict in JUDGED
            for run in self._newest(f"{scope} and tags.`paritylab.verdict` = '{verdict}' and {ENDED}")
        ]
        judged.sort(key=lambda run: run.start_ms, reverse=True)
        return next((run for run in judged if usable_baseline(run, exclude, judged=True)), None)

    def _newest(self, filter_string: str) -> list[StoredRun]:
        return self._search("find the baseline", filter_string, 20, order_by=["attributes.start_time DESC"])

    def download(self, run_id: str, artifact: str, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        what = f"download {artifact} of run {run_id}"
        return Path(self._call(what, self.client.download_artifacts, run_id, artifact, str(directory)))

    def promote(self, run_id: str, force: bool = False) -> list[str]:
        run = self.get_run(run_id)
        refused, forceable = promotable(run)
        if refused and not (force and forceable):
            hint = "; pass --force to promote it anyway" if forceable else ""
            raise ValueError(f"run {run_id} cannot be a baseline: {refused}{hint}")
        scope = f"tags.`{FINGERPRINT}` = '{_quote(run.tags[FINGERPRINT])}' and tags.`{BASELINE}` = 'golden'"
        previous = [other.run_id for other in self._search("find the baseline", scope) if other.run_id != run_id]
        for other in previous:
            self._call("supersede the baseline", self.client.set_tag, other, BASELINE, "superseded")
        self._call("promote the run", self.client.set_tag, run_id, BASELINE, "golden")
        return previous

    def trend_run(self, fingerprint: str, name: str, tags: Mapping[str, str]) -> str:
        found = self._search(
            "find the trend run", f"tags.`{TREND}` = 'true' and tags.`{FINGERPRINT}` = '{_quote(fingerprint)}'", 1
        )
        if found:
            return found[0].run_id
        all_tags = {**tags, TREND: "true", FINGERPRINT: fingerprint}
        run = self._call("open the trend run", self.client.create_run, self.experiment_id, run_name=name, tags=all_tags)
        # finished runs still take metrics, and are never taken for stale
        self._call("open the trend run", self.client.set_terminated, run.info.run_id, "FINISHED")
        return str(run.info.run_id)

    def next_trend_step(self, run_id: str) -> int:
        step = int(self.get_run(run_id).tags.get(TREND_STEPS, "0")) + 1
        self._call("count the trend's points", self.client.set_tag, run_id, TREND_STEPS, str(step))
        return step

    def log_metrics_to(self, run_id: str, metrics: Iterable[Metric]) -> None:
        self.tracker.log_metrics_to(run_id, metrics)

    def metric_history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        history = self._call("read a metric's history", self.client.get_metric_history, run_id, key)
        return [(int(point.timestamp), float(point.value)) for point in history]

    def log_artifact_to(self, run_id: str, path: Path) -> None:
        self._call("upload an artifact", self.client.log_artifact, run_id, str(path))

    def close_stale_runs(self, exclude: str | None = None) -> list[str]:
        running = self._search("find running runs", "attributes.status = 'RUNNING'", 500)
        stale = [
            run.run_id
            for run in running
            if run.run_id != exclude and run.tags.get(TREND) != "true" and owner_gone(run.tags, run.start_ms)
        ]
        for run_id in stale:
            self._call("close a stale run", self.client.set_terminated, run_id, "KILLED")
        return stale

    def close_running_children(self, parent_run_id: str) -> list[str]:
        condition = f"tags.`mlflow.parentRunId` = '{_quote(parent_run_id)}' and attributes.status = 'RUNNING'"
        running = [run.run_id for run in self._search("find the sweep's running jobs", condition, 1000)]
        for run_id in running:
            self._call("close a job's run", self.client.set_terminated, run_id, "KILLED")
        return running

    def next_sweep_number(self) -> int:
        experiment = self._call("read the experiment", self.client.get_experiment, self.experiment_id)
        number = int(experiment.tags.get(SWEEPS, "0")) + 1
        self._call("number the sweep", self.client.set_experiment_tag, self.experiment_id, SWEEPS, str(number))
        return number


def _stored(run: Any) -> StoredRun:
    return StoredRun(
        run_id=run.info.run_id,
        experiment_id=run.info.experiment_id,
        status=run.info.status,
        start_ms=int(run.info.start_time or 0),
        tags=dict(run.data.tags),
        metrics=dict(run.data.metrics),
    )


def _quote(text: str) -> str:
    return text.replace("\\", "\\\\").replace("'", "\\'")
