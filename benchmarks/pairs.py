"""Exact-origin table over pairs of independently written implementations, with zero alignment rules.

    python benchmarks/pairs.py                 # every pair, site, kind and size, fp32 and bf16
    python benchmarks/pairs.py --pairs gpt2 --dtypes float32 --sizes 0.01
    python benchmarks/pairs.py --seeds 8 --kinds                # clean pairs only, over 8 more weight seeds
    python benchmarks/pairs.py --pairs whisper --seed 2          # the planted table on other weights
    python benchmarks/pairs.py --pairs esm --dtypes bfloat16 --sites layers.0.fc1   # plants at some sites only
    python benchmarks/pairs.py --weights --dtypes float32 bfloat16 --json weights.json   # bugs in weights
    python benchmarks/pairs.py --kinds scale w-element table      # output and weight plants, in separate rows

For each pair (``tests/pairs.py``) and candidate dtype, the clean candidate must pass; then an error is
planted in the output of one candidate module at a time (scale, offset or noise of relative size 1e-2 or
1e-3) and the named origin must be that module's true counterpart. Weight kinds (``--weights``, or any of
``tests.pairs.WEIGHT_KINDS`` in ``--kinds``) plant the bug in one of the module's weights instead, once each
(sizes do not apply; a site holding nothing a kind changes is skipped), and are counted in rows of their own.
Prints one row per pair and dtype (and one for weight plants), then every miss; ``--json`` writes the
figures (``results``/``misses`` for output plants, ``weight_results``/``weight_misses`` for weight plants and
``weight_plants`` with each plant's named origin, verdict and the weight ledger's findings for its tensor).
Scratch traces go to a temporary directory that is removed at the end.
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

from paritylab.reports.render import headline
from paritylab.run.parity import (
    compare_and_replay,
    match_weight_grids,
    trace_model,
)
from tests.pairs import (
    KINDS,
    PAIRS,
    SEED,
    WEIGHT_KINDS,
    named_origin,
    planted,
    planted_weight,
    reference_side,
    tied_sites,
    unavailable,
    weight_target,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", nargs="*", default=list(PAIRS))
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    parser.add_argument("--sizes", nargs="*", type=float, default=[1e-2, 1e-3])
    parser.add_argument("--kinds", nargs="*", help=f"output kinds {KINDS} and weight kinds {WEIGHT_KINDS}")
    parser.add_argument("--weights", action="store_true", help="every weight kind (with --kinds: added to them)")
    parser.add_argument("--sites", nargs="*", help="plant only at candidate modules whose path contains one of these")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--seeds", type=int, default=0, help="also run each clean pair with N other weight seeds")
    parser.add_argument("--seed", type=int, default=0, help="the weight seed of the planted table (0: the default)")
    args = parser.parse_args()
    kinds = list(args.kinds) if args.kinds is not None else ([] if args.weights else list(KINDS))
    kinds += [kind for kind in WEIGHT_KINDS if args.weights and kind not in kinds]
    unknown = [kind for kind in kinds if kind not in KINDS + WEIGHT_KINDS]
    if unknown:
        parser.error(f"unknown kinds {unknown}: choose from {KINDS + WEIGHT_KINDS}")
    args.kinds = [kind for kind in kinds if kind in KINDS]
    args.weight_kinds = [kind for kind in kinds if kind in WEIGHT_KINDS]
    SEED[0] = args.seed
    scratch = Path(tempfile.mkdtemp(prefix="paritylab-pairs-"))
    results, misses = [], []
    weight_results: list[dict] = []
    weight_misses: list[str] = []
    weight_plants: list[dict] = []
    try:
        for name in args.pairs:
            if unavailable(name):
                print(f"skip {name}: {unavailable(name)}")
                continue
            for dtype_name in args.dtypes:
                row, row_misses, weighed = run_pair(name, getattr(torch, dtype_name), args, scratch)
                if args.kinds or not args.weight_kinds:
                    results.append(row)
                    misses += row_misses
                    print(
                        f"{row['pair']:<28} {dtype_name:<9} clean={row['clean']:<5} exact {row['exact']}/"
                        f"{row['planted']} ({100 * row['exact'] / max(1, row['planted']):.1f} %), {row['no-op']} no-op"
                        f" plants ({row['no-op named']} of them named)  {row['seconds']:.0f} s",
                        flush=True,
                    )
                if weighed is not None:
                    weight_row, plants = weighed
                    weight_results.append(weight_row)
                    weight_plants += plants
                    weight_misses += [plant["miss"] for plant in plants if plant.get("miss")]
                    if not args.kinds and row["clean"] != "pass":  # the output row is not printed: say it here
                        weight_misses += row_misses
                    print(weight_line(weight_row), flush=True)
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
    if results:
        print(
            f"total: exact {exact}/{total} ({100 * exact / max(1, total):.1f} %), false alarms {false_alarms}, "
            f"{noop} plants changed no value the candidate computes (left out; {noop_named} of them named all the"
            " same, by the lifted replay)"
        )
    if weight_results:
        for miss in weight_misses:
            print("weight miss:", miss)
        total = sum(r["planted"] for r in weight_results)
        exact = sum(r["exact"] for r in weight_results)
        false_alarms = sum(r["clean"] != "pass" for r in weight_results) + len(alarms)
        noop, skipped = sum(r["no-op"] for r in weight_results), sum(r["skipped"] for r in weight_results)
        print(
            f"weights total: exact {exact}/{total} ({100 * exact / max(1, total):.1f} %), false alarms {false_alarms},"
            f" {noop} plants changed no output (left out), {skipped} site and kind combinations with nothing to plant"
        )
    if args.json:
        figures = {"results": results, "misses": misses}
        if weight_results:
            figures |= {
                "weight_results": weight_results,
                "weight_misses": weight_misses,
                "weight_plants": weight_plants,
            }
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


def weight_line(row: dict) -> str:
    """One pair and dtype's weight plants: exact of planted, and per kind."""
    per_kind = " ".join(f"{kind} {exact}/{planted}" for kind, (exact, planted) in row["kinds"].items())
    return (
        f"{row['pair']:<28} {row['dtype']:<9} clean={row['clean']:<5} weights exact {row['exact']}/{row['planted']}"
        f" ({100 * row['exact'] / max(1, row['planted']):.1f} %), {row['no-op']} no-op, {row['skipped']} skipped"
        f"  [{per_kind}]  {row['seconds']:.0f} s"
    )


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
                    named = named_origin(report)
                    alarms.append(f"{name} {dtype_name} seed {seed}: named {named}")
                shutil.rmtree(base, ignore_errors=True)
    finally:
        SEED[0] = 0
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{name}: {args.seeds} more seeds x {len(args.dtypes)} dtypes clean, {len(alarms)} false alarms", flush=True)
    return alarms


def run_pair(
    name: str, dtype: torch.dtype, args: argparse.Namespace, scratch: Path
) -> tuple[dict, list[str], tuple[dict, list[dict]] | None]:
    """The output-plant row of pair ``name`` in ``dtype``, its misses, and (with weight kinds) the weight-plant row
    and every weight plant's record."""
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
        misses.append(f"{case.name} {row['dtype']} clean: {named_origin(clean)}")
    for site, expected in case.sites.items():
        if args.sites and not any(part in site for part in args.sites):
            continue
        for kind in args.kinds:
            for size in args.sizes:
                with planted(case.candidate, site, kind, size) as effect:
                    report = judge(f"{site}-{kind}-{size}")
                named = named_origin(report)
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
    weighed = None
    if args.weight_kinds:
        weighed = weight_plants(case, row, args, judge)
        weighed[0]["seconds"] = time.perf_counter() - started - row["seconds"]
    return row, misses, weighed


def weight_plants(case, row: dict, args: argparse.Namespace, judge) -> tuple[dict, list[dict]]:
    """Each weight kind planted once at each site (and weight-only site) holding something it changes: the row
    (exact of planted, per kind too) and one record per plant (what was named, the verdict, the weight ledger's
    findings for the planted tensor, which reference calls the site was paired with; a miss's headline)."""
    counts = {"planted": 0, "exact": 0, "no-op": 0, "skipped": 0}
    weight_row = {"pair": case.name, "dtype": row["dtype"], "seed": row["seed"], "clean": row["clean"], **counts}
    kinds: dict[str, list[int]] = {}
    plants = []
    for site, expected in (case.sites | case.weight_sites).items():
        if args.sites and not any(part in site for part in args.sites):
            continue
        for kind in args.weight_kinds:
            tensor = weight_target(case.candidate, site, kind)
            if tensor is None:
                weight_row["skipped"] += 1
                continue
            with planted_weight(case.candidate, site, kind, probe=case.candidate_call) as effect:
                report = judge(f"{site}-{kind}")
            named = named_origin(report)
            expected = tied_sites(case, tensor, tuple(expected))  # a tied tensor: every module holding it
            verdict = "pass" if report.passed else "fail"
            plant = {
                "pair": case.name, "dtype": row["dtype"], "site": site, "kind": kind, "tensor": tensor,
                "expected": list(expected), "named": named, "verdict": verdict, "changed": effect["changed"],
                "exact": named in expected and effect["changed"],
                "findings": [f.to_json() for f in report.alignment.weights.findings if f.candidate == tensor],
                "paired": sorted(
                    f"{pair.reference.rsplit('#', 1)[0]} ({pair.source})" for pair in report.alignment.pairs
                    if pair.candidate.rsplit("#", 1)[0] == site
                ),
            }  # fmt: skip
            plants.append(plant)
            if not effect["changed"]:  # the plant rounded away, or changed what no output reads
                weight_row["no-op"] += 1
                if named is not None and named not in expected:
                    plant["miss"] = f"{case.name} {row['dtype']} {site} {kind}: no-op plant named {named!r}"
                continue
            weight_row["planted"] += 1
            tally = kinds.setdefault(kind, [0, 0])
            tally[1] += 1
            if named in expected:
                weight_row["exact"] += 1
                tally[0] += 1
            else:
                plant["miss"] = (
                    f"{case.name} {row['dtype']} {site} {kind} ({tensor}): named {named!r} ({verdict}),"
                    f" expected {expected[0]}"
                )
                plant["headline"] = headline(report)
    weight_row["kinds"] = kinds
    return weight_row, plants


if __name__ == "__main__":
    raise SystemExit(main())
