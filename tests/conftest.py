"""Shared fixtures: torch global state is restored after every test."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

# Everything the suite and its subprocesses put in the temporary directory (MLflow's db_init_lock-* files, a
# library's scratch) goes into one folder of this process's, removed at the end: /tmp is left as it was.
_SCRATCH = tempfile.mkdtemp(prefix="paritylab-tests-")
os.environ["TMPDIR"] = tempfile.tempdir = _SCRATCH


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_SCRATCH, ignore_errors=True)


if os.environ.get("PYTEST_XDIST_WORKER"):  # one worker per core: one thread each (subprocesses inherit it)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _restore_torch_state():
    dtype = torch.get_default_dtype()
    threads = torch.get_num_threads()
    rng = torch.get_rng_state()
    grad = torch.is_grad_enabled()
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)
    torch.set_rng_state(rng)
    torch.set_grad_enabled(grad)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real ``mlflow server`` on 127.0.0.1 (its own process group, stopped at the end)."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    from tests.helpers import migrated_store

    root = tmp_path_factory.mktemp("mlflow-server")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
        "--backend-store-uri", migrated_store(root / "server.db"), "--artifacts-destination", str(root / "artifacts"),
        "--workers", "1",
    ]  # fmt: skip
    log = open(root / "server.log", "w")  # noqa: SIM115 - closed below
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            log.close()
            raise RuntimeError(f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}")
        time.sleep(0.5)
    yield uri
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=2)  # uvicorn's graceful shutdown can take seconds; nothing of it is tested
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)
    log.close()


@pytest.fixture(autouse=True)
def _run_in_a_temporary_directory(tmp_path_factory, monkeypatch):
    """Each test runs in its own directory: what a run writes to its working directory (MLflow's ./mlruns
    artifacts, outputs/) never lands in the checkout."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))
