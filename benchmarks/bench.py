"""paritylab benchmark on llava-bench: tracing, storage, comparison and logging against a plain forward and
transformers' debugger, measured in one run, interleaved, median of several repetitions after a warm-up.

    python benchmarks/bench.py [--reps 11] [--device cpu|cuda] [--attention sdpa|eager] [--quick]

llava-bench: transformers LlavaForConditionalGeneration, random init, CLIP vision tower and Llama text
model with hidden size 512, 8 + 8 layers, 8 heads, a 224x224 image with patch 14 (256 image tokens)
plus 64 text tokens, fp32, transformers' default attention (sdpa; ``--attention eager`` also stores the
attention probabilities every eager attention module returns). Ratios are medians of per-round ratios
(each round runs every mode back to back, so slow phases of a noisy machine cancel). Peak memory is
measured in fresh subprocesses (one per mode), since a process's peak RSS only ever grows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))

import paritylab  # noqa: E402
from paritylab.run.references import llava  # noqa: E402

TEXT_TOKENS = 64


BENCH_SIZE = dict(hidden_size=512, layers=8, heads=8, image_size=224, patch_size=14, vocab_size=32064)
QUICK_SIZE = dict(hidden_size=128, layers=2, heads=4, image_size=56)


def llava_bench(
    device: str = "cpu", quick: bool = False, attention: str = "sdpa"
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The benchmark model and its inputs (``quick``: a smaller model for a smoke run)."""
    params = {**BENCH_SIZE, **(QUICK_SIZE if quick else {})}
    model = llava(**params, intermediate_size=None, attn_implementation=attention).to(device)
    config = model.config
    image_tokens = (config.vision_config.image_size // config.vision_config.patch_size) ** 2
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.image_token_index - 1, (1, TEXT_TOKENS + image_tokens), generator=generator)
    ids[:, 1 : 1 + image_tokens] = config.image_token_index
    size_px = config.vision_config.image_size
    pixels = torch.randn(1, 3, size_px, size_px, generator=generator)
    return model, {"input_ids": ids.to(device), "pixel_values": pixels.to(device)}


def plain(model: torch.nn.Module, inputs: dict[str, torch.Tensor], _: Path) -> None:
    with torch.no_grad():
        model(**inputs)


def stats_only(model: torch.nn.Module, inputs: dict[str, torch.Tensor], _: Path) -> None:
    with paritylab.trace(model, capture=None):
        model(**inputs)


def full_capture(model: torch.nn.Module, inputs: dict[str, torch.Tensor], directory: Path) -> None:
    with paritylab.trace(model, directory, save_tensors=True, capture=None):
        model(**inputs)


def hf_debugger(model: torch.nn.Module, inputs: dict[str, torch.Tensor], directory: Path) -> None:
    from transformers.model_debugging_utils import model_addition_debugger_context

    with model_addition_debugger_context(model, debug_path=str(directory), do_prune_layers=False, use_repr=False):
        model(**inputs)


MODES: dict[str, Callable[[torch.nn.Module, dict[str, torch.Tensor], Path], None]] = {
    "plain": plain,
    "stats": stats_only,
    "full": full_capture,
    "hf_debugger": hf_debugger,
}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_modes(model: torch.nn.Module, inputs: dict[str, torch.Tensor], reps: int, device: str) -> dict[str, Any]:
    """Median seconds per mode and median per-round ratio to the plain forward, interleaved (plain, stats,
    full, debugger, plain, ...) after a warm-up round."""
    scratch = Path(tempfile.mkdtemp(prefix="paritylab-bench-"))
    times: dict[str, list[float]] = {name: [] for name in MODES}
    written: dict[str, dict[str, int]] = {}
    try:
        for round_index in range(reps + 1):
            for name, mode in MODES.items():
                directory = scratch / f"{name}-{round_index}"
                directory.mkdir()
                _sync(device)
                start = time.perf_counter()
                mode(model, inputs, directory)
                _sync(device)
                elapsed = time.perf_counter() - start
                if round_index:  # round 0 warms up
                    times[name].append(elapsed)
                written[name] = _footprint(directory)
                shutil.rmtree(directory)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    ratios = {
        name: statistics.median(value / plain for value, plain in zip(values, times["plain"], strict=True))
        for name, values in times.items()
    }
    seconds = {name: statistics.median(values) for name, values in times.items()}
    return {"seconds": seconds, "ratio_to_plain": ratios, "written": written}


def _footprint(directory: Path) -> dict[str, int]:
    files = [path for path in directory.rglob("*") if path.is_file()]
    return {"bytes": sum(path.stat().st_size for path in files), "files": len(files)}


PEAK_PROBE = """
import gc, pathlib, sys, tempfile
sys.path.insert(0, {repo!r})
from benchmarks.bench import llava_bench, MODES
model, inputs = llava_bench({device!r}, {quick!r}, {attention!r})
with tempfile.TemporaryDirectory(prefix="paritylab-peak-") as scratch:  # removed at the end, whatever happens
    MODES["plain"](model, inputs, pathlib.Path(scratch))  # warm-up: allocator caches, lazy imports
    gc.collect()
    status = lambda key: int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1])
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
    before = status("VmRSS:")
    MODES[{mode!r}](model, inputs, pathlib.Path(scratch))
    print(before, status("VmHWM:"))
"""


def peak_memory(mode: str, device: str, quick: bool, attention: str) -> float:
    """Peak RSS growth (MB) of one ``mode`` forward in a fresh process, model already built and warmed up."""
    code = PEAK_PROBE.format(repo=str(REPOSITORY), device=device, quick=quick, mode=mode, attention=attention)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, check=True)
    before, peak = (int(value) for value in result.stdout.split()[-2:])
    return (peak - before) / 1024


def comparison_throughput(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[dict[str, float], Any]:
    """GB of tensor data (both sides) compared per second, for two full traces of the same model;
    also returns the report (its metrics are what a llava-bench run logs)."""
    from paritylab import Trace
    from paritylab.comparison.report import compare_traces

    scratch = Path(tempfile.mkdtemp(prefix="paritylab-compare-"))
    try:
        for side in ("a", "b"):
            full_capture(model, inputs, scratch / side)
        reference = Trace.load(scratch / "a")
        compare_traces(reference, Trace.load(scratch / "b"))  # warm-up (page cache, imports)
        start = time.perf_counter()
        report = compare_traces(Trace.load(scratch / "a"), Trace.load(scratch / "b"))
        elapsed = time.perf_counter() - start
        compared, seen = 0, set()
        for row in report.rows:  # each distinct pair of stored tensors counts once (repeats are memoised)
            if row.status != "compared" or row.reference.slot is None:
                continue
            node = dict(reference.call(row.reference.key).tensors("outputs"))[row.reference.slot]
            if node.get("ref") in seen:
                continue
            seen.add(node.get("ref"))
            element_size = torch.empty(0, dtype=getattr(torch, row.reference.dtype)).element_size()
            compared += 2 * math.prod(row.reference.shape) * element_size
        return {"seconds": elapsed, "gigabytes": compared / 1e9, "gb_per_s": compared / 1e9 / elapsed}, report
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def logging_time(report: Any) -> dict[str, float]:
    """Seconds to log every metric of a llava-bench comparison to a fresh default (SQLite) store."""
    from paritylab.sink.dashboard import report_metrics
    from paritylab.sink.tracking import MlflowTracker

    scratch = Path(tempfile.mkdtemp(prefix="paritylab-log-"))
    cwd = Path.cwd()
    try:
        metrics = report_metrics(report)
        os.chdir(scratch)
        tracker = MlflowTracker(None, "bench")
        tracker.start("bench", {})
        start = time.perf_counter()
        tracker.log_metrics(metrics)
        elapsed = time.perf_counter() - start
        tracker.end("FINISHED")
        return {"seconds": elapsed, "metrics": len(metrics)}
    finally:
        os.chdir(cwd)
        shutil.rmtree(scratch, ignore_errors=True)


def default_run_wall() -> float:
    """Wall seconds of ``python -m paritylab model=llava candidate=port`` in a fresh directory."""
    scratch = Path(tempfile.mkdtemp(prefix="paritylab-run-"))
    try:
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "paritylab", "model=llava", "candidate=port"],
            cwd=scratch, check=True, capture_output=True, timeout=600,
        )  # fmt: skip
        return time.perf_counter() - start
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


RESIDENT_RUN = [
    "model=llava", "candidate=port", "compare.replay=false", "tracking=off", "inputs.prompt_length=64",
    *(f"model.build.{key}={value}" for key, value in BENCH_SIZE.items()), "+model.build.intermediate_size=null",
]  # fmt: skip


def resident_peaks(device: str) -> dict[str, float]:
    """Peak anonymous memory (MB, sampled every 5 ms) of a llava-bench parity run with resident=both and one."""
    peaks = {}
    for mode in ("both", "one"):
        scratch = Path(tempfile.mkdtemp(prefix="paritylab-resident-"))
        try:
            command = [sys.executable, "-m", "paritylab", *RESIDENT_RUN, f"resident={mode}", f"device={device}"]
            process = subprocess.Popen(command, cwd=scratch, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            peak = 0
            while process.poll() is None:
                peak = max(peak, _anonymous_kb(process.pid))
                time.sleep(0.005)
            if process.returncode != 0:
                raise RuntimeError(f"resident={mode} run exited {process.returncode}: {' '.join(command)}")
            peaks[mode] = peak / 1024
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return peaks


def _anonymous_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            return next((int(line.split()[1]) for line in status if line.startswith("RssAnon:")), 0)
    except (OSError, ValueError):
        return 0  # the process just ended


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", type=Path, default=REPOSITORY / "benchmarks" / "results.json")
    parser.add_argument("--quick", action="store_true", help="a small model and few repetitions (smoke test)")
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    torch.manual_seed(0)
    model, inputs = llava_bench(args.device, args.quick, args.attention)
    timing = time_modes(model, inputs, args.reps, args.device)
    seconds = timing["seconds"]
    results: dict[str, Any] = {
        "device": args.device,
        "attention": args.attention,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "reps": args.reps,
        "seconds": seconds,
        "ratio_to_plain": timing["ratio_to_plain"],
        "full_vs_hf_debugger_time": seconds["full"] / seconds["hf_debugger"],
        "written": timing["written"],
        "bytes_full_vs_hf": timing["written"]["full"]["bytes"] / max(1, timing["written"]["hf_debugger"]["bytes"]),
    }
    if not args.skip_memory:
        peaks = {name: peak_memory(name, args.device, args.quick, args.attention) for name in MODES}
        results["forward_peak_growth_mb"] = peaks
        results["extra_peak_mb"] = {name: peaks[name] - peaks["plain"] for name in MODES}
    results["comparison"], report = comparison_throughput(model, inputs)
    results["logging"] = logging_time(report)
    results["default_run_seconds"] = default_run_wall()
    if not args.skip_memory and not args.quick:
        results["resident_peak_anon_mb"] = resident_peaks(args.device)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1))
    print(render(results))
    return results


def render(results: dict[str, Any]) -> str:
    ratio, seconds, written = results["ratio_to_plain"], results["seconds"], results["written"]
    lines = [
        f"llava-bench ({results['attention']} attention) on {results['device']} ({results['threads']} threads), "
        f"median of {results['reps']} interleaved rounds",
        f"  plain forward             {seconds['plain'] * 1000:8.1f} ms   1.00x",
        f"  paritylab stats only      {seconds['stats'] * 1000:8.1f} ms   {ratio['stats']:.2f}x  (target <= 1.08x)",
        f"  paritylab full capture    {seconds['full'] * 1000:8.1f} ms   {ratio['full']:.2f}x  (target <= 1.2x)",
        f"  transformers debugger     {seconds['hf_debugger'] * 1000:8.1f} ms   {ratio['hf_debugger']:.2f}x",
        f"  full capture vs debugger  time {results['full_vs_hf_debugger_time']:.2f}x, "
        f"bytes {results['bytes_full_vs_hf']:.2f}x (target <= 0.6x)",
        f"  written: full {written['full']['bytes'] / 1e6:.0f} MB in {written['full']['files']} files; "
        f"debugger {written['hf_debugger']['bytes'] / 1e6:.0f} MB in {written['hf_debugger']['files']} files",
    ]
    if "extra_peak_mb" in results:
        extra = results["extra_peak_mb"]
        lines.append(
            f"  peak RSS over plain: stats {extra['stats']:.0f} MB, full {extra['full']:.0f} MB (target <= 64), "
            f"debugger {extra['hf_debugger']:.0f} MB"
        )
    comparison = results["comparison"]
    lines.append(
        f"  comparison: {comparison['gigabytes']:.2f} GB in {comparison['seconds']:.2f} s = "
        f"{comparison['gb_per_s']:.2f} GB/s (target >= 2)"
    )
    lines.append(
        f"  logging {results['logging']['metrics']} metrics to SQLite: {results['logging']['seconds']:.2f} s "
        "(target <= 1.5)"
    )
    lines.append(f"  default parity run: {results['default_run_seconds']:.1f} s wall (target <= 15)")
    if "resident_peak_anon_mb" in results:
        resident = results["resident_peak_anon_mb"]
        lines.append(
            f"  llava-bench parity run, peak anonymous memory: resident=both {resident['both']:.0f} MB, "
            f"resident=one {resident['one']:.0f} MB"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
