"""Take the README's screenshot: a parity run's divergence charts in the MLflow UI, via headless Chromium.

    apt-get install -y chromium    # Debian's package (Playwright's own browser download does not work here)
    pip install playwright         # the Python client only; it drives the Debian chromium above
    python scripts/screenshot_mlflow.py [--output docs/mlflow_divergence.png]

It runs ``python -m paritylab candidate=bf16`` in a scratch directory (a run with visible divergence),
serves that store with ``mlflow ui`` on 127.0.0.1, and screenshots the run's metric charts.
"""

from __future__ import annotations

import argparse
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
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=REPOSITORY / "docs" / "mlflow_divergence.png")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = parser.parse_args()
    if not Path(args.chromium).exists():
        print("chromium not found: apt-get install -y chromium", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="paritylab-shot-"))
    store = f"sqlite:///{scratch / 'mlflow.db'}"
    subprocess.run(
        [sys.executable, "-m", "paritylab", "candidate=bf16", "model.build.layers=4", f"tracking.uri={store}"],
        cwd=scratch, check=True, capture_output=True,
    )  # fmt: skip
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("paritylab")
    runs = client.search_runs([experiment.experiment_id])
    run = next(r for r in runs if "paritylab.pair" in r.data.tags and r.data.tags.get("paritylab.trend") != "true")
    port = _free_port()
    command = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", store, "--host", "127.0.0.1"]
    server = subprocess.Popen(
        [*command, "--port", str(port)],
        cwd=scratch, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        _wait(f"{base}/health")
        url = f"{base}/#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}/model-metrics"
        args.output.parent.mkdir(parents=True, exist_ok=True)
        shoot(args.chromium, url, args.output)
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"wrote {args.output}")
    return 0


def shoot(chromium: str, url: str, output: Path) -> None:
    """Open ``url``, filter the charts to the per-module divergence, wait for them to draw, screenshot."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS[1:])
        page = browser.new_page(viewport={"width": 1500, "height": 1000})
        page.goto(url, wait_until="networkidle")
        for label in ("Close", "close"):  # the assistant side panel, when the UI shows one
            button = page.get_by_role("button", name=label)
            if button.count():
                button.first.click()
                break
        page.get_by_placeholder("Search metric charts").fill("divergence/")
        page.wait_for_selector("svg .main-svg, canvas, .js-plotly-plot", timeout=60000)
        page.wait_for_timeout(3000)
        page.screenshot(path=str(output))
        browser.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


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
