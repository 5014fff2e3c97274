"""Exact-origin table over pairs of independently written implementations, with zero alignment rules.

    python benchmarks/pairs.py                 # every pair, site, kind and size, fp32 and bf16
    python benchmarks/pairs.py --pairs gpt2 --dtypes float32 --sizes 0.01
    python benchmarks/pairs.py --seeds 8 --kinds                # clean pairs only, over 8 more weight seeds
    python benchmarks/pairs.py --pairs whisper --seed 2          # the planted table on other weights
    python benchmarks/pairs.py --pairs esm --dtypes bfloat16 --sites layers.0.fc1   # plants at some sites only

For each pair (``tests/pairs.py``) and candidate dtype, the clean candidate must pass; then an error is
planted in the output of one candidate module at a time (scale, offset or noise of relative size 1e-2 or
1e-3) and the named origin must be that module's true counterpart. Prints one row per pair and dtype,
then every miss; ``--json`` writes the figures. Scratch traces go to a temporary directory that is
removed at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paritylab.run.parity import (
    compare_and_replay,
    match_weight_grids,
    trace_model,
)
from tests.pairs import KINDS, PAIRS, SEED, planted, reference_side, unavailable


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", nargs="*", default=list(PAIRS))
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    parser.add_argument("--sizes", nargs="*", type=float, default=[1e-2, 1e-3])
    parser.add_argument("--kinds", nargs="*", default=list(KINDS))
    parser.add_argument("--sites", nargs="*", help="plant only at candidate modules whose path contains one of these")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--seeds", type=int, default=0, help="also run each clean pair with N other weight seeds")
    parser.add_argument("--seed", type=int, default=0, help="the weight seed of the planted table (0: the default)")
    args = parser.parse_args()
    SEED[0] = args.seed
    scratch = Path(tempfile.mkdtemp(prefix="paritylab-pairs-"))
    results, misses = [], []
    try:
        for name in args.pairs:
            if unavailable(name):
                print(f"skip {name}: {unavailable(name)}")
                continue
            for dtype_name in args.dtypes:
                row, row_misses = run_pair(name, getattr(torch, dtype_name), args, scratch)
                results.append(row)
                misses += row_misses
                print(
                    f"{row['pair']:<28} {dtype_name:<9} clean={row['clean']:<5} exact {row['exact']}/{row['planted']}"
                    f" ({100 * row['exact'] / max(1, row['planted']):.1f} %), {row['no-op']} no-op plants"
                    f" ({row['no-op named']} of them named)"
                    f"  {row['seconds']:.0f} s",
                    flush=True,
                )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    alarms = [alarm for name in args.pairs if not unavailable(name) for alarm in clean_seeds(name, args)]
    for miss in misses:
        print("miss:", miss)
    total = sum(r["planted"] for r in results)
    exact = sum(r["exact"] for r in results)
    false_alarms = sum(r["clean"] != "pass" for r in results) + len(alarms)
    for alarm in alarms:
        print("false alarm:", alarm)
    noop, noop_named = sum(r["no-op"] for r in results), sum(r["no-op named"] for r in results)
    print(
        f"total: exact {exact}/{total} ({100 * exact / max(1, total):.1f} %), false alarms {false_alarms}, "
        f"{noop} plants changed no value the candidate computes (left out; {noop_named} of them named all the"
        " same, by the lifted replay)"
    )
    if args.json:
        args.json.write_text(json.dumps({"results": results, "misses": misses}, indent=1))
    return 0


def clean_seeds(name: str, args: argparse.Namespace) -> list[str]:
    """Clean candidates of ``name`` with references seeded 1..N (other weights, other token ids): each must pass."""
    alarms = []
    scratch = Path(tempfile.mkdtemp(prefix="paritylab-seeds-"))
    try:
        for seed in range(1, args.seeds + 1):
            SEED[0] = seed
            for dtype_name in args.dtypes:
                case = PAIRS[name](getattr(torch, dtype_name))
                base = scratch / f"{name}-{seed}-{dtype_name}"
                reference_trace, floors = reference_side(case, base)
                candidate_trace = trace_model(case.candidate, case.candidate_call, base / "candidate")
                match_weight_grids(case.reference, case.candidate, reference_trace, candidate_trace)
                report = compare_and_replay(
                    reference_trace, candidate_trace, case.candidate, case.candidate_call, base, floors=floors,
                    reference=case.reference, reference_call=case.reference_call,
                )  # fmt: skip
                if not report.passed or report.first_divergence is not None:
                    named = report.first_divergence.path if report.first_divergence else None
                    alarms.append(f"{name} {dtype_name} seed {seed}: named {named}")
                shutil.rmtree(base, ignore_errors=True)
    finally:
        SEED[0] = 0
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{name}: {args.seeds} more seeds x {len(args.dtypes)} dtypes clean, {len(alarms)} false alarms", flush=True)
    return alarms


def run_pair(name: str, dtype: torch.dtype, args: argparse.Namespace, scratch: Path) -> tuple[dict, list[str]]:
    started = time.perf_counter()
    case = PAIRS[name](dtype)
    base = scratch / f"{name}-{dtype}".replace("torch.", "")
    reference_trace, floors = reference_side(case, base)
    counter = 0

    def judge(tag: str):
        nonlocal counter
        counter += 1
        directory = base / f"{counter}-{tag}"
        candidate_trace = trace_model(case.candidate, case.candidate_call, directory / "candidate")
        match_weight_grids(case.reference, case.candidate, reference_trace, candidate_trace)
        report = compare_and_replay(
            reference_trace, candidate_trace, case.candidate, case.candidate_call, directory, floors=floors,
            reference=case.reference, reference_call=case.reference_call,
        )  # fmt: skip
        shutil.rmtree(directory, ignore_errors=True)
        return report

    clean = judge("clean")
    row = {
        "pair": case.name,
        "dtype": str(dtype).removeprefix("torch."),
        "seed": SEED[0],
        "planted": 0,
        "exact": 0,
        "no-op": 0,
        "no-op named": 0,
    }
    row["clean"] = "pass" if clean.passed and clean.first_divergence is None else "FAIL"
    misses = []
    if row["clean"] != "pass":
        misses.append(f"{case.name} {row['dtype']} clean: {clean.first_divergence and clean.first_divergence.path}")
    for site, expected in case.sites.items():
        if args.sites and not any(part in site for part in args.sites):
            continue
        for kind in args.kinds:
            for size in args.sizes:
                with planted(case.candidate, site, kind, size) as effect:
                    report = judge(f"{site}-{kind}-{size}")
                named = report.first_divergence.path if report.first_divergence else None
                if not effect["changed"]:  # the error rounded away from every value the candidate computes
                    row["no-op"] += 1
                    if named in expected:  # the code is wrong all the same: the lifted replay sees it
                        row["no-op named"] += 1
                    elif not report.passed:
                        misses.append(f"{case.name} {row['dtype']} {site} {kind} {size:g}: no-op plant named {named!r}")
                    continue
                row["planted"] += 1
                if named in expected:
                    row["exact"] += 1
                else:
                    verdict = "pass" if report.passed else "fail"
                    misses.append(
                        f"{case.name} {row['dtype']} {site} {kind} {size:g}: named {named!r} ({verdict}),"
                        f" expected {expected[0]}"
                    )
    row["seconds"] = time.perf_counter() - started
    return row, misses


if __name__ == "__main__":
    raise SystemExit(main())
