"""Does comparing in float32 change any verdict? Every row of each pair's report, computed both ways.

    python benchmarks/float32_metrics.py        # gpt2, esm and whisper; fp32 and bf16; clean and planted
    python benchmarks/float32_metrics.py --pairs llama --dtypes bfloat16

``paritylab.comparison.metrics`` compares floating-point tensors of 32 bits or fewer in float32
(``WORK_FLOAT32``). For each pair (``tests/pairs.py``) and candidate dtype, the clean candidate and one with a
1e-3 noise planted at the first site are compared twice on the same traces, once in float32 and once in float64,
and the script prints how many rows each verdict-bearing field (diverged, status, the first divergence, the
pass/fail) differs in, and the largest relative difference of ``rel_l2`` over the rows. Scratch traces go to a
temporary directory that is removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paritylab.comparison import metrics
from paritylab.comparison.report import Report
from paritylab.run.parity import compare_and_replay, match_weight_grids, trace_model
from tests.pairs import PAIRS, planted, reference_side, unavailable


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", nargs="*", default=["gpt2", "esm", "whisper"])
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="paritylab-f32-"))
    flips = 0
    try:
        for name in args.pairs:
            if unavailable(name):
                print(f"skip {name}: {unavailable(name)}")
                continue
            for dtype_name in args.dtypes:
                case = PAIRS[name](getattr(torch, dtype_name))
                base = scratch / f"{name}-{dtype_name}"
                reference_trace, floors = reference_side(case, base)
                site = next(iter(case.sites))
                for label, plant in (("clean", None), (f"{site} noise 1e-3", site)):
                    reports = []
                    for narrow in (True, False):
                        metrics.WORK_FLOAT32 = narrow
                        directory = base / f"{label}-{narrow}".replace(" ", "_")
                        with planted(case.candidate, plant, "noise", 1e-3) if plant else contextlib.nullcontext():
                            candidate_trace = trace_model(case.candidate, case.candidate_call, directory / "candidate")
                            match_weight_grids(case.reference, case.candidate, reference_trace, candidate_trace)
                            report = compare_and_replay(
                                reference_trace, candidate_trace, case.candidate, case.candidate_call, directory,
                                floors=floors, reference=case.reference, reference_call=case.reference_call,
                            )  # fmt: skip
                            reports.append(report)
                    flips += _print(f"{case.name} {dtype_name} {label}", *reports)
    finally:
        metrics.WORK_FLOAT32 = True
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"total: {flips} verdict-bearing fields differ between float32 and float64")
    return 0


def _print(label: str, narrow: Report, wide: Report) -> int:
    rows = {row.index: row for row in wide.rows}
    differing = sum(
        1
        for row in narrow.rows
        if row.index in rows and (row.diverged, row.status) != (rows[row.index].diverged, rows[row.index].status)
    )
    first = [r.first_divergence.path if r.first_divergence else None for r in (narrow, wide)]
    verdicts = [r.passed for r in (narrow, wide)]
    worst = max(
        (
            abs(row.rel_l2 - rows[row.index].rel_l2) / max(abs(rows[row.index].rel_l2), 1e-30)
            for row in narrow.rows
            if row.index in rows and row.rel_l2 is not None and rows[row.index].rel_l2 is not None
        ),
        default=0.0,
    )
    flips = differing + (first[0] != first[1]) + (verdicts[0] != verdicts[1])
    print(
        f"{label:<60} rows {len(narrow.rows):>4}: {differing} differ in diverged/status; first divergence "
        f"{first[0]!r} both ways: {first[0] == first[1]}; passed {verdicts[0]} both ways: {verdicts[0] == verdicts[1]};"
        f" largest relative rel_l2 difference {worst:.1e}",
        flush=True,
    )
    return flips


if __name__ == "__main__":
    raise SystemExit(main())
