"""What a run publishes to MLflow, kept on disk first (``tracking.json``) so it can be published again.

The runner writes the record into the run directory before it talks to MLflow; if the server is
unreachable or fails mid-run, ``python -m paritylab.upload RUN_DIR`` publishes the same record and
files later.
"""

from __future__ import annotations

import json
import socket
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from paritylab.tracefile import WITHHELD_FILE, write_json
from paritylab.tracking import Metric, Tracker

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
            "python -m paritylab.upload, or compare this copy on statistics only.\n",
            encoding="utf-8",
        )
        for folder in sorted(withheld):
            parent = folder.relative_to(directory).as_posix()
            tracker.log_artifact(note, None if parent == "." else parent)
