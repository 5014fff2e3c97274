"""What a person sees in MLflow's UI with nothing clicked or set up: in a real browser (a real ``mlflow server``
on 127.0.0.1 over runs paritylab logged to it, pages loaded in headless Chromium, Debian's ``chromium``, with a
fresh profile, read as the UI rendered them: ``--dump-dom``), and the run names and tags it shows, which say
each run's verdict: parity runs, sweep parents."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import uuid
from html.parser import HTMLParser

import pytest
from mlflow.tracking import MlflowClient

from paritylab.cli.app import compose
from paritylab.run.config import fresh_directory
from paritylab.run.runner import EXIT_FAIL, EXIT_PASS, run
from paritylab.sink.publish import MAX_NAME, display_name, verdict_label
from paritylab.sink.tracking import runs_link
from tests.helpers import migrated_store

CHROMIUM = shutil.which("chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--window-size=1600,1000"]  # fmt: skip
FAULTY = [
    "candidate.ports.llava.build._target_=tests.faulty.scaled_port",
    "+candidate.ports.llava.build.module=llm.layers.1.feed_forward.w2",
    "+candidate.ports.llava.build.scale=1.05",
]
"""The port with one projection of layer 1 scaled: it fails, and divergence starts there."""
FIRST_DIVERGENCE = "model.language_model.layers.1.mlp.down_proj"
SHORT = "layers.1.mlp.down_proj"
"""What the run's name says of it: its last two parts, the layer's number with its container."""


STATUS_ICONS = {
    "M6.94 8 4.97 6.03l1.06-1.06L8 6.94l1.97-1.97 1.06 1.06L9.06 8l1.97 1.97-1.06 1.06L8 9.06l-1.97 1.97-1.06-1.06z": (
        "FAILED"  # a cross in a circle (red)
    ),
    "M11.53 6.53 7 11.06 4.47 8.53l1.06-1.06L7 8.94l3.47-3.47z": "FINISHED",  # a tick in a circle (green)
}
"""The first path of the status icon MLflow 3.17 draws in a run's *Created* cell, per status."""
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class Page(HTMLParser):
    """A page as the UI rendered it: its links (address, text) and the runs list's cells (run id -> column id ->
    text; MLflow's grid names each row by its run's id and each cell by its column's)."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self.cells: dict[str, dict[str, str]] = {}
        self.text = ""
        """Every text the page shows, in order, separated by single spaces."""
        self._stack: list[tuple[str, str | None, str | None, str | None]] = []  # tag, href, row id, column id
        self.statuses: dict[str, str] = {}
        """Run id -> the status its *Created* cell's icon draws (:data:`STATUS_ICONS`)."""
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in VOID:
            return
        found = dict(attrs)
        row = found.get("row-id") or next((item[2] for item in reversed(self._stack) if item[2]), None)
        column = found.get("col-id") if found.get("role") == "gridcell" else None
        self._stack.append((tag, found.get("href") if tag == "a" else None, row, column))
        if tag == "a":
            self.links.append((found.get("href") or "", ""))
        if row and column:
            self.cells.setdefault(row, {})[column] = ""
        cell = next((item[3] for item in reversed(self._stack) if item[3]), None)
        if tag == "path" and row and cell == "runDateAndNestInfo" and row not in self.statuses:
            self.statuses[row] = STATUS_ICONS.get(found.get("d") or "", found.get("d") or "")

    def handle_data(self, data: str) -> None:
        self.text = " ".join(f"{self.text} {data}".split())
        if any(item[0] == "a" for item in self._stack) and self.links:
            self.links[-1] = (self.links[-1][0], " ".join(f"{self.links[-1][1]} {data}".split()))
        cell = next(((item[2], item[3]) for item in reversed(self._stack) if item[3]), None)
        if cell is not None and cell[0] is not None:
            row, column = cell
            self.cells[row][column] = " ".join(f"{self.cells[row][column]} {data}".split())

    def handle_endtag(self, tag: str) -> None:
        while self._stack:
            if self._stack.pop()[0] == tag:
                break


def render(url: str, wanted: str, in_text: bool = False) -> Page:
    """``url`` as headless Chromium renders it (a fresh profile: no view the UI remembers), once the page shows
    ``wanted`` in a link (or, ``in_text``, anywhere: the UI draws after its requests answer: a busy machine gets two
    more tries)."""
    page = Page("")
    for budget in (15000, 30000, 60000):
        with tempfile.TemporaryDirectory(prefix="paritylab-chromium-") as profile:
            command = [CHROMIUM or "chromium", *FLAGS, f"--user-data-dir={profile}",
                       f"--virtual-time-budget={budget}", "--dump-dom", url]  # fmt: skip
            page = Page(subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout)
        if (in_text and wanted in page.text) or any(wanted in text or wanted in href for href, text in page.links):
            break
    return page


def _mlflow_before(major: int, minor: int) -> bool:
    from importlib.metadata import version

    found = tuple(int(part) for part in version("mlflow").split(".")[:2])
    return found < (major, minor)


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no browser: apt-get install -y chromium (Debian's package)")
@pytest.mark.skipif(
    _mlflow_before(3, 17),
    reason="the page is read as MLflow 3.17's UI lays out its runs list (a saved view by link); older UIs differ "
    "(under MLflow 3.9 a run's link was not in the page read): the run names and tags are tested on every version",
)
def test_the_printed_link_opens_the_training_runs_table_with_the_failing_run_marked_failed(tmp_path, mlflow_server):
    experiment = f"ui-{uuid.uuid4().hex[:8]}"
    common = [f"tracking.uri={mlflow_server}", f"tracking.experiment={experiment}", "compare.replay=false"]
    passing = run(compose(common), fresh_directory(str(tmp_path / "run")), echo=lambda _: None)
    said: list[str] = []
    failing = run(compose([*common, *FAULTY]), fresh_directory(str(tmp_path / "run")), echo=said.append)
    assert (passing.exit_code, failing.exit_code) == (EXIT_PASS, EXIT_FAIL)
    found = MlflowClient(mlflow_server).get_experiment_by_name(experiment)
    runs_list = runs_link(found.experiment_id)
    # the console's line: the runs list in the model-training view, then the run's own page
    (line,) = [line for line in said if line.startswith("paritylab: logged to MLflow: ")]
    printed = line.removeprefix("paritylab: logged to MLflow: ").split()[0]
    assert printed == f"{mlflow_server}/{runs_list}" and "workflowType=machine_learning" in printed

    # Opened on a fresh profile: the training view's runs table (not the GenAI overview), each name saying its
    # verdict and where divergence starts, the failing run marked failed, its origin in full in its column.
    page = render(printed, FIRST_DIVERGENCE)
    names = {href.rsplit("/", 1)[-1].split("?")[0]: text for href, text in page.links}
    assert names[passing.run_id] == "PASS llava/port seed=0"
    assert names[failing.run_id] == f"FAIL {SHORT} @ llava/port seed=0"
    columns = ("tags.`paritylab.verdict`", "tags.`paritylab.first_divergence`")
    assert [page.cells[failing.run_id][column] for column in columns] == ["fail", FIRST_DIVERGENCE]
    assert [page.cells[passing.run_id][column] for column in columns] == ["pass", "none"]
    statuses = {run_id: page.statuses.get(run_id) for run_id in (passing.run_id, failing.run_id)}
    assert statuses == {passing.run_id: "FINISHED", failing.run_id: "FAILED"}, statuses
    assert MlflowClient(mlflow_server).get_run(failing.run_id).info.status == "FAILED"

    # The experiment opened without the link (MLflow 3.17's GenAI overview in a fresh browser): the description's
    # first line, the newest run and the verdicts, links to the same runs list.
    newest = f"FAIL {SHORT} @ llava/port seed=0 (the newest of 2 runs: 1 fail, 1 pass)"
    assert found.tags["mlflow.note.content"].split("\n")[0] == f"{newest} \u00b7 [runs list]({runs_list})"
    landing = render(f"{mlflow_server}/#/experiments/{found.experiment_id}", runs_list)
    assert runs_list in [href for href, _ in landing.links] and newest in landing.text
    home = render(f"{mlflow_server}/", newest, in_text=True)
    assert experiment in [text for _, text in home.links] and newest in home.text


def test_a_run_name_starts_with_its_verdict_and_keeps_what_tells_jobs_apart():
    assert verdict_label("pass", "regressed") == "REGRESSED" and verdict_label("fail", "regressed") == "FAIL"
    assert verdict_label("error", None, "KILLED") == "INTERRUPTED" and verdict_label("inconclusive") == "INCONCLUSIVE"
    base = "llava/port seed=0 " + " ".join(f"key{n}=value{n}" for n in range(40))  # a long sweep job's name
    name = display_name("FAIL", base[:200], "model." + ".".join(["block"] * 20) + ".mlp.down_proj")
    assert len(name) == MAX_NAME and name.startswith(f"FAIL {base[:200]} @ \u2026") and name.endswith(".mlp.down_proj")
    assert display_name("FAIL", base * 2, "model.layers.1").startswith("FAIL llava/port seed=0 key0=value0")
    assert len(display_name("FAIL", base * 2, "model.layers.1")) == MAX_NAME


@pytest.mark.parametrize(
    ("interrupted", "expected"),
    [(False, "ERROR sweep/1: 1 error, 1 fail, 1 regressed, 2 pass"),
     (True, "INTERRUPTED sweep/1: 1 error, 1 fail, 1 regressed, 2 pass")],
)  # fmt: skip
def test_a_sweep_parent_is_named_and_tagged_by_its_worst_job(tmp_path, monkeypatch, interrupted, expected):
    from omegaconf import OmegaConf

    import paritylab.sink.sweep as sweep_module

    monkeypatch.setenv(sweep_module.ENVIRONMENT, "")
    monkeypatch.setattr(sweep_module, "_current", None)
    uri = migrated_store(tmp_path / "mlflow.db")
    directory = tmp_path / "sweep"
    config = OmegaConf.create({
        "hydra": {"sweep": {"dir": str(directory)}, "overrides": {"task": ["candidate=a,b"]}},
        "tracking": {"enabled": True, "uri": uri, "experiment": "sweeps", "timeout": 10, "retries": 0},
    })  # fmt: skip
    state = sweep_module.start_sweep(config)
    jobs = [("pass", None, 0), ("pass", "regressed", 1), ("fail", "none", 1), ("pass", "none", 0), ("error", None, 2)]
    for number, (verdict, regression, code) in enumerate(jobs):
        job = directory / f"{number}-candidate=x{number}"
        (job / ".hydra").mkdir(parents=True)
        summary = {"verdict": verdict, "regression": regression, "exit_code": code, "link": ""}
        (job / "run.json").write_text(json.dumps(summary))
    sweep_module.finish_sweep(directory, interrupted=interrupted)
    parent = MlflowClient(uri).get_run(state["parent_run_id"])
    assert parent.info.run_name == expected
    assert parent.data.tags["paritylab.verdict"] == expected.split()[0].lower()
    assert parent.data.tags["paritylab.regression"] == "regressed"
    assert parent.info.status == ("KILLED" if interrupted else "FAILED")
