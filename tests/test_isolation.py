"""A run reads and writes only what is its own: a directory no other run shares, trace files that are the
trace's own (never one linked from outside), and the keys it knows (a typo is refused, never ignored)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import paritylab
from paritylab.cli.app import compose
from paritylab.run.config import fresh_directory
from paritylab.run.runner import EXIT_ERROR, run

REPOSITORY = Path(__file__).resolve().parents[1]


def test_a_fresh_directory_is_never_one_that_exists(tmp_path):
    first = fresh_directory(str(tmp_path / "outputs" / "12-00-00-llava-port"))
    second = fresh_directory(str(tmp_path / "outputs" / "12-00-00-llava-port"))
    assert Path(first).name == "12-00-00-llava-port" and Path(second).name == "12-00-00-llava-port-2"
    assert Path(first).is_dir() and Path(second).is_dir()


@pytest.mark.slow
def test_two_runs_started_with_one_directory_name_never_share_it(tmp_path):
    """Both processes read one clock value (the same name); one is clean, one fails: each reports its own."""
    env = {**os.environ, "PYTHONPATH": str(REPOSITORY)}
    common = [sys.executable, "-m", "paritylab", "tracking=off", "compare.replay=false",
              "hydra.run.dir=${paritylab.fresh:outputs/same-second}"]  # fmt: skip
    faulty = ["candidate.ports.llava.build._target_=tests.faulty.scaled_port",
              "+candidate.ports.llava.build.module=llm.layers.1.feed_forward.w2",
              "+candidate.ports.llava.build.scale=1.05"]  # fmt: skip
    processes = [
        subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for command in (common, common + faulty)
    ]
    outputs = [process.communicate(timeout=300)[0] for process in processes]
    assert [process.returncode for process in processes] == [0, 1], outputs
    assert "PASS:" in outputs[0] and "FAIL:" in outputs[1]
    directories = sorted((tmp_path / "outputs").iterdir())
    assert [d.name for d in directories] == ["same-second", "same-second-2"]
    verdicts = sorted(json.loads((d / "run.json").read_text())["verdict"] for d in directories)
    assert verdicts == ["fail", "pass"]


def test_a_directory_that_holds_a_run_is_refused_and_left_as_it_was(tmp_path):
    cfg = compose(["tracking=off", "compare.replay=false"])
    first = run(cfg, tmp_path / "run", echo=lambda _: None)
    assert first.exit_code == 0
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*") if p.is_file()}
    lines: list[str] = []
    second = run(cfg, tmp_path / "run", echo=lines.append)
    assert second.exit_code == EXIT_ERROR
    assert lines == [
        f"paritylab: {tmp_path / 'run'} already holds another paritylab run: pass a new directory "
        "(hydra.run.dir=... or output_dir=...), or remove that one"
    ]
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*") if p.is_file()} == before


def _killed_trace(tmp_path: Path) -> Path:
    """A trace whose process was killed mid-forward: journals and unfinished ``.partial`` shards."""
    import time

    from tests.test_reliability import KILLED_MID_FORWARD

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
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("link", ["hard", "symbolic"])
def test_recovering_a_killed_trace_never_writes_through_a_link_to_an_outside_file(tmp_path, link):
    """A ``.partial`` shard that is another name of a file outside the trace: recovery finishes a private copy;
    the outside file keeps every byte, and the trace still loads with its tensors."""
    import hashlib

    from paritylab import Trace, TraceFormatError
    from paritylab.cli.compare import main as compare

    directory = _killed_trace(tmp_path)
    (partial,) = directory.glob("*.partial")
    outside = tmp_path / "precious.bin"
    os.replace(partial, outside)
    os.link(outside, partial) if link == "hard" else os.symlink(outside, partial)
    before = hashlib.sha256(outside.read_bytes()).hexdigest(), outside.stat().st_size
    assert compare([str(directory), str(directory)]) == 2  # a killed forward, or a refused link: exit 2 either way
    assert (hashlib.sha256(outside.read_bytes()).hexdigest(), outside.stat().st_size) == before
    if link == "symbolic":  # a trace directory holds only real files: refused in one line, nothing written
        with pytest.raises(TraceFormatError, match=r"\.partial is a symbolic link; a trace directory holds only"):
            Trace.load(directory)
        assert not (directory / "trace.json").exists()
        return
    trace = Trace.load(directory)
    assert trace.meta["recovered"] is True
    stored = [node for call in trace.calls for _, node in call.tensors("outputs") if "ref" in node]
    assert stored and all(trace.tensor(node) is not None for node in stored)
    assert not list(directory.glob("*.recovering"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+compare.rtoll=1"], "compare.rtoll is not a paritylab setting (did you mean compare.rtol?)"),
        (["compare.rtoll=1"], "compare.rtoll is not a paritylab setting (did you mean compare.rtol?)"),
        (["+devcie=cuda"], "devcie is not a paritylab setting (did you mean device?)"),
        (["++devcie=cuda"], "devcie is not a paritylab setting (did you mean device?)"),
        (
            ["candidate=prot"],
            "candidate=prot is not a candidate config (did you mean candidate=port?): choose one of "
            "bf16, compiled, eager, pipeline, port, sdpa, tp",
        ),
        (  # Hydra's own groups (and its plugins'): the group named whole, its options as Hydra lists them
            ["hydra/job_logging=nne"],
            "hydra/job_logging=nne is not a hydra/job_logging config (did you mean hydra/job_logging=none?): choose "
            "one of default, disabled, none, stdout",
        ),
        (["-m", "compare.rtol=1e-3", "+compare.atoll=1,2"], "compare.atoll is not a paritylab setting (did you mean"),
        (["+compare.modules={'[': {rtol: 1e-3}}"], "no viable alternative at input"),  # Hydra cannot parse it
    ],
)
def test_an_unknown_key_or_choice_is_refused_in_one_line_with_what_was_meant(overrides, message, capsys):
    """With or without ``+``, a key paritylab does not know is refused before anything runs, naming the closest
    one, and never with a suggestion that would be ignored."""
    from paritylab.cli.app import preflight

    with pytest.raises(SystemExit) as exited:
        preflight([*overrides, "tracking=off"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"paritylab: bad configuration: {message}" in err
    assert "+compare" not in err.split(message, 1)[1]  # never suggests adding the typo


@pytest.mark.parametrize(
    "overrides",
    [
        ["++compare.rtol=0.1"],  # forcing a key that exists
        ["+candidate.ports.llava.build.bug=mask"],  # open: a builder's own arguments
        ["+model.call.kwargs.output_hidden_states=true"],
        ["+compare.modules.lm_head.rtol=0.01"],
        ["+experiment=nightly"],  # a config group
    ],
)
def test_open_sections_and_known_keys_are_accepted(overrides):
    from paritylab.cli.app import preflight

    preflight([*overrides, "tracking=off"])  # no SystemExit


class _Payload:
    """What a malicious checkpoint pickles: unpickling it would call a function (here a harmless one)."""

    def __reduce__(self):
        return (print, ("unpickled: code ran",))


def test_a_pretrained_bin_that_holds_code_is_refused_in_one_line(tmp_path, capsys):
    """transformers loads a ``pytorch_model.bin`` with ``torch.load(weights_only=True)``: a pickle that calls
    something is refused, and the run says so in one line naming the directory (exit 2), running no code."""
    import torch

    from tests.tiny import tiny_llama_config

    tiny_llama_config().save_pretrained(tmp_path / "checkpoint")
    torch.save({"model.embed_tokens.weight": _Payload()}, tmp_path / "checkpoint" / "pytorch_model.bin")
    lines: list[str] = []
    cfg = compose(
        ["model=llama", "candidate=sdpa", "tracking=off", f"model.build.pretrained={tmp_path / 'checkpoint'}"]
    )
    result = run(cfg, tmp_path / "run", echo=lines.append)
    assert result.exit_code == EXIT_ERROR
    assert "unpickled: code ran" not in capsys.readouterr().out
    refusal = [line for line in lines if "pickled code" in line]
    assert refusal == [
        f"paritylab: model.build.pretrained={tmp_path / 'checkpoint'}: a weights file there holds pickled code, not "
        "only tensors, and the weights-only load refused it; convert it to safetensors where you trust it, or use a "
        "safetensors copy"
    ]
    assert all("\n" not in line for line in lines)


@pytest.mark.slow
def test_a_disk_that_fills_up_mid_run_is_one_line_and_an_error_in_mlflow(tmp_path):
    """A real full disk (a 400 kB tmpfs) while the reference is traced: one error line that says what to do, exit
    2, the MLflow run FAILED with verdict ``error`` (never left ``running``), no half-written JSON left behind."""
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(small)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"a real full disk needs a small tmpfs, and mounting one here failed: {mounted.stderr!r}")
    try:
        store = f"sqlite:///{tmp_path / 'mlflow.db'}"
        result = subprocess.run(
            [sys.executable, "-m", "paritylab", f"tracking.uri={store}", "compare.replay=false",
             f"hydra.run.dir={small / 'run'}"],
            cwd=small, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPOSITORY)},
        )  # fmt: skip
        assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
        errors = [line for line in (result.stdout + result.stderr).splitlines() if "No space" in line or "full" in line]
        assert errors == [
            f"paritylab: error: the disk is full (no space left on device) under {small / 'run'}: free space or set "
            "output_dir elsewhere, then run again; what was written is kept"
        ]
        assert "Traceback" not in result.stderr
        assert not list((small / "run").rglob("*.json.partial"))
        from mlflow.tracking import MlflowClient

        client = MlflowClient(store)
        (run_info,) = client.search_runs([client.get_experiment_by_name("paritylab").experiment_id])
        assert run_info.info.status == "FAILED" and run_info.data.tags["paritylab.verdict"] == "error"
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)


def test_a_trace_that_could_not_be_finished_for_a_full_disk_says_so_when_recovered(tmp_path, monkeypatch):
    """trace.json could not be written (ENOSPC): the journal keeps the cause in the slot it reserved (written in
    place, needing no free space), and the recovered trace says "no space left on device", not "killed"."""
    import errno

    from paritylab.tracing.tracefile import Trace
    from tests.tiny import tiny_llama, token_ids

    model, ids = tiny_llama(num_hidden_layers=1), token_ids()

    def full(*_: object, **__: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(Trace, "save", full)
        with pytest.raises(OSError, match="No space"), paritylab.trace(model, tmp_path / "t", save_tensors=True):
            model(ids)
    recovered = Trace.load(tmp_path / "t")
    error = recovered.meta["error"]
    assert error["type"] == "Unfinished" and "killed" not in error["message"]
    assert error["message"] == (
        "the trace could not be finished: OSError: No space left on device; recovered from its journal"
    )
    with paritylab.trace(model, tmp_path / "whole", save_tensors=True):
        model(ids)
    assert [call.key for call in recovered.calls] == [call.key for call in Trace.load(tmp_path / "whole").calls]
    assert all(call.outputs is not None and call.error is None for call in recovered.calls)  # all closed
