"""Generate parity against a single-forward parity run: whole processes, the default tiny LLaVA, interleaved.

    python benchmarks/generate.py [--rounds 5] [--steps 16]

Each round runs ``python -m paritylab tracking=off`` (the forward: trace, compare, replay, report) and the same
with ``generate.steps=N`` (plus a prefill and N one-token decode steps, each traced and compared on both
sides), back to back; the figure is the median of the per-round ratios, so a slow phase of the machine cancels.
Everything is written into a temporary directory that is removed.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]


def _wall(arguments: list[str], scratch: Path) -> float:
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "paritylab", "tracking=off", f"hydra.run.dir={scratch / 'run'}", *arguments],
        cwd=scratch, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={"PYTHONPATH": str(REPOSITORY), **_environment()},
    )  # fmt: skip
    elapsed = time.perf_counter() - started
    shutil.rmtree(scratch / "run", ignore_errors=True)
    return elapsed


def _environment() -> dict[str, str]:
    import os

    return {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16)
    options = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="paritylab-generate-bench-"))
    try:
        _wall([], scratch)  # warm the page cache and the bytecode
        forward, generate, ratios = [], [], []
        for _ in range(options.rounds):
            forward.append(_wall([], scratch))
            generate.append(_wall([f"generate.steps={options.steps}"], scratch))
            ratios.append(generate[-1] / forward[-1])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result = {
        "forward_s": statistics.median(forward),
        "generate_s": statistics.median(generate),
        "ratio": statistics.median(ratios),
    }
    print(f"| run (whole process, median of {options.rounds}) | seconds |")
    print("|---|---|")
    print(f"| forward parity | {result['forward_s']:.2f} |")
    print(f"| forward + {options.steps}-step generate parity | {result['generate_s']:.2f} |")
    print(f"| ratio (median of per-round ratios; target at most 3.0) | {result['ratio']:.2f} |")
    return result


if __name__ == "__main__":
    main()
