"""MLflow in a child process (``tracking.process=child``): the same run logged, MLflow never imported by the run's
process, and a Ctrl-C or a dead child handled as the inline connection handles them."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from paritylab.cli.app import compose
from paritylab.run.runner import run
from paritylab.sink.connection import Opening
from paritylab.sink.publish import RunRecord
from paritylab.sink.tracking import Metric, TrackingError
from paritylab.sink.worker import ChildConnection
from tests.helpers import migrated_store
from tests.test_runner import _user_candidate

REPOSITORY = Path(__file__).resolve().parents[1]


def test_a_run_logged_from_a_child_process_is_the_run_logged_inline(tmp_path):
    uri = migrated_store(tmp_path / "mlflow.db")
    client = MlflowClient(uri)
    logged = {}
    user_configs = _user_candidate(tmp_path)  # a port whose first MLP is scaled by 1.05
    for process in ("inline", "child"):
        overrides = [f"tracking.uri={uri}", f"tracking.process={process}", f"tracking.experiment={process}"]
        overrides += ["candidate=scaled", "compare.replay=false"]  # one experiment each: no baseline between them
        result = run(compose(overrides, str(user_configs)), tmp_path / process, echo=lambda _: None)
        assert result.exit_code == 1 and result.tracking_error is None  # the planted scale fails parity
        mlflow_run = client.get_run(result.run_id)
        assert mlflow_run.info.status == "FAILED"  # the planted scale fails: red
        assert json.loads((tmp_path / process / "run.json").read_text())["run_id"] == result.run_id
        metrics = {key: value for key, value in mlflow_run.data.metrics.items() if not key.startswith("seconds/")}
        artifacts = {item.path for item in client.list_artifacts(result.run_id, "candidate")}
        logged[process] = (metrics, mlflow_run.data.tags["paritylab.first_divergence"], artifacts)
    inline, child = logged["inline"], logged["child"]
    assert child[0] == inline[0] and len(child[0]) > 20  # every metric, value for value
    assert child[1] == inline[1] != "none"
    assert child[2] == inline[2] and any(path.endswith(".safetensors") for path in child[2])  # a failing run's shards


PROBE = """
import sys
sys.path.insert(0, {repository!r})
from paritylab.cli.app import compose
from paritylab.run.runner import run
result = run(compose([{uri!r}, "compare.replay=false"]), {directory!r}, echo=lambda _: None)
print(result.exit_code, result.run_id, "mlflow" in sys.modules)
"""


@pytest.mark.slow
def test_the_run_process_never_imports_mlflow(tmp_path):
    """By default (``auto``) a fresh process leaves MLflow to a child: its 3 s import overlaps the run."""
    uri = migrated_store(tmp_path / "mlflow.db")
    code = PROBE.format(repository=str(REPOSITORY), uri=f"tracking.uri={uri}", directory=str(tmp_path / "run"))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    exit_code, run_id, imported = result.stdout.split()[-3:]
    assert (exit_code, imported) == ("0", "False"), result.stdout + result.stderr
    logged = MlflowClient(uri).get_run(run_id)
    assert logged.info.status == "FINISHED" and logged.data.tags["paritylab.verdict"] == "pass"
    assert logged.data.metrics["summary/failing_modules"] == 0
    assert logged.data.metrics["summary/weights_differing"] == 0  # the weight ledger: every port weight matched
    assert logged.data.metrics["summary/unaccounted_calls"] == 0  # the call ledger: every reference call checked


def _record(uri: str) -> RunRecord:
    return RunRecord(run_name="probe", experiment="worker", uri=uri, tags={}, params={"a": "1"})


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_a_ctrl_c_while_the_child_waits_on_a_server_interrupts_the_child_too(tmp_path, inherited):
    """A server that accepts connections and never answers: the child would wait out the 30 s timeout; a Ctrl-C
    in the run reaches it at once, and it answers the run's next request. ``ignored``: the run was started from a
    background shell or nohup, so SIGINT is ignored when the child starts; the child hears the run's all the same."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        before = signal.signal(signal.SIGINT, signal.SIG_IGN) if inherited == "ignored" else None
        try:
            connection = ChildConnection(Opening(_record(f"http://127.0.0.1:{silent.getsockname()[1]}"), 30.0, 0))
        finally:
            if before is not None:
                signal.signal(signal.SIGINT, before)

        def interrupt(*_: object) -> None:
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGALRM, interrupt)
        started = time.monotonic()
        try:
            signal.setitimer(signal.ITIMER_REAL, 3.0)
            with pytest.raises(KeyboardInterrupt):
                connection.ready()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        with pytest.raises(TrackingError, match="KeyboardInterrupt"):
            connection.end("KILLED")  # the open it interrupted is answered first: it failed
        assert time.monotonic() - started < 20
        connection.close()
    assert connection.process.returncode == 0


def test_a_child_that_dies_is_a_tracking_error_not_a_hang(tmp_path):
    connection = ChildConnection(Opening(_record(migrated_store(tmp_path / "mlflow.db")), 10.0, 0))
    connection.process.kill()
    with pytest.raises(TrackingError, match="worker process ended while asked to open the run"):
        connection.ready()
    with pytest.raises(TrackingError, match="worker process ended"):  # again, at once: nothing left to read
        connection.ready()
    connection.end("FAILED")  # nothing to end: the run was never opened
    connection.close()


def test_the_child_opens_the_run_it_is_given(tmp_path):
    uri = migrated_store(tmp_path / "mlflow.db")
    record = _record(uri)
    record.tags = {"paritylab.verdict": "pending"}
    record.metrics = [Metric("summary/failing_modules", 3.0)]  # published at the end, not sent to open the run
    connection = ChildConnection(Opening(record, 10.0, 0))
    run_id = connection.ready()
    assert run_id is not None and run_id in connection.link()
    logged = MlflowClient(uri).get_run(run_id)
    assert logged.info.run_name == "probe" and logged.data.params == {"a": "1"}
    assert logged.data.tags["paritylab.verdict"] == "pending" and logged.info.status == "RUNNING"
    connection.end("FAILED")
    assert MlflowClient(uri).get_run(run_id).info.status == "FAILED"
    connection.close()
    assert connection.process.returncode == 0
    assert Opening(record).to_json()["record"]["metrics"] == [] and record.metrics[0].value == 3.0
    assert Opening.from_json(Opening(record).to_json()).record.tags == record.tags


def test_the_child_imports_neither_torch_nor_mlflow_before_it_is_asked():
    """The child starts in milliseconds and holds MLflow only (250 MB, not 430 with torch): publishing a run needs
    its files, not tensors."""
    code = "import sys, paritylab.sink.worker; print(sorted(m for m in ('torch', 'mlflow') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPOSITORY)
    assert result.stdout.strip() == "[]", result.stderr


def test_a_child_whose_run_was_killed_while_it_opened_the_run_exits_quietly(tmp_path):
    """kill -9 of the run while its child opens the MLflow run: the reply has no reader. The child says nothing
    (no BrokenPipeError traceback on the terminal) and exits."""
    uri = migrated_store(tmp_path / "mlflow.db")
    child = subprocess.Popen(
        [sys.executable, "-m", "paritylab.sink.worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, cwd=REPOSITORY,
    )  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    child.stdout.close()  # the run is gone: nobody will read the reply
    child.stdin.write(json.dumps({"op": "open", "arguments": Opening(_record(uri), 10.0, 0).to_json()}) + "\n")
    child.stdin.close()
    assert child.wait(timeout=120) == 0
    assert child.stderr is not None and "Traceback" not in child.stderr.read()
