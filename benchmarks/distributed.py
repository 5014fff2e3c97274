"""Tensor parallelism at 2 ranks on the CPU: the traced TP forward against the plain TP forward, in the same ranks.

    python benchmarks/distributed.py [--rounds 5] [--hidden 256] [--layers 4] [--length 128] [--ranks 2]

One launch of ``--ranks`` gloo ranks through paritylab's own launcher (:mod:`paritylab.distributed.launch`: fresh
worker processes, the reference's weights handed over as safetensors) builds ``experiments/tp_llama.py``'s
port of a small random-init Llama on every rank. Each rank then runs, after a warm-up round, ``--rounds``
interleaved rounds (the order alternates round by round) of:

- ``plain``: the TP forward in ``torch.no_grad()``: what the port costs on its own;
- ``traced``: the same forward as a rank of a paritylab run traces it: under paritylab's ``Tracer`` with every
  tensor saved (no parameter fingerprints, as the worker sets) and the DTensor placements recorded
  (``PlacementRecorder``), into that round's own directory.

Each forward is timed between barriers as the slowest rank's. Then this process does the rest of what paritylab
does with a round's rank traces: merges them into one trace of whole tensors, compares it with the one-device
reference's trace and localises (:func:`paritylab.distributed.compare_ranks`), timed per round. Medians over the
rounds; the ratio is the median of per-round ratios. Everything is written into a temporary directory that is
removed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))  # the ranks import this module as the builder (they get this sys.path)

from paritylab.distributed import compare_ranks  # noqa: E402
from paritylab.distributed.launch import (  # noqa: E402
    INPUTS_FILE,
    LaunchSpec,
    RankContext,
    prepare,
    run_ranks,
    state_dict_of,
)
from paritylab.tracing.tracefile import Trace  # noqa: E402
from paritylab.tracing.tracer import TraceOptions, Tracer  # noqa: E402

BUILDER = "benchmarks.distributed:timed_build"
TIMINGS = "timings.json"


def llama(hidden: int, layers: int, heads: int, vocab: int) -> nn.Module:
    """The one-device reference: a seeded random-init transformers Llama (eager attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=int(8 * hidden / 3 + 7) // 8 * 8, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab, max_position_embeddings=4096,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def timed_build(context: RankContext) -> nn.Module:
    """The builder the ranks run: ``experiments/tp_llama.py``'s TP port, timed plain and traced on this rank
    (``options``: ``rounds`` and the ``out`` directory); rank 0 writes the timings. It returns the port, which
    the worker then traces once more as usual (not timed)."""
    import torch.distributed as dist
    from paritylab.experiments.tp_llama import build

    from paritylab.distributed.launch import load_tensors
    from paritylab.distributed.placements import PlacementRecorder

    model = build(context)
    out = Path(str(context.options["out"]))
    inputs = load_tensors(Path(str(context.options["inputs"])))
    metadata = {"rank": str(context.rank), "world_size": str(context.world_size)}  # as the worker records them
    traced_options = TraceOptions(save_tensors=True, fingerprint=False, metadata=metadata)

    def plain(_: int) -> None:
        with torch.no_grad():
            model(**inputs)

    def traced(number: int) -> None:
        folder = out / f"round{number}" / f"rank{context.rank}"
        with PlacementRecorder(model, folder), Tracer(model, folder, traced_options):
            model(**inputs)

    def timed(run: Any, number: int) -> float:
        dist.barrier()
        started = time.perf_counter()
        run(number)
        dist.barrier()
        slowest = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return float(slowest)

    times: dict[str, list[float]] = {"plain": [], "traced": []}
    for number in range(int(context.options["rounds"]) + 1):  # round 0 warms up
        order = [("plain", plain), ("traced", traced)]
        for name, run in order if number % 2 else reversed(order):
            seconds = timed(run, number)
            if number:
                times[name].append(seconds)
    if context.rank == 0:
        (out / TIMINGS).write_text(json.dumps({"threads": torch.get_num_threads(), **times}), encoding="utf-8")
    return model


def measure(rounds: int, hidden: int, layers: int, heads: int, vocab: int, length: int, ranks: int) -> dict[str, Any]:
    """Median seconds of the plain and the traced TP forward, of merging and comparing a round's rank traces,
    the median per-round ratio, and what the run wrote per round."""
    scratch = Path(tempfile.mkdtemp(prefix="paritylab-distributed-bench-"))
    try:
        reference = llama(hidden, layers, heads, vocab)
        inputs = {"input_ids": torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(1))}
        with Tracer(reference, scratch / "reference", TraceOptions(save_tensors=True)):
            reference(**inputs)
        reference_trace = Trace.load(scratch / "reference")
        prepare(scratch / "ranks", inputs, state_dict_of(reference))
        out = scratch / "timed"
        options = {
            "config": reference.config.to_dict(), "rounds": rounds, "out": str(out),
            "inputs": str(scratch / "ranks" / INPUTS_FILE),
        }  # fmt: skip
        started = time.perf_counter()
        (launch,) = run_ranks(LaunchSpec(BUILDER, ranks, scratch / "ranks", options=options, timeout_s=1800))
        launch_seconds = time.perf_counter() - started
        if not launch.ok:
            raise RuntimeError(launch.error_line())
        timings = json.loads((out / TIMINGS).read_text(encoding="utf-8"))
        merged: list[float] = []
        for number in range(1, rounds + 1):
            folders = [out / f"round{number}" / f"rank{rank}" for rank in range(ranks)]
            started = time.perf_counter()
            result = compare_ranks(reference_trace, folders, scratch / "judged" / str(number))
            merged.append(time.perf_counter() - started)
            if result.verdict != "pass":
                raise RuntimeError(f"round {number}: the clean port did not pass ({result.verdict})")
        written = sum(path.stat().st_size for path in (out / "round1").rglob("*") if path.is_file())
        plain, traced = timings["plain"], timings["traced"]
        return {
            "ranks": ranks,
            "threads_per_rank": timings["threads"],
            "rounds": rounds,
            "shape": {"hidden": hidden, "layers": layers, "heads": heads, "vocab": vocab, "tokens": length},
            "plain_s": statistics.median(plain),
            "traced_s": statistics.median(traced),
            "ratio": statistics.median(t / p for t, p in zip(traced, plain, strict=True)),
            "merge_compare_s": statistics.median(merged),
            "written_mb_per_round": written / 1e6,
            "launch_s": launch_seconds,
        }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def render(results: dict[str, Any]) -> str:
    shape = results["shape"]
    lines = [
        f"tensor parallel at {results['ranks']} ranks (gloo, CPU, {results['threads_per_rank']} thread(s) per rank), "
        f"Llama hidden {shape['hidden']}, {shape['layers']} layers, {shape['heads']} heads, vocabulary "
        f"{shape['vocab']}, {shape['tokens']} tokens; medians of {results['rounds']} interleaved rounds",
        f"  plain TP forward (torch.no_grad)          {results['plain_s'] * 1000:8.1f} ms   1.00x",
        f"  traced TP forward (paritylab's ranks)     {results['traced_s'] * 1000:8.1f} ms   {results['ratio']:.2f}x"
        f"   ({results['written_mb_per_round']:.1f} MB written per forward, all ranks)",
        f"  then, in this process: merge + compare + localise {results['merge_compare_s'] * 1000:.0f} ms per run",
        f"  the whole launch (start, import, build, {results['rounds'] + 1} rounds each): {results['launch_s']:.1f} s",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after a warm-up round (at least 3)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--length", type=int, default=128, help="tokens in the one sequence")
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args(argv)
    if args.rounds < 3:
        parser.error("--rounds must be at least 3")
    results = measure(args.rounds, args.hidden, args.layers, args.heads, args.vocab, args.length, args.ranks)
    print(render(results))
    return results


if __name__ == "__main__":
    main()
