"""Take the screenshots in docs/mlflow.md: paritylab runs in a real MLflow server's UI, as a person first sees
them: headless Chromium with a fresh profile, each page loaded by its address, nothing clicked or set up.

    apt-get install -y chromium    # Debian's package
    python scripts/screenshot_mlflow.py [--output docs/]

In a scratch directory it starts ``mlflow server`` on 127.0.0.1 and logs to it, over HTTP: a passing run
(the port), a failing one (the port with one projection scaled by 1.05), a sweep (bf16 and sdpa), and three
scheduled nights of one pair (``tracking.trend=true``), the third with one projection scaled by 1.0001 in the
candidate's code (within tolerance: it passes, and regresses against the nights before). Then it screenshots
the page ``mlflow ui`` opens on, the experiment as it opens, the runs list its description links to, a failing
run's charts, the trend run's charts and its layer × night heatmap, and removes the scratch directory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
]  # fmt: skip
FAULTY = [
    "candidate.ports.llava.build._target_=tests.faulty.scaled_port",
    "+candidate.ports.llava.build.module=llm.layers.1.feed_forward.w2",
    "+candidate.ports.llava.build.scale=1.05",
]
NIGHTLY = """from tests.faulty import scaled_port


def build(reference):
    return scaled_port(reference, module="llm.layers.1.feed_forward.w2", scale={scale})
"""
"""Tonight's candidate code: the configuration stays (one pair, one trend run), the code changes. Scaled by
1.0001 the port is within tolerance (the run passes), but layer 1's error grows far past the nights before."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=REPOSITORY / "docs")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = parser.parse_args()
    if not Path(args.chromium).exists():
        print("chromium not found: apt-get install -y chromium", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="paritylab-shot-"))
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{scratch / 'server.db'}", "--artifacts-destination", str(scratch / "art")],
        cwd=scratch, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "TMPDIR": str(scratch)},  # MLflow's db_init_lock files: removed with the scratch
    )  # fmt: skip
    try:
        _wait(f"{uri}/health")
        _paritylab(scratch, uri, "candidate=port")
        _paritylab(scratch, uri, "candidate=port", *FAULTY)
        _paritylab(scratch, uri, "-m", "candidate=bf16,sdpa", "compare.replay=false")
        for scale in ("1.0", "1.0", "1.0001"):
            (scratch / "nightly_port.py").write_text(NIGHTLY.format(scale=scale))
            _paritylab(scratch, uri, "candidate=port", "candidate.ports.llava.build._target_=nightly_port.build",
                       "tracking.trend=true", "inputs.seed=1", "compare.replay=false")  # fmt: skip
        from mlflow.tracking import MlflowClient

        from paritylab.sink.tracking import runs_link

        client = MlflowClient(uri)
        experiment = client.get_experiment_by_name("paritylab").experiment_id
        runs = client.search_runs([experiment], max_results=100)
        failing = next(
            r
            for r in runs
            if r.data.tags.get("paritylab.verdict") == "fail"
            and r.data.tags.get("paritylab.candidate") == "port"
            and "paritylab.trend_step" not in r.data.tags
        )
        trend = next(r for r in runs if r.data.tags.get("paritylab.trend") == "true")
        args.output.mkdir(parents=True, exist_ok=True)
        base = f"{uri}/#/experiments/{experiment}"
        view = "?workflowType=machine_learning"  # the model-training view, as the description's link opens
        shots = [
            (f"{uri}/", "mlflow_home.png"),  # where `mlflow ui` opens: its home page, the recent experiments
            (base, "mlflow_landing.png"),  # where the experiment opens: MLflow 3.17's GenAI overview
            (f"{uri}/{runs_link(experiment)}", "mlflow_runs.png"),  # the description's link: paritylab's view
            (f"{base}/runs/{failing.info.run_id}/model-metrics{view}", "mlflow_depth.png"),
            (f"{base}/runs/{trend.info.run_id}/model-metrics{view}", "mlflow_trend.png"),
            (f"{base}/runs/{trend.info.run_id}/artifacts/trend_heatmap.svg{view}", "mlflow_trend_heatmap.png"),
        ]
        for url, name in shots:
            render(args.chromium, url)  # once to warm the server up: charts drawn the first time may still load
            render(args.chromium, url, screenshot=args.output / name)
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"wrote {', '.join(name for _, name in shots)} to {args.output}")
    return 0


def render(
    chromium: str, url: str, screenshot: Path | None = None, size: tuple[int, int] = (1900, 1000), wait_ms: int = 15000
) -> str:
    """Load ``url`` in headless Chromium with a fresh profile (no view MLflow remembers), let its scripts run
    for ``wait_ms`` of virtual time, and return the page as rendered (``--dump-dom``), or write a PNG of it to
    ``screenshot`` (then the return value is empty)."""
    with tempfile.TemporaryDirectory(prefix="paritylab-chromium-") as profile:
        action = [f"--screenshot={screenshot}"] if screenshot is not None else ["--dump-dom"]
        command = [
            chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}",
            f"--virtual-time-budget={wait_ms}", *action, url,
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    return "" if screenshot is not None else result.stdout


def _paritylab(scratch: Path, uri: str, *overrides: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(REPOSITORY), str(scratch))), "TMPDIR": str(scratch)}
    command = [sys.executable, "-m", "paritylab", *overrides, f"tracking.uri={uri}"]
    result = subprocess.run(command, cwd=scratch, capture_output=True, text=True, env=env)
    if result.returncode not in (0, 1):
        raise RuntimeError(f"{' '.join(overrides)}: exit {result.returncode}: {result.stdout[-500:]}")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait(url: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {seconds} s")


if __name__ == "__main__":
    sys.exit(main())
