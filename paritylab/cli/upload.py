"""Publish a run directory to MLflow later (the server was unreachable, or failed mid-run).

paritylab-upload RUN_DIR [--tracking-uri URI] [--experiment NAME] [--allow-interrupted]

Exit codes: 0 published (or already), 2 bad input, an unreachable store or a failure while publishing
(a full disk), 130 interrupted. A failed or interrupted upload closes its run FAILED or KILLED and can be
run again: it finds that run by the directory's id tag and finishes it. A run that was itself interrupted
(Ctrl-C, SIGTERM: its record is KILLED, its verdict unreached) is refused unless --allow-interrupted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from paritylab.sink.interrupts import EXIT_INTERRUPTED, sigterm_as_interrupt
from paritylab.sink.publish import RunRecord, upload
from paritylab.sink.tracking import TrackingError
from paritylab.tracing.files import check_directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="paritylab-upload",
        description=__doc__.split("\n\n", 1)[0],
        epilog=__doc__.split("\n\n", 2)[2] + "\nexample: paritylab-upload outputs/2026-11-25/10-00-00-llava-port "
        "--tracking-uri http://127.0.0.1:5000",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("directory", type=Path, help="a run directory (it holds tracking.json)")
    parser.add_argument("--tracking-uri", help="default: the run's own, else MLFLOW_TRACKING_URI, else sqlite")
    parser.add_argument("--experiment", help="the MLflow experiment (default: the one the run was meant for)")
    parser.add_argument(
        "--allow-interrupted", action="store_true",
        help="publish a run that was interrupted before its verdict (it is logged KILLED, its results partial)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    again = f"run paritylab-upload {args.directory} again to finish it"
    if not args.allow_interrupted and _interrupted(args.directory):
        print(
            f"paritylab-upload: {args.directory} holds a run that was interrupted before its verdict (KILLED): its "
            "results are partial; pass --allow-interrupted to publish it anyway",
            file=sys.stderr,
        )
        return 2
    try:
        with sigterm_as_interrupt():
            run_id, already = upload(args.directory, args.tracking_uri, args.experiment)
    except (ValueError, TrackingError) as error:
        print(f"paritylab-upload: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"paritylab-upload: interrupted; the run is marked KILLED; {again}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as error:
        print(f"paritylab-upload: publishing failed: {error}; the run is marked FAILED; {again}", file=sys.stderr)
        return 2
    if already:
        print(f"paritylab-upload: {args.directory} is already published as run {run_id}; nothing to do")
    else:
        regression = RunRecord.load(args.directory).tags.get("paritylab.regression", "not assessed")
        print(f"paritylab-upload: published {args.directory} as run {run_id} (regression: {regression})")
    return 0


def _interrupted(directory: Path) -> bool:
    """Whether the run in ``directory`` was interrupted before its verdict: its record says KILLED (a run
    interrupted while publishing kept its verdict and is not; a directory without a record, or one that holds a
    link out of it, is left to :func:`~paritylab.sink.publish.upload` to refuse)."""
    try:
        check_directory(directory, "run")  # no file is opened in a directory that holds a link out of it
        return RunRecord.load(directory).status == "KILLED"
    except (ValueError, OSError):
        return False


if __name__ == "__main__":
    sys.exit(main())
