"""Sweeps (``python -m paritylab -m ...``): a parent MLflow run, child runs nested under it, a summary.

:class:`SweepCallback` (registered in ``conf/config.yaml``) prepares the tracking store once, marks runs
left RUNNING by dead processes as KILLED, opens the parent run and writes ``paritylab_sweep.json`` in
the sweep directory, where every job (in-process or a joblib worker) finds its parent. Each job writes
``run.json``; :func:`finish_sweep` summarises them, logs the summary on the parent and gives the exit
code. It is idempotent and also called by ``__main__`` after Hydra returns, because Hydra swallows
exceptions raised in callbacks and skips ``on_multirun_end`` when a job raises.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from paritylab.sink.interrupts import EXIT_INTERRUPTED
from paritylab.sink.processes import owner_tags
from paritylab.tracing.files import write_json

STATE_FILE = "paritylab_sweep.json"
ENVIRONMENT = "PARITYLAB_SWEEP_DIR"

_current: Path | None = None


class SweepCallback(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        start_sweep(config)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        finish_sweep(Path(config.hydra.sweep.dir))


def start_sweep(config: DictConfig) -> dict[str, Any]:
    """Open the sweep: state file, parent run, stale-run cleanup."""
    global _current
    directory = Path(config.hydra.sweep.dir).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    overrides = list(config.hydra.overrides.task)
    state: dict[str, Any] = {"parent_run_id": None, "number": None, "finished": False, "overrides": overrides}
    tracking = config.tracking
    if tracking.enabled:
        state.update(_open_parent(tracking, overrides))
    _write(directory, state)
    os.environ[ENVIRONMENT] = str(directory)  # joblib workers started later inherit it
    _current = directory
    return state


def _open_parent(tracking: DictConfig, overrides: list[str]) -> dict[str, Any]:
    from paritylab.sink.store import MlflowStore
    from paritylab.sink.tracking import MlflowTracker, TrackingError

    try:
        tracker = MlflowTracker(tracking.uri, tracking.experiment, tracking.timeout, tracking.retries)
        store = MlflowStore(tracker)
        killed = store.close_stale_runs()
        number = store.next_sweep_number()
        tags = {
            "paritylab.sweep": "true",
            "paritylab.sweep_number": str(number),
            "paritylab.overrides": " ".join(overrides),
            **owner_tags(),  # a sweep that dies leaves its parent to the next run's stale-run cleanup
        }
        tracker.start(f"sweep/{number}", tags)
    except TrackingError as error:
        print(f"paritylab: sweep without a parent run: {error}")
        return {"tracking_error": str(error)}
    print(f"paritylab: sweep {number} (parent run {tracker.run_id}); closed {len(killed)} stale runs")
    return {
        "parent_run_id": tracker.run_id,
        "number": number,
        "uri": tracker.uri,
        "experiment": str(tracking.experiment),
        "stale_closed": killed,
    }


def sweep_state() -> dict[str, Any] | None:
    """The state of the sweep this job belongs to, or ``None`` outside a sweep."""
    directory = os.environ.get(ENVIRONMENT)
    if not directory:
        return None
    path = Path(directory) / STATE_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def sweep_started() -> bool:
    """Whether this process opened a sweep (:func:`start_sweep`): a multirun past its start."""
    return _current is not None


def finish_sweep(directory: Path | None = None, interrupted: bool = False) -> int:
    """Summarise the sweep's jobs (printed and logged on the parent run); returns the process exit code:
    0 when every job passed without regression, 1 when one failed or regressed, 2 when one errored, 130 when
    the sweep was ``interrupted`` (Ctrl-C, SIGTERM: the parent run ends KILLED, the finished jobs kept)."""
    directory = directory or _current
    if directory is None or not (directory / STATE_FILE).is_file():
        return 0
    state = json.loads((directory / STATE_FILE).read_text(encoding="utf-8"))
    if state.get("finished"):
        return int(state.get("exit_code", 0))
    jobs = _jobs(directory, interrupted)
    code = EXIT_INTERRUPTED if interrupted else max((job["exit_code"] for job in jobs), default=2)
    summary = summarise(jobs, state)
    print(summary)
    (directory / "sweep_summary.md").write_text(summary, encoding="utf-8")
    if state.get("parent_run_id"):
        if interrupted:  # a job killed with its worker (joblib) never closed its run: close it here
            state["children_killed"] = _close_children(state)
        _close_parent(state, directory, jobs, summary, code)
    state.update(finished=True, exit_code=code)
    _write(directory, state)
    _remove_placeholder_folders(directory)
    return code


def _remove_placeholder_folders(directory: Path) -> None:
    """A launcher may leave an empty folder named by an unexpanded pattern: submitit creates
    ``.submitit/%j`` before it knows any job id, and puts every job's files in ``.submitit/<job id>``."""
    for folder in directory.glob(".*/*%*"):
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def _jobs(directory: Path, interrupted: bool = False) -> list[dict[str, Any]]:
    """Every job's ``run.json``; a job that started but wrote none counts as an error (as interrupted, when
    the sweep was)."""
    jobs = []

    def number(path: Path) -> tuple[int, str]:  # job directories start with Hydra's job number: 2 before 10
        head = path.name.split("-", 1)[0]
        return (int(head) if head.isdigit() else -1, path.name)

    for job_dir in sorted((path for path in directory.iterdir() if (path / ".hydra").is_dir()), key=number):
        try:
            job = json.loads((job_dir / "run.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            if interrupted:  # killed with its worker: its run.json says how far it got
                job = _interrupted_job(job_dir)
                with contextlib.suppress(OSError):
                    write_json(job_dir / "run.json", job, indent=1)
            else:
                job = {"exit_code": 2, "verdict": "error", "error": "the job ended without a result", "link": ""}
        job["directory"] = job_dir.name
        jobs.append(job)
    return jobs


def _interrupted_job(job_dir: Path) -> dict[str, Any]:
    """``run.json`` of a job the interruption ended before it wrote one. A job that reached its verdict (its
    ``tracking.json`` holds it) keeps that verdict, unpublished; otherwise it was interrupted mid-run. Either way
    its status is KILLED and its exit code 130."""
    job: dict[str, Any] = {
        "status": "KILLED", "exit_code": EXIT_INTERRUPTED, "verdict": "interrupted", "link": "",
        "error": "interrupted: the sweep was stopped while this job ran",
    }  # fmt: skip
    try:
        record = json.loads((job_dir / "tracking.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return job
    tags = record.get("tags") if isinstance(record, dict) else None
    if not isinstance(tags, dict):
        return job
    verdict = tags.get("paritylab.verdict")
    if record.get("status") == "FINISHED" and isinstance(verdict, str):
        job.update(
            verdict=verdict,
            first_divergence=tags.get("paritylab.first_divergence"),
            error=f"interrupted while publishing: the verdict is kept; paritylab-upload {job_dir} publishes it",
        )
    return job


def _close_children(state: dict[str, Any]) -> list[str]:
    """Mark KILLED every run of this sweep (nested under its parent) still RUNNING: the jobs it started and the
    interruption ended; returns their ids."""
    from paritylab.sink.store import MlflowStore
    from paritylab.sink.tracking import MlflowTracker, TrackingError

    try:
        tracker = MlflowTracker(state.get("uri"), _experiment_of(state))
        return MlflowStore(tracker).close_running_children(str(state["parent_run_id"]))
    except TrackingError as error:
        print(f"paritylab: could not close the sweep's interrupted jobs: {error}")
        return []


def summarise(jobs: list[dict[str, Any]], state: dict[str, Any]) -> str:
    lines = [
        f"## paritylab sweep {state.get('number') or ''}",
        "",
        "| job | verdict | first divergence | regression | regressed layers | run |",
        "|---|---|---|---|---|---|",
    ]
    for job in jobs:
        regressed = ", ".join(job.get("regressed_layers") or []) or "-"
        lines.append(
            f"| {job['directory']} | {job.get('verdict')} | {job.get('first_divergence') or 'none'} | "
            f"{job.get('regression') or '-'} | {regressed} | {job.get('link') or job.get('error') or ''} |"
        )
    failing = [job for job in jobs if job["exit_code"]]
    lines += ["", f"{len(jobs)} jobs, {len(failing)} failed, regressed or errored."]
    return "\n".join(lines)


def _close_parent(state: dict[str, Any], directory: Path, jobs: list[dict[str, Any]], summary: str, code: int) -> None:
    """The summary, counts and file on the parent run; its outcome (``paritylab.verdict``: ``interrupted``,
    ``error``, ``fail``, ``regressed``, ``inconclusive`` or ``pass``, the first of these a job has) and a name that
    starts with it and counts the jobs (``FAIL sweep/3: 1 fail, 3 pass``); the status: FINISHED, FAILED, KILLED."""
    from paritylab.sink.publish import aggregate, display_name, outcome, summarise_experiment, tally
    from paritylab.sink.tracking import Metric, MlflowTracker, TrackingError

    outcomes = [outcome(str(job.get("verdict") or "error"), job.get("regression")) for job in jobs]
    verdict = "interrupted" if code == EXIT_INTERRUPTED else aggregate(outcomes)
    per_verdict = tally(outcomes) or "no jobs"
    regressed = any(job.get("regression") == "regressed" for job in jobs)
    try:
        tracker = MlflowTracker(state.get("uri"), _experiment_of(state))
        tracker.run_id = state["parent_run_id"]
        tracker.set_tags(
            {
                "mlflow.note.content": summary,
                "paritylab.sweep_exit_code": str(code),
                "paritylab.verdict": verdict,
                "paritylab.regression": "regressed" if regressed else "none",
                "mlflow.runName": display_name(verdict.upper(), f"sweep/{state.get('number')}", per_verdict, ": "),
            }
        )
        counts = {"jobs": len(jobs), "failed": sum(1 for j in jobs if j["exit_code"])}
        counts["regressed"] = sum(1 for j in jobs if j.get("regression") == "regressed")
        tracker.log_metrics([Metric(f"sweep/{key}", value) for key, value in counts.items()])
        tracker.log_artifact(directory / "sweep_summary.md")
        # FAILED: a job failed, regressed or errored; KILLED: the sweep was interrupted
        tracker.end("KILLED" if code == EXIT_INTERRUPTED else "FINISHED" if code == 0 else "FAILED")
        summarise_experiment(tracker)
    except TrackingError as error:
        print(f"paritylab: could not log the sweep summary: {error}")


def _experiment_of(state: dict[str, Any]) -> str:
    return str(state.get("experiment") or "paritylab")


def _write(directory: Path, state: dict[str, Any]) -> None:
    write_json(directory / STATE_FILE, state, indent=1)
