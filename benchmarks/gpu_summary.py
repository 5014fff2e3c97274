"""One line per run of ``benchmarks/gpu.sh``: exit code, verdict, wall time, phases, planned and measured memory;
appended to ``gpu-results.json`` in the output directory.

    python benchmarks/gpu_summary.py NAME EXIT_CODE STARTED RUN_DIRECTORY OUTPUT_DIRECTORY
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def summary(name: str, code: int, started: float, directory: Path) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": name, "exit_code": code, "wall_s": round(time.time() - started, 1)}
    path = directory / "run.json"
    if not path.is_file():
        return entry
    run = json.loads(path.read_text())
    memory = run.get("memory") or {}
    entry.update(
        verdict=run.get("verdict"),
        first_divergence=run.get("first_divergence"),
        error=run.get("error"),
        seconds=run.get("seconds"),
        plan=memory.get("plan"),
        peak=memory.get("peak"),
        notes=[note for note in run.get("notes", []) if note.startswith(("memory plan", "lifted", "resident"))],
    )
    return entry


def line(entry: dict[str, Any]) -> str:
    gib = 2**30
    text = f"{entry['name']}: exit {entry['exit_code']}, {entry['wall_s']:.1f} s"
    if entry.get("verdict"):
        text += f", {entry['verdict']}"
    if entry.get("first_divergence"):
        text += f" at {entry['first_divergence']}"
    if entry.get("error"):
        text += f"; error: {entry['error']}"
    plan = entry.get("plan")
    if plan:
        forward = f"{plan['forward'] / gib:.2f} GiB" if plan.get("forward") is not None else "unmeasured"
        text += (
            f"; plan: {plan['resident']} resident, reference {plan['reference'] / gib:.2f} GiB + candidate "
            f"{plan['candidate'] / gib:.2f} GiB + forward {forward} = {plan['needed'] / gib:.2f} GiB"
        )
    if entry.get("peak") is not None:
        text += f"; measured peak {entry['peak'] / gib:.2f} GiB"
    if entry.get("seconds"):
        text += "; " + ", ".join(f"{phase} {value:.1f}" for phase, value in entry["seconds"].items())
    return text


def main(argv: list[str]) -> None:
    name, code, started, directory, output = argv
    entry = summary(name, int(code), float(started), Path(directory))
    print(line(entry), flush=True)
    results = Path(output) / "gpu-results.json"
    known = json.loads(results.read_text()) if results.is_file() else []
    results.write_text(json.dumps([*known, entry], indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
