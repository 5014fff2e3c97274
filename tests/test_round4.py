"""Reliability round 4 (issue 44): typos inside per-module tolerances and builder options, a world of ranks that
cannot fit, empty inputs, Hydra's own errors, and signals at a run's start-up or in a sweep.

The refusals run in process (``compose`` then ``check_targets``) and across the process boundary where the exit
code and the one line are what the user sees."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from paritylab.cli.app import compose
from paritylab.distributed import takes_options
from paritylab.run.config import check_targets
from paritylab.run.errors import ConfigError

REPOSITORY = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")]))}


def paritylab(cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "paritylab", *args]
    return subprocess.run(command, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


def refused(cfg_overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as raised:
        check_targets(compose(cfg_overrides))
    message = str(raised.value)
    assert "\n" not in message
    return message


def one_line_exit_2(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("paritylab")]
    assert len(lines) == 1, result.stdout + result.stderr
    return lines[0]


# -- empty inputs -------------------------------------------------------------------------------------------------


def test_an_input_without_elements_is_refused_before_anything_runs(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    empty = tmp_path / "empty.safetensors"
    save_file({"input_ids": torch.zeros(1, 0, dtype=torch.long)}, str(empty))
    message = refused(["tracking=off", "inputs=file", f"inputs.path={empty}"])
    assert message == (
        f"inputs.path={str(empty)!r}: input_ids has no elements (shape [1, 0]); a comparison over nothing proves "
        "nothing: save inputs with at least one element each"
    )
    nothing = tmp_path / "nothing.safetensors"
    nothing.write_bytes(b"")
    assert refused(["tracking=off", "inputs=file", f"inputs.path={nothing}"]).startswith(
        f"inputs.path={str(nothing)!r} is not a readable safetensors file"
    )
    line = one_line_exit_2(paritylab(tmp_path, "tracking=off", "inputs=file", f"inputs.path={empty}"))
    assert "input_ids has no elements (shape [1, 0])" in line
    assert not (tmp_path / "mlflow.db").exists()


def test_inputs_built_empty_are_refused_too() -> None:
    from paritylab.run.inputs import not_empty

    with pytest.raises(ConfigError, match=r"inputs=prompts: attention_mask has no elements \(shape \[2, 0\]\)"):
        not_empty({"input_ids": torch.ones(2, 3), "attention_mask": torch.ones(2, 0)}, "prompts")


# -- Hydra's own errors, and a signal while a single run starts ------------------------------------------------


def test_an_override_hydra_rejects_in_a_sweep_is_one_line_and_exit_2(tmp_path: Path) -> None:
    for override in ("hydra.launcher.n_jobs=abc", "hydra.job.chdir=maybe"):
        result = paritylab(tmp_path, "-m", "tracking=off", override, f"hydra.sweep.dir={tmp_path / 'sweep'}")
        line = one_line_exit_2(result)
        assert line.startswith("paritylab: bad configuration: ") and override.split("=")[0] in line
        assert "HYDRA_FULL_ERROR" not in result.stderr


SLOW_IMPORT = """
import sys, time
from pathlib import Path
Path({marker!r}).write_text("importing")
time.sleep(120)
"""


def test_a_sigterm_while_a_single_run_starts_does_not_speak_of_a_sweep(tmp_path: Path) -> None:
    marker = tmp_path / "importing"
    (tmp_path / "slow_builder.py").write_text(SLOW_IMPORT.format(marker=str(marker)))
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), ENV["PYTHONPATH"]])}
    command = [sys.executable, "-m", "paritylab", "tracking=off", "model.build._target_=slow_builder.build",
               f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not marker.exists() and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.1)
    assert marker.exists(), process.communicate()
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130, out + err
    assert "sweep" not in out + err and "finished jobs" not in out + err
    assert err.strip() == "paritylab: interrupted while starting; nothing was compared"


# -- compare.modules: one schema for every entry, a pattern that matches nothing is said ------------------------


def test_a_typo_inside_a_per_module_override_is_refused_with_what_was_meant(tmp_path: Path) -> None:
    message = refused(["tracking=off", "+compare.modules.fc2.rtoll=10"])
    assert message == (
        "compare.modules.fc2.rtoll is not a per-module setting (did you mean compare.modules.fc2.rtol?): "
        "an entry takes rtol, atol"
    )
    assert refused(["tracking=off", "+compare.modules.lm.head.rtol=1"]).endswith(
        "a pattern with dots is given whole: '+compare.modules={lm.head: {rtol: 1e-3}}'"
    )
    assert refused(["tracking=off", "+compare.modules.fc2=3"]).startswith(
        "compare.modules.fc2=3 must be {rtol:, atol:}"
    )
    check_targets(compose(["tracking=off", "+compare.modules.fc2.rtol=10", "+compare.modules.fc2.atol=1"]))
    line = one_line_exit_2(paritylab(tmp_path, "tracking=off", "+compare.modules.fc2.rtoll=10"))
    assert line == f"paritylab: bad configuration: {message}"
    line = one_line_exit_2(paritylab(tmp_path, "-m", "tracking=off", "compare.rtol=0,1", "+compare.modules.x.atoll=1"))
    assert "compare.modules.x.atoll is not a per-module setting (did you mean compare.modules.x.atol?)" in line


def test_a_pattern_that_matches_no_module_is_a_note(tmp_path: Path) -> None:
    from paritylab.run.runner import run

    cfg = compose(
        ["tracking=off", "compare.replay=false", "+compare.modules={lm_head: {rtol: 0.05}, nowhere.*: {rtol: 0.1}}"]
    )
    assert set(cfg.compare.modules) == {"lm_head", "nowhere.*"}
    result = run(cfg, tmp_path / "run", echo=lambda _: None)
    expected = (
        "compare.modules.nowhere.* matches no module of the reference: its tolerances were not applied "
        "(patterns are fnmatch on module paths, e.g. 'model.layers.*.mlp')"
    )
    assert result.exit_code == 0
    assert expected in result.notes
    assert not any("compare.modules.lm_head" in note for note in result.notes)


# -- builder options: checked against what the builder declares ----------------------------------------------------


def test_options_on_a_candidate_that_is_not_distributed_are_refused(tmp_path: Path) -> None:
    assert refused(["tracking=off", "+candidate.options.modle=x"]) == (
        "candidate.options.modle is read only by a distributed candidate's builder (candidate.kind=distributed), "
        "and this candidate is a port: its builder's arguments go under candidate.ports.<family>.build"
    )
    assert refused(["tracking=off", "candidate=bf16", "+candidate.options.x=1"]).endswith(
        "this candidate is a dtype: its builder's arguments go under candidate.build"
    )
    line = one_line_exit_2(paritylab(tmp_path, "tracking=off", "+candidate.options.modle=x"))
    assert "candidate.options.modle is read only by a distributed candidate's builder" in line


def test_an_unknown_option_to_the_tp_builder_is_refused_naming_the_known_ones(tmp_path: Path) -> None:
    known = "it takes: config, defect, layer, mesh, scale"
    message = refused(["model=llama", "candidate=tp", "tracking=off", "+candidate.options.defetc=rank1_scaled"])
    assert message == (
        "candidate.options.defetc: paritylab.experiments.tp_llama:build takes no option 'defetc' "
        f"(did you mean defect?); {known}"
    )
    check_targets(compose(["model=llama", "candidate=tp", "tracking=off", "+candidate.options.defect=rank1_scaled"]))
    pipeline = ["model=llama", "candidate=pipeline", "tracking=off", "+candidate.options.mesh=[1,2]"]
    assert refused(pipeline).endswith("takes no option 'mesh'; it takes: config, defect, layer")
    result = paritylab(
        tmp_path, "model=llama", "candidate=tp", "tracking=off", "+candidate.options.defetc=rank1_scaled"
    )
    assert one_line_exit_2(result) == f"paritylab: {message}"
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").glob("*/*/ranks"))


@takes_options("scale")
def scaled(context: object) -> torch.nn.Module:
    return torch.nn.Identity()


def test_a_launch_made_without_the_command_line_refuses_an_undeclared_option_on_the_rank(tmp_path: Path) -> None:
    from paritylab.distributed.launch import LaunchSpec, prepare, run_ranks

    prepare(tmp_path, {"x": torch.ones(2)}, None)
    spec = LaunchSpec("tests.test_round4:scaled", 1, tmp_path, options={"scael": 2.0}, timeout_s=120)
    (result,) = run_ranks(spec)
    assert not result.ok
    assert result.failed[0].phase == "build"
    assert result.failed[0].error == (
        "ValueError: options.scael: tests.test_round4:scaled takes no option 'scael' (did you mean scale?); "
        "it takes: config, scale"
    )


# -- a world of ranks that cannot fit -------------------------------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_rank_is_counted_as_a_process_of_the_size_measured_for_it() -> None:
    """:data:`RANK_PROCESS` holds what a rank's process takes before its model: measured here, it is no guess
    (``VmRSS``: ``ru_maxrss`` would carry the forking parent's high-water mark)."""
    from paritylab.run.budget import RANK_PROCESS

    code = "import torch, torch.distributed; print(open('/proc/self/status').read())"  # VmRSS: this process's own
    status = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    measured = int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) * 1024
    assert measured <= RANK_PROCESS <= 3 * measured, f"{measured / 2**20:.0f} MiB measured"


def test_a_world_that_does_not_fit_is_refused_saying_what_fits() -> None:
    from paritylab.run.budget import plan_ranks

    with pytest.raises(ConfigError) as raised:
        plan_ranks(64, 2, 16 * 2**30)
    assert str(raised.value) == (
        "candidate.world_size=64: 64 rank processes need about 18.8 GiB (300.0 MiB each: interpreter, torch) on 2 "
        "cores, and 2 cores take at most 4 ranks (2 per core) and 16.0 GiB free takes at most 46; at most 4 ranks "
        "fit here: use candidate.world_size=4 or fewer"
    )
    with pytest.raises(ConfigError, match=r"4.0 GiB free takes at most 5; at most 5 ranks fit here"):
        plan_ranks(8, 16, 4 * 2**30, weights=300 * 2**20)
    assert plan_ranks(2, 2, 24 * 2**30) == (
        "2 rank processes need about 600.0 MiB (300.0 MiB each: interpreter, torch) on 2 cores (24.0 GiB free)"
    )


def test_world_size_64_on_a_small_machine_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    world = max(64, 2 * (os.cpu_count() or 1) + 1)  # more than this machine's cores take, whatever it is
    result = paritylab(tmp_path, "model=llama", "candidate=tp", f"candidate.world_size={world}", "tracking=off",
                       f"hydra.run.dir={tmp_path / 'run'}")  # fmt: skip
    line = one_line_exit_2(result)
    assert line.startswith(f"paritylab: candidate.world_size={world}: {world} rank processes need about ")
    assert "ranks fit here: use candidate.world_size=" in line
    assert not (tmp_path / "run" / "ranks").exists() and not (tmp_path / "run" / "reference").exists()


# -- a sweep's interruption, and publishing an interrupted run ------------------------------------------------------


def test_ctrl_c_into_a_joblib_sweep_closes_every_job_it_started_and_writes_each_run_json(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    from tests.helpers import ctrl_c_heard, migrated_store

    store = migrated_store(tmp_path / "mlflow.db")
    sweep = tmp_path / "sweep"
    command = [sys.executable, "-m", "paritylab", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
               "compare.replay=false", f"tracking.uri={store}", "tracking.experiment=joblib",
               f"hydra.sweep.dir={sweep}",
               "candidate.ports.llava.build._target_=paritylab.experiments.llava_port.from_reference,"
               "tests.faulty.slow_port"]  # fmt: skip
    process = subprocess.Popen(
        command, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=ctrl_c_heard,
    )  # fmt: skip
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and process.poll() is None:
        if any(sweep.glob("0-*/run.json")) and any(sweep.glob("1-*/candidate")):
            break
        time.sleep(0.2)
    time.sleep(1.0)
    process.send_signal(signal.SIGINT)  # the parent only: joblib then kills its workers, jobs and all
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, out[-2000:] + err[-2000:]
    assert "Traceback" not in out + err
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("joblib")
    runs = client.search_runs([experiment.experiment_id], max_results=100)
    statuses = sorted((run.data.tags.get("paritylab.sweep") == "true", run.info.status) for run in runs)
    assert statuses == [(False, "FINISHED"), (False, "KILLED"), (True, "KILLED")], statuses
    jobs = sorted(path.parent.name.split("-", 1)[0] for path in sweep.glob("*/run.json"))
    assert jobs == ["0", "1"]
    (killed,) = sweep.glob("1-*/run.json")
    assert '"verdict": "interrupted"' in killed.read_text()


def test_a_job_killed_after_its_verdict_keeps_it_in_the_run_json_the_sweep_writes(tmp_path: Path) -> None:
    import json

    from paritylab.sink.sweep import _interrupted_job

    record = {"status": "FINISHED", "tags": {"paritylab.verdict": "pass", "paritylab.first_divergence": "none"}}
    (tmp_path / "tracking.json").write_text(json.dumps(record))
    job = _interrupted_job(tmp_path)
    assert job["verdict"] == "pass" and job["status"] == "KILLED" and job["exit_code"] == 130
    assert f"paritylab-upload {tmp_path} publishes it" in job["error"]
    (tmp_path / "tracking.json").unlink()
    assert _interrupted_job(tmp_path)["verdict"] == "interrupted"


def test_upload_refuses_an_interrupted_run_unless_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mlflow import MlflowClient

    from paritylab.cli.upload import main
    from paritylab.sink.publish import RunRecord
    from tests.helpers import migrated_store

    store = migrated_store(tmp_path / "mlflow.db")
    capsys.readouterr()  # MLflow's own lines while the store was made
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    RunRecord("llava vs port", "interrupted", None, {"paritylab.verdict": "error"}, {}, status="KILLED").save(run_dir)
    assert main([str(run_dir), "--tracking-uri", store]) == 2
    assert capsys.readouterr().err.strip() == (
        f"paritylab-upload: {run_dir} holds a run that was interrupted before its verdict (KILLED): its results are "
        "partial; pass --allow-interrupted to publish it anyway"
    )
    assert MlflowClient(store).get_experiment_by_name("interrupted") is None
    assert main([str(run_dir), "--tracking-uri", store, "--allow-interrupted"]) == 0
    experiment = MlflowClient(store).get_experiment_by_name("interrupted")
    (published,) = MlflowClient(store).search_runs([experiment.experiment_id])
    assert published.info.status == "KILLED"
