"""The tracer's host cost per module call: what a forward bound by its host (a small or medium model on a GPU, where a
module's kernels take less time than Python takes to launch them) pays per traced call, measured where the
tensors are so small that the forward itself is little more than its own Python.

    python benchmarks/host.py [--blocks 128] [--width 16] [--rounds 31] [--device cpu|cuda]

A stack of ``--blocks`` blocks (``Linear -> GELU``, 3 module calls each with the block) is run plain and in each mode
below, interleaved round by round after a warm-up round; each mode prints its median extra time over the plain
forward per module call, in microseconds. The paritylab modes switch parts of the tracer off one at a time, so the
rows say where a call's time goes: ``enter + exit`` is a trace with no forward inside (registering and removing two
hooks per module, the fingerprints' cache check, the trace's end), spread over the calls of one forward.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))

import paritylab  # noqa: E402
from benchmarks.bench import hooks_noop, hooks_stats  # noqa: E402
from paritylab.tracing import tracer  # noqa: E402


def stack(blocks: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(blocks)]).eval()


def modes(model: nn.Module, batch: torch.Tensor, scratch: Path) -> dict[str, Callable[[], Any]]:
    inputs = {"input": batch}

    def plain() -> None:
        with torch.no_grad():
            model(batch)

    def traced(**options: Any) -> Callable[[], None]:
        def run() -> None:
            with paritylab.trace(model, capture=None, **options):
                model(batch)

        return run

    def no_statistics() -> None:
        kept = tracer.supports_stats
        tracer.supports_stats = lambda _tensor: False  # every tensor recorded, none summarised
        try:
            traced()()
        finally:
            tracer.supports_stats = kept

    def enter_exit() -> None:
        with paritylab.trace(model, capture=None):
            pass

    def full() -> None:
        directory = Path(tempfile.mkdtemp(dir=scratch))
        with paritylab.trace(model, directory, save_tensors=True, capture=None):
            model(batch)
        shutil.rmtree(directory)

    return {
        "plain": plain,
        "hooks doing nothing": lambda: hooks_noop(model, inputs, scratch),
        "hooks + the same statistics": lambda: hooks_stats(model, inputs, scratch),
        "paritylab stats only": traced(),
        "  without input records": traced(inputs=False),
        "  without statistics": no_statistics,
        "  without fingerprints": traced(fingerprint=False),
        "  enter + exit alone": enter_exit,
        "paritylab full capture": full,
    }


def measure(blocks: int, width: int, rounds: int, device: str) -> dict[str, Any]:
    model = stack(blocks, width).to(device)
    batch = torch.randn(4, width, device=device)
    scratch = Path(tempfile.mkdtemp(prefix="paritylab-host-"))
    try:
        chosen = modes(model, batch, scratch)
        with paritylab.trace(model, capture=None) as trace:
            model(batch)
        calls = len(trace.calls)
        times: dict[str, list[float]] = {name: [] for name in chosen}
        for index in range(rounds + 1):
            for name, run in chosen.items():
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                start = time.perf_counter()
                run()
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                if index:  # round 0 warms up
                    times[name].append(time.perf_counter() - start)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    plain = times["plain"]
    per_call = {
        name: statistics.median((value - base) / calls * 1e6 for value, base in zip(values, plain, strict=True))
        for name, values in times.items()
        if name != "plain" and "enter + exit" not in name
    }
    per_call["  enter + exit alone"] = statistics.median(times["  enter + exit alone"]) / calls * 1e6
    return {"calls": calls, "plain_ms": statistics.median(plain) * 1e3, "us_per_call": per_call}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=128)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    result = measure(args.blocks, args.width, args.rounds, args.device)
    print(
        f"{result['calls']} module calls on {args.device} ({torch.get_num_threads()} threads), plain forward "
        f"{result['plain_ms']:.2f} ms, median of {args.rounds} interleaved rounds; extra time per call:"
    )
    for name, value in result["us_per_call"].items():
        print(f"  {name:<32} {value:7.1f} us")
    return result


if __name__ == "__main__":
    main()
