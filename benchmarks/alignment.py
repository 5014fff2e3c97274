"""Alignment cost at scale: two traces of a deep model (default 1,000 blocks, 6,001 calls each), the
candidate's module paths renamed so identical-path matching cannot help.

    python benchmarks/alignment.py [--blocks 1000] [--rounds 3]

Prints the median seconds of ``align`` with parameter fingerprints (what paritylab's traces carry) and
without (traces written by other tools), then removes its temporary traces.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import paritylab
from paritylab.comparison.alignment import align
from paritylab.tracing.tracefile import Trace


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.fc, self.act = nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()
        self.out, self.drop = nn.Linear(width, width), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.out(self.act(self.fc(self.norm(x)))))


class Deep(nn.Module):
    def __init__(self, blocks: int, width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _renamed(path: str) -> str:
    return path.replace("blocks", "layers").replace("fc", "w1")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    reference = Deep(args.blocks).eval()
    candidate = Deep(args.blocks).eval()
    candidate.load_state_dict(reference.state_dict())
    x = torch.randn(2, 8)
    scratch = Path(tempfile.mkdtemp(prefix="paritylab-align-"))
    try:
        for fingerprints in (True, False):
            traces = []
            for name, model in (("reference", reference), ("candidate", candidate)):
                directory = scratch / f"{name}-{fingerprints}"
                with paritylab.trace(model, directory, fingerprint=fingerprints):
                    model(x)
                traces.append(Trace.load(directory))
            for call in traces[1].calls:
                call.path = _renamed(call.path)
            for entry in traces[1].meta.get("structure", []):
                entry["path"] = _renamed(entry["path"])
            times = []
            for _ in range(args.rounds):
                started = time.perf_counter()
                alignment = align(*traces)
                times.append(time.perf_counter() - started)
            label = "with fingerprints" if fingerprints else "without fingerprints"
            print(
                f"align 2 x {len(traces[0].calls)} calls, {label}: {statistics.median(times):.2f} s "
                f"({len(alignment.pairs)} pairs, {len(alignment.unmatched_reference)} unmatched)"
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
