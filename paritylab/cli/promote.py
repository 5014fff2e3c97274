"""Make a run the golden baseline of its model/candidate/inputs.

paritylab-promote RUN_ID [--tracking-uri URI] [--force]

Refuses, with the reason, a trend run, a run that did not finish, and a run whose verdict is not pass
(``--force`` promotes a finished or failing parity run anyway).
"""

from __future__ import annotations

import argparse
import sys

from paritylab.sink.tracking import MlflowTracker, TrackingError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paritylab-promote", description=__doc__.splitlines()[0])
    parser.add_argument("run_id")
    parser.add_argument("--tracking-uri", help="default: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db")
    parser.add_argument("--force", action="store_true", help="promote a run that is not a clean pass anyway")
    args = parser.parse_args(argv)
    try:
        superseded = MlflowTracker(args.tracking_uri, "paritylab").store().promote(args.run_id, args.force)
    except (TrackingError, ValueError) as error:
        print(f"paritylab-promote: {error}", file=sys.stderr)
        return 2
    print(f"paritylab-promote: {args.run_id} is the golden baseline; superseded: {', '.join(superseded) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
