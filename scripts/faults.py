"""Break paritylab from outside, as a user would, and say for each fault whether the promise held.

    python scripts/faults.py            # from a checkout with the project installed; ~8 minutes on 2 cores
    python scripts/faults.py joblib     # only the faults whose name holds one of the words given

Each fault runs the real commands (``python -m paritylab``, ``paritylab-compare``, ``paritylab-upload``) in a
temporary directory that is removed afterwards, and is classified:

- **held**: the promised outcome (exit code, one-line message, no false PASS, nothing lost), in time;
- **degraded**: the outcome is safe but not as promised (slow, several lines, a traceback);
- **broken**: a false PASS, a lost run, a hang, or the wrong exit code.

This is the list of the reliability issues (#15, #28, #44); the test suite covers each fault too, this re-runs them
from outside the suite.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")]))}
Outcome = tuple[str, str]


def run(args: list[str], cwd: Path, timeout: float = 300) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    result = subprocess.run(args, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
    return result, time.monotonic() - started


def app(cwd: Path, *overrides: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess[str], float]:
    return run([sys.executable, "-m", "paritylab", *overrides, f"hydra.run.dir={cwd / 'run'}"], cwd, timeout)


def compare(cwd: Path, *args: str | Path) -> tuple[subprocess.CompletedProcess[str], float]:
    return run([sys.executable, "-m", "paritylab.cli.compare", *map(str, args)], cwd, timeout=60)


def one_line_exit_2(result: subprocess.CompletedProcess[str], seconds: float, limit: float) -> Outcome:
    lines = [line for line in (result.stdout + result.stderr).strip().splitlines() if line.startswith("paritylab")]
    if result.returncode == 0:
        return "broken", "exit 0"
    if result.returncode != 2:
        return "broken", f"exit {result.returncode}"
    if "Traceback" in result.stderr:
        return "degraded", "exit 2 with a traceback"
    if seconds > limit:
        return "degraded", f"exit 2 after {seconds:.1f} s (promised within {limit:.0f} s)"
    return "held", f"exit 2 in {seconds:.1f} s: {lines[-1][:110] if lines else result.stderr.strip()[:110]}"


def good_trace(root: Path) -> Path:
    code = (
        "import torch, paritylab\nfrom torch import nn\n"
        "m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))\n"
        f"with paritylab.trace(m, {str(root)!r}, save_tensors=True):\n    m(torch.randn(3, 4))\n"
    )
    subprocess.run([sys.executable, "-c", code], env=ENV, check=True, capture_output=True)
    return root


def copy_of(trace: Path, target: Path) -> Path:
    shutil.copytree(trace, target)
    return target


# -- the faults ---------------------------------------------------------------------------------------------------


def no_values_no_pass(cwd: Path) -> Outcome:
    bug = ["candidate.ports.llava.build._target_=tests.faulty.scaled_port",
           "+candidate.ports.llava.build.module=llm.layers.1.attention.wo"]  # fmt: skip
    result, _ = app(cwd, *bug, "compare.max_bytes=0", "tracking=off")
    if result.returncode == 0:
        return "broken", "a wrong model passed with compare.max_bytes=0"
    return "held", f"exit {result.returncode}: {result.stdout.strip().splitlines()[-2][:110]}"


def sigterm_mid_run(cwd: Path) -> Outcome:
    command = [sys.executable, "-m", "paritylab", "candidate.ports.llava.build._target_=tests.faulty.slow_port",
               f"tracking.uri=sqlite:///{cwd / 'mlflow.db'}", f"hydra.run.dir={cwd / 'run'}"]  # fmt: skip
    process = subprocess.Popen(command, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (cwd / "run" / "candidate").exists():
        time.sleep(0.2)
    time.sleep(1.0)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    summary = cwd / "run" / "run.json"
    status = _statuses(cwd / "mlflow.db")
    if process.returncode != 130 or not summary.exists():
        return "broken", f"exit {process.returncode}, run.json {'kept' if summary.exists() else 'missing'}"
    if "Traceback" in output:
        return "degraded", "exit 130 with a traceback"
    return ("held" if status == ["KILLED"] else "degraded"), f"exit 130, run.json kept, MLflow run {status}"


def _statuses(database: Path) -> list[str]:
    if not database.exists():
        return []
    with sqlite3.connect(database) as connection:
        return [row[0] for row in connection.execute("select status from runs")]


def hostile(kind: str) -> Callable[[Path], Outcome]:
    def fault(cwd: Path) -> Outcome:
        trace = good_trace(cwd / "good")
        target = copy_of(trace, cwd / "hostile")
        if kind == "fifo":
            os.mkfifo(target / "model_debug_tree_FULL_TENSORS.json")
        elif kind == "dev_zero":
            (target / "model_debug_tree_FULL_TENSORS.json").symlink_to("/dev/zero")
        elif kind == "symlink_out":
            outside = cwd / "outside.json"
            outside.write_text((target / "trace.json").read_text())
            (target / "trace.json").unlink()
            (target / "trace.json").symlink_to(outside)
        elif kind == "deep":
            (target / "trace.json").write_text('{"calls": ' + "[" * 100_000 + "]" * 100_000 + "}")
        elif kind == "wide":
            (target / "trace.json").write_text('{"calls": [' + "{}," * 56_000_000 + "{}]}")
        elif kind == "infinity":
            document = json.loads((target / "trace.json").read_text())
            document["calls"][1]["index"] = 10**400
            (target / "trace.json").write_text(json.dumps(document).replace("1" + "0" * 400, "Infinity"))
        elif kind == "empty":
            document = json.loads((target / "trace.json").read_text())
            document["calls"] = []
            (target / "trace.json").write_text(json.dumps(document))
        try:
            result, seconds = compare(cwd, trace, target)
        except subprocess.TimeoutExpired:
            return "broken", "hangs (60 s timeout)"
        return one_line_exit_2(result, seconds, 10)

    return fault


def kill_9_then_a_plain_run(cwd: Path) -> Outcome:
    uri = f"sqlite:///{cwd / 'mlflow.db'}"
    command = [sys.executable, "-m", "paritylab", "candidate.ports.llava.build._target_=tests.faulty.slow_port",
               f"tracking.uri={uri}", f"hydra.run.dir={cwd / 'killed'}"]  # fmt: skip
    process = subprocess.Popen(command, cwd=cwd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (cwd / "killed" / "candidate").exists():
        time.sleep(0.2)
    time.sleep(1.0)
    process.kill()
    process.wait()
    kept = (cwd / "killed" / "reference" / "trace.json").exists()
    result, _ = compare(cwd, cwd / "killed" / "reference", cwd / "killed" / "candidate")  # recovers the cut one
    recovered = (cwd / "killed" / "candidate" / "trace.json").exists() and result.returncode in (1, 2, 3)
    app(cwd, f"tracking.uri={uri}", "compare.replay=false")
    statuses = sorted(_statuses(cwd / "mlflow.db"))
    if statuses != ["FINISHED", "KILLED"]:
        return "broken", f"after the next run the statuses are {statuses}"
    return ("held" if kept and recovered else "degraded"), (
        f"the dead run closed KILLED by the next plain run; reference trace kept: {kept}; the candidate's cut "
        f"trace recovered: {recovered} (compare exit {result.returncode})"
    )


def upload_twice(cwd: Path) -> Outcome:
    result, _ = app(cwd, "tracking.uri=http://127.0.0.1:9", "tracking.timeout=2", "compare.replay=false")
    if result.returncode != 2:
        return "broken", f"an unreachable server gave exit {result.returncode}"
    store = f"sqlite:///{cwd / 'later.db'}"
    for _ in range(2):
        upload, _ = run([sys.executable, "-m", "paritylab.cli.upload", str(cwd / "run"), "--tracking-uri", store], cwd)
        if upload.returncode != 0:
            return "broken", f"upload exit {upload.returncode}: {upload.stderr.strip()[:100]}"
    statuses = _statuses(cwd / "later.db")
    verdict = "held" if statuses == ["FINISHED"] else "broken"
    return verdict, f"unreachable server: exit 2, results kept; two uploads make {len(statuses)} run(s) {statuses}"


def upload_symlink_out(cwd: Path) -> Outcome:
    app(cwd, "tracking=off", "compare.replay=false")
    secret = cwd / "secret.txt"
    secret.write_text("not yours")
    (cwd / "run" / "report" / "leak.txt").symlink_to(secret)
    result, seconds = run([sys.executable, "-m", "paritylab.cli.upload", str(cwd / "run"),
                           "--tracking-uri", f"sqlite:///{cwd / 'u.db'}"], cwd)  # fmt: skip
    return one_line_exit_2(result, seconds, 30)


def config_fault(*overrides: str, limit: float = 10) -> Callable[[Path], Outcome]:
    def fault(cwd: Path) -> Outcome:
        result, seconds = app(cwd, *overrides)
        outcome = one_line_exit_2(result, seconds, limit)
        if (cwd / "mlflow.db").exists() and _statuses(cwd / "mlflow.db"):
            return "degraded", outcome[1] + "; and it left a run in MLflow"
        return outcome

    return fault


def output_under_a_file(cwd: Path) -> Outcome:
    (cwd / "a-file").write_text("x")
    return config_fault(f"output_dir={cwd / 'a-file' / 'run'}")(cwd)


def _python(cwd: Path, code: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess[str], float]:
    return run([sys.executable, "-c", code], cwd, timeout)


def check_pair(reference: str, candidate: str, expected: str) -> Callable[[Path], Outcome]:
    """``paritylab.check`` on two of the suite's tiny models (``tests/test_outputs.py``): a wrong model must
    never PASS, a right one must."""

    def fault(cwd: Path) -> Outcome:
        code = (
            "import torch, paritylab\nfrom tests.test_outputs import Model, Preprocessing, IDS\n"
            "from paritylab.reports.render import headline\n"
            f"ids = IDS.clone()\nr = paritylab.check({reference}, {candidate}, 'out', reference_call=lambda m: m(ids),"
            " noise_floor='off')\nprint(r.verdict)\nprint(headline(r.report))\n"
        )
        result, _ = _python(cwd, code)
        lines = result.stdout.strip().splitlines()
        if result.returncode != 0 or not lines:
            return "broken", f"exit {result.returncode}: {result.stderr.strip()[-150:]}"
        verdict = lines[0]
        detail = lines[-1][:140]
        if verdict == "pass" and expected != "pass":
            return "broken", f"a wrong model passed: {detail}"
        return ("held" if verdict == expected else "degraded"), f"{verdict}: {detail}"

    return fault


def same_second_runs(cwd: Path) -> Outcome:
    """Two runs started at once in one directory (one clean, one wrong), Hydra's default run directory."""
    base = [sys.executable, "-m", "paritylab", "tracking=off", "compare.replay=false"]
    wrong = ["candidate.ports.llava.build._target_=tests.faulty.scaled_port",
             "+candidate.ports.llava.build.module=llm.layers.1.feed_forward.w2"]  # fmt: skip
    processes = [subprocess.Popen(c, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for c in (base, base + wrong)]  # fmt: skip
    outputs = [p.communicate(timeout=300)[0] for p in processes]
    codes = [p.returncode for p in processes]
    directories = sorted(path.parent for path in (cwd / "outputs").glob("*/*/run.json"))
    if codes != [0, 1] or "PASS:" not in outputs[0]:
        return "broken", f"exits {codes}; the clean run said {outputs[0].strip().splitlines()[-2:]}"
    return "held", f"exits {codes}, {len(directories)} directories: {[d.name for d in directories]}"


def ctrl_c_in_a_sweep(cwd: Path) -> Outcome:
    database = cwd / "mlflow.db"
    command = [sys.executable, "-m", "paritylab", "-m", "compare.replay=false", f"tracking.uri=sqlite:///{database}",
               f"hydra.sweep.dir={cwd / 'sweep'}",
               "candidate.ports.llava.build._target_=paritylab.experiments.llava_port.from_reference,"
               "tests.faulty.slow_port"]  # fmt: skip
    process = subprocess.Popen(command, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any((cwd / "sweep").glob("1-*/candidate")):
        time.sleep(0.2)
    time.sleep(1.0)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    statuses = sorted(_statuses(database))
    if process.returncode != 130 or "RUNNING" in statuses:
        return "broken", f"exit {process.returncode}, MLflow runs {statuses}"
    if "Traceback" in out + err:
        return "degraded", f"exit 130 with a traceback; runs {statuses}"
    return "held", f"exit 130, runs {statuses}: {err.strip().splitlines()[-1][:100]}"


def hard_linked_partial(cwd: Path) -> Outcome:
    """A killed trace whose unfinished shard is a hard link to a file outside: reading it must not write there."""
    code = (
        "import sys, time, torch, paritylab\nfrom torch import nn\n"
        "class Stall(nn.Module):\n    def forward(self, x):\n        open(sys.argv[2], 'w').close()\n"
        "        time.sleep(60)\n        return x\n"
        "m = nn.Sequential(nn.Linear(64, 64), Stall())\n"
        "with paritylab.trace(m, sys.argv[1], save_tensors=True, pending_bytes=0):\n    m(torch.randn(8, 64))\n"
    )
    trace, marker = cwd / "killed", cwd / "marker"
    process = subprocess.Popen([sys.executable, "-c", code, str(trace), str(marker)], env=ENV)
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    process.kill()
    process.wait(timeout=30)
    partials = list(trace.glob("*.partial"))
    if not partials:
        return "broken", "the harness left no .partial shard"
    outside = cwd / "precious.bin"
    os.replace(partials[0], outside)
    os.link(outside, partials[0])
    before = outside.read_bytes()
    result, seconds = compare(cwd, trace, trace)
    if outside.read_bytes() != before:
        return "broken", f"the outside file changed ({len(before)} -> {outside.stat().st_size} bytes)"
    return "held", f"outside file untouched; compare exit {result.returncode} in {seconds:.1f} s"


def promote_a_failing_run(cwd: Path) -> Outcome:
    bug = ["candidate.ports.llava.build._target_=tests.faulty.scaled_port",
           "+candidate.ports.llava.build.module=llm.layers.1.feed_forward.w2"]  # fmt: skip
    app(cwd, *bug, f"tracking.uri=sqlite:///{cwd / 'mlflow.db'}", "compare.replay=false")
    summary = json.loads((cwd / "run" / "run.json").read_text())
    result, seconds = run([sys.executable, "-m", "paritylab.cli.promote", summary["run_id"],
                           "--tracking-uri", f"sqlite:///{cwd / 'mlflow.db'}"], cwd)  # fmt: skip
    outcome = one_line_exit_2(result, seconds, 30)
    if outcome[0] == "held" and "verdict is 'fail'" not in result.stderr:
        return "degraded", f"refused for another reason: {result.stderr.strip()[:110]}"
    return outcome


# -- round 4 (#44) --------------------------------------------------------------------------------------------------


def unmatched_pattern(cwd: Path) -> Outcome:
    """A ``compare.modules`` pattern that matches no module: the run goes on and says so."""
    result, _ = app(cwd, "tracking=off", "compare.replay=false", "+compare.modules={nowhere.*: {rtol: 0.1}}")
    notes = json.loads((cwd / "run" / "run.json").read_text())["notes"] if (cwd / "run" / "run.json").exists() else []
    said = [note for note in notes if note.startswith("compare.modules.nowhere.* matches no module")]
    if result.returncode != 0:
        return "broken", f"exit {result.returncode}"
    return ("held" if said else "degraded"), (said[0][:110] if said else "no note that the pattern matched nothing")


def empty_input_ids(cwd: Path) -> Outcome:
    code = (
        "import sys, torch\nfrom safetensors.torch import save_file\n"
        "save_file({'input_ids': torch.zeros(1, 0, dtype=torch.long)}, sys.argv[1])\n"
    )
    subprocess.run([sys.executable, "-c", code, str(cwd / "empty.safetensors")], env=ENV, check=True)
    return config_fault("inputs=file", f"inputs.path={cwd / 'empty.safetensors'}")(cwd)


def world_too_large(cwd: Path) -> Outcome:
    """More ranks than the cores take (64 on a small machine): refused before any rank starts."""
    world = max(64, 2 * (os.cpu_count() or 1) + 1)
    outcome = config_fault("model=llama", "candidate=tp", f"candidate.world_size={world}", limit=30)(cwd)
    if (cwd / "run" / "ranks").exists():
        return "broken", "ranks were started"
    return outcome


RANK_LAUNCH = """
import os, signal, sys
from pathlib import Path
import torch
from paritylab.distributed.launch import LaunchSpec, prepare, run_ranks
root, mode = Path(sys.argv[1]), sys.argv[2]
prepare(root / "ranks", {"x": torch.ones(3)}, None)
spec = LaunchSpec("tests.test_rank_processes:spawning", 2, root / "ranks", grace_s=1.0,
                  options={"mode": "hang" if mode == "sigint" else mode, "pids": str(root)},
                  timeout_s=15 if mode == "hang" else 240)
try:
    run_ranks(spec)
except KeyboardInterrupt:
    sys.exit(130)
"""


def rank_grandchildren(mode: str) -> Callable[[Path], Outcome]:
    """Each of 2 ranks starts two processes (one ignores SIGTERM); after the launch ends (``ok``, ``fail``,
    ``hang`` past ``timeout_s``, ``sigint`` to the launcher) none of them may be left."""

    def fault(cwd: Path) -> Outcome:
        process = subprocess.Popen([sys.executable, "-c", RANK_LAUNCH, str(cwd), mode], cwd=cwd, env=ENV,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None and mode == "sigint":
            if all((cwd / f"rank{rank}.pids").exists() for rank in (0, 1)):
                time.sleep(0.5)
                process.send_signal(signal.SIGINT)
                break
            time.sleep(0.1)
        process.wait(timeout=300)
        pids = [int(pid) for path in cwd.glob("rank*.pids") for pid in path.read_text().split()]
        time.sleep(1.0)
        left = [pid for pid in pids if _alive(pid)]
        for pid in left:  # the harness cleans up what a broken launch left
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if len(pids) != 6:
            return "broken", f"the harness saw {len(pids)} of 6 processes (launch exit {process.returncode})"
        if left:
            return "broken", f"{len(left)} of 6 processes (ranks and what they started) outlived the launch"
        return "held", f"launch exit {process.returncode}; none of the 2 ranks and 4 processes they started is left"

    return fault


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def ctrl_c_in_a_joblib_sweep(cwd: Path) -> Outcome:
    database = cwd / "mlflow.db"
    command = [sys.executable, "-m", "paritylab", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
               "compare.replay=false", f"tracking.uri=sqlite:///{database}", f"hydra.sweep.dir={cwd / 'sweep'}",
               "candidate.ports.llava.build._target_=paritylab.experiments.llava_port.from_reference,"
               "tests.faulty.slow_port"]  # fmt: skip
    process = subprocess.Popen(command, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and process.poll() is None:
        if any((cwd / "sweep").glob("0-*/run.json")) and any((cwd / "sweep").glob("1-*/candidate")):
            break
        time.sleep(0.2)
    time.sleep(1.0)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    statuses = sorted(_statuses(database))
    jobs = sorted(path.parent.name.split("-")[0] for path in (cwd / "sweep").glob("*/run.json"))
    if process.returncode != 130 or "RUNNING" in statuses:
        return "broken", f"exit {process.returncode}, MLflow runs {statuses}"
    if jobs != ["0", "1"] or "Traceback" in out + err:
        return "degraded", f"exit 130, runs {statuses}, run.json for jobs {jobs}"
    return "held", f"exit 130, runs {statuses}, run.json for jobs {jobs}"


def upload_an_interrupted_run(cwd: Path) -> Outcome:
    outcome = sigterm_mid_run(cwd)
    if not (cwd / "run" / "tracking.json").exists():
        return "broken", f"no tracking.json after the SIGTERM ({outcome[1]})"
    upload = [sys.executable, "-m", "paritylab.cli.upload", str(cwd / "run"), "--tracking-uri",
              f"sqlite:///{cwd / 'later.db'}"]  # fmt: skip
    refused, seconds = run(upload, cwd)
    if refused.returncode == 0:
        return "broken", "an interrupted run was published without being asked"
    allowed, _ = run([*upload, "--allow-interrupted"], cwd)
    statuses = _statuses(cwd / "later.db")
    held = one_line_exit_2(refused, seconds, 30)
    if held[0] != "held" or allowed.returncode != 0:
        return "degraded", f"{held[1]}; with --allow-interrupted exit {allowed.returncode}"
    return "held", f"refused (exit 2), published with --allow-interrupted as {statuses}: {held[1][:60]}"


SLOW_IMPORT = "import time\nfrom pathlib import Path\nPath({marker!r}).write_text('importing')\ntime.sleep(120)\n"


def sigterm_while_starting(cwd: Path) -> Outcome:
    """SIGTERM while a single run imports its reference's builder (its start-up): no word of a sweep."""
    marker = cwd / "importing"
    (cwd / "slow_builder.py").write_text(SLOW_IMPORT.format(marker=str(marker)))
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(cwd), ENV["PYTHONPATH"]])}
    command = [sys.executable, "-m", "paritylab", "tracking=off", "model.build._target_=slow_builder.build",
               f"hydra.run.dir={cwd / 'run'}"]  # fmt: skip
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not marker.exists() and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    if process.returncode != 130:
        return "broken", f"exit {process.returncode}"
    if "sweep" in out + err or "Traceback" in err:
        return "degraded", f"exit 130: {err.strip().splitlines()[-1][:100]}"
    return "held", f"exit 130: {err.strip()[:100]}"


FAULTS: dict[str, Callable[[Path], Outcome]] = {
    "only the second output is wrong (a flipped bool mask)": check_pair(
        "Model('tuple')", "Model('tuple', 'mask')", "fail"
    ),
    "a wrong int in a nested dict output": check_pair("Model('dict')", "Model('dict', 'count')", "fail"),
    "the reference preprocesses its input in place, the candidate lacks the step": check_pair(
        "Preprocessing('before')", "Preprocessing('')", "fail"
    ),
    "the reference zeroes its input after computing (a correct copy)": check_pair(
        "Preprocessing('after')", "Preprocessing('')", "pass"
    ),
    "two runs started in one second in one directory": same_second_runs,
    "Ctrl-C in a Hydra multirun": ctrl_c_in_a_sweep,
    "a killed trace's .partial hard-linked to an outside file": hard_linked_partial,
    "+compare.rtoll=1 (a typo with +)": config_fault("+compare.rtoll=1"),
    "+devcie=cuda": config_fault("+devcie=cuda"),
    "candidate=prot": config_fault("candidate=prot"),
    "promote a failing run": promote_a_failing_run,
    "no tensor values stored (max_bytes=0) on a wrong model": no_values_no_pass,
    "SIGTERM mid-run": sigterm_mid_run,
    "FIFO named *_FULL_TENSORS.json": hostile("fifo"),
    "*_FULL_TENSORS.json -> /dev/zero": hostile("dev_zero"),
    "trace.json symlinked outside": hostile("symlink_out"),
    "100k-deep JSON nesting": hostile("deep"),
    "168 MB of tiny JSON values": hostile("wide"),
    '"index": Infinity': hostile("infinity"),
    "an empty trace": hostile("empty"),
    "kill -9 mid-run, then a plain run": kill_9_then_a_plain_run,
    "server unreachable, then upload twice": upload_twice,
    "upload with a symlink out of the run directory": upload_symlink_out,
    "output_dir under a file": output_under_a_file,
    "compare.rtol=-1": config_fault("compare.rtol=-1"),
    "an invalid per-module pattern": config_fault("+compare.modules={'[': {rtol: 1e-3}}"),
    "model=llama candidate=port": config_fault("model=llama", "candidate=port"),
    "tracking.uri=htp://nowhere": config_fault("tracking.uri=htp://nowhere"),
    "+compare.modules.fc2.rtoll=10 (a typo inside a per-module override)": config_fault(
        "+compare.modules.fc2.rtoll=10"
    ),
    "a compare.modules pattern that matches no module": unmatched_pattern,
    "+candidate.options.modle=x on a candidate that is not distributed": config_fault("+candidate.options.modle=x"),
    "candidate=tp +candidate.options.defetc=rank1_scaled": config_fault(
        "model=llama", "candidate=tp", "+candidate.options.defetc=rank1_scaled", limit=30
    ),
    "processes ranks started, after they succeed": rank_grandchildren("ok"),
    "processes ranks started, after one fails": rank_grandchildren("fail"),
    "processes ranks started, after timeout_s": rank_grandchildren("hang"),
    "processes ranks started, after Ctrl-C to the launcher": rank_grandchildren("sigint"),
    "candidate.world_size=64 on a small machine": world_too_large,
    "Ctrl-C in a joblib multirun": ctrl_c_in_a_joblib_sweep,
    "paritylab-upload of an interrupted run": upload_an_interrupted_run,
    "-m with an override Hydra rejects (hydra.launcher.n_jobs=abc)": config_fault("-m", "hydra.launcher.n_jobs=abc"),
    "a 0-length input_ids file (inputs=file)": empty_input_ids,
    "SIGTERM while a single run starts": sigterm_while_starting,
}


def main(words: list[str]) -> int:
    results = []
    for name, fault in FAULTS.items():
        if words and not any(word.lower() in name.lower() for word in words):
            continue
        scratch = Path(tempfile.mkdtemp(prefix="paritylab-fault-"))
        try:
            verdict, detail = fault(scratch)
        except Exception as error:  # the harness itself: report, never hide
            verdict, detail = "broken", f"{type(error).__name__}: {error}"[:200]
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        results.append((name, verdict, detail))
        print(f"| {name} | {verdict} | {detail} |", flush=True)
    counts = {v: sum(1 for _, verdict, _ in results if verdict == v) for v in ("held", "degraded", "broken")}
    print(f"\n{len(results)} faults: {counts['held']} held, {counts['degraded']} degraded, {counts['broken']} broken")
    return 1 if counts["broken"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
