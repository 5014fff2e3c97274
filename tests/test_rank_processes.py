"""The ranks' processes: everything a rank starts ends with it, however the run ends.

A rank's builder starts two grandchildren (long sleeps) and writes their pids and its own down; after the launch returns
(success, a failure, the time limit) or is interrupted (SIGINT to a launcher in its own process), the OS is
asked whether any of them is still alive (``/proc``: a zombie waiting for its reaper counts as gone).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from paritylab.distributed.launch import LaunchSpec, RankContext, prepare, run_ranks
from tests.helpers import ctrl_c_heard

pytestmark = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and dist.is_available() and dist.is_gloo_available()),
    reason="needs /proc and torch.distributed with gloo",
)
BUILDER = "tests.test_rank_processes:spawning"
REPOSITORY = Path(__file__).resolve().parents[1]


def spawning(context: RankContext) -> nn.Module:
    """Start two grandchildren (one ignores SIGTERM), note their pids and the rank's own, then succeed, fail or hang
    as asked."""
    pids = []
    for ignore in (False, True):
        code = "import signal, time\n" + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore else "")
        pids.append(subprocess.Popen([sys.executable, "-c", code + "time.sleep(300)"]).pid)
    folder = Path(context.options["pids"])
    (folder / f"rank{context.rank}.pids.part").write_text(" ".join(map(str, [os.getpid(), *pids])))
    (folder / f"rank{context.rank}.pids.part").rename(folder / f"rank{context.rank}.pids")
    mode = context.options["mode"]
    if mode == "fail":
        raise RuntimeError("planted failure after starting two processes")
    if mode == "hang":
        time.sleep(300)
    return Doubling()


class Doubling(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (exists and is not a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def grandchildren(folder: Path, world_size: int) -> list[int]:
    return [int(pid) for rank in range(world_size) for pid in (folder / f"rank{rank}.pids").read_text().split()]


def gone(pids: list[int], within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(alive(pid) for pid in pids)


def _spec(tmp_path: Path, mode: str, world_size: int = 1, timeout_s: float = 120.0) -> LaunchSpec:
    directory = tmp_path / "ranks"
    prepare(directory, {"x": torch.ones(3)}, None)
    options = {"mode": mode, "pids": str(tmp_path)}
    return LaunchSpec(BUILDER, world_size, directory, options=options, timeout_s=timeout_s, grace_s=1.0)


@pytest.mark.parametrize(("mode", "world_size"), [("ok", 2), ("fail", 1), ("hang", 1)])
def test_nothing_a_rank_started_outlives_the_launch(tmp_path: Path, mode: str, world_size: int) -> None:
    spec = _spec(tmp_path, mode, world_size, timeout_s=20.0 if mode == "hang" else 120.0)
    (result,) = run_ranks(spec)
    pids = grandchildren(tmp_path, world_size)
    assert len(pids) == 3 * world_size
    assert result.ok is (mode == "ok")
    assert result.timed_out is (mode == "hang")
    assert gone(pids), [pid for pid in pids if alive(pid)]


LAUNCHER = """
import sys
from pathlib import Path
import torch
from paritylab.distributed.launch import LaunchSpec, prepare, run_ranks
root = Path(sys.argv[1])
prepare(root / "ranks", {"x": torch.ones(3)}, None)
spec = LaunchSpec("tests.test_rank_processes:spawning", 1, root / "ranks", options={"mode": "hang", "pids": str(root)},
                  timeout_s=240)
try:
    run_ranks(spec)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(130)
"""


def test_a_ctrl_c_to_the_launcher_ends_the_ranks_and_what_they_started(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPOSITORY), os.environ.get("PYTHONPATH", "")])}
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env, preexec_fn=ctrl_c_heard,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not (tmp_path / "rank0.pids").exists() and time.monotonic() < deadline and launcher.poll() is None:
        time.sleep(0.1)
    assert (tmp_path / "rank0.pids").exists(), launcher.communicate()[0]
    launcher.send_signal(signal.SIGINT)
    output, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 130 and "interrupted" in output, output
    assert gone(grandchildren(tmp_path, 1))
