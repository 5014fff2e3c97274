"""Offline comparison of two trace directories (paritylab's or transformers' debugger's).

    paritylab-compare REFERENCE_TRACE_DIR CANDIDATE_TRACE_DIR [--align rules.yaml] [--atol A --rtol R]

Exit code 0 when parity holds, 1 when it does not, 2 on bad input (with a one-line reason on stderr), 3 when
nothing failed but some aligned output could not be compared by value (inconclusive: never a pass).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from paritylab.comparison.alignment import AlignmentError, load_rules
from paritylab.comparison.metrics import Tolerances
from paritylab.comparison.report import compare_traces
from paritylab.distributed import DistributedError, compare_ranks
from paritylab.distributed.rank import rank_directories
from paritylab.reports.render import to_console, to_json, to_markdown
from paritylab.tracing.storage import StorageError
from paritylab.tracing.tracefile import Trace, TraceFormatError

EPILOG = """\
trace directories it reads:
  - paritylab's own (trace.json and safetensors shards: a run's traces/reference and traces/candidate);
  - a trace whose run was killed (a .partial journal): recovered into the trace's own files first;
  - as the candidate, a folder of rank traces (rank0/, rank1/, ... as paritylab.distributed.trace_rank writes
    them under torchrun or Slurm): merged into one trace (in --merged, default CANDIDATE/merged) and the rank
    at fault named;
  - transformers' model_addition_debugger_context output ({Model}_debug_tree_SUMMARY.json and
    {Model}_debug_tree_FULL_TENSORS.json, with one .safetensors file per module).

exit codes:
  0  parity holds
  1  parity does not hold (the first divergence is printed)
  2  bad input: a directory that is not a trace, bad alignment rules (one line on stderr says which)
  3  inconclusive: nothing failed, but some aligned output could not be compared by value (never a pass)

example:
  paritylab-compare outputs/2026-11-25/10-00-00-llava-port/traces/{reference,candidate} --json report.json
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paritylab-compare",
        description="Compare a candidate trace against a reference trace, module by module, and name the module "
        "where divergence starts.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("reference", type=Path, help="reference trace directory (see the formats below)")
    parser.add_argument("candidate", type=Path, help="candidate trace directory")
    parser.add_argument("--align", type=Path, help="alignment rules YAML (reference pattern -> candidate pattern)")
    parser.add_argument("--atol", type=float, help="absolute tolerance (default: assert_close's per dtype)")
    parser.add_argument("--rtol", type=float, help="relative tolerance (default: assert_close's per dtype)")
    parser.add_argument("--json", type=Path, help="write the full report as JSON here")
    parser.add_argument("--markdown", type=Path, help="write the report as markdown here")
    parser.add_argument("--write-alignment", type=Path, help="write the alignment used as rules YAML here")
    parser.add_argument("--all-rows", action="store_true", help="print every row, not only the interesting ones")
    parser.add_argument("--merged", type=Path, help="rank traces: where the merged trace goes (CANDIDATE/merged)")
    parser.add_argument(
        "--partial-output", action="append", default=[], metavar="PATTERN",
        help="rank traces: a module pattern whose plain outputs are partial sums by design (repeatable)",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rules = load_rules(args.align) if args.align else []
        reference = Trace.load(args.reference)
        tolerances = Tolerances(args.rtol, args.atol)
        ranks = rank_directories(args.candidate)
        finding = None
        if ranks is not None:
            merged = args.merged or args.candidate / "merged"
            result = compare_ranks(reference, ranks, merged, rules=rules, tolerances=tolerances,
                                   partial_outputs=args.partial_output)  # fmt: skip
            report, finding = result.report, result.finding
        else:
            candidate = Trace.load(args.candidate)
            report = compare_traces(reference, candidate, rules=rules, tolerances=tolerances)
    except (TraceFormatError, StorageError, AlignmentError, DistributedError, ValueError, OSError) as error:
        print(f"paritylab-compare: {error}", file=sys.stderr)
        return 2
    print(to_console(report, limit=None if args.all_rows else 60))
    if ranks is not None:
        merged_into = (args.merged or args.candidate / "merged") / "candidate"
        print(f"paritylab-compare: {len(ranks)} ranks merged into {merged_into}")
    if finding is not None:
        print(f"paritylab-compare: ranks ({finding.kind}): {finding.message}")
    for path, text in ((args.json, to_json), (args.markdown, to_markdown)):
        if path is not None:
            path.write_text(text(report), encoding="utf-8")
    if args.write_alignment is not None:
        args.write_alignment.write_text(report.alignment.to_yaml(), encoding="utf-8")
    return {"pass": 0, "fail": 1, "error": 2, "inconclusive": 3}[report.verdict]


if __name__ == "__main__":
    sys.exit(main())
