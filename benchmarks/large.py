"""A large model on this machine: the whole ``python -m paritylab`` run against the least a parity tool must do,
with peak memory, at TinyLlama's shape (1.10 B parameters) or a smaller one.

    python benchmarks/large.py [--shape 1b|300m|quick] [--rounds 1] [--candidate bf16]
    python benchmarks/large.py --candidate "sdpa candidate.dtype=bfloat16"   # the reference's code cast, another kernel
    python benchmarks/large.py --capture [--reps 3]   # the reference trace against its plain forward, in-process

Each round runs, in fresh processes: ``floor`` (build the reference and the candidate, one forward each, in
``torch.no_grad()``) and ``paritylab`` (the whole run, MLflow off: its child process is not the run's memory),
sampling each process's anonymous memory every 5 ms. Prints wall time, peak memory and their ratios side by
side, the run's phases (``run.json``), and each target of issue #30 met or missed. Everything is written into a
temporary directory that is removed.

``--capture`` instead builds the reference once, in this process, and times its forward plain, under paritylab's
tracer (statistics only; every tensor saved, as the run traces the reference) and under naive forward hooks
writing one safetensors file, rounds interleaved after a warm-up round, medians of per-round ratios
(``benchmarks/bench.py``'s modes): the reference trace against its own plain forward.
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

from benchmarks.bench import _anonymous_kb, floor_code  # noqa: E402

SHAPES = {
    # TinyLlama-1.1B: width 2048, 22 layers, MLP 5632, grouped-query attention 32/4, vocabulary 32000
    "1b": dict(hidden_size=2048, layers=22, heads=32, kv_heads=4, intermediate_size=5632, vocab_size=32000),
    "300m": dict(hidden_size=1024, layers=16, heads=16, kv_heads=4, intermediate_size=2816, vocab_size=32000),
    "quick": dict(hidden_size=256, layers=4, heads=8, kv_heads=2, intermediate_size=704, vocab_size=32000),
}
TOKENS = 128


def overrides(shape: str, candidate: str) -> list[str]:
    build = [f"++model.build.{key}={value}" for key, value in SHAPES[shape].items()]  # some are not in the yaml
    name, *more = candidate.split()  # "sdpa candidate.dtype=bfloat16": a candidate and overrides of it
    return ["model=llama", *build, f"candidate={name}", *more, f"inputs.prompt_length={TOKENS}", "tracking=off"]


def _measured(command: list[str], cwd: Path) -> tuple[float, float]:
    """Wall seconds and peak anonymous memory (MB) of one process."""
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0
    while process.poll() is None:
        peak = max(peak, _anonymous_kb(process.pid))
        time.sleep(0.005)
    wall = time.perf_counter() - started
    if process.returncode not in (0, 1):  # 1: a candidate that differs is still a run that finished
        error = process.stderr.read().decode(errors="replace")[-2000:] if process.stderr else ""
        raise RuntimeError(f"exit {process.returncode}: {' '.join(command)}\n{error}")
    return wall, peak / 1024


def measure(shape: str, candidate: str, rounds: int) -> dict[str, float]:
    scratch = Path(tempfile.mkdtemp(prefix="paritylab-large-"))
    chosen = overrides(shape, candidate)
    walls: dict[str, list[float]] = {"floor": [], "paritylab": []}
    peaks: dict[str, list[float]] = {"floor": [], "paritylab": []}
    phases: dict[str, float] = {}
    try:
        for number in range(rounds):
            for name, command in (
                ("floor", [sys.executable, "-c", floor_code(chosen)]),
                (
                    "paritylab",
                    [sys.executable, "-m", "paritylab", *chosen, f"hydra.run.dir={scratch / f'run{number}'}"],
                ),
            ):
                wall, peak = _measured(command, scratch)
                walls[name].append(wall)
                peaks[name].append(peak)
            phases = json.loads((scratch / f"run{number}" / "run.json").read_text())["seconds"]
            shutil.rmtree(scratch / f"run{number}", ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result = {f"{kind}_{name}": statistics.median(values) for kind, table in (("wall", walls), ("peak", peaks))
              for name, values in table.items()}  # fmt: skip
    result["wall_ratio"] = result["wall_paritylab"] / result["wall_floor"]
    result["peak_ratio"] = result["peak_paritylab"] / result["peak_floor"]
    result.update({f"phase: {key}": value for key, value in phases.items()})
    return result


CAPTURE_MODES = ["plain", "stats", "full", "write_floor", "hooks_safetensors"]


def capture(shape: str, reps: int) -> dict[str, object]:
    """The capture modes side by side on the reference at ``shape``, in this process (see the module's text)."""
    import torch

    from benchmarks.bench import time_modes
    from paritylab.cli.app import compose
    from paritylab.run.candidates import instantiate
    from paritylab.run.inputs import build_inputs

    cfg = compose(overrides(shape, "bf16"))
    torch.manual_seed(0)
    model = instantiate("model.build", cfg.model.build).eval()
    inputs = build_inputs(cfg.inputs, cfg.model.family, model, None)
    return time_modes(model, inputs, reps, "cpu", CAPTURE_MODES)


def render_capture(shape: str, reps: int, timing: dict[str, dict[str, float]]) -> str:
    lines = [
        f"{shape} ({TOKENS} tokens), the reference's forward, {reps} interleaved rounds, medians",
        "| mode | time | ratio to plain | written |",
        "|---|---|---|---|",
    ]
    for name in CAPTURE_MODES:
        written = timing["written"].get(name, {}).get("bytes", 0)
        lines.append(
            f"| {name} | {timing['seconds'][name]:.2f} s | {timing['ratio_to_plain'][name]:.2f}x "
            f"| {written / 2**20:.0f} MB |"
        )
    lines.append("targets (issue #30): the reference trace (full) at most 1.2x its plain forward; stats only 1.08x")
    return "\n".join(lines)


def render(shape: str, candidate: str, rounds: int, result: dict[str, float]) -> str:
    lines = [
        f"{shape} ({TOKENS} tokens, candidate={candidate}), median of {rounds} round(s), MLflow off",
        "| | build both + one forward each | python -m paritylab | ratio | target |",
        "|---|---|---|---|---|",
        f"| wall | {result['wall_floor']:.1f} s | {result['wall_paritylab']:.1f} s "
        f"| {result['wall_ratio']:.2f}x | 1.5x |",
        f"| peak anonymous memory | {result['peak_floor']:.0f} MB | {result['peak_paritylab']:.0f} MB "
        f"| {result['peak_ratio']:.2f}x | 1.25x |",
    ]
    phases = {k.removeprefix("phase: "): v for k, v in result.items() if k.startswith("phase: ")}
    lines.append("phases (last run): " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--candidate", default="bf16")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--capture", action="store_true", help="capture modes on the reference, in this process")
    parser.add_argument("--reps", type=int, default=3, help="--capture: interleaved rounds after the warm-up")
    options = parser.parse_args(argv)
    if options.capture:
        timing = capture(options.shape, options.reps)
        print(render_capture(options.shape, options.reps, timing))  # type: ignore[arg-type]
        return {f"ratio {name}": value for name, value in timing["ratio_to_plain"].items()}  # type: ignore[union-attr]
    result = measure(options.shape, options.candidate, options.rounds)
    print(render(options.shape, options.candidate, options.rounds, result))
    return result


if __name__ == "__main__":
    main()
