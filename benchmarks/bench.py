"""paritylab benchmark on llava-bench: capture, storage, comparison and logging against a plain forward, naive
hooks, transformers' debugger and (when installed) TorchLens, measured in one run, interleaved, median of several
repetitions after a warm-up.

    python benchmarks/bench.py [--reps 11] [--device cpu|cuda] [--attention sdpa|eager] [--quick]
                               [--skip-memory] [--no-libraries] [--whole-run-rounds 3]

One run measures everything the performance targets name: capture side by side, peak memory per mode, the
comparison and the compare CLI, the parity run's memory against its floor, and (``benchmarks/whole_run.py``) the
whole ``python -m paritylab`` process against building both models and running one forward each.

llava-bench (``benchmarks/llava_bench.py``) is built through the run's own configuration: the model and inputs
``python -m paritylab`` builds at that size, eager attention as configured (``--attention sdpa`` for PyTorch's
kernel). Ratios are medians of per-round ratios (each round runs every mode back to back, so slow phases of a noisy
machine cancel). Peak memory is measured in fresh subprocesses, one per mode, each warmed up by a forward of its own
mode, since a process's peak RSS only ever grows. Everything is written into temporary directories that are removed.
"""

from __future__ import annotations

import argparse
import importlib.util
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
from benchmarks import llava_bench  # noqa: E402

BENCH_SIZE, QUICK_SIZE = llava_bench.SIZE, llava_bench.QUICK_SIZE


def plain(model: torch.nn.Module, inputs: dict[str, torch.Tensor], _: Path) -> None:
    with torch.no_grad():
        model(**inputs)


def stats_only(model: torch.nn.Module, inputs: dict[str, torch.Tensor], _: Path) -> None:
    with paritylab.trace(model, capture=None):
        model(**inputs)


def full_capture(model: torch.nn.Module, inputs: dict[str, torch.Tensor], directory: Path) -> None:
    with paritylab.trace(model, directory, save_tensors=True, capture=None):
        model(**inputs)


_WRITE_FLOOR: dict[str, Any] = {"bytes": 0, "buffer": None}
"""The bytes full capture wrote in the last round (:func:`time_modes` sets it), and a buffer holding that many."""


def write_floor(model: torch.nn.Module, inputs: dict[str, torch.Tensor], directory: Path) -> None:
    """The floor of any capture that keeps every output on disk: a plain forward, then as many bytes as full capture
    wrote, written to one file (its space reserved first) from memory that already holds them (no hook, no copy,
    no format, no statistics): what the page cache alone costs on this machine."""
    plain(model, inputs, directory)
    size = int(_WRITE_FLOOR["bytes"])
    if not size:
        return
    buffer = _WRITE_FLOOR["buffer"]
    if buffer is None or len(buffer) != size:  # made once (round 0 warms up), every page touched: real data
        block = os.urandom(1 << 20)
        buffer = _WRITE_FLOOR["buffer"] = (block * (size // len(block) + 1))[:size]
    with open(directory / "floor.bin", "wb") as handle:
        if hasattr(os, "posix_fallocate"):  # the space reserved first, as paritylab's shards are
            os.posix_fallocate(handle.fileno(), 0, size)
        handle.write(buffer)


def _hooked(model: torch.nn.Module, inputs: dict[str, torch.Tensor], keep: Callable[[str, torch.Tensor], None]) -> None:
    """A forward with a forward hook on every module handing each tensor output to ``keep``."""

    def hook(name: str) -> Callable[..., None]:
        def record(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            items: Any = [output] if isinstance(output, torch.Tensor) else []
            if isinstance(output, dict):  # transformers' ModelOutput
                items = list(output.values())
            elif isinstance(output, tuple | list):
                items = output
            for index, item in enumerate(items):
                if isinstance(item, torch.Tensor):
                    keep(f"{name}.{index}", item)

        return record

    handles = [module.register_forward_hook(hook(name)) for name, module in model.named_modules()]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()


def hooks_references(model: torch.nn.Module, inputs: dict[str, torch.Tensor], _: Path) -> None:
    """What a library that keeps a reference to every output does: no copy, no statistics, nothing written."""
    kept: list[torch.Tensor] = []
    _hooked(model, inputs, lambda _name, tensor: kept.append(tensor))


def hooks_noop(model: torch.nn.Module, inputs: dict[str, torch.Tensor], _: Path) -> None:
    """The floor of any per-module hook: a forward hook on every module that looks at each output and keeps nothing."""
    _hooked(model, inputs, lambda _name, _tensor: None)


def hooks_stats(model: torch.nn.Module, inputs: dict[str, torch.Tensor], _: Path) -> None:
    """Naive statistics: the same three reductions as paritylab's (sum, dot, aminmax) over every output, as floats,
    nothing else (no call tree, no deduplication of a tensor handed on, no inputs)."""

    def summarise(_name: str, tensor: torch.Tensor) -> None:
        if tensor.is_floating_point() and tensor.numel():
            flat = tensor.detach().reshape(-1).float()
            low, high = torch.aminmax(flat)
            torch.stack([flat.sum(), torch.dot(flat, flat), low, high]).tolist()

    _hooked(model, inputs, summarise)


def hooks_copies(model: torch.nn.Module, inputs: dict[str, torch.Tensor], _: Path) -> None:
    """Naive hooks: a copy of every output, kept in a list."""
    kept: list[torch.Tensor] = []
    _hooked(model, inputs, lambda _name, tensor: kept.append(tensor.detach().clone()))


def hooks_safetensors(model: torch.nn.Module, inputs: dict[str, torch.Tensor], directory: Path) -> None:
    """Naive hooks: a copy of every output, written to one safetensors file at the end."""
    from safetensors.torch import save_file

    kept: dict[str, torch.Tensor] = {}

    def keep(name: str, tensor: torch.Tensor) -> None:
        key = name
        while key in kept:  # a module called again
            key += "+"
        kept[key] = tensor.detach().clone().contiguous()

    _hooked(model, inputs, keep)
    save_file(kept, str(directory / "hooks.safetensors"))


def hf_debugger(model: torch.nn.Module, inputs: dict[str, torch.Tensor], directory: Path) -> None:
    from transformers.model_debugging_utils import model_addition_debugger_context

    with model_addition_debugger_context(model, debug_path=str(directory), do_prune_layers=False, use_repr=False):
        model(**inputs)


def torchlens_trace(model: torch.nn.Module, inputs: dict[str, torch.Tensor], _: Path) -> None:
    """TorchLens (every tensor operation logged, its output kept in memory)."""
    import torchlens

    with torch.no_grad():
        torchlens.trace(model, input_kwargs=inputs)


MODES: dict[str, Callable[[torch.nn.Module, dict[str, torch.Tensor], Path], None]] = {
    "plain": plain,
    "stats": stats_only,
    "full": full_capture,
    "write_floor": write_floor,
    "hooks_noop": hooks_noop,
    "hooks_stats": hooks_stats,
    "hooks_references": hooks_references,
    "hooks_copies": hooks_copies,
    "hooks_safetensors": hooks_safetensors,
    "hf_debugger": hf_debugger,
}
LIBRARIES = {"torchlens": torchlens_trace}
"""Other capture libraries, measured when installed (``pip install torchlens``)."""


def available_modes(libraries: bool = True) -> list[str]:
    names = list(MODES)
    if libraries:
        names += [name for name in LIBRARIES if importlib.util.find_spec(name) is not None]
    return names


def _mode(name: str) -> Callable[[torch.nn.Module, dict[str, torch.Tensor], Path], None]:
    return MODES.get(name) or LIBRARIES[name]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_modes(
    model: torch.nn.Module, inputs: dict[str, torch.Tensor], reps: int, device: str, names: list[str]
) -> dict[str, Any]:
    """Median seconds per mode and median per-round ratio to the plain forward, interleaved (plain, stats,
    full, hooks, debugger, ..., plain, ...) after a warm-up round."""
    scratch = Path(tempfile.mkdtemp(prefix="paritylab-bench-"))
    times: dict[str, list[float]] = {name: [] for name in names}
    written: dict[str, dict[str, int]] = {}
    try:
        for round_index in range(reps + 1):
            for name in names:
                directory = scratch / f"{name}-{round_index}"
                directory.mkdir()
                _sync(device)
                start = time.perf_counter()
                _mode(name)(model, inputs, directory)
                _sync(device)
                elapsed = time.perf_counter() - start
                if round_index:  # round 0 warms up
                    times[name].append(elapsed)
                written[name] = _footprint(directory)
                if name == "full":  # the write floor, next, writes as many bytes
                    _WRITE_FLOOR["bytes"] = written[name]["bytes"]
                shutil.rmtree(directory)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    ratios = {
        name: statistics.median(value / plain for value, plain in zip(values, times["plain"], strict=True))
        for name, values in times.items()
    }
    seconds = {name: statistics.median(values) for name, values in times.items()}
    against = {
        f"{ours}/{naive}": statistics.median(a / b for a, b in zip(times[ours], times[naive], strict=True))
        for ours, naive in AGAINST
        if ours in times and naive in times
    }
    return {"seconds": seconds, "ratio_to_plain": ratios, "written": written, "against_naive": against}


AGAINST = (("full", "hooks_safetensors"), ("stats", "hooks_stats"), ("stats", "hooks_noop"))
"""paritylab's modes against the naive hooks doing the same work (or none), as medians of per-round ratios."""


def _footprint(directory: Path) -> dict[str, int]:
    files = [path for path in directory.rglob("*") if path.is_file()]
    return {"bytes": sum(path.stat().st_size for path in files), "files": len(files)}


PEAK_PROBE = """
import gc, pathlib, sys, tempfile
sys.path.insert(0, {repo!r})
from benchmarks import llava_bench
from benchmarks.bench import _mode
model, inputs = llava_bench.build({quick!r}, {attention!r}, {device!r})
run = _mode({mode!r})
with tempfile.TemporaryDirectory(prefix="paritylab-peak-") as scratch:  # removed at the end, whatever happens
    for name in ("warm-up", "measured"):
        (pathlib.Path(scratch) / name).mkdir()
    run(model, inputs, pathlib.Path(scratch) / "warm-up")  # this mode's own warm-up: caches, lazy imports, pools
    gc.collect()
    status = lambda key: int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1])
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
    before = status("VmRSS:")
    run(model, inputs, pathlib.Path(scratch) / "measured")
    print(before, status("VmHWM:"))
"""


def peak_memory(mode: str, device: str, quick: bool, attention: str | None) -> float:
    """Peak RSS growth (MB) of one ``mode`` forward in a fresh process, after a warm-up forward of that mode."""
    code = PEAK_PROBE.format(repo=str(REPOSITORY), device=device, quick=quick, mode=mode, attention=attention)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"peak memory of {mode}: {result.stderr.strip().splitlines()[-1:]}")
    before, peak = (int(value) for value in result.stdout.split()[-2:])
    return (peak - before) / 1024


def comparison_throughput(
    model: torch.nn.Module, inputs: dict[str, torch.Tensor], scratch: Path
) -> tuple[dict[str, float], Any]:
    """GB of tensor data (both sides) compared per second, for two full traces of the same model written into
    ``scratch`` (``a`` and ``b``); also returns the report (its metrics are what a llava-bench run logs)."""
    from paritylab import Trace
    from paritylab.comparison.report import compare_traces

    for side in ("a", "b"):
        full_capture(model, inputs, scratch / side)
    reference = Trace.load(scratch / "a")
    compare_traces(reference, Trace.load(scratch / "b"))  # warm-up (page cache, imports)
    rounds = []
    for _ in range(3):
        start = time.perf_counter()
        report = compare_traces(Trace.load(scratch / "a"), Trace.load(scratch / "b"))
        rounds.append(time.perf_counter() - start)
    elapsed = statistics.median(rounds)
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


def compare_cli(scratch: Path, in_process: float, rounds: int = 3) -> dict[str, float]:
    """``paritylab-compare a b`` (``python -m paritylab.cli.compare``) against ``python -c "import torch"`` plus
    the in-process comparison, whole processes, interleaved; medians."""
    command = [sys.executable, "-m", "paritylab.cli.compare", str(scratch / "a"), str(scratch / "b")]
    times: dict[str, list[float]] = {"cli": [], "import_torch": []}
    for _ in range(rounds + 1):
        for name, argv in (("import_torch", [sys.executable, "-c", "import torch"]), ("cli", command)):
            start = time.perf_counter()
            done = subprocess.run(argv, cwd=REPOSITORY, capture_output=True, text=True, timeout=600)
            if done.returncode not in (0, 1):  # 1: the traces differ (they do not here)
                raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[-300:]}")
            times[name].append(time.perf_counter() - start)
    cli, torch_import = (statistics.median(times[name][1:]) for name in ("cli", "import_torch"))
    return {"cli_s": cli, "import_torch_s": torch_import, "ratio": cli / (torch_import + in_process)}


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


FLOOR = """
import sys, torch
sys.path.insert(0, {repository!r})
from paritylab.cli.app import compose
from paritylab.run.candidates import build_candidate, instantiate
from paritylab.run.inputs import build_inputs
cfg = compose({overrides!r})
torch.manual_seed(0)
reference = instantiate("model.build", cfg.model.build)
inputs = build_inputs(cfg.inputs, cfg.model.family, reference, None)
with torch.no_grad():
    reference(**inputs)
if {both!r}:
    candidate = build_candidate(cfg.candidate, cfg.model.family, reference).model
    with torch.no_grad():
        candidate(**{{k: v.to(torch.bfloat16) if v.is_floating_point() and {bf16!r} else v for k, v in inputs.items()}})
"""
"""The least any parity tool must do: build the reference (and the candidate) and run one forward each."""


def floor_code(overrides: list[str], both: bool = True) -> str:
    bf16 = "candidate=bf16" in overrides or "candidate.dtype=bfloat16" in overrides
    return FLOOR.format(repository=str(REPOSITORY), overrides=overrides, both=both, bf16=bf16)


def resident_peaks(device: str, quick: bool, attention: str | None) -> dict[str, float]:
    """Peak anonymous memory (MB, sampled every 5 ms) of a llava-bench parity run with resident=both and one,
    against building the two models and running one forward each (``floor_both``) and the reference alone
    (``floor_one``), each a fresh process. MLflow is off here: its child process is not the run's memory."""
    base = [*llava_bench.overrides(quick, attention), "candidate=port"]
    commands = {
        "floor_both": [sys.executable, "-c", floor_code(base)],
        "floor_one": [sys.executable, "-c", floor_code(base, both=False)],
        **{
            mode: [sys.executable, "-m", "paritylab", *base, "tracking=off", f"resident={mode}", f"device={device}"]
            for mode in ("both", "one")
        },
    }
    peaks = {}
    for name, command in commands.items():
        scratch = Path(tempfile.mkdtemp(prefix="paritylab-resident-"))
        try:
            process = subprocess.Popen(command, cwd=scratch, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            peak = 0
            while process.poll() is None:
                peak = max(peak, _anonymous_kb(process.pid))
                time.sleep(0.005)
            if process.returncode not in (0, 1):  # 1: a port that differs is still a run that finished
                raise RuntimeError(f"{name} exited {process.returncode}: {' '.join(command)}")
            peaks[name] = peak / 1024
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return peaks


def _anonymous_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            return next((int(line.split()[1]) for line in status if line.startswith("RssAnon:")), 0)
    except (OSError, ValueError):
        return 0  # the process just ended


def profile_mode(
    name: str, model: torch.nn.Module, inputs: dict[str, torch.Tensor], device: str, rounds: int = 5
) -> str:
    """Where one mode's time goes over ``rounds`` forwards: the Python functions by their own time (cProfile), and
    the operators the device ran, by count and time (torch.profiler), for the next round of optimisation."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    scratch = Path(tempfile.mkdtemp(prefix="paritylab-profile-"))
    try:
        _mode(name)(model, inputs, scratch / "warm")
        profiler = cProfile.Profile()
        _sync(device)
        profiler.enable()
        for index in range(rounds):
            _mode(name)(model, inputs, scratch / f"p{index}")
        _sync(device)
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
        with profile(activities=activities) as operators:
            _mode(name)(model, inputs, scratch / "operators")
            _sync(device)
        order = "cuda_time_total" if device.startswith("cuda") else "cpu_time_total"
        table = operators.key_averages().table(sort_by=order, row_limit=20)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return f"== profile of {LABELS.get(name, name)}, {rounds} forwards\n{text.getvalue()}\n{table}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", type=Path, default=REPOSITORY / "benchmarks" / "results.json")
    parser.add_argument("--quick", action="store_true", help="a small model and few repetitions (smoke test)")
    parser.add_argument("--attention", choices=["sdpa", "eager"], help="default: the run's configuration (eager)")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--no-libraries", action="store_true", help="skip other capture libraries (TorchLens)")
    parser.add_argument("--skip-logging", action="store_true", help="skip MLflow's logging time (no mlflow there)")
    parser.add_argument(
        "--whole-run-rounds", type=int, default=3, help="rounds of benchmarks/whole_run.py in this run (0: skip)"
    )
    parser.add_argument(
        "--default-run-rounds", type=int, default=3, help="runs of the default python -m paritylab (0: skip)"
    )
    parser.add_argument("--only-capture", action="store_true", help="capture side by side and the default run only")
    parser.add_argument(
        "--profile", metavar="MODE", action="append", default=[], help="print where MODE's time goes (repeatable)"
    )
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    model, inputs = llava_bench.build(args.quick, args.attention, args.device)
    names = available_modes(not args.no_libraries)
    timing = time_modes(model, inputs, args.reps, args.device, names)
    seconds = timing["seconds"]
    results: dict[str, Any] = {
        "device": args.device,
        "attention": args.attention or str(model.config.text_config._attn_implementation),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "reps": args.reps,
        "seconds": seconds,
        "ratio_to_plain": timing["ratio_to_plain"],
        "against_naive": timing["against_naive"],
        "full_vs_hf_debugger_time": seconds["full"] / seconds["hf_debugger"],
        "written": timing["written"],
        "bytes_full_vs_hf": timing["written"]["full"]["bytes"] / max(1, timing["written"]["hf_debugger"]["bytes"]),
    }
    if args.default_run_rounds > 0:
        from benchmarks import whole_run

        results["default_run"] = whole_run.default_phases(args.default_run_rounds)
        results["default_run_rounds"] = args.default_run_rounds
    for name in args.profile:
        print(profile_mode(name, model, inputs, args.device))
    if args.only_capture:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=1))
        print(render(results))
        return results
    if not args.skip_memory:
        measured = [name for name in names if name not in ("write_floor", "hooks_noop", "hooks_stats")]  # no peak
        # of their own: the first's is the plain forward's, the others keep nothing
        peaks = {name: peak_memory(name, args.device, args.quick, args.attention) for name in measured}
        results["forward_peak_growth_mb"] = peaks
        results["extra_peak_mb"] = {name: peaks[name] - peaks["plain"] for name in measured}
    scratch = Path(tempfile.mkdtemp(prefix="paritylab-compare-"))
    try:
        results["comparison"], report = comparison_throughput(model, inputs, scratch)
        results["compare_cli"] = compare_cli(scratch, results["comparison"]["seconds"])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if not args.skip_logging:
        results["logging"] = logging_time(report)
    if not args.skip_memory:
        results["resident_peak_anon_mb"] = resident_peaks(args.device, args.quick, args.attention)
    if args.whole_run_rounds > 0 and args.device == "cpu":
        from benchmarks import whole_run

        results["whole_run"] = whole_run.measure(args.whole_run_rounds, args.quick)
        results["whole_run_rounds"] = args.whole_run_rounds
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1))
    print(render(results))
    return results


LABELS = {
    "plain": "plain forward",
    "stats": "paritylab stats only",
    "full": "paritylab full capture",
    "write_floor": "forward + writing those bytes",
    "hooks_noop": "hooks doing nothing",
    "hooks_stats": "hooks + the same statistics",
    "hooks_references": "hooks keeping references",
    "hooks_copies": "hooks keeping copies",
    "hooks_safetensors": "hooks + one safetensors file",
    "hf_debugger": "transformers debugger",
    "torchlens": "TorchLens",
}
TARGETS = {"stats": "target <= 1.08x", "full": "target <= 1.2x"}


def render(results: dict[str, Any]) -> str:
    ratio, seconds, written = results["ratio_to_plain"], results["seconds"], results["written"]
    extra = results.get("extra_peak_mb", {})
    lines = [
        f"llava-bench ({results['attention']} attention) on {results['device']} ({results['threads']} threads), "
        f"median of {results['reps']} interleaved rounds",
        f"  {'mode':30} {'time':>9} {'ratio':>6} {'extra peak':>11} {'written':>16}",
    ]
    for name, value in seconds.items():
        memory = f"{extra[name]:+8.0f} MB" if name in extra else ""
        files = written[name]
        wrote = f"{files['bytes'] / 1e6:6.0f} MB in {files['files']:3d}" if files["files"] else ""
        target = f"  ({TARGETS[name]})" if name in TARGETS else ""
        lines.append(f"  {LABELS[name]:30} {value * 1000:6.0f} ms {ratio[name]:5.2f}x {memory:>11} {wrote:>16}{target}")
    lines.append(
        "  against naive hooks (median of per-round ratios): "
        + ", ".join(f"{pair.replace('/', ' / ')} {value:.2f}x" for pair, value in results["against_naive"].items())
    )
    lines.append(
        f"  full capture vs debugger: time {results['full_vs_hf_debugger_time']:.2f}x, "
        f"bytes {results['bytes_full_vs_hf']:.2f}x; extra peak memory target <= 64 MB"
    )
    if "default_run" in results:
        from benchmarks import whole_run

        lines.append(whole_run.render_default(results["default_run"], results["default_run_rounds"]))
    if "comparison" not in results:  # --only-capture
        return "\n".join(lines)
    comparison, cli = results["comparison"], results["compare_cli"]
    lines.append(
        f"  comparison: {comparison['gigabytes']:.2f} GB in {comparison['seconds']:.2f} s = "
        f"{comparison['gb_per_s']:.2f} GB/s (target >= 2)"
    )
    lines.append(
        f"  paritylab-compare CLI: {cli['cli_s']:.2f} s = {cli['ratio']:.2f}x "
        f"(import torch {cli['import_torch_s']:.2f} s + in-process comparison; target <= 1.5x)"
    )
    if "logging" in results:
        logged = results["logging"]
        lines.append(f"  logging {logged['metrics']} metrics to SQLite: {logged['seconds']:.2f} s")
    if "resident_peak_anon_mb" in results:
        peak = results["resident_peak_anon_mb"]
        lines.append(
            f"  parity run, peak anonymous memory: resident=both {peak['both']:.0f} MB = "
            f"{peak['both'] / peak['floor_both']:.2f}x two models + forwards "
            f"({peak['floor_both']:.0f} MB; target <= 1.2x);"
            f" resident=one {peak['one']:.0f} MB = {peak['one'] / peak['floor_one']:.2f}x the reference + its forward "
            f"({peak['floor_one']:.0f} MB)"
        )
    if "whole_run" in results:
        from benchmarks import whole_run

        lines.append("whole run (python -m paritylab against building both models and one forward each):")
        lines.append(whole_run.render(results["whole_run"], results["whole_run_rounds"]))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
