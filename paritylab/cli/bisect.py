"""Find the first commit of the candidate's code where parity broke: ``git bisect run`` with parity's verdict.

paritylab-bisect --repo PATH --good REV --bad REV [--tracking-uri URI] [--experiment NAME]
                           -- [paritylab overrides ...]

Each step checks out a commit of the repository holding the candidate's code (on ``PYTHONPATH`` for the
step), runs ``python -m paritylab`` with the given overrides and no tracking, and answers git with the
verdict: pass is good, fail is bad, and a run that errored or could not judge (exit 2 or 3) is skipped, so a
commit that does not build never takes the blame. The commits tested, their verdicts and the first bad
commit are logged to MLflow as one run (``bisect/<model>/<candidate>``) and kept in ``bisect.json``.
The repository is left as it was (``git bisect reset``); its working tree must be clean.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from paritylab.sink.tracking import Metric, MlflowTracker, TrackingError

SKIP, ABORT = 125, 128
"""``git bisect run``: 125 skips a commit, above 127 stops the bisection."""
STEPS_FILE = "steps.jsonl"


class BisectError(RuntimeError):
    """The repository or revisions cannot be bisected; one line says why."""


def _git(repo: Path, *args: str, check: bool = True) -> str:
    result = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=120)
    if check and result.returncode != 0:
        message = (result.stderr or result.stdout).strip().splitlines()
        raise BisectError(f"git {' '.join(args)} failed: {message[-1] if message else result.returncode}")
    return result.stdout.strip()


def bisect(
    repo: Path, good: str, bad: str, overrides: list[str], directory: Path, python: str = sys.executable
) -> dict[str, Any]:
    """Bisect ``good..bad`` in ``repo``; returns the first bad commit and every step (also in ``bisect.json``)."""
    if not (repo / ".git").exists():
        raise BisectError(f"{repo} is not a git repository: pass --repo the checkout that holds the candidate's code")
    if _git(repo, "status", "--porcelain", "--untracked-files=no"):
        raise BisectError(f"{repo} has uncommitted changes: commit or stash them first (bisect checks out commits)")
    good_sha, bad_sha = (_git(repo, "rev-parse", "--verify", f"{rev}^{{commit}}") for rev in (good, bad))
    directory.mkdir(parents=True, exist_ok=True)
    steps_file = directory / STEPS_FILE
    steps_file.unlink(missing_ok=True)
    step = [python, "-m", "paritylab.cli.bisect", "--step", str(directory), "--", *overrides]
    started = time.time()
    _git(repo, "bisect", "start", bad_sha, good_sha)
    try:
        run = subprocess.run(["git", "-C", str(repo), "bisect", "run", *step], capture_output=True, text=True)
        first = _git(repo, "rev-parse", "--verify", "refs/bisect/bad", check=False)
        log = _git(repo, "bisect", "log", check=False)
    finally:
        _git(repo, "bisect", "reset", check=False)
    steps = [json.loads(line) for line in steps_file.read_text().splitlines()] if steps_file.exists() else []
    found = "is the first bad commit" in run.stdout
    if not found:
        tail = (run.stdout + run.stderr).strip().splitlines()[-3:]
        raise BisectError(f"git bisect run found no first bad commit: {' / '.join(tail) or run.returncode}")
    result = {
        "repo": str(repo),
        "good": good_sha,
        "bad": bad_sha,
        "first_bad_commit": first,
        "subject": _git(repo, "log", "-1", "--format=%s", first),
        "steps": steps,
        "overrides": overrides,
        "seconds": round(time.time() - started, 1),
        "git_bisect_log": log,
    }
    from paritylab.tracing.files import write_json

    write_json(directory / "bisect.json", result, indent=1)
    return result


def step(directory: Path, overrides: list[str]) -> int:
    """One ``git bisect run`` step: parity at the checked-out commit, as git's exit code."""
    repo = Path.cwd()
    commit = _git(repo, "rev-parse", "HEAD")
    run_dir = directory / commit[:12]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "paritylab", *overrides, "tracking=off", f"hydra.run.dir={run_dir}"]
    run = subprocess.run(command, capture_output=True, text=True, env=env, cwd=directory)
    summary: dict[str, Any] = {}
    if (run_dir / "run.json").is_file():
        summary = json.loads((run_dir / "run.json").read_text())
    entry = {
        "commit": commit,
        "subject": _git(repo, "log", "-1", "--format=%s", commit),
        "exit_code": run.returncode,
        "verdict": summary.get("verdict", "error"),
        "first_divergence": summary.get("first_divergence"),
        "error": summary.get("error") or (run.stderr.strip().splitlines() or [""])[-1][:300] or None,
    }
    with open(directory / STEPS_FILE, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(entry) + "\n")
    if run.returncode == 0:
        return 0
    if run.returncode == 1:
        return 1
    if run.returncode == 130:
        return ABORT
    return SKIP  # errored or inconclusive: this commit cannot be judged


def log_bisect(result: dict[str, Any], uri: str | None, experiment: str, directory: Path) -> str | None:
    """One MLflow run: the commits tested with their verdicts (a table), the first bad commit as tags."""
    overrides = result["overrides"]
    pair = "/".join(
        next((o.split("=", 1)[1] for o in overrides if o.startswith(f"{key}=")), default)
        for key, default in (("model", "llava"), ("candidate", "port"))
    )
    tracker = MlflowTracker(uri, experiment)
    tags = {
        "paritylab.bisect": "true",
        "paritylab.first_bad_commit": result["first_bad_commit"],
        "paritylab.first_bad_subject": result["subject"],
        "mlflow.source.git.commit": result["first_bad_commit"],
        "mlflow.note.content": _describe(result),
    }
    tracker.start(f"bisect/{pair}", tags)
    tracker.log_params({"repo": result["repo"], "good": result["good"], "bad": result["bad"]})
    steps = result["steps"]
    table = {key: [str(s.get(key)) for s in steps] for key in ("commit", "subject", "verdict", "first_divergence")}
    tracker.log_table(table, "bisect_steps.json")
    tracker.log_metrics([Metric("bisect/commits_tested", len(steps)), Metric("bisect/seconds", result["seconds"])])
    tracker.log_artifact(directory / "bisect.json")
    tracker.end("FINISHED")
    return tracker.run_id


def _describe(result: dict[str, Any]) -> str:
    lines = [f"### First bad commit: `{result['first_bad_commit'][:12]}` {result['subject']}", ""]
    lines += ["| commit | subject | verdict | first divergence |", "|---|---|---|---|"]
    for s in result["steps"]:
        lines.append(f"| `{s['commit'][:12]}` | {s['subject']} | {s['verdict']} | {s.get('first_divergence') or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, overrides = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(
        prog="paritylab-bisect",
        usage="paritylab-bisect --repo PATH --good REV --bad REV [options] -- [OVERRIDES ...]",
        description="\n\n".join(__doc__.replace("``", "").split("\n\n")[::2]),
        epilog="OVERRIDES, after --, are the parity run's own (python -m paritylab OVERRIDES), e.g. model=llava "
        "candidate=port candidate.ports.llava.build._target_=my_llava.build\n\nexit codes: 0 the first bad commit "
        "was found (printed and logged), 2 the repository or revisions cannot be bisected, or no commit was bad\n\n"
        "example:\n  paritylab-bisect --repo ~/src/my-llava --good v1.2 --bad main -- model=llava candidate=port",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    required = parser.add_argument_group("required")
    required.add_argument("--repo", type=Path, help="the git checkout holding the candidate's code")
    required.add_argument("--good", metavar="REV", help="a commit where parity holds")
    required.add_argument("--bad", metavar="REV", help="a later commit where it does not")
    parser.add_argument("--tracking-uri", help="default: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db")
    parser.add_argument("--experiment", default="paritylab", help="the MLflow experiment (default: paritylab)")
    parser.add_argument("--output", type=Path, help="where steps and bisect.json go (default: a new directory)")
    parser.add_argument("--step", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.step is not None:
        return step(args.step, overrides)
    if not (args.repo and args.good and args.bad):
        parser.error("--repo, --good and --bad are required")
    directory = args.output or Path(tempfile.mkdtemp(prefix="bisect-", dir=Path.cwd()))
    try:
        result = bisect(args.repo.resolve(), args.good, args.bad, overrides, directory.resolve())
        run_id = log_bisect(result, args.tracking_uri, args.experiment, directory)
    except (BisectError, TrackingError, OSError) as error:
        print(f"paritylab-bisect: {error}", file=sys.stderr)
        return 2
    tested = ", ".join(f"{s['commit'][:8]} {s['verdict']}" for s in result["steps"])
    print(f"paritylab-bisect: tested {tested}")
    print(f"paritylab-bisect: first commit where parity broke: {result['first_bad_commit']} {result['subject']}")
    print(f"paritylab-bisect: logged as MLflow run {run_id}; details in {directory / 'bisect.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
