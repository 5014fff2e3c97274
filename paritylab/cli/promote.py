"""Make a run the golden baseline of its model/candidate/inputs.

paritylab-promote RUN_ID [--tracking-uri URI] [--force]

Refuses, with the reason, a trend run, a run that did not finish, and a run whose verdict is not pass
(``--force`` promotes a finished or failing parity run anyway).
"""

from __future__ import annotations

import argparse
import sys

from paritylab.sink.store import MlflowStore
from paritylab.sink.tracking import MlflowTracker, TrackingError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="paritylab-promote",
        description=__doc__.split("\n\n", 1)[0].rstrip(".")
        + ": later runs of the same pair are judged for regressions "
        "against it.",
        epilog="It refuses, with the reason, a trend run, a run that did not finish and a run whose verdict is not "
        "pass (--force promotes a finished failing run anyway).\n\nexit codes: 0 promoted, 2 refused or the store "
        "could not be read (one line on stderr).\n\nexample: paritylab-promote 3f2a9c0d1e8b4f6a --tracking-uri "
        "sqlite:///mlflow.db",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_id", help="the MLflow run id of a parity run (the run page's URL, or paritylab's output)")
    parser.add_argument("--tracking-uri", help="default: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db")
    parser.add_argument("--force", action="store_true", help="promote a run that is not a clean pass anyway")
    args = parser.parse_args(argv)
    try:
        superseded = MlflowStore(MlflowTracker(args.tracking_uri, "paritylab")).promote(args.run_id, args.force)
    except (TrackingError, ValueError) as error:
        print(f"paritylab-promote: {error}", file=sys.stderr)
        return 2
    print(f"paritylab-promote: {args.run_id} is the golden baseline; superseded: {', '.join(superseded) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
