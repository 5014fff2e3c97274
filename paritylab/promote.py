"""Make a run the golden baseline of its model/candidate/inputs.

python -m paritylab.promote RUN_ID [--tracking-uri URI]
"""

from __future__ import annotations

import argparse
import sys

from paritylab.history import promote
from paritylab.tracking import MlflowTracker, TrackingError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paritylab.promote", description=__doc__.splitlines()[0])
    parser.add_argument("run_id")
    parser.add_argument("--tracking-uri", help="default: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db")
    args = parser.parse_args(argv)
    try:
        tracker = MlflowTracker(args.tracking_uri, "paritylab")
        superseded = tracker.call("promote the run", promote, tracker.client, args.run_id)
    except (TrackingError, ValueError) as error:
        print(f"paritylab.promote: {error}", file=sys.stderr)
        return 2
    print(f"paritylab.promote: {args.run_id} is the golden baseline; superseded: {', '.join(superseded) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
