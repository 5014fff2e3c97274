"""Faults never lose data or crash badly: the fault matrix of docs/faults.md, one test per row."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlflow.tracking import MlflowClient
from torch import nn

import paritylab
from paritylab import Trace, TraceFormatError
from paritylab.cli.app import compose
from paritylab.comparison.report import compare_traces
from paritylab.reports.render import to_html
from paritylab.run.runner import run
from paritylab.sink.keys import metric_key
from paritylab.sink.tracking import TrackingError
from paritylab.tracing.storage import StorageError, TensorReader
from tests.helpers import migrated_store, parity_runs, traced
from tests.test_runner import app, run_with

REPOSITORY = Path(__file__).resolve().parents[1]
READ_ERRORS = (TraceFormatError, StorageError)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# -- bad configuration -----------------------------------------------------------------------------------


def test_missing_required_value_is_one_line_exit_2_and_no_run(tmp_path):
    result = app(tmp_path, "model.name=???")
    assert result.returncode == 2
    output = (result.stderr + result.stdout).strip()
    assert output.splitlines() == [output] and "model.name is required" in output
    assert not (tmp_path / "mlflow.db").exists()


# -- a forward raises --------------------------------------------------------------------------------------


def test_reference_forward_that_raises_is_logged_as_failed(tmp_path):
    result, client = run_with(
        tmp_path,
        "model.build._target_=tests.faulty.raising_reference",
        "+model.build.module=model.language_model.layers.0.mlp",
    )
    assert result.exit_code == 2
    run = client.get_run(result.run_id)
    assert run.info.status == "FAILED" and run.data.tags["paritylab.verdict"] == "error"
    partial = Trace.load(result.directory / "reference")
    assert partial.meta["error"]["module"] == "model.language_model.layers.0.mlp"
    assert result.report.errors["reference"]["message"] == "planted failure in model.language_model.layers.0.mlp"
    assert "model.language_model.layers.0.mlp" in (result.directory / "report" / "report.md").read_text()
    uploaded = {a.path for a in client.list_artifacts(result.run_id, "reference")}
    assert {"reference/trace.json", "reference/tensors-00000.safetensors"} <= uploaded


# -- mismatches --------------------------------------------------------------------------------------------


class Looper(nn.Module):
    def __init__(self, times: int, out: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.times = times
        self.step = nn.Linear(4, 4)
        self.head = nn.Linear(4, out)

    def forward(self, x):
        for _ in range(self.times):
            x = self.step(x)
        return self.head(x).to(torch.float64)


def test_different_call_counts_dtypes_and_shapes_are_rows(tmp_path):
    x = torch.randn(2, 4)
    reference = traced(Looper(2), lambda m: m(x), tmp_path)
    candidate = traced(Looper(3, out=5), lambda m: m(x), tmp_path)
    report = compare_traces(reference, candidate)
    assert report.alignment.unmatched_candidate == ["step#2"]
    rows = {row.reference.key: row for row in report.rows}
    assert rows["step#0"].verdict == "pass" and rows["step#1"].verdict == "pass"
    assert rows["head#0"].status == "shape-mismatch"
    assert rows["#0"].candidate.dtype == "float64"


# -- MLflow unreachable or failing -------------------------------------------------------------------------


@pytest.mark.slow
def test_unreachable_server_fails_fast_keeps_results_and_uploads_later(tmp_path):
    started = time.monotonic()
    said: list[str] = []
    directory = tmp_path / "hydra"
    cfg = compose([f"tracking.uri=http://127.0.0.1:{free_port()}", "tracking.timeout=2", "compare.replay=false"])
    result = run(cfg, directory, echo=said.append)
    elapsed = time.monotonic() - started
    assert result.exit_code == 2
    assert elapsed < 180  # never hangs on the server (MLflow's own retries would take minutes)
    output = "\n".join(said)
    assert "failed to" in output and "paritylab-upload " in output
    seconds = json.loads((directory / "run.json").read_text())["seconds"]
    assert seconds["tracking start"] + seconds["publish"] < 20  # the timeout (2 s) and one retry, not a model's
    assert (directory / "tracking.json").is_file() and (directory / "report" / "report.html").is_file()
    store = migrated_store(tmp_path / "later.db")
    from paritylab.cli.upload import main as upload_main  # the CLI's entry, in this process

    assert upload_main([str(directory), "--tracking-uri", store]) == 0
    client = MlflowClient(store)
    (uploaded,) = parity_runs(client)
    assert uploaded.info.status == "FINISHED" and uploaded.data.tags["paritylab.verdict"] == "pass"
    assert uploaded.data.tags["paritylab.uploaded_from"] == str(directory)
    assert uploaded.data.metrics["summary/failing_modules"] == 0
    assert {a.path for a in client.list_artifacts(uploaded.info.run_id)} >= {"reference", "candidate", "report"}
    from paritylab.sink.publish import upload

    assert upload(directory, store) == (uploaded.info.run_id, True)  # again, through the function
    assert [r.info.run_id for r in parity_runs(client)] == [uploaded.info.run_id]  # idempotent: still one run


def test_tracking_failing_mid_run_keeps_everything(tmp_path, monkeypatch):
    from paritylab.sink.tracking import MlflowTracker

    def broken(self, metrics):
        raise TrackingError("MLflow at test failed to log metrics: connection reset")

    monkeypatch.setattr(MlflowTracker, "log_metrics", broken)  # in this process: MLflow inline
    result, client = run_with(tmp_path, "compare.replay=false", "tracking.process=inline")
    assert result.exit_code == 2 and "connection reset" in result.tracking_error
    assert client.get_run(result.run_id).info.status == "FAILED"  # not left RUNNING
    record = json.loads((result.directory / "tracking.json").read_text())
    assert record["tags"]["paritylab.verdict"] == "pass" and len(record["metrics"]) > 20
    monkeypatch.undo()
    from paritylab.sink.publish import upload

    run_id, already = upload(result.directory)  # the store works again: the orphan is finished, not duplicated
    assert run_id == result.run_id and not already
    finished = client.get_run(run_id)
    assert finished.info.status == "FINISHED" and finished.data.metrics["summary/failing_modules"] == 0
    assert len(parity_runs(client)) == 1 and upload(result.directory) == (run_id, True)


def test_a_signal_while_publishing_keeps_the_run_and_closes_it_killed(tmp_path, monkeypatch):
    """SIGTERM or Ctrl-C after the verdict, while the run is being published (for real models, gigabytes):
    no traceback, exit 130, the MLflow run KILLED (never RUNNING), run.json and tracking.json kept; the upload
    later finishes that same run."""
    import paritylab.sink.connection as connection_module
    from paritylab.sink.publish import publish as real_publish

    def interrupted(tracker, record, directory):
        tracker.log_metrics(record.metrics[:5])  # part of it got through
        raise KeyboardInterrupt

    monkeypatch.setattr(connection_module, "publish", interrupted)
    result, client = run_with(tmp_path, "compare.replay=false", "tracking.process=inline")
    assert result.exit_code == 130 and "interrupted while publishing" in result.tracking_error
    assert client.get_run(result.run_id).info.status == "KILLED"
    summary = json.loads((result.directory / "run.json").read_text())
    assert summary["exit_code"] == 130 and summary["verdict"] == "error"
    record = json.loads((result.directory / "tracking.json").read_text())
    assert record["tags"]["paritylab.verdict"] == "pass" and record["status"] == "FINISHED"
    monkeypatch.setattr(connection_module, "publish", real_publish)
    from paritylab.sink.publish import upload

    assert upload(result.directory) == (result.run_id, False)
    finished = client.get_run(result.run_id)
    assert finished.info.status == "FINISHED" and finished.data.tags["paritylab.verdict"] == "pass"


def test_a_full_disk_while_finishing_fails_the_run_in_one_line_and_never_leaves_it_running(tmp_path, monkeypatch):
    """ENOSPC when the run record, the reports or run.json are written: no traceback, exit 2, the MLflow
    run FAILED (not RUNNING), the verdict still printed."""
    import errno

    from paritylab.sink.publish import RunRecord

    def full(self, directory):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(RunRecord, "save", full)
    said: list[str] = []
    uri = migrated_store(tmp_path / "mlflow.db")
    result = run(compose([f"tracking.uri={uri}", "compare.replay=false"]), tmp_path / "run", echo=said.append)
    assert result.exit_code == 2 and "No space left on device" in result.tracking_error
    assert MlflowClient(uri).get_run(result.run_id).info.status == "FAILED"
    assert any("PASS" in line for line in said)  # the verdict was reached and shown
    assert (tmp_path / "run" / "report" / "report.json").is_file()  # what was written before stays


def _fault(kind: str) -> None:
    """SIGTERM delivered to this process (the run's handler turns it into an exception at once), or ENOSPC."""
    import errno

    if kind == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # never reached: the handler raises on the next bytecode
    raise OSError(errno.ENOSPC, "No space left on device")


def _inject(monkeypatch, phase: str, kind: str) -> None:
    """Make ``phase`` of a run fail with ``kind``, from inside that phase's own code."""
    import paritylab.run.runner as runner_module

    def failing(*args, **kwargs):
        _fault(kind)

    if phase == "forward":  # inside the candidate's forward, with the tracer's hooks live
        real_build = runner_module.build_candidate

        def build_with_a_fault(*args, **kwargs):
            candidate = real_build(*args, **kwargs)
            layer = next(m for name, m in candidate.model.named_modules() if name.endswith("layers.1"))
            layer.register_forward_pre_hook(lambda module, inputs: _fault(kind))
            return candidate

        monkeypatch.setattr(runner_module, "build_candidate", build_with_a_fault)
    elif phase == "publish":  # MLflow in this process (tracking.process=inline): the fault is raised here
        import paritylab.sink.connection as connection_module

        monkeypatch.setattr(connection_module, "publish", failing)
    else:
        target = {
            "build": "build_candidate",
            "compare": "compare_against_floors",
            "replay": "judge_with_replay",
            "report": "to_html",
        }
        monkeypatch.setattr(runner_module, target[phase], failing)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sigterm", "enospc"])
@pytest.mark.parametrize("phase", ["build", "forward", "compare", "replay", "report", "publish"])
def test_a_signal_or_a_full_disk_at_every_phase_closes_the_run_and_keeps_what_was_written(
    tmp_path, monkeypatch, phase, kind
):
    """At every phase: no run left RUNNING (KILLED after a signal, FAILED after ENOSPC), no traceback, one
    line, the documented exit code (130 or 2), run.json written and every file written before the fault kept."""
    _inject(monkeypatch, phase, kind)
    said: list[str] = []
    uri = migrated_store(tmp_path / "mlflow.db")
    overrides = [f"tracking.uri={uri}", "model=llama", "candidate=bf16", "compare.noise_floor=off"]
    result = run(compose([*overrides, "tracking.process=inline"]), tmp_path / "run", echo=said.append)
    assert result.exit_code == (130 if kind == "sigterm" else 2), said
    assert not any("Traceback" in line for line in said)
    messages = [line for line in said if "interrupted" in line or "No space left" in line or "disk is full" in line]
    assert messages and all("\n" not in line for line in messages)  # the fault in one line (and the report's)
    assert messages[-1].startswith("paritylab: ")
    (status,) = [r.info.status for r in MlflowClient(uri).search_runs(["0", *_experiments(uri)])]
    assert status == ("KILLED" if kind == "sigterm" else "FAILED")
    summary = json.loads((tmp_path / "run" / "run.json").read_text())
    assert summary["exit_code"] == result.exit_code and summary["status"] in ("KILLED", "FAILED", "FINISHED")
    if phase != "build":
        assert Trace.load(tmp_path / "run" / "reference").calls  # the reference's whole trace is kept
    if phase == "forward":
        partial = Trace.load(tmp_path / "run" / "candidate")  # the candidate's trace up to the fault
        assert partial.meta["status"] == "error" and any(c.path.endswith("layers.0") for c in partial.calls)
    if phase in ("report", "publish"):
        assert (tmp_path / "run" / "report" / "report.json").is_file()
    if phase == "publish":
        assert (tmp_path / "run" / "tracking.json").is_file()  # paritylab-upload can finish the run


def _experiments(uri: str) -> list[str]:
    return [e.experiment_id for e in MlflowClient(uri).search_experiments() if e.experiment_id != "0"]


@pytest.mark.parametrize("kind", ["sigterm", "enospc"])
def test_a_signal_or_a_full_disk_while_uploading_closes_the_run_and_a_second_upload_finishes_it(
    tmp_path, monkeypatch, kind
):
    import paritylab.sink.publish as publish_module
    from paritylab.cli.upload import main as upload_main

    result = run(compose(["tracking=off", "model=llama", "candidate=bf16", "compare.replay=false"]),
                 tmp_path / "run", echo=lambda _: None)  # fmt: skip
    assert result.exit_code == 0 and (tmp_path / "run" / "tracking.json").is_file()
    uri = migrated_store(tmp_path / "mlflow.db")
    real_publish = publish_module.publish

    def publish_with_a_fault(tracker, record, directory):
        tracker.log_metrics(record.metrics[:3])  # part of it got through
        _fault(kind)

    monkeypatch.setattr(publish_module, "publish", publish_with_a_fault)
    assert upload_main([str(tmp_path / "run"), "--tracking-uri", uri]) == (130 if kind == "sigterm" else 2)
    (first,) = MlflowClient(uri).search_runs(_experiments(uri))
    assert first.info.status == ("KILLED" if kind == "sigterm" else "FAILED")
    monkeypatch.setattr(publish_module, "publish", real_publish)
    assert upload_main([str(tmp_path / "run"), "--tracking-uri", uri]) == 0
    (again,) = MlflowClient(uri).search_runs(_experiments(uri))  # the same run, finished: never a second one
    assert again.info.run_id == first.info.run_id and again.info.status == "FINISHED"
    assert again.data.tags["paritylab.verdict"] == "pass"


# -- disk budget -------------------------------------------------------------------------------------------


def test_byte_budget_through_the_app_keeps_stats_and_says_what_is_missing(tmp_path):
    result, client = run_with(tmp_path, "compare.max_bytes=20000", "compare.replay=false")
    assert result.exit_code == 3  # inconclusive: a run that could not see every value is never a PASS
    assert json.loads((result.directory / "run.json").read_text())["verdict"] == "inconclusive"
    assert client.get_run(result.run_id).data.tags["paritylab.verdict"] == "inconclusive"
    meta = Trace.load(result.directory / "reference").meta
    assert meta["storage"]["bytes"] <= 20000 and meta["storage"]["skipped"] > 0
    statuses = {row.status for row in result.report.rows if row.candidate}
    assert "stats-only" in statuses and "compared" in statuses


# -- interrupted ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_ends_the_run_killed_with_partial_artifacts(tmp_path):
    command = [
        sys.executable, "-m", "paritylab", "candidate.ports.llava.build._target_=tests.faulty.slow_port",
        "compare.replay=false", f"hydra.run.dir={tmp_path / 'hydra'}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPOSITORY)}
    migrated_store(tmp_path / "mlflow.db")  # the default store, already created: the signal is what is tested
    process = subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines = []
    deadline = time.monotonic() + 120
    for line in process.stdout:  # type: ignore[union-attr]
        lines.append(line)
        if "tracing the candidate" in line or time.monotonic() > deadline:
            break
    time.sleep(1.0)
    process.send_signal(signal.SIGTERM)
    output = "".join(lines) + process.communicate(timeout=120)[0]
    assert process.returncode == 130, output
    assert "interrupted" in output
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = parity_runs(client)
    assert run.info.status == "KILLED"
    names = {a.path for a in client.list_artifacts(run.info.run_id, "reference")}
    assert "reference/trace.json" in names
    partial = Trace.load(tmp_path / "hydra" / "candidate")
    assert partial.meta["status"] == "error" and partial.call("llm.layers.0#0").outputs is not None


# -- concurrency ---------------------------------------------------------------------------------------------


JOBS = 3


@pytest.mark.slow
def test_parallel_jobs_on_one_fresh_sqlite_store(tmp_path):
    """Three processes on two cores, all creating the store at once (it was eight, then four: the race is the
    same, the wait was longer)."""
    store = f"sqlite:///{tmp_path / 'shared.db'}"
    common = ["model=llama", "candidate=bf16", "compare.replay=false", "compare.noise_floor=off"]
    common += ["compare.rtol=1e-1", "compare.atol=1e-1", f"tracking.uri={store}"]
    jobs = []
    for index in range(JOBS):
        command = [
            sys.executable,
            "-m",
            "paritylab",
            *common,
            f"seed={index}",
            f"hydra.run.dir={tmp_path / str(index)}",
        ]
        jobs.append(
            subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outputs = [job.communicate(timeout=600)[0] for job in jobs]
    assert [job.returncode for job in jobs] == [0] * JOBS, outputs
    client = MlflowClient(store)
    runs = parity_runs(client)
    assert len(runs) == JOBS and {r.info.status for r in runs} == {"FINISHED"}
    assert sorted(r.data.params["seed"] for r in runs) == [str(i) for i in range(JOBS)]


# -- hostile or corrupt trace files --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_trace(tmp_path_factory):
    root = tmp_path_factory.mktemp("good")
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with paritylab.trace(model, root, save_tensors=True):
        model(torch.randn(3, 4))
    return root


def copy_trace(source: Path, target: Path) -> Path:
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    return target


def shard(directory: Path) -> Path:
    return directory / "tensors-00000.safetensors"


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("truncate", "do not fit its shape or the file"),
        ("huge_header", "beyond the file or the limit"),
        ("garbage_header", "malformed safetensors header"),
        ("escape", "outside the trace directory"),
        ("absurd_shape", "tensor shape must be"),
        ("shape_lie", "the trace says"),
        ("bad_json", "not valid JSON"),
    ],
)
def test_corrupt_trace_gives_one_line_exit_2(tmp_path, good_trace, damage, message, capsys):
    """In process (paritylab-compare's main): an exception escaping it would fail the test as a traceback would;
    the process boundary is exercised by the hostile-directory tests below."""
    from paritylab.cli.compare import main

    broken = copy_trace(good_trace, tmp_path / "broken")
    document = json.loads((broken / "trace.json").read_text())
    data = shard(broken).read_bytes()
    if damage == "truncate":
        shard(broken).write_bytes(data[: len(data) - 20])
    elif damage == "huge_header":
        shard(broken).write_bytes((2**62).to_bytes(8, "little") + data[8:])
    elif damage == "garbage_header":
        shard(broken).write_bytes(data[:8] + b"\xff" * 64 + data[72:])
    elif damage == "escape":
        document["files"]["t0"] = ["../../secret.safetensors", "t0"]
    elif damage == "absurd_shape":
        document["calls"][1]["outputs"]["shape"] = [-1, 10**20]
    elif damage == "shape_lie":
        document["calls"][1]["outputs"]["shape"] = [3, 5]
    elif damage == "bad_json":
        (broken / "trace.json").write_text('{"schema_version": 1, "calls": [')
    if damage in ("escape", "absurd_shape", "shape_lie"):
        (broken / "trace.json").write_text(json.dumps(document))
    reference = broken if damage == "shape_lie" else good_trace  # a lie on both sides is only seen in the file
    code = main([str(reference), str(broken)])
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    assert stderr.count("\n") == 1 and message in stderr


def _mutate(document, path, value):
    target = document
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*prefix, index))


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_trace_json_never_crashes_the_reader(good_trace, tmp_path_factory, data):
    document = json.loads((good_trace / "trace.json").read_text())
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p in _paths(document) if p]  # afresh: a mutation may have replaced a container
        _mutate(document, data.draw(st.sampled_from(paths)), data.draw(JSON_VALUES))
    target = copy_trace(good_trace, tmp_path_factory.mktemp("fuzz"))
    (target / "trace.json").write_text(json.dumps(document))
    try:
        trace = Trace.load(target)
        compare_traces(Trace.load(good_trace), trace)
    except READ_ERRORS:
        pass


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=st.binary(max_size=200), length=st.integers(0, 2**64 - 1))
def test_fuzzed_safetensors_headers_never_crash_or_overread(tmp_path_factory, header, length):
    directory = tmp_path_factory.mktemp("st")
    (directory / "x.safetensors").write_bytes(length.to_bytes(8, "little") + header)
    reader = TensorReader(directory)
    try:
        value = reader.load("x.safetensors", "t0")
    except StorageError:
        return
    assert value.numel() * value.element_size() <= len(header)


DIRECTORY_MUTATIONS = ("flip bytes", "truncate", "delete", "append junk", "replace JSON", "zero-length")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_trace_directories_never_crash_the_reader(good_trace, tmp_path_factory, data):
    """The whole directory format, both layouts: paritylab's own (``trace.json``, ``tensors.index.json``,
    shards) and transformers' debugger files (read when ``trace.json`` is absent). Any file may get flipped
    bytes, be cut short, deleted, grown, emptied or have a JSON value swapped in; loading and comparing then
    either works or gives a one-line format error, never another exception or a hang."""
    target = copy_trace(good_trace, tmp_path_factory.mktemp("fuzzdir"))
    if data.draw(st.booleans(), label="debugger layout"):
        (target / "trace.json").unlink()
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        files = sorted(p.name for p in target.iterdir())
        if not files:
            break
        path = target / data.draw(st.sampled_from(files), label="file")
        kind = data.draw(st.sampled_from(DIRECTORY_MUTATIONS), label="mutation")
        content = path.read_bytes()
        if kind == "flip bytes" and content:
            mutable = bytearray(content)
            for _ in range(data.draw(st.integers(1, 8))):
                mutable[data.draw(st.integers(0, len(content) - 1))] = data.draw(st.integers(0, 255))
            path.write_bytes(bytes(mutable))
        elif kind == "truncate":
            path.write_bytes(content[: data.draw(st.integers(0, max(0, len(content) - 1)))])
        elif kind == "delete":
            path.unlink()
        elif kind == "append junk":
            path.write_bytes(content + data.draw(st.binary(min_size=1, max_size=64)))
        elif kind == "zero-length":
            path.write_bytes(b"")
        elif kind == "replace JSON" and path.suffix == ".json":
            try:
                document = json.loads(content)
            except ValueError:  # an earlier mutation broke it already
                continue
            paths = [p for p in _paths(document) if p]
            if paths:
                _mutate(document, data.draw(st.sampled_from(paths)), data.draw(JSON_VALUES))
                path.write_text(json.dumps(document))
    try:
        trace = Trace.load(target)
        compare_traces(Trace.load(good_trace), trace)
    except READ_ERRORS:
        pass


# -- odd module names ----------------------------------------------------------------------------------------


class Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        for name in ("my layer", "ünïcode", "a/b", "<script>alert(1)</script>", "x#1", "q:z"):
            self.add_module(name, nn.Linear(3, 3))

    def forward(self, x):
        for module in self.children():
            x = module(x)
        return x


def test_odd_module_names_get_safe_files_valid_keys_and_escaped_html(tmp_path):
    x = torch.randn(2, 3)
    reference = traced(Odd(), lambda m: m(x), tmp_path)
    report = compare_traces(reference, traced(Odd(), lambda m: m(x), tmp_path))
    assert report.passed and {row.path for row in report.rows} >= {"my layer", "a/b", "x#1", "q:z"}
    assert all(path.name.startswith(("tensors", "trace", "Odd_")) for path in reference.directory.iterdir())
    html = to_html(report)
    assert "<script>alert" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    from mlflow.utils.validation import _validate_metric_name

    for row in report.rows:
        key = metric_key(f"layer/{row.path}/rel_l2")
        _validate_metric_name(key)
        assert re.fullmatch(r"[A-Za-z0-9_.\- /:]+", key)
    assert re.fullmatch(r"layer/_n_code-[0-9a-f]{6}/rel_l2", metric_key("layer/ünïcode/rel_l2"))
    assert re.fullmatch(r"layer/_-[0-9a-f]{6}/rel_l2", metric_key("layer/../rel_l2"))
    assert metric_key("layer/a<b/rel_l2") != metric_key("layer/a>b/rel_l2")  # injective: no two layers share a key
    assert metric_key("layer/ok.0/rel_l2") == "layer/ok.0/rel_l2"  # valid keys are unchanged


def test_metric_key_map_is_written_for_renamed_keys(tmp_path):
    from paritylab.sink.dashboard import write_key_map
    from paritylab.sink.tracking import Metric

    names = ["layer/blocks.ü.0/rel_l2", "layer/a<b/rel_l2", "layer/a>b/rel_l2"]
    write_key_map(tmp_path, [*(Metric(name, 1.0) for name in names), Metric("layer/blocks.0/rel_l2", 1.0)])
    key_map = json.loads((tmp_path / "metric_keys.json").read_text())
    assert key_map == {metric_key(name): name for name in names} and len(key_map) == 3  # every entry kept


# -- no pickle -----------------------------------------------------------------------------------------------


def test_no_pickle_anywhere():
    sources = [*(REPOSITORY / "paritylab").rglob("*.py"), *(REPOSITORY / "experiments").rglob("*.py")]
    for source in sources:
        text = source.read_text()
        assert not re.search(r"^\s*(import|from)\s+(pickle|dill|cloudpickle)\b", text, re.M), source
        assert "torch.save(" not in text, source
        for call in re.findall(r"torch\.load\([^)]*\)", text):
            assert "weights_only=True" in call, (source, call)


@pytest.mark.parametrize("scale", [1.0005, 1.5])
def test_no_values_stored_is_never_a_pass(tmp_path, scale):
    """max_bytes=0 stores no tensor: a wrong candidate is a FAIL when statistics prove it, else INCONCLUSIVE."""
    result, _ = run_with(
        tmp_path,
        "compare.max_bytes=0",
        "candidate.ports.llava.build._target_=tests.faulty.scaled_port",
        "+candidate.ports.llava.build.module=llm.layers.0.attention.wo",
        f"+candidate.ports.llava.build.scale={scale}",
    )
    assert result.exit_code in (1, 3) and result.report.verdict in ("fail", "inconclusive")
    if scale > 1.1:
        assert result.report.verdict == "fail"  # statistics alone prove it


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("compare.rtol=-1", "compare.rtol=-1.0 must be zero or positive"),
        ("compare.noise_multiple=0", "compare.noise_multiple=0.0 must be positive"),
        ("+compare.modules.lm_head={rtol: -0.5}", "compare.modules.lm_head.rtol=-0.5 must be zero or positive"),
        ("+compare.modules.lm_head={rtol: abc}", "compare.modules: tolerance rtol must be a number"),
        ("tracking.uri=htp://nowhere", "unsupported scheme 'htp'"),
    ],
)
def test_settings_that_would_fail_late_fail_before_any_model_is_built(tmp_path, override, expected):
    said: list[str] = []
    result = run(compose([override]), tmp_path / "run", echo=said.append)
    assert result.exit_code == 2 and len(said) == 1 and expected in said[0], said
    assert not (tmp_path / "run" / "reference").exists() and "building" not in " ".join(said)  # no model built


def test_output_dir_under_a_file_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("x")
    said: list[str] = []
    result = run(compose(["tracking=off"]), tmp_path / "afile" / "run", echo=said.append)
    assert result.exit_code == 2 and len(said) == 1 and "is a file, not a directory" in said[0]


def test_names_with_control_characters_are_escaped_on_the_terminal_and_html_in_markdown():
    from paritylab.comparison.report import Row, Side
    from paritylab.reports.render import _cells, _md_escape
    from paritylab.tracing.tracefile import display_path

    assert display_path("evil\r\x1b[2Kname") == "evil\\r\\x1b[2Kname"
    row = Row(0, "a\x1b[31m", Side("a\x1b[31m#0"), Side("b\r#0"), "compared", "pass")
    assert all(cell.isprintable() for cell in _cells(row))
    assert _md_escape("<script>alert(1)</script>") == "&lt;script&gt;alert(1)&lt;/script&gt;"


def compare_cli(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "paritylab.cli.compare", *map(str, args)], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("hostile", ["fifo", "symlink_out", "dev_zero", "nested_symlink"])
def test_hostile_trace_directories_are_refused_in_one_line(good_trace, tmp_path, hostile):
    """A FIFO would block the reader forever, /dev/zero would be read until memory runs out, a symlink leads
    outside the directory: each is refused before any file is opened (one line, exit 2, within the timeout)."""
    target = copy_trace(good_trace, tmp_path / "hostile")
    if hostile == "fifo":
        os.mkfifo(target / "model_debug_tree_FULL_TENSORS.json")
    elif hostile == "symlink_out":
        outside = tmp_path / "outside.json"
        outside.write_text((target / "trace.json").read_text())
        (target / "trace.json").unlink()
        (target / "trace.json").symlink_to(outside)
    elif hostile == "dev_zero":
        (target / "model_debug_tree_FULL_TENSORS.json").symlink_to("/dev/zero")
    else:
        (target / "sub").mkdir()
        (target / "sub" / "link").symlink_to(tmp_path)
    result = compare_cli(good_trace, target)
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "symbolic link" in result.stderr or "not a regular file" in result.stderr


def test_upload_never_follows_a_symlink_out_of_the_run_directory(tmp_path):
    from paritylab.cli.upload import main as upload_main

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (tmp_path / "secret.txt").write_text("not yours")
    (run_dir / "tracking.json").write_text("{}")
    (run_dir / "notes.txt").symlink_to(tmp_path / "secret.txt")
    assert upload_main([str(run_dir), "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]) == 2
    assert not (tmp_path / "mlflow.db").exists()  # refused before any tracking


def test_infinity_where_an_index_belongs_is_one_line(good_trace, tmp_path):
    """``"index": Infinity`` (valid to Python's JSON reader) is a malformed trace, not an OverflowError."""
    target = copy_trace(good_trace, tmp_path / "inf")
    text = (target / "trace.json").read_text()
    assert '"index":1,' in text
    (target / "trace.json").write_text(text.replace('"index":1,', '"index":Infinity,', 1))
    with pytest.raises(TraceFormatError, match="malformed call record"):
        Trace.load(target)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"calls": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests JSON deeper than any trace does"),
        (None, "holds a trace with no module calls"),
    ],
    ids=["deep-nesting", "empty-trace"],
)
def test_deep_nesting_and_empty_traces_are_format_errors(good_trace, tmp_path, content, expected):
    """100k-deep nesting would raise RecursionError inside the JSON reader; an empty trace would compare as
    "nothing to compare". Both are malformed input: one line (TraceFormatError, exit 2 from the CLI)."""
    from paritylab.cli.compare import main as compare_main

    target = copy_trace(good_trace, tmp_path / "bad")
    if content is None:
        document = json.loads((target / "trace.json").read_text())
        document["calls"] = []
        content = json.dumps(document)
    (target / "trace.json").write_text(content)
    with pytest.raises(TraceFormatError, match=expected):
        Trace.load(target)
    assert compare_main([str(good_trace), str(target)]) == 2


def test_json_memory_is_bounded_by_a_count_of_values_before_parsing(good_trace, tmp_path, monkeypatch):
    """Memory per parsed JSON value is bounded (~90 bytes), so the value count bounds a load's memory whatever
    the file's shape (``[{},{},...]`` costs ~25x its size). The count is taken before parsing."""
    import paritylab.tracing.tracefile as tracefile

    target = copy_trace(good_trace, tmp_path / "wide")
    Trace.load(target)  # the real trace is within any sane bound
    monkeypatch.setattr(tracefile, "MAX_TRACE_JSON_ELEMENTS", 200)
    (target / "trace.json").write_text('{"calls": [' + ",".join(["{}"] * 300) + "]}")
    with pytest.raises(TraceFormatError, match=r"holds about 60\d JSON values, over the 200"):
        Trace.load(target)


KILLED_MID_FORWARD = """
import sys, time
from pathlib import Path
import torch
from torch import nn
import paritylab

class Stall(nn.Module):
    def forward(self, x):
        Path(sys.argv[2]).write_text("in the forward")
        time.sleep(120)  # killed here
        return x

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), Stall(), nn.Linear(16, 4))
with paritylab.trace(model, sys.argv[1], save_tensors=True, pending_bytes=0):
    model(torch.randn(3, 16))
"""


@pytest.mark.slow
def test_a_trace_killed_mid_forward_is_recovered_with_every_whole_tensor(tmp_path):
    """kill -9 in the forward: no trace.json, shards unfinished. The journals written as calls and tensors
    completed let Trace.load rebuild it: every finished call with its values, the open calls marked
    interrupted, the trace marked recovered (never taken for a finished one), no .partial left."""
    directory, marker = tmp_path / "killed", tmp_path / "marker"
    process = subprocess.Popen(
        [sys.executable, "-c", KILLED_MID_FORWARD, str(directory), str(marker)],
        env={**os.environ, "PYTHONPATH": str(REPOSITORY)},
    )
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    process.kill()
    process.wait(timeout=30)
    assert marker.exists() and not (directory / "trace.json").exists()
    assert list(directory.glob("*.partial"))  # what a kill -9 leaves
    trace = Trace.load(directory)
    assert trace.meta["recovered"] is True and trace.meta["status"] == "error"
    assert trace.meta["error"]["module"] == "3" and trace.meta["error"]["type"] == "Killed"
    assert not list(directory.glob("*.partial")) and not list(directory.glob("*.journal.jsonl"))
    by_path = {call.path: call for call in trace.calls}
    assert set(by_path) == {"", "0", "1", "2", "3"}  # the last Linear never ran
    assert by_path["3"].error.startswith("interrupted") and by_path[""].error.startswith("interrupted")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.Identity(), nn.Linear(16, 4))
    x = torch.randn(3, 16)
    assert torch.equal(trace.tensor(by_path["2"].outputs), model[:3](x))  # whole tensors, bit for bit
    assert torch.equal(trace.tensor(by_path["0"].tensors("inputs")[0][1]), x)
    assert Trace.load(directory).meta["recovered"] is True  # loading again reads the rebuilt trace.json


@pytest.mark.parametrize(
    "entry",
    [
        {"file": "../outside.safetensors", "name": "t0", "dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        {"file": "tensors-00000.safetensors", "name": "t0", "dtype": "F32", "shape": [1], "data_offsets": [8, 4]},
        {"file": "tensors-00000.safetensors", "name": "t0", "dtype": "PICKLE", "shape": [1], "data_offsets": [0, 4]},
    ],
    ids=["path-escape", "offsets-backwards", "unknown-dtype"],
)
def test_a_hostile_journal_is_refused_in_one_line(tmp_path, entry):
    """Recovery reads journals left in a directory: their file names never leave it, their entries are checked
    before any byte is touched."""
    (tmp_path / "trace.journal.jsonl").write_text(
        json.dumps({"meta": {}}) + "\n" + json.dumps({"index": 0, "path": "", "call_index": 0, "cls": "M",
                                                       "parent": None, "depth": 0}) + "\n"
    )  # fmt: skip
    (tmp_path / "tensors.journal.jsonl").write_text(json.dumps({"metadata": {}}) + "\n" + json.dumps(entry) + "\n")
    with pytest.raises(TraceFormatError, match="malformed tensor entry"):
        Trace.load(tmp_path)
    assert not (tmp_path / "trace.json").exists()
