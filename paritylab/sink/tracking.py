"""MLflow logging behind a small interface: explicit run ids (no global active run), batched calls,
bounded HTTP timeouts, and metric keys that MLflow accepts whatever the module names are."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from paritylab.sink.keys import metric_key

DEFAULT_URI = "sqlite:///mlflow.db"
MAX_PARAM = 6000
MAX_TAG = 8000


class TrackingError(RuntimeError):
    """The tracking server or store failed; the local files are kept."""


LOG_FLOOR = -12.0
"""log10 charts start here: an error of 0 (or below 1e-12) is drawn at the bottom, not left out."""


def log10_for_charts(value: float | None) -> float | None:
    """``log10(value)`` for MLflow's linear chart axes, floored at :data:`LOG_FLOOR`; ``None`` when not finite."""
    if value is None or not math.isfinite(value):
        return None
    return max(LOG_FLOOR, math.log10(value)) if value > 0 else LOG_FLOOR


def resolve_uri(uri: str | None) -> str:
    """``tracking.uri``, else ``MLFLOW_TRACKING_URI``, else the embedded SQLite store in the working directory."""
    if uri:
        return uri
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path('mlflow.db').resolve()}"


@dataclass
class Metric:
    key: str
    value: float
    step: int = 0
    timestamp: int | None = None
    """Milliseconds since the epoch; default the time it is logged (trend points carry their run's start)."""


class Tracker:
    """The interface the runner logs through; this base class logs nothing (``tracking.enabled=false``)."""

    run_id: str | None = None
    uri: str = ""

    def start(self, run_name: str, tags: Mapping[str, str], parent_run_id: str | None = None) -> str | None:
        return None

    def log_params(self, params: Mapping[str, Any]) -> None: ...

    def log_metrics(self, metrics: Iterable[Metric]) -> None: ...

    def set_tags(self, tags: Mapping[str, str]) -> None: ...

    def log_artifacts(self, directory: Path, artifact_path: str | None = None) -> None: ...

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> bool:
        """Upload one file; True when the store now holds its own copy of it (False: linked, or no store)."""
        return False

    def artifact_sizes(self, artifact_path: str | None = None) -> dict[str, int]:
        """The size in bytes of each file the run's store holds directly under ``artifact_path``."""
        return {}

    def log_table(self, table: Mapping[str, list[Any]], artifact_file: str) -> None: ...

    def end(self, status: str) -> None: ...

    def link(self) -> str:
        return ""

    def runs_link(self) -> str:
        """The experiment's runs list, relative to MLflow's UI (``#/experiments/...``); empty: none."""
        return ""

    def newest_runs(self, limit: int) -> list[dict[str, str]]:
        """The tags (``mlflow.runName`` and the status as ``status`` among them) of the experiment's newest finished
        runs that are not a sweep's jobs, newest first, at most ``limit``."""
        return []

    def describe_experiment(self, summary: str) -> None:
        """Put ``summary`` on the experiment's description, as its first line (see :func:`experiment_description`)."""


class MlflowTracker(Tracker):
    def __init__(self, uri: str | None, experiment: str, timeout: float = 10.0, retries: int = 1) -> None:
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(max(1, timeout))))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(max(0, retries)))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # no bars inside sweep jobs
        # MLflow's own "View run ... at" lines open the GenAI view: the link paritylab prints opens the training view
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
        from mlflow.tracking import MlflowClient

        self.uri = resolve_uri(uri)
        self._call("open the store", prepare_store, self.uri)
        self.client = MlflowClient(tracking_uri=self.uri)
        self.experiment = experiment
        self.experiment_id: str | None = None
        self.run_id: str | None = None
        self._artifact_roots: dict[str, Path | None] = {}
        """Per run, its local artifact directory (``None``: not on this machine's file system)."""

    def call(self, what: str, function: Any, *args: Any, **kwargs: Any) -> Any:
        """``function(*args)``, with MLflow's failures as one-line :class:`TrackingError`."""
        return self._call(what, function, *args, **kwargs)

    def log_metrics_to(self, run_id: str, metrics: Iterable[Metric]) -> None:
        """Log to another run (a trend run) in batches."""
        current, self.run_id = self.run_id, run_id
        try:
            self.log_metrics(metrics)
        finally:
            self.run_id = current

    def _call(self, what: str, function: Any, *args: Any, **kwargs: Any) -> Any:
        for attempt in range(LOCKED_RETRIES + 1):
            try:
                return function(*args, **kwargs)
            except Exception as error:
                text = str(error).strip()
                if "database is locked" in text and attempt < LOCKED_RETRIES:
                    time.sleep(0.2 * (attempt + 1))  # another job holds the SQLite write lock
                    continue
                first = text.splitlines()[0] if text else type(error).__name__
                raise TrackingError(f"MLflow at {self.uri} failed to {what}: {first[:300]}") from error
        raise AssertionError("unreachable")

    def ensure_experiment(self) -> str:
        if self.experiment_id is None:
            self.experiment_id = self._call("open the experiment", _experiment_id, self.client, self.experiment)
        return self.experiment_id

    def start(self, run_name: str, tags: Mapping[str, str], parent_run_id: str | None = None) -> str | None:
        experiment_id = self.ensure_experiment()
        all_tags = {k: _cut(v, MAX_TAG) for k, v in tags.items()}
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        run = self._call("create a run", self.client.create_run, experiment_id, run_name=run_name, tags=all_tags)
        self.run_id = run.info.run_id
        return self.run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(metric_key(str(k)), _cut(str(v), MAX_PARAM)) for k, v in params.items()]
        for start in range(0, len(items), 100):
            self._call("log params", self.client.log_batch, self.run_id, params=items[start : start + 100])

    def log_metrics(self, metrics: Iterable[Metric]) -> None:
        from mlflow.entities import Metric as MlflowMetric

        now = int(time.time() * 1000)
        items = [MlflowMetric(metric_key(m.key), float(m.value), m.timestamp or now, int(m.step)) for m in metrics]
        for start in range(0, len(items), 1000):
            self._call("log metrics", self.client.log_batch, self.run_id, metrics=items[start : start + 1000])

    def set_tags(self, tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, _cut(str(v), MAX_TAG)) for k, v in tags.items()]
        for start in range(0, len(items), 100):
            self._call("set tags", self.client.log_batch, self.run_id, tags=items[start : start + 100])

    def log_artifacts(self, directory: Path, artifact_path: str | None = None) -> None:
        self._call("upload artifacts", self.client.log_artifacts, self.run_id, str(directory), artifact_path)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> bool:
        if path.suffix in LINKABLE and self._link(path, artifact_path):
            return False
        self._call("upload an artifact", self.client.log_artifact, self.run_id, str(path), artifact_path)
        return True

    def artifact_sizes(self, artifact_path: str | None = None) -> dict[str, int]:
        listed = self._call("list the run's artifacts", self.client.list_artifacts, self.run_id, artifact_path)
        return {PurePosixPath(item.path).name: int(item.file_size or 0) for item in listed if not item.is_dir}

    def _link(self, path: Path, artifact_path: str | None) -> bool:
        """With a local artifact store, hard-link the file into it instead of copying it (one copy of the
        traces on disk). Only files paritylab never rewrites in place are linked (:data:`LINKABLE`); a store on
        another file system, or a server, gets a copy."""
        if self.run_id is None:
            return False
        if self.run_id not in self._artifact_roots:
            from urllib.parse import unquote, urlparse

            uri = self._call("find the run's artifact store", self.client.get_run, self.run_id).info.artifact_uri
            parsed = urlparse(uri)
            self._artifact_roots[self.run_id] = Path(unquote(parsed.path)) if parsed.scheme in ("", "file") else None
        root = self._artifact_roots[self.run_id]
        if root is None:
            return False
        target = root / (artifact_path or "") / path.name
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.unlink(missing_ok=True)
            os.link(path, target)
        except OSError:  # another file system, or links not allowed: copy instead
            return False
        return True

    def log_table(self, table: Mapping[str, list[Any]], artifact_file: str) -> None:
        self._call("log the table", self.client.log_table, self.run_id, data=dict(table), artifact_file=artifact_file)

    def end(self, status: str) -> None:
        if self.run_id is not None:
            self._call("end the run", self.client.set_terminated, self.run_id, status)

    def newest_runs(self, limit: int) -> list[dict[str, str]]:
        from mlflow.entities import ViewType

        experiment_id = self.ensure_experiment()
        runs: list[dict[str, str]] = []
        token = None
        for _ in range(NEWEST_PAGES):  # a large sweep's jobs started after its parent: read past them
            page = self._call(
                "list the newest runs", self.client.search_runs, [experiment_id], "attributes.status != 'RUNNING'",
                ViewType.ACTIVE_ONLY, 200, ["attributes.start_time DESC"], token,
            )  # fmt: skip
            runs += [{**r.data.tags, "status": r.info.status} for r in page if "mlflow.parentRunId" not in r.data.tags]
            token = page.token
            if len(runs) >= limit or not token:
                break
        return runs[:limit]

    def describe_experiment(self, summary: str) -> None:
        experiment_id = self.ensure_experiment()
        tags = self._call("read the experiment", self.client.get_experiment, experiment_id).tags
        note = tags.get(NOTE, "")
        if not _ours(tags):
            return  # an experiment paritylab did not make keeps its description
        previous = tags.get(SUMMARY, "")
        rest = note[len(previous) :].lstrip("\n") if previous and note.startswith(previous) else note
        line = summary_line(summary, experiment_id)
        description = f"{line}\n\n{rest or experiment_description(experiment_id)}"
        for key, value in ((NOTE, description), (SUMMARY, line)):
            self._call("describe the experiment", self.client.set_experiment_tag, experiment_id, key, value)

    def link(self) -> str:
        """Where to see the run, in MLflow's model-training view: the experiment's runs list (:func:`runs_link`; the
        run's name there says its verdict and where divergence starts, a failing run is marked failed), then the
        run's own page. With a server, at its address; with a local store, where ``mlflow ui`` serves it, after the
        command that starts it."""
        if self.run_id is None or self.experiment_id is None:
            return ""
        server = self.uri.rstrip("/") if self.uri.startswith("http") else LOCAL_UI
        runs, run = runs_link(self.experiment_id), run_link(self.experiment_id, self.run_id)
        opened = f"{server}/{runs} (this run: {server}/{run})"
        return (
            opened
            if self.uri.startswith("http")
            else f"start mlflow ui --backend-store-uri {self.uri} and open {opened}"
        )

    def runs_link(self) -> str:
        return runs_link(self.experiment_id) if self.experiment_id is not None else ""


LOCAL_UI = "http://127.0.0.1:5000"
"""Where ``mlflow ui`` serves a local store by default."""
LINKABLE = (".safetensors",)
"""Files written once under a new name and renamed into place (``os.replace``): a hard link to them never
changes when a later run writes the same name. (Reports are rewritten in place: they are copied.)"""
LOCKED_RETRIES = 10


def prepare_store(uri: str) -> None:
    """Create and migrate a SQLite store once, under a file lock, before anything uses it.

    Several processes opening a fresh SQLite store at once each try to create its tables, and all fail
    (leaving it broken); the lock makes the first create it and the others find it ready.
    """
    if not uri.startswith("sqlite:///"):
        return
    database = Path(uri.removeprefix("sqlite:///"))
    database.parent.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock
    from mlflow.tracking import MlflowClient

    with FileLock(database.with_name(database.name + ".lock")), _quiet_schema_setup():
        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)


@contextlib.contextmanager
def _quiet_schema_setup() -> Iterator[None]:
    """MLflow and alembic say at INFO that they create and migrate a fresh store's tables (2 to 10 lines on a
    user's first run, more under older MLflow): that is paritylab's business, not the user's. Warnings stay."""
    loggers = [logging.getLogger(name) for name in ("mlflow.store.db.utils", "alembic")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


EXPERIMENT_KIND = "mlflow.experimentKind"
MODEL_TRAINING = "custom_model_development"
"""The experiment's kind (``genai_development``, ``custom_model_development``, ...): MLflow 3 UIs that read it open
a ``custom_model_development`` experiment on its runs list, not on the GenAI overview. MLflow 3.17's UI takes the
kind from its sidebar switch (GenAI / Model training, kept by the browser) instead, or from ``?workflowType=``
in the address: the description links to the runs list with ``workflowType=machine_learning``, under its first
line (the newest run and the verdicts of the newest runs: :func:`paritylab.sink.publish.summarise_experiment`)."""
NOTE = "mlflow.note.content"
"""The tag MLflow shows as an experiment's (or a run's) description."""
SUMMARY = "paritylab.summary"
"""The experiment's tag holding the line paritylab last put first in its description (the newest run and the
verdicts of the newest runs): the next run replaces that line, and keeps what a person wrote below or instead."""
NEWEST_PAGES = 10
"""Pages of 200 runs read for an experiment's newest runs (a sweep's jobs, newer than its parent, are skipped)."""
RUNS_VIEW = "paritylab"
"""The experiment's saved view of its runs list (the experiment tag ``mlflow.sharedViewState.paritylab``, MLflow's
"Views" menu): the verdict, first divergence and regression columns, wide enough to read a module's name. The
description's first line links to it (``?viewStateShareKey=paritylab``)."""
_COLUMNS = {  # MLflow's column ids: the width (pixels) of each a person reads first, in this order
    "attributes.`Run Name`": 300,
    "runDateAndNestInfo": None,  # Created, with the run's status
    "tags.`paritylab.first_divergence`": 330,
    "tags.`paritylab.regression`": 125,
    "tags.`paritylab.verdict`": 115,
    "duration": None,
    "attributes.`Source`": None,
}


def runs_view(now_ms: int | None = None) -> str:
    """The saved view, as MLflow 3.17's UI stores one: ``{name, createdAt, updatedAt, state}``, ``state`` being the
    runs list's settings as JSON (the columns shown, their order and widths; the rest stays MLflow's default)."""
    import json

    state = {
        "selectedColumns": [column for column in _COLUMNS if column.startswith(("tags.", "attributes.`Source"))],
        "columnOrder": list(_COLUMNS),
        "columnWidths": {column: width for column, width in _COLUMNS.items() if width},
    }
    now = int(time.time() * 1000) if now_ms is None else now_ms
    view = {"name": "paritylab: verdict and first divergence", "createdAt": now, "updatedAt": now}
    return json.dumps({**view, "state": json.dumps(state)})


EXPERIMENT_DESCRIPTION = """**paritylab: [the runs list]({runs})**, each run named by its verdict, where divergence \
starts and what ran: `FAIL layers.1.mlp.down_proj @ llava/port seed=0`; a run that fails or errors is marked failed.

**paritylab** checks that a candidate (a port, a dtype, an attention kernel, torch.compile) computes what its
reference computes, module by module. MLflow 3 opens an experiment on its GenAI overview unless the sidebar's
*Model training* switch is on (the browser remembers it); the links here and those paritylab prints open the
model-training view either way (`?workflowType=machine_learning`), in the view *paritylab: verdict and first
divergence* (also in the runs list's *Views* menu).

- A run's name starts with its verdict: PASS, FAIL, INCONCLUSIVE, ERROR, INTERRUPTED, or REGRESSED (parity holds
  but a layer's error grew past its baseline's); then the last two parts of the module where divergence starts
  (or of the first regressed layer); then `@ model/candidate seed=N` and what else was overridden. The same as
  tags, the module in full: `paritylab.verdict`, `paritylab.first_divergence`, `paritylab.regression`.
- A run that fails, regresses or errors ends FAILED (red), one that passes or is inconclusive FINISHED, an
  interrupted one KILLED; its verdict tag tells a failure from an error.
- Sweep parents are named `VERDICT sweep/N: <jobs per verdict>` (FAILED when a job failed, regressed or
  errored) and fold their jobs; `VERDICT trend/<pair>/<inputs>` runs hold one point per scheduled night of each
  layer's error, and say what the newest night said.
- On a run's page, the `depth/<tower>/log10_*` charts show divergence against layer index (step = layer),
  `divergence/*` against execution order; `comparison_table.json` lists every module.
"""


def runs_link(experiment_id: str) -> str:
    """The experiment's runs list in MLflow's model-training view, in paritylab's saved view (relative to the UI)."""
    return f"#/experiments/{experiment_id}/runs?viewStateShareKey={RUNS_VIEW}&workflowType=machine_learning"


def run_link(experiment_id: str, run_id: str) -> str:
    """A run's page in MLflow's model-training view (relative to the UI)."""
    return f"#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"


def summary_line(summary: str, experiment_id: str) -> str:
    """The description's first line, the part MLflow shows before its *more*: ``summary`` (the newest run and the
    verdicts of the newest runs) and a link to the runs list (:func:`runs_link`)."""
    return f"{summary} \u00b7 [runs list]({runs_link(experiment_id)})"


def experiment_description(experiment_id: str) -> str:
    """The experiment's description, its first line a link to :func:`runs_link`."""
    return EXPERIMENT_DESCRIPTION.format(runs=runs_link(experiment_id))


def _experiment_id(client: Any, name: str) -> str:
    """The experiment's id, created with its kind (:data:`MODEL_TRAINING`), saved runs view (:data:`RUNS_VIEW`) and
    description when it is new. An experiment paritylab made that lacks one of them (made before paritylab set
    it, or its creator stopped before the description) gets it; what is there stays, and so does an experiment
    paritylab did not make."""
    from mlflow.exceptions import MlflowException

    view = f"mlflow.sharedViewState.{RUNS_VIEW}"
    found = client.get_experiment_by_name(name)
    if found is not None:
        ours = _ours(found.tags)
        missing = {
            EXPERIMENT_KIND: MODEL_TRAINING,
            view: runs_view(),
            NOTE: experiment_description(found.experiment_id),  # lost to a failed create
        }
        for key, value in missing.items() if ours else ():
            if key not in found.tags:
                with contextlib.suppress(MlflowException):  # how the UI shows it is worth no failed run
                    client.set_experiment_tag(found.experiment_id, key, value)
        return found.experiment_id
    try:
        experiment_id = client.create_experiment(name, tags={EXPERIMENT_KIND: MODEL_TRAINING, view: runs_view()})
    except MlflowException:  # created concurrently by another job
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id
    client.set_experiment_tag(experiment_id, NOTE, experiment_description(experiment_id))
    return str(experiment_id)


def _ours(tags: Mapping[str, str]) -> bool:
    """The experiment is one paritylab made: it holds paritylab's runs view, or the description paritylab writes."""
    note = tags.get(NOTE, "")
    return f"mlflow.sharedViewState.{RUNS_VIEW}" in tags or note.startswith("**paritylab") or SUMMARY in tags


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings and lists as ``a.b.0.c`` keys (for MLflow params)."""
    if isinstance(data, Mapping):
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    if isinstance(data, list | tuple) and data and any(isinstance(item, Mapping | list) for item in data):
        out = {}
        for index, value in enumerate(data):
            out.update(flatten(value, f"{prefix}{index}."))
        return out
    return {prefix.rstrip("."): data}
