"""Sweeps over a real MLflow server: parent/child runs, the regression gate, parallel jobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from paritylab import Trace
from paritylab.cli.app import compose
from paritylab.comparison.report import compare_traces
from paritylab.run.runner import run
from tests.helpers import ctrl_c_heard, migrated_store

pytestmark = pytest.mark.slow
REPOSITORY = Path(__file__).resolve().parents[1]


def sweep(tmp_path: Path, uri: str, experiment: str, *overrides: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "paritylab", "-m", *overrides, f"tracking.uri={uri}",
         f"tracking.experiment={experiment}", "compare.replay=false", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPOSITORY)},
    )  # fmt: skip


def runs_of(client: MlflowClient, experiment: str) -> list:
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id], max_results=500)


@pytest.mark.slow
def test_sweep_over_http_nests_jobs_under_a_parent(tmp_path, mlflow_server):
    """Two jobs run in parallel (Hydra's joblib launcher), nested under one parent run on a real server."""
    result = sweep(
        tmp_path, mlflow_server, "nested", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "model=llama",
        "candidate=bf16,sdpa", "tracking.log_tensors=always",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    client = MlflowClient(mlflow_server)
    runs = runs_of(client, "nested")
    (parent,) = [r for r in runs if r.data.tags.get("paritylab.sweep") == "true"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    names = [f"PASS llama/{c} seed=0 replay=False" for c in ("bf16", "sdpa")]  # the verdict, then what varies
    assert sorted(r.info.run_name for r in children) == names  # what varies, and every other override
    assert all(r.info.status == "FINISHED" and r.data.tags["paritylab.verdict"] == "pass" for r in children)
    assert (
        parent.info.status == "FINISHED"
        and "| 0-candidate=bf16,compare.replay=False,model=llama,tracking.log_tensors=always | pass |"
        in parent.data.tags["mlflow.note.content"]
    )
    assert parent.data.metrics["sweep/jobs"] == 2 and parent.data.metrics["sweep/failed"] == 0
    assert "sweep_summary.md" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert not [r for r in runs if r.data.tags.get("paritylab.trend") == "true"]  # an ad-hoc sweep is no night
    # the experiment's description starts with its newest run, the sweep (its jobs counted in it): the line MLflow's
    # home page and the experiment's every view show
    described = client.get_experiment_by_name("nested").tags["mlflow.note.content"]
    assert described.split("\n")[0].startswith(f"{parent.info.run_name} (the newest run: 1 pass) \u00b7 [runs list](")
    assert parent.info.run_name.startswith("PASS sweep/") and parent.info.run_name.endswith(": 2 pass")
    tags = children[0].data.tags  # MLflow's own columns: user, source, type
    assert tags["mlflow.user"] and tags["mlflow.source.type"] == "LOCAL" and "paritylab" in tags["mlflow.source.name"]
    assert (
        len(tags["paritylab.fingerprint"]) == 12 and len({r.data.tags["paritylab.fingerprint"] for r in children}) == 2
    )
    for child in children:  # tensors uploaded (log_tensors=always), whole; the run directory's copy deleted
        uploaded = {
            a.path: a.file_size for a in _artifacts(client, child.info.run_id) if a.path.endswith(".safetensors")
        }
        fetched = Path(client.download_artifacts(child.info.run_id, "candidate", str(tmp_path / child.info.run_id)))
        assert {
            f"candidate/{p.name}": p.stat().st_size for p in fetched.glob("*.safetensors")
        }.items() <= uploaded.items()
        run_dir = Path(child.data.tags["paritylab.output_dir"])
        assert (
            uploaded and not list(run_dir.rglob("*.safetensors")) and (run_dir / "candidate" / "trace.json").is_file()
        )
        note = (run_dir / "candidate" / "TENSORS_UPLOADED.txt").read_text()
        assert child.info.run_id in note and "mlflow artifacts download" in note
        stays = Trace.load(run_dir / "candidate")  # what stays loads with statistics only: even against itself ...
        assert compare_traces(stays, stays).verdict == "inconclusive"  # ... never a plain PASS
    kept = run(compose([f"tracking.uri={mlflow_server}", "tracking.experiment=nested", "model=llama",
                        "candidate=sdpa", "compare.replay=false", "tracking.log_tensors=always",
                        "tracking.keep_local=true"]), tmp_path / "kept", echo=lambda _: None)  # fmt: skip
    shards = [a for a in _artifacts(client, kept.run_id) if a.path.endswith(".safetensors")]
    local = list((tmp_path / "kept").rglob("*.safetensors"))
    assert shards and sorted(a.file_size for a in shards) == sorted(p.stat().st_size for p in local)  # kept as asked
    links = [json.loads(path.read_text())["link"] for path in (tmp_path / "sweep").glob("*/run.json")]
    assert len(links) == 2 and all(link.startswith(mlflow_server) and "/runs/" in link for link in links)  # real URLs


@pytest.mark.slow
def test_a_sweep_on_submitit_local_nests_its_jobs_on_a_real_server(tmp_path, mlflow_server):
    """The cluster route (Hydra's submitit launcher, here its local executor): each job in its own process, logged
    to one server under the sweep's parent; names say what the job is, not where it is logged; no ``%j`` folder."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the test extra installs it")
    result = sweep(tmp_path, mlflow_server, "cluster", "hydra/launcher=submitit_local", "model=llama",
                   "candidate=bf16,sdpa", "tracking=server")  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    client = MlflowClient(mlflow_server)
    runs = runs_of(client, "cluster")
    (parent,) = [r for r in runs if r.data.tags.get("paritylab.sweep") == "true"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.info.run_name for r in children) == [
        f"PASS llama/{c} seed=0 replay=False" for c in ("bf16", "sdpa")
    ]
    assert {r.data.tags["paritylab.verdict"] for r in children} == {"pass"} and parent.info.status == "FINISHED"
    assert len({r.data.tags["paritylab.pid"] for r in children}) == 2  # each job in a process of its own
    jobs = sorted(path.name for path in (tmp_path / "sweep").iterdir() if (path / ".hydra").is_dir())
    assert jobs == [
        "0-candidate=bf16,compare.replay=False,model=llama",
        "1-candidate=sdpa,compare.replay=False,model=llama",
    ]
    submitit = tmp_path / "sweep" / ".submitit"
    assert sorted(path.name.isdigit() for path in submitit.iterdir()) == [True, True]  # one folder per job id
    assert "Downloading artifacts" not in result.stderr + result.stdout


PORT = """
from tests.faulty import scaled_port


def build(reference):
    return scaled_port(reference, module="llm.layers.1.feed_forward.w2", scale={scale})
"""


@pytest.mark.slow
def test_regression_gate_names_the_layer_and_unchanged_rerun_passes(tmp_path, monkeypatch):
    """Nights of one pair: the candidate's code changes between them (the configuration does not), so the
    pair keeps its fingerprint and the newest night is judged against the promoted baseline. The nights run in
    this process on a store file: sweeps across the process boundary and over HTTP are the test above, and a
    night with a failing job fails its sweep in ``test_a_sweep_parent_is_failed_when_any_child_fails_or_errors``."""
    uri, experiment = migrated_store(tmp_path / "gate.db"), "gate"
    code = tmp_path / "nightly_port.py"
    monkeypatch.syspath_prepend(str(tmp_path))
    pair = ["candidate=port", "candidate.ports.llava.build._target_=nightly_port.build", "tracking.trend=true",
            f"tracking.uri={uri}", f"tracking.experiment={experiment}", "compare.replay=false"]  # fmt: skip

    def night(number: int, scale: str):
        code.write_text(PORT.format(scale=scale))
        sys.modules.pop("nightly_port", None)  # tonight's commit, imported afresh
        return run(compose(pair), tmp_path / f"night{number}", echo=lambda _: None)

    assert night(1, "1.0").exit_code == 0
    client = MlflowClient(uri)
    (golden,) = parity_runs_named(client, experiment)
    from paritylab.cli.promote import main as promote_main  # in process: test_history runs the CLI's process

    assert promote_main([golden.info.run_id, "--tracking-uri", uri]) == 0
    assert client.get_run(golden.info.run_id).data.tags["paritylab.baseline"] == "golden"

    same = night(2, "1.0")
    assert same.exit_code == 0 and json.loads((tmp_path / "night2" / "run.json").read_text())["regression"] == "none"

    worse = night(3, "1.0001")  # tonight's commit scales one projection by 1e-4
    assert worse.exit_code == 1 and worse.report.verdict == "pass"  # within tolerance: only the gate catches it
    summary = json.loads((tmp_path / "night3" / "run.json").read_text())
    assert summary["regression"] == "regressed" and "model.language_model.layers.1" in summary["regressed_layers"]
    newest = client.get_run(worse.run_id)
    tags = newest.data.tags
    assert tags["paritylab.verdict"] == "pass"
    assert tags["paritylab.regression"] == "regressed" and tags["paritylab.baseline_run"] == golden.info.run_id
    assert "model.language_model.layers.1" in tags["paritylab.regressed_layers"]
    assert newest.data.metrics["regression/model.language_model.layers.1/ratio"] > 2
    assert any(a.path.endswith(".safetensors") for a in _artifacts(client, newest.info.run_id))  # regressed: kept
    assert not any(a.path.endswith(".safetensors") for a in _artifacts(client, golden.info.run_id))  # passed
    (trend,) = [r for r in runs_of(client, experiment) if r.data.tags.get("paritylab.trend") == "true"]
    # named and tagged by its newest night: it regressed, at layer 1
    assert trend.info.run_name.startswith("REGRESSED layers.1")
    assert trend.info.run_name.endswith(" @ trend/llava/port/synthetic-seed-0")
    assert trend.data.tags["paritylab.verdict"] == "regressed"
    # the experiment's description starts with the newest night; the trend run's nights are counted once each
    described = client.get_experiment_by_name(experiment).tags["mlflow.note.content"].split("\n")[0]
    assert described.startswith(f"{newest.info.run_name} (the newest of 3 runs: 1 regressed, 2 pass) \u00b7 [runs")
    assert newest.info.run_name.startswith("REGRESSED layers.1") and " @ llava/port seed=0" in newest.info.run_name
    assert newest.info.status == "FAILED"  # a regression exits 1: red in the runs list, its verdict tag still pass
    history = client.get_metric_history(trend.info.run_id, "layer/model.language_model.layers.1/rel_l2")
    starts = sorted(r.info.start_time for r in parity_runs_named(client, experiment))
    assert [m.step for m in history] == [1, 2, 3]
    assert [m.timestamp for m in history] == pytest.approx(starts, abs=5000)  # stamped with each night's start
    assert history[2].value > 2 * history[1].value
    heatmap = Path(client.download_artifacts(trend.info.run_id, "trend_heatmap.svg", str(tmp_path / "heatmap")))
    svg = heatmap.read_text()  # layer × night, refreshed each night: three columns now
    assert svg.startswith("<svg") and "model.language_model.layers.1" in svg and svg.count("<rect") >= 3 * 3


def _artifacts(client: MlflowClient, run_id: str, path: str | None = None) -> list:
    found = []
    for item in client.list_artifacts(run_id, path):
        found += _artifacts(client, run_id, item.path) if item.is_dir else [item]
    return found


def parity_runs_named(client: MlflowClient, experiment: str) -> list:
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id], max_results=500)
    return [r for r in runs if "paritylab.pair" in r.data.tags and r.data.tags.get("paritylab.trend") != "true"]


def test_regression_rule_is_a_factor_plus_a_floor():
    from paritylab.sink.history import assess

    baseline = {"a": 1e-8, "b": 1e-3, "c": 1e-3}
    result = assess({"a": 5e-7, "b": 3e-3, "c": 1e-4, "new": 1.0}, baseline, factor=2.0, floor=1e-6)
    assert result.regressed == ["b"] and result.improved == ["c"]  # "a" grew 50x but stays under the floor
    assert result.verdict == "regressed" and result.ratios["a"] == pytest.approx(50)
    assert assess({"a": 1.0}, None, 2.0, 1e-6).verdict == "no-baseline"
    assert assess({"c": 1e-4}, baseline, 2.0, 1e-6).verdict == "improved"


def test_runs_left_running_by_dead_processes_are_closed(tmp_path):
    import socket

    from paritylab.sink.processes import process_start
    from paritylab.sink.store import MlflowStore
    from paritylab.sink.tracking import MlflowTracker

    store = migrated_store(tmp_path / "stale.db")
    client = MlflowClient(store)
    experiment = client.create_experiment("stale")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    orphan = client.create_run(experiment, tags={"paritylab.host": host, "paritylab.pid": str(dead.pid)})
    me = {"paritylab.host": host, "paritylab.pid": str(os.getpid())}
    alive = client.create_run(experiment, tags={**me, "paritylab.process_start": process_start(os.getpid())})
    # the pid of a dead run now held by another process (this one, started at another time): gone too
    reused = client.create_run(experiment, tags={**me, "paritylab.process_start": "12"})
    trend = client.create_run(experiment, tags={"paritylab.trend": "true"})
    closed = MlflowStore(MlflowTracker(store, "stale")).close_stale_runs()
    assert sorted(closed) == sorted([orphan.info.run_id, reused.info.run_id])
    assert client.get_run(orphan.info.run_id).info.status == "KILLED"
    assert client.get_run(reused.info.run_id).info.status == "KILLED"
    assert client.get_run(alive.info.run_id).info.status == "RUNNING"
    assert client.get_run(trend.info.run_id).info.status == "RUNNING"


def test_a_plain_run_closes_runs_left_running_by_a_kill_9(tmp_path):
    """kill -9 leaves a run RUNNING; the next run of any kind (not only a sweep) closes it."""
    from tests.helpers import migrated_store

    store = migrated_store(tmp_path / "mlflow.db")
    victim = subprocess.Popen(  # its candidate sleeps 30 s in a forward: killed mid-run, whenever MLflow opened it
        [sys.executable, "-m", "paritylab", "candidate.ports.llava.build._target_=tests.faulty.slow_port",
         f"tracking.uri={store}", f"hydra.run.dir={tmp_path / 'victim'}"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )  # fmt: skip
    client = MlflowClient(store)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (tmp_path / "mlflow.db").exists():
        time.sleep(0.2)
    running: list = []
    while time.monotonic() < deadline and not running:
        time.sleep(0.2)
        experiment = client.get_experiment_by_name("paritylab")
        if experiment is not None:
            running = client.search_runs([experiment.experiment_id], filter_string="attributes.status = 'RUNNING'")
    assert running, "the victim never started its run"
    victim.kill()
    victim.wait()
    from paritylab.cli.app import compose
    from paritylab.run.runner import run

    said: list[str] = []
    cfg = compose(["model=llama", "candidate=sdpa", "compare.replay=false", f"tracking.uri={store}"])
    assert run(cfg, tmp_path / "next", echo=said.append).exit_code == 0
    assert any("marked KILLED 1 runs left RUNNING" in line for line in said)
    assert client.get_run(running[0].info.run_id).info.status == "KILLED"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ("candidate=bf16,compare.rtol=0.01", "candidate=bf16,compare.rtol=0.01"),
        ("inputs.path=data/batch.safetensors", "inputs.path=data_batch.safetensors"),  # a `/` never nests
        ("", "defaults"),
        ("..", "defaults"),
    ],
)
def test_sweep_job_directories_are_named_by_what_varies_in_one_component(overrides, expected):
    from paritylab.run.config import DIRNAME_LIMIT, job_dirname

    assert job_dirname(overrides) == expected
    long_a, long_b = "x=" + "a" * 300, "x=" + "a" * 299 + "b"
    assert len(job_dirname(long_a)) == DIRNAME_LIMIT and job_dirname(long_a) != job_dirname(long_b)


def test_the_sweep_subdir_uses_the_dirname_resolver():
    from omegaconf import OmegaConf

    from paritylab.run.config import CONF_DIR, register

    register()
    hydra = OmegaConf.load(CONF_DIR / "config.yaml").hydra
    assert (
        OmegaConf.to_container(hydra.sweep)["subdir"]
        == "${hydra.job.num}-${paritylab.dirname:${hydra.job.override_dirname}}"
    )
    assert OmegaConf.create({"d": "${paritylab.dirname:'a/b=c'}"}).d == "a_b=c"


@pytest.mark.parametrize("failing", ["fail", "error", "no result"])
def test_a_sweep_parent_is_failed_when_any_child_fails_or_errors(tmp_path, monkeypatch, failing):
    """The parent's status and the sweep's exit code follow its worst job: a FAIL verdict (1), an error (2) or
    a job that ended without a result (2), not only a regression; the summary lists jobs in number order."""
    from omegaconf import OmegaConf

    import paritylab.sink.sweep as sweep_module
    from tests.helpers import migrated_store

    monkeypatch.setenv(sweep_module.ENVIRONMENT, "")
    monkeypatch.setattr(sweep_module, "_current", None)
    uri = migrated_store(tmp_path / "mlflow.db")
    directory = tmp_path / "sweep"
    config = OmegaConf.create({
        "hydra": {"sweep": {"dir": str(directory)}, "overrides": {"task": ["candidate=a,b"]}},
        "tracking": {"enabled": True, "uri": uri, "experiment": "sweeps", "timeout": 10, "retries": 0},
    })  # fmt: skip
    state = sweep_module.start_sweep(config)
    jobs = {2: ("pass", 0), 10: {"fail": ("fail", 1), "error": ("error", 2), "no result": None}[failing]}
    for number, outcome in jobs.items():
        job = directory / f"{number}-candidate=x{number}"
        (job / ".hydra").mkdir(parents=True)
        if outcome is not None:
            verdict, code = outcome
            (job / "run.json").write_text(json.dumps({"verdict": verdict, "exit_code": code, "link": ""}))
    expected = {"fail": 1, "error": 2, "no result": 2}[failing]
    assert sweep_module.finish_sweep(directory) == expected
    parent = MlflowClient(uri).get_run(state["parent_run_id"])
    assert parent.info.status == "FAILED" and parent.data.metrics["sweep/failed"] == 1
    note = parent.data.tags["mlflow.note.content"]
    assert note.index("| 2-candidate=x2 | pass |") < note.index("| 10-candidate=x10 |")  # 2 before 10


def test_ctrl_c_in_a_sweep_exits_130_keeps_finished_jobs_and_kills_the_parent(tmp_path):
    """SIGINT (a terminal's Ctrl-C) while the second job's forward runs: one line, exit 130, no traceback; the
    finished job stays FINISHED, the interrupted one and the parent are KILLED, no later job starts; the parent
    carries its owner, so a sweep killed outright leaves it to the next run's stale-run cleanup."""
    import signal

    store = migrated_store(tmp_path / "mlflow.db")
    sweep_dir = tmp_path / "sweep"
    process = subprocess.Popen(
        [sys.executable, "-m", "paritylab", "-m", "compare.replay=false", f"tracking.uri={store}",
         "tracking.experiment=interrupted", f"hydra.sweep.dir={sweep_dir}",
         "candidate.ports.llava.build._target_=paritylab.experiments.llava_port.from_reference,"
         "tests.faulty.slow_port,paritylab.experiments.llava_port.from_reference"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPOSITORY)}, preexec_fn=ctrl_c_heard,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the first job finished and the second is in its slow forward
        if any(sweep_dir.glob("0-*/run.json")) and any(sweep_dir.glob("1-*/candidate")):
            break
        time.sleep(0.1)
    time.sleep(1.0)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, out[-2000:] + err[-2000:]
    assert "Traceback" not in out + err
    assert "paritylab: interrupted; finished jobs are kept, the sweep's parent run is KILLED" in err
    client = MlflowClient(store)
    runs = runs_of(client, "interrupted")
    (parent,) = [r for r in runs if r.data.tags.get("paritylab.sweep") == "true"]
    children = sorted((r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id),
                      key=lambda r: r.info.start_time)  # fmt: skip
    assert parent.info.status == "KILLED"
    assert [c.info.status for c in children] == ["FINISHED", "KILLED"]  # the third job never started
    assert not any(sweep_dir.glob("2-*"))
    assert parent.data.tags["paritylab.pid"] == str(process.pid) and parent.data.tags["paritylab.host"]
