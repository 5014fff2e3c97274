"""The whole run a user waits for, against the least any tool must do: whole processes at llava-bench size.

    python benchmarks/whole_run.py [--rounds 3] [--quick]

Each round runs, back to back, in fresh processes (so imports count, as they do for a user):

- ``floor``: build the reference and the candidate (our port, or the reference in bf16) and run one forward
  each, in ``torch.no_grad()``: what any parity tool must do at least;
- ``paritylab``: ``python -m paritylab`` on the same model and inputs, with the embedded SQLite MLflow store;

for ``candidate=port`` and ``candidate=bf16``. Ratios are medians of per-round ratios. The phase timings of the
last paritylab run of each kind (``run.json``) say where the difference goes. Everything is written into a
temporary directory that is removed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))

from benchmarks import llava_bench  # noqa: E402
from benchmarks.bench import floor_code  # noqa: E402


def _run(command: list[str], scratch: Path) -> float:
    started = time.perf_counter()
    subprocess.run(command, cwd=scratch, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800)
    return time.perf_counter() - started


def measure(rounds: int = 3, quick: bool = False) -> dict[str, dict[str, float]]:
    """Per candidate: median seconds of the floor and of ``python -m paritylab``, the median per-round ratio, the
    start-up before the reference's build and the last run's phase timings."""
    base = llava_bench.overrides(quick)
    scratch = Path(tempfile.mkdtemp(prefix="paritylab-whole-run-"))
    results: dict[str, dict[str, float]] = {}
    try:
        times: dict[str, dict[str, list[float]]] = {c: {"floor": [], "paritylab": []} for c in ("port", "bf16")}
        phases: dict[str, dict[str, float]] = {}
        for number in range(rounds + 1):  # round 0 warms the page cache
            for candidate in ("port", "bf16"):
                overrides = [*base, f"candidate={candidate}"]
                floor = _run([sys.executable, "-c", floor_code(overrides)], scratch)
                run_dir = scratch / f"run-{candidate}"
                parity = _run([sys.executable, "-m", "paritylab", *overrides, f"hydra.run.dir={run_dir}"], scratch)
                phases[candidate] = json.loads((run_dir / "run.json").read_text())["seconds"]
                shutil.rmtree(run_dir, ignore_errors=True)
                if number:
                    times[candidate]["floor"].append(floor)
                    times[candidate]["paritylab"].append(parity)
        for candidate, measured in times.items():
            ratios = [p / f for p, f in zip(measured["paritylab"], measured["floor"], strict=True)]
            results[candidate] = {
                "floor_s": statistics.median(measured["floor"]),
                "paritylab_s": statistics.median(measured["paritylab"]),
                "ratio": statistics.median(ratios),
                "before_build_s": sum(phases[candidate].get(phase, 0.0) for phase in ("imports", "tracking start")),
                **{f"phase: {phase}": value for phase, value in phases[candidate].items()},
            }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return results


def default_phases(rounds: int = 3) -> dict[str, float]:
    """Median seconds per phase of ``python -m paritylab`` with the default configuration (the tiny LLaVA pair,
    the local SQLite MLflow store), over ``rounds`` runs after a warm-up run, each a fresh process in a temporary
    directory; ``wall`` is the whole process."""
    scratch = Path(tempfile.mkdtemp(prefix="paritylab-default-run-"))
    measured: dict[str, list[float]] = {}
    try:
        for number in range(rounds + 1):
            run_dir = scratch / f"run-{number}"
            wall = _run([sys.executable, "-m", "paritylab", f"hydra.run.dir={run_dir}"], scratch)
            seconds = json.loads((run_dir / "run.json").read_text())["seconds"]
            if number:  # run 0 warms the page cache
                for phase, value in {**seconds, "wall": wall}.items():
                    measured.setdefault(phase, []).append(value)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {phase: statistics.median(values) for phase, values in measured.items()}


def render_default(phases: dict[str, float], rounds: int) -> str:
    shown = ", ".join(f"{phase} {value:.2f}" for phase, value in phases.items() if phase != "wall")
    plan = phases.get("memory plan", 0.0)
    return (
        f"default run (python -m paritylab), median of {rounds}: {phases['wall']:.1f} s; seconds per phase: {shown}\n"
        f"  memory plan {plan:.2f} s (target <= 0.5 s); the model's code imports it triggers are 'model imports'"
    )


def render(results: dict[str, dict[str, float]], rounds: int) -> str:
    lines = [
        f"| candidate | build + one forward each | python -m paritylab | ratio (median of {rounds}) "
        "| start-up before the build (last run) |",
        "|---|---|---|---|---|",
    ]
    for candidate, figures in results.items():
        lines.append(
            f"| {candidate} | {figures['floor_s']:.1f} s | {figures['paritylab_s']:.1f} s | {figures['ratio']:.2f}x "
            f"| {figures['before_build_s']:.1f} s |"
        )
    lines.append("targets: port <= 1.3x, bf16 <= 1.6x, start-up <= 3 s")
    for candidate, figures in results.items():
        shown = ", ".join(f"{k.removeprefix('phase: ')} {v:.1f}" for k, v in figures.items() if k.startswith("phase"))
        lines.append(f"{candidate}, seconds per phase (last run): {shown}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a small model, for a smoke run")
    options = parser.parse_args(argv)
    results = measure(options.rounds, options.quick)
    print(render(results, options.rounds))
    return results


if __name__ == "__main__":
    main()
