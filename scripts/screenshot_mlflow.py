"""Take the screenshots in docs/mlflow.md: paritylab runs in a real MLflow server's UI, via headless Chromium.

    apt-get install -y chromium    # Debian's package (Playwright's own browser download does not work here)
    pip install playwright         # the Python client only; it drives the Debian chromium above
    python scripts/screenshot_mlflow.py [--output docs/]

In a scratch directory it starts ``mlflow server`` on 127.0.0.1 and logs to it, over HTTP: a passing run
(the port), a failing one (the port with one projection scaled by 1.05), a sweep (bf16 and sdpa), and three
scheduled nights of one pair (``tracking.trend=true``). Then it screenshots a failing run's depth charts,
the runs list, the trend run's charts and its layer × night heatmap, and removes the scratch directory.
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
from typing import Any

REPOSITORY = Path(__file__).resolve().parents[1]
CHROMIUM_FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--hide-scrollbars",
]  # fmt: skip
FAULTY = [
    "candidate.ports.llava.build._target_=tests.faulty.scaled_port",
    "+candidate.ports.llava.build.module=llm.layers.1.feed_forward.w2",
    "+candidate.ports.llava.build.scale=1.05",
]


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
    )  # fmt: skip
    try:
        _wait(f"{uri}/health")
        _paritylab(scratch, uri, "candidate=port")
        _paritylab(scratch, uri, "candidate=port", *FAULTY)
        _paritylab(scratch, uri, "-m", "candidate=bf16,sdpa", "compare.replay=false")
        for _ in range(3):
            _paritylab(scratch, uri, "candidate=port", "tracking.trend=true", "inputs.seed=1")
        from mlflow.tracking import MlflowClient

        client = MlflowClient(uri)
        experiment = client.get_experiment_by_name("paritylab").experiment_id
        runs = client.search_runs([experiment], max_results=100)
        failing = next(r for r in runs if r.data.tags.get("paritylab.verdict") == "fail")
        trend = next(r for r in runs if r.data.tags.get("paritylab.trend") == "true")
        args.output.mkdir(parents=True, exist_ok=True)
        base = f"{uri}/#/experiments/{experiment}"
        shots = [
            (f"{base}/runs/{failing.info.run_id}/model-metrics", "depth/", "mlflow_depth.png"),
            (f"{base}/runs", None, "mlflow_runs.png"),
            (f"{base}/runs/{trend.info.run_id}/model-metrics", "nightly/", "mlflow_trend.png"),
            (f"{base}/runs/{trend.info.run_id}/artifacts", "trend_heatmap.svg", "mlflow_trend_heatmap.png"),
        ]
        shoot(args.chromium, shots, args.output)
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"wrote {', '.join(name for *_, name in shots)} to {args.output}")
    return 0


def _paritylab(scratch: Path, uri: str, *overrides: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPOSITORY)}
    command = [sys.executable, "-m", "paritylab", *overrides, f"tracking.uri={uri}"]
    result = subprocess.run(command, cwd=scratch, capture_output=True, text=True, env=env)
    if result.returncode not in (0, 1):
        raise RuntimeError(f"{' '.join(overrides)}: exit {result.returncode}: {result.stdout[-500:]}")


def shoot(chromium: str, shots: list[tuple[str, str | None, str]], output: Path) -> None:
    """Open each page, narrow it (chart search, or the artifact to open), let it draw, screenshot."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1900, "height": 1000})
        for url, narrow, name in shots:
            page.goto(url, wait_until="load")  # the runs list polls: never "network idle"
            page.wait_for_timeout(5000)
            _close_panels(page)
            training = page.get_by_text("Model training", exact=True)
            if training.count():  # MLflow 3 opens in its GenAI view; parity runs are model-training runs
                training.first.click()
                page.goto(url, wait_until="load")
                page.wait_for_timeout(4000)
            if name == "mlflow_runs.png":
                _show_columns(page, "paritylab.verdict", "paritylab.first_divergence", "paritylab.regression")
            elif narrow and name.endswith("heatmap.png"):
                page.get_by_text(narrow).first.click()
            elif narrow:
                page.get_by_placeholder("Search metric charts").fill(narrow)
            page.wait_for_timeout(4000)
            page.screenshot(path=str(output / name))
        browser.close()


def _show_columns(page: Any, *tags: str) -> None:
    """Add tag columns to the runs list (what a user does once: Columns, search, tick)."""
    page.get_by_role("button", name="Columns").first.click()
    page.wait_for_timeout(1000)
    for tag in tags:
        page.get_by_placeholder("Search columns").fill(tag)
        page.wait_for_timeout(800)
        page.get_by_text(tag, exact=True).first.click()
        page.wait_for_timeout(500)
    page.keyboard.press("Escape")


def _close_panels(page: Any) -> None:
    for label in ("Close", "close"):  # the assistant side panel, when the UI shows one
        button = page.get_by_role("button", name=label)
        if button.count():
            button.first.click()
            return


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
