"""What a run publishes to MLflow, kept on disk first (``tracking.json``) so it can be published again.

The runner writes the record into the run directory before it talks to MLflow; if the server is
unreachable or fails mid-run, ``paritylab-upload RUN_DIR`` publishes the same record and
files later.
"""

from __future__ import annotations

import json
import socket
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from paritylab.sink.tracking import Metric, MlflowTracker, Tracker
from paritylab.tracing.tracefile import WITHHELD_FILE, write_json

RECORD_FILE = "tracking.json"
RUN_UID = "paritylab.run_uid"
"""A run directory's identity in MLflow: an upload finds the run a live run already made (and finishes it)."""
PUBLISHED = "paritylab.published"
"""Set once every metric, tag and file of the run is in MLflow: uploading again then does nothing."""


@dataclass
class RunRecord:
    run_name: str
    experiment: str
    uri: str | None
    tags: dict[str, str]
    params: dict[str, str]
    metrics: list[Metric] = field(default_factory=list)
    table: dict[str, list[Any]] | None = None
    status: str = "FINISHED"
    log_tensors: bool = True

    def save(self, directory: Path) -> Path:
        path = directory / RECORD_FILE
        write_json(path, asdict(self), indent=1)
        return path

    @classmethod
    def load(cls, directory: Path) -> RunRecord:
        path = directory / RECORD_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            data["metrics"] = [Metric(**metric) for metric in data.get("metrics", [])]
            return cls(**data)
        except (OSError, ValueError, TypeError) as error:
            raise ValueError(f"{path} is not a paritylab run record ({error}); pass a run directory") from error


def publish(tracker: Tracker, record: RunRecord, directory: Path) -> None:
    """Metrics (batched), the comparison table, final tags, every file of the run, then the final status."""
    tracker.log_metrics(record.metrics)
    if record.table is not None:
        tracker.log_table(record.table, "comparison_table.json")
    tracker.set_tags(record.tags)
    log_directory(tracker, directory, record.log_tensors)
    tracker.set_tags({PUBLISHED: "true"})
    tracker.end(record.status)


def log_directory(tracker: Tracker, directory: Path, log_tensors: bool = True) -> None:
    """Upload every file of the run directory, keeping its layout (safetensors shards only with ``log_tensors``;
    without them each trace gets a note saying where they are, and loads with statistics only)."""
    withheld: set[Path] = set()
    for path in sorted(directory.rglob("*")):
        if not path.is_file():
            continue
        if not log_tensors and path.suffix == ".safetensors":
            withheld.add(path.parent)
            continue
        parent = path.parent.relative_to(directory).as_posix()
        tracker.log_artifact(path, None if parent == "." else parent)
    if not withheld:
        return
    with tempfile.TemporaryDirectory(prefix="paritylab-note-") as scratch:
        note = Path(scratch) / WITHHELD_FILE
        note.write_text(
            "The safetensors shards of this trace were not uploaded (tracking.log_tensors); they are in\n"
            f"{directory} on {socket.gethostname()}. Publish them with tracking.log_tensors=always and\n"
            "paritylab-upload, or compare this copy on statistics only.\n",
            encoding="utf-8",
        )
        for folder in sorted(withheld):
            parent = folder.relative_to(directory).as_posix()
            tracker.log_artifact(note, None if parent == "." else parent)


def upload(directory: Path, uri: str | None = None, experiment: str | None = None) -> tuple[str | None, bool]:
    """Publish ``directory``'s ``tracking.json`` and files; returns the run id and whether it was already
    published. Idempotent: the run a live run started (left FAILED or RUNNING when the store failed) is
    found by the directory's run id tag and finished, never duplicated; a published run is left alone."""
    from paritylab.tracing.tracefile import check_directory

    check_directory(directory, "run")  # nothing from outside the run directory is ever uploaded
    record = RunRecord.load(directory)
    tracker = MlflowTracker(uri or record.uri, experiment or record.experiment)
    existing = tracker.call("find the run", _existing_run, tracker, record.tags.get(RUN_UID))
    if existing is not None and existing.data.tags.get(PUBLISHED) == "true":
        return existing.info.run_id, True
    tags = {**record.tags, "paritylab.uploaded_from": str(directory.resolve())}
    if existing is not None:
        tracker.run_id = existing.info.run_id  # the orphan of the live run: finish it
    else:
        tracker.start(record.run_name, tags)
        tracker.log_params(record.params)
    record.tags = tags
    publish(tracker, record, directory)
    return tracker.run_id, False


def _existing_run(tracker: MlflowTracker, uid: str | None) -> Any | None:
    if not uid:
        return None
    experiment = tracker.ensure_experiment()
    found = tracker.client.search_runs([experiment], filter_string=f"tags.`{RUN_UID}` = '{uid}'", max_results=1)
    return found[0] if found else None
