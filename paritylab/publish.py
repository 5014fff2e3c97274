"""What a run publishes to MLflow, kept on disk first (``tracking.json``) so it can be published again.

The runner writes the record into the run directory before it talks to MLflow; if the server is
unreachable or fails mid-run, ``python -m paritylab.upload RUN_DIR`` publishes the same record and
files later.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from paritylab.tracefile import write_json
from paritylab.tracking import Metric, Tracker

RECORD_FILE = "tracking.json"


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
    tracker.end(record.status)


def log_directory(tracker: Tracker, directory: Path, log_tensors: bool = True) -> None:
    """Upload every file of the run directory, keeping its layout (safetensors shards only with ``log_tensors``)."""
    for path in sorted(directory.rglob("*")):
        if not path.is_file() or (not log_tensors and path.suffix == ".safetensors"):
            continue
        parent = path.parent.relative_to(directory).as_posix()
        tracker.log_artifact(path, None if parent == "." else parent)
