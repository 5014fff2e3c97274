"""Publish a run directory to MLflow later (the server was unreachable, or failed mid-run).

python -m paritylab.upload RUN_DIR [--tracking-uri URI] [--experiment NAME]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from paritylab.publish import PUBLISHED, RUN_UID, RunRecord, publish
from paritylab.tracking import MlflowTracker, TrackingError


def upload(directory: Path, uri: str | None = None, experiment: str | None = None) -> tuple[str | None, bool]:
    """Publish ``directory``'s ``tracking.json`` and files; returns the run id and whether it was already
    published. Idempotent: the run a live run started (left FAILED or RUNNING when the store failed) is
    found by the directory's run id tag and finished, never duplicated; a published run is left alone."""
    from paritylab.tracefile import check_directory

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paritylab.upload", description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="a run directory (it holds tracking.json)")
    parser.add_argument("--tracking-uri", help="default: the run's own, else MLFLOW_TRACKING_URI, else sqlite")
    parser.add_argument("--experiment")
    args = parser.parse_args(argv)
    try:
        run_id, already = upload(args.directory, args.tracking_uri, args.experiment)
    except (ValueError, TrackingError) as error:
        print(f"paritylab.upload: {error}", file=sys.stderr)
        return 2
    if already:
        print(f"paritylab.upload: {args.directory} is already published as run {run_id}; nothing to do")
    else:
        print(f"paritylab.upload: published {args.directory} as run {run_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
