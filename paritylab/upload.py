"""Publish a run directory to MLflow later (the server was unreachable, or failed mid-run).

python -m paritylab.upload RUN_DIR [--tracking-uri URI] [--experiment NAME]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from paritylab.publish import RunRecord, publish
from paritylab.tracking import MlflowTracker, TrackingError


def upload(directory: Path, uri: str | None = None, experiment: str | None = None) -> str | None:
    """Create a run from ``directory``'s ``tracking.json`` and files; returns its id."""
    from paritylab.tracefile import check_directory

    check_directory(directory, "run")  # nothing from outside the run directory is ever uploaded
    record = RunRecord.load(directory)
    tracker = MlflowTracker(uri or record.uri, experiment or record.experiment)
    tags = {**record.tags, "paritylab.uploaded_from": str(directory.resolve())}
    tracker.start(record.run_name, tags)
    tracker.log_params(record.params)
    publish(tracker, record, directory)
    return tracker.run_id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paritylab.upload", description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="a run directory (it holds tracking.json)")
    parser.add_argument("--tracking-uri", help="default: the run's own, else MLFLOW_TRACKING_URI, else sqlite")
    parser.add_argument("--experiment")
    args = parser.parse_args(argv)
    try:
        run_id = upload(args.directory, args.tracking_uri, args.experiment)
    except (ValueError, TrackingError) as error:
        print(f"paritylab.upload: {error}", file=sys.stderr)
        return 2
    print(f"paritylab.upload: published {args.directory} as run {run_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
