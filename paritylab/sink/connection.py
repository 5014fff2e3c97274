"""A run's connection to MLflow: open the run, read the pair's baseline alignment, publish, end.

What the runner needs from MLflow, as four operations whose arguments and results are plain data, so that the
same connection can live in this process (:class:`InlineConnection`) or in a child process
(:class:`paritylab.sink.worker.ChildConnection`, which runs an :class:`InlineConnection` there). The base class
is the connection of a run without tracking: it opens nothing and publishes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from paritylab.sink.history import Regression, baseline_alignment
from paritylab.sink.publish import RunRecord, publish
from paritylab.sink.store import MlflowStore
from paritylab.sink.tracking import MlflowTracker, TrackingError


@dataclass
class Opening:
    """What opening a run takes: its record (name, experiment, store, tags, parameters) and how to reach the store."""

    record: RunRecord
    timeout: float = 10.0
    retries: int = 1
    parent_run_id: str | None = None
    """A sweep's parent run."""
    close_stale: bool = True
    """Close runs left RUNNING by dead processes (a sweep does it once, before its jobs start)."""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["record"]["metrics"] = []  # opening needs the name, tags and parameters only
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Opening:
        return cls(**{**data, "record": RunRecord(**data["record"])})


class Connection:
    """No tracking (``tracking.enabled=false``, or a store that could not be opened): nothing is logged."""

    uri: str = ""

    def ready(self) -> str | None:
        """The MLflow run's id once it is open (a child's set-up is waited for here); ``None`` without tracking.
        Raises :class:`~paritylab.sink.tracking.TrackingError` when the run could not be opened."""
        return None

    def link(self) -> str:
        """Where to see the run: a URL, or the ``mlflow ui`` command for a local store; empty without tracking."""
        return ""

    def baseline_alignment(self, fingerprint: str, directory: Path) -> tuple[str, Path] | None:
        """The pair's baseline run id and its ``report/alignment.yaml``, downloaded into ``directory``."""
        return None

    def publish(self, directory: Path) -> Regression | None:
        """Publish the run directory's record (``tracking.json``) and files; the regression against the baseline."""
        return None

    def end(self, status: str) -> None:
        """Mark the run ended (``FAILED``, ``KILLED``) without publishing."""

    def close(self) -> None:
        """Release the connection (a child process exits)."""


class InlineConnection(Connection):
    """MLflow in this process. Opening the run is immediate: the store is opened, the run created, its
    parameters logged and (outside sweeps) runs left RUNNING by dead processes closed, before this returns."""

    def __init__(self, opening: Opening, echo: Callable[[str], None] = print) -> None:
        record = opening.record
        self.tracker = MlflowTracker(record.uri, record.experiment, opening.timeout, opening.retries)
        self.uri = self.tracker.uri
        self.tracker.start(record.run_name, record.tags, opening.parent_run_id)
        self.tracker.log_params(record.params)
        if opening.close_stale:  # not this run: opened in a child, it outlives a run killed meanwhile by a moment
            stale = MlflowStore(self.tracker).close_stale_runs(exclude=self.tracker.run_id)
            if stale:
                echo(f"paritylab: marked KILLED {len(stale)} runs left RUNNING by processes that are gone")

    def ready(self) -> str | None:
        return self.tracker.run_id

    def link(self) -> str:
        return self.tracker.link()

    def baseline_alignment(self, fingerprint: str, directory: Path) -> tuple[str, Path] | None:
        return baseline_alignment(MlflowStore(self.tracker), fingerprint, self.tracker.run_id, directory)

    def publish(self, directory: Path) -> Regression | None:
        return publish(self.tracker, RunRecord.load(directory), directory)

    def end(self, status: str) -> None:
        """End the run unpublished; its verdict tag (``running`` since it opened) says why: ``error`` for a
        FAILED run (a forward raised, a full disk), ``interrupted`` for a KILLED one."""
        with contextlib.suppress(TrackingError):  # the status matters more than the tag
            self.tracker.set_tags({"paritylab.verdict": "interrupted" if status == "KILLED" else "error"})
        self.tracker.end(status)
