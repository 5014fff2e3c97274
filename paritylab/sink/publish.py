"""What a run publishes to MLflow, kept on disk first (``tracking.json``) so it can be published again.

The runner writes the record into the run directory before it talks to MLflow; if the server is
unreachable or fails mid-run, ``paritylab-upload RUN_DIR`` publishes the same record and
files later.
"""

from __future__ import annotations

import json
import math
import socket
import tempfile
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from paritylab.reports.plots import trend_heatmap
from paritylab.sink.history import FINGERPRINT, TREND, Regression, assess, layer_errors
from paritylab.sink.interrupts import signals_ignored
from paritylab.sink.store import RUN_UID, TREND_STEPS, MlflowStore, Store, store_of
from paritylab.sink.tracking import (
    NOTE,
    Metric,
    MlflowTracker,
    Tracker,
    TrackingError,
    log10_for_charts,
    metric_key,
)
from paritylab.tracing.files import UPLOADED_FILE, WITHHELD_FILE, check_directory, write_json

RECORD_FILE = "tracking.json"
PUBLISHED = "paritylab.published"
"""Set once every metric, tag and file of the run is in MLflow: uploading again then does nothing."""
TREND_RUN = "paritylab.trend_run"
MAX_NAME = 250
"""MLflow keeps a run's name in a 250-character column."""
AGGREGATE_ORDER = ("interrupted", "error", "fail", "regressed", "inconclusive", "pass")
"""What a sweep parent says when its jobs differ: the first of these that one of them has."""


@dataclass
class RunRecord:
    """Everything a run sends to MLflow, kept in the run directory (``tracking.json``) first."""

    run_name: str
    experiment: str
    uri: str | None
    tags: dict[str, str]
    params: dict[str, str]
    metrics: list[Metric] = field(default_factory=list)
    table: dict[str, list[Any]] | None = None
    status: str = "FINISHED"
    log_tensors: bool = True
    log_tensors_mode: str = "on_failure"
    """``tracking.log_tensors``: ``always``, ``never``, or ``on_failure`` (decided once the regression is known)."""
    regression_factor: float = 2.0
    regression_floor: float = 1e-6
    trend: bool = False
    """A scheduled run: it adds a point to the pair's trend run."""
    start_ms: int | None = None
    keep_local: bool = False
    """``tracking.keep_local``: keep the run directory's shards once the store holds a verified copy of them."""

    def save(self, directory: Path) -> Path:
        path = directory / RECORD_FILE
        write_json(path, asdict(self), indent=1)
        return path

    @classmethod
    def load(cls, directory: Path) -> RunRecord:
        path = directory / RECORD_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            data["metrics"] = [Metric(**metric) for metric in data.get("metrics", [])]
            return cls(**data)
        except (OSError, ValueError, TypeError) as error:
            raise ValueError(f"{path} is not a paritylab run record ({error}); pass a run directory") from error


def publish(tracker: Tracker, record: RunRecord, directory: Path) -> Regression | None:
    """The one way a run reaches MLflow, for a live run and ``paritylab-upload`` alike: the regression against
    the pair's baseline and, for scheduled runs, the trend point (MLflow stores only); then metrics (batched),
    the comparison table, final tags, every file of the run, and the final status. Returns the regression."""
    regression = None
    store = store_of(tracker)
    if store is not None and tracker.run_id is not None and FINGERPRINT in record.tags and record.metrics:
        regression = _history(store, tracker.run_id, record, directory)
        verdict = record.tags.get("paritylab.verdict", "")
        record.log_tensors = upload_tensors(record.log_tensors_mode, verdict, bool(regression.regressed))
        record.save(directory)  # published again (an upload after a failure), the same history is not redone
    tracker.log_metrics(record.metrics)
    if record.table is not None:
        tracker.log_table(record.table, "comparison_table.json")
    tracker.set_tags({**record.tags, **_linked(tracker, record.tags), **_judged_name(record, regression)})
    if store is not None and regression is not None and TREND_RUN in record.tags:
        _label_trend(tracker, store, record, regression)
    copied = log_directory(tracker, directory, record.log_tensors)
    tracker.set_tags({PUBLISHED: "true"})
    tracker.end(_final_status(record, regression))
    summarise_experiment(tracker)
    if not record.keep_local:
        drop_local_copies(tracker, directory, copied)
    return regression


def _linked(tracker: Tracker, tags: Mapping[str, str]) -> dict[str, str]:
    """The run's description with, on its first line, a link to the experiment's runs list in MLflow's
    model-training view (:func:`paritylab.sink.tracking.runs_link`)."""
    note, link = tags.get(NOTE), tracker.runs_link()
    if not note or not link:
        return {}
    first, _, rest = note.partition("\n")
    return {NOTE: f"{first} \u00b7 [runs list]({link})\n{rest}"}


def verdict_label(verdict: str, regression: str | None = None, status: str = "FINISHED") -> str:
    """What a run's name starts with: ``PASS``, ``FAIL``, ``INCONCLUSIVE``, ``ERROR``, ``INTERRUPTED`` (a
    KILLED run) or ``REGRESSED`` (parity holds, but a layer's error grew past its baseline's; a run that fails
    is a ``FAIL`` whatever its regression, which its tags say)."""
    if status == "KILLED" or verdict == "interrupted":
        return "INTERRUPTED"
    if verdict == "pass" and regression == "regressed":
        return "REGRESSED"
    return verdict.upper()


def end_status(verdict: str, regression: str | None = None, status: str = "FINISHED") -> str:
    """The status a judged run ends with in MLflow, as ``mlflow run`` ends a command by its exit code, so the runs
    list shows a failure red: ``FAILED`` for a fail or a regression (exit 1) and an error (exit 2), ``FINISHED`` for
    a pass or an inconclusive run, ``KILLED`` for an interrupted one. ``paritylab.verdict`` still tells them apart:
    baselines, trends, promotion and sweeps read that tag, never the status."""
    return END_STATUS[outcome(verdict, regression, status)]


END_STATUS = {
    "pass": "FINISHED",
    "inconclusive": "FINISHED",
    "fail": "FAILED",
    "regressed": "FAILED",
    "error": "FAILED",
    "interrupted": "KILLED",
}
"""The MLflow status of each outcome (:func:`end_status`)."""


def _final_status(record: RunRecord, regression: Regression | None) -> str:
    """The MLflow status ``record``'s run ends with: by its verdict (:func:`end_status`); a record of no parity run
    (no verdict) ends with the status it holds."""
    verdict = record.tags.get("paritylab.verdict")
    if verdict is None:
        return record.status
    judged = regression.verdict if regression is not None else record.tags.get("paritylab.regression")
    return end_status(verdict, judged, record.status)


def outcome(verdict: str, regression: str | None = None, status: str = "FINISHED") -> str:
    """One word for a run: ``pass``, ``fail``, ``regressed``, ``inconclusive``, ``error`` or ``interrupted`` (a
    verdict paritylab does not know: ``error``): what sweep parents and trend runs aggregate."""
    word = verdict_label(verdict, regression, status).lower()
    return word if word in AGGREGATE_ORDER else "error"


def tally(outcomes: list[str]) -> str:
    """``1 fail, 3 pass``: how many runs had each outcome, in :data:`AGGREGATE_ORDER`."""
    from collections import Counter

    counted = sorted(Counter(outcomes).items(), key=lambda item: AGGREGATE_ORDER.index(item[0]))
    return ", ".join(f"{number} {word}" for word, number in counted)


def aggregate(outcomes: list[str]) -> str:
    """The outcome of a sweep from its jobs' (:data:`AGGREGATE_ORDER`); ``error`` when there is none."""
    return next((word for word in AGGREGATE_ORDER if word in outcomes), "error")


NEWEST_RUNS = 50
"""How many of an experiment's newest runs its description counts (:func:`summarise_experiment`)."""


def summarise_experiment(tracker: Tracker) -> None:
    """Start the experiment's description with its newest run's name (the verdict, what ran, where divergence
    starts) and the outcomes of its newest runs (:data:`NEWEST_RUNS`; a sweep's jobs count in their parent, a
    trend run's nights each in its own run): the first thing MLflow's UI shows of the experiment wherever it
    opens, with nothing set up (the home page's list of experiments, the GenAI overview). Runs ending at once
    each write what the store holds then; the last write stands. How the UI shows it is worth no failed run: an
    error leaves the description as it was."""
    try:
        runs = [
            tags
            for tags in tracker.newest_runs(NEWEST_RUNS)
            if "paritylab.verdict" in tags and tags.get(TREND) != "true"
        ]
        if not runs:
            return
        outcomes = [
            outcome(tags["paritylab.verdict"], tags.get("paritylab.regression"), tags["status"]) for tags in runs
        ]
        newest = runs[0].get("mlflow.runName") or verdict_label(runs[0]["paritylab.verdict"])
        counted = "the newest run" if len(runs) == 1 else f"the newest of {len(runs)} runs"
        tracker.describe_experiment(f"{newest} ({counted}: {tally(outcomes)})")
    except TrackingError:
        pass


def display_name(label: str, base: str, where: str | None = None, separator: str = " @ ") -> str:
    """``LABEL base @ where`` (``where``: the module where divergence starts, or the first regressed layer), at
    most :data:`MAX_NAME` characters. ``base`` (the name the run started with: what tells sweep jobs apart) is
    kept whole when it fits; ``where`` is cut from the left, its end naming the module."""
    head = f"{label} {base}"[:MAX_NAME]
    if not where:
        return head
    room = MAX_NAME - len(head) - len(separator)
    if room >= len(where):
        return f"{head}{separator}{where}"
    return f"{head}{separator}\u2026{where[-(room - 1) :]}" if room > 8 else head


def parity_name(base: str, tags: Mapping[str, str], status: str, regressed: list[str] | None = None) -> str:
    """A parity run's name once judged, short enough for MLflow's default run name column: the verdict, then the
    last two parts of the module where divergence starts (a layer's number with its container), then ``@`` what
    ran: ``FAIL layers.1.mlp.down_proj @ llava/port seed=0``, ``REGRESSED layers.1 (+1) @ llava/port seed=0`` (the
    first regressed layer), ``PASS llava/port seed=0``. The full path is the tag ``paritylab.first_divergence``
    (and the run's description)."""
    regression = tags.get("paritylab.regression")
    label = verdict_label(tags.get("paritylab.verdict", "error"), regression, status)
    first = tags.get("paritylab.first_divergence", "none")
    where = None if first == "none" else short_module(first)
    if where is None and regression == "regressed":
        layers = regressed if regressed is not None else _listed(tags.get("paritylab.regressed_layers", "none"))
        if layers:
            where = short_module(layers[0]) + (f" (+{len(layers) - 1})" if len(layers) > 1 else "")
    if where is None:
        return f"{label} {base}"[:MAX_NAME]
    if len(where) > MAX_WHERE:
        where = f"\u2026{where[-(MAX_WHERE - 1) :]}"
    name = f"{label} {where} @ {base}"
    return name if len(name) <= MAX_NAME else f"{name[: MAX_NAME - 1]}\u2026"


MAX_WHERE = 80
"""The most characters of a module's name in a run's name (cut from the left: its end names the module)."""


def short_module(path: str) -> str:
    """The last two parts of a module's dotted path, a layer's number kept with its container:
    ``model.language_model.layers.1.mlp.down_proj`` -> ``layers.1.mlp.down_proj``, ``...layers.1`` ->
    ``layers.1``, ``...vision_tower.encoder.layers.0.self_attn`` -> ``layers.0.self_attn``; a decode step's
    ``step3/model.layers.0.mlp`` -> ``step3/layers.0.mlp``."""
    step, _, path = path.rpartition("/")
    parts = path.split(".")
    start = max(0, len(parts) - 2)
    if start > 0 and parts[start].isdigit():
        start -= 1
    elif start > 1 and parts[start - 1].isdigit():
        start -= 2
    return f"{step.rsplit('/', 1)[-1]}/" * bool(step) + ".".join(parts[start:])


def _listed(text: str) -> list[str]:
    return [] if text in ("", "none") else text.split(",")


def _judged_name(record: RunRecord, regression: Regression | None) -> dict[str, str]:
    """The run's name with its verdict and where divergence starts (``FAIL llava/port seed=0 @ <module>``), so
    the runs list shows them with no column set up. ``record.run_name`` stays the name the run started with: an
    upload starts the run under it and publishes the same name again. Records of no parity run: no new name."""
    if "paritylab.verdict" not in record.tags:
        return {}
    regressed = regression.regressed if regression is not None else None
    return {"mlflow.runName": parity_name(record.run_name, record.tags, record.status, regressed)}


def _label_trend(tracker: Tracker, store: Store, record: RunRecord, regression: Regression) -> None:
    """The trend run says what its newest night says: its verdict, regression and first divergence as tags, and
    a name that starts with them (``REGRESSED trend/llava/port/synthetic-seed-0 @ <layer>``). A run published
    after a later night (an upload) leaves the trend as that night left it."""
    trend = record.tags[TREND_RUN]
    if store.get_run(trend).tags.get(TREND_STEPS) != record.tags.get("paritylab.trend_step"):
        return
    tags = _trend_tags(_trend_name(record), record.tags, regression)
    current, tracker.run_id = tracker.run_id, trend
    try:
        tracker.set_tags(tags)
    finally:
        tracker.run_id = current


def _trend_tags(name: str, night: Mapping[str, str], regression: Regression) -> dict[str, str]:
    """The trend run's tags after a night (``night``: that run's tags): its outcome as ``paritylab.verdict``
    (``pass``, ``fail``, ``regressed``, ``inconclusive``), its regression and first divergence, and a name that
    starts with them (``REGRESSED trend/llava/port/synthetic-seed-0 @ <first regressed layer>``)."""
    tags = {**night, **regression.tags()}
    return {
        "paritylab.verdict": outcome(night.get("paritylab.verdict", "error"), regression.verdict),
        "paritylab.regression": regression.verdict,
        "paritylab.first_divergence": night.get("paritylab.first_divergence", "none"),
        "paritylab.regressed_layers": ",".join(regression.regressed) or "none",
        "mlflow.runName": parity_name(name, tags, "FINISHED", regression.regressed),
    }


def upload_tensors(mode: str, verdict: str, regressed: bool | None) -> bool:
    """``tracking.log_tensors``: ``always``, ``never``, or ``on_failure`` (a run that did not pass, or
    regressed; the tensors stay in the run directory either way)."""
    if mode in ("always", "never"):
        return mode == "always"
    return verdict != "pass" or bool(regressed)


def _history(store: Store, run_id: str, record: RunRecord, directory: Path) -> Regression:
    """Each layer against the pair's baseline (tags and ``regression/*`` metrics), and on a scheduled run the
    pair's trend point (once per run: the record remembers it)."""
    fingerprint = record.tags[FINGERPRINT]
    if "paritylab.regression" in record.tags:  # computed when this record was published before
        return Regression.from_tags(record.tags)
    baseline = store.find_baseline(fingerprint, exclude=run_id)
    before = layer_errors(baseline.metrics) if baseline is not None else None
    current = layer_errors({m.key: m.value for m in record.metrics})
    regression = assess(current, before, record.regression_factor, record.regression_floor)
    if baseline is not None:
        regression.baseline_run_id = baseline.run_id
    record.metrics += [
        Metric(f"regression/{layer}/ratio", ratio) for layer, ratio in regression.ratios.items() if math.isfinite(ratio)
    ]
    if record.trend and "paritylab.trend_step" not in record.tags:
        _trend_point(store, record, directory, fingerprint)
    record.tags.update(regression.tags())
    return regression


def _trend_point(store: Store, record: RunRecord, directory: Path, fingerprint: str) -> None:
    """One point per layer on the pair's trend run, stamped with the run's own start (MLflow's time axis reads
    as dates), in log10 under one chart section (``nightly/log10_rel_l2/<layer>``); and the layer × night
    heatmap, refreshed."""
    tags = {k: record.tags[k] for k in ("paritylab.pair", "paritylab.inputs", "paritylab.model", "paritylab.candidate")}
    trend = store.trend_run(fingerprint, _trend_name(record), tags)
    step = store.next_trend_step(trend)
    points = [Metric(m.key, m.value, step, record.start_ms) for m in record.metrics if _trend_metric(m.key)]
    points += [
        Metric(
            f"nightly/log10_rel_l2/{m.key.removeprefix('layer/').removesuffix('/rel_l2')}", log, step, record.start_ms
        )
        for m in points
        if m.key.startswith("layer/") and (log := log10_for_charts(m.value)) is not None
    ]
    store.log_metrics_to(trend, points)
    record.tags.update({TREND_RUN: trend, "paritylab.trend_step": str(step)})
    record.save(directory)  # logged: published again after a failure, this point is not added twice
    histories = {
        _layer(key): store.metric_history(trend, metric_key(key))
        for key in (m.key for m in points)
        if key.startswith("layer/")
    }
    if histories:
        path = directory / "report" / "trend_heatmap.svg"
        path.parent.mkdir(parents=True, exist_ok=True)
        limits = {_layer(m.key.removesuffix("/limit")): m.value for m in record.metrics if m.key.endswith("/limit")}
        title = f"rel L2 per layer and night, against its tolerance: {record.run_name}"
        path.write_text(trend_heatmap(histories, title, limits))
        store.log_artifact_to(trend, path)


def _trend_name(record: RunRecord) -> str:
    """The pair's trend run: ``trend/<model>/<candidate>/<inputs>``."""
    return f"trend/{record.tags['paritylab.pair']}/{record.tags['paritylab.inputs'].replace(' ', '-')}"


def _layer(key: str) -> str:
    return key.removeprefix("layer/").removesuffix("/rel_l2")


def _trend_metric(key: str) -> bool:
    return (key.startswith("layer/") and key.endswith("/rel_l2")) or key.startswith("summary/")


def log_directory(tracker: Tracker, directory: Path, log_tensors: bool = True) -> list[Path]:
    """Upload every file of the run directory, keeping its layout (safetensors shards only with ``log_tensors``;
    without them each trace gets a note saying where they are, and loads with statistics only). Returns the
    files the store now holds a copy of (a local artifact store hard-links them instead: one copy on disk)."""
    withheld: set[Path] = set()
    copied: list[Path] = []
    for path in sorted(directory.rglob("*")):
        if not path.is_file():
            continue
        if not log_tensors and path.suffix == ".safetensors":
            withheld.add(path.parent)
            continue
        parent = path.parent.relative_to(directory).as_posix()
        if tracker.log_artifact(path, None if parent == "." else parent):
            copied.append(path)
    if not withheld:
        return copied
    with tempfile.TemporaryDirectory(prefix="paritylab-note-") as scratch:
        note = Path(scratch) / WITHHELD_FILE
        note.write_text(
            "The safetensors shards of this trace were not uploaded (tracking.log_tensors); they are in\n"
            f"{directory} on {socket.gethostname()}. Publish them with tracking.log_tensors=always and\n"
            "paritylab-upload, or compare this copy on statistics only.\n",
            encoding="utf-8",
        )
        for folder in sorted(withheld):
            parent = folder.relative_to(directory).as_posix()
            tracker.log_artifact(note, None if parent == "." else parent)
    return copied


def drop_local_copies(tracker: Tracker, directory: Path, copied: list[Path]) -> list[Path]:
    """Once the store holds the run's safetensors shards (their sizes checked against the store's listing),
    delete the run directory's second copy, the bulk of a run's bytes, and leave a note in each trace saying
    where the values are (the trace then loads with statistics only). Reports, JSON and statistics stay: they
    are small and what one opens locally. A shard the store cannot vouch for is kept; so is everything when
    the listing fails. Returns the deleted files."""
    folders: dict[Path, list[Path]] = {}
    for path in copied:
        if path.suffix == ".safetensors":
            folders.setdefault(path.parent, []).append(path)
    dropped: list[Path] = []
    for folder, shards in sorted(folders.items()):
        parent = folder.relative_to(directory).as_posix()
        artifact_path = None if parent == "." else parent
        try:
            stored = tracker.artifact_sizes(artifact_path)
        except TrackingError:
            continue  # unverified: the local copy is the only one we can vouch for
        verified = [path for path in shards if stored.get(path.name) == path.stat().st_size]
        if not verified:
            continue
        (folder / UPLOADED_FILE).write_text(
            f"The safetensors shards of this trace ({', '.join(p.name for p in verified)}) were uploaded to\n"
            f"MLflow run {tracker.run_id} at {tracker.uri}, artifact path {artifact_path or '.'}, and deleted\n"
            "here (tracking.keep_local=false). Fetch them with:\n"
            f"  mlflow artifacts download --run-id {tracker.run_id} --artifact-path {artifact_path or '.'} "
            "--dst-path <dir>\n"
            "Until then this trace loads with statistics only.\n",
            encoding="utf-8",
        )
        for path in verified:
            path.unlink()
            dropped.append(path)
    return dropped


def upload(directory: Path, uri: str | None = None, experiment: str | None = None) -> tuple[str | None, bool]:
    """Publish ``directory``'s ``tracking.json`` and files; returns the run id and whether it was already
    published. Idempotent: the run a live run started (left FAILED or RUNNING when the store failed) is
    found by the directory's run id tag and finished, never duplicated; a published run is left alone."""

    check_directory(directory, "run")  # nothing from outside the run directory is ever uploaded
    record = RunRecord.load(directory)
    tracker = MlflowTracker(uri or record.uri, experiment or record.experiment)
    uid = record.tags.get(RUN_UID)
    existing = MlflowStore(tracker).find_run(uid) if uid else None
    if existing is not None and existing.tags.get(PUBLISHED) == "true":
        return existing.run_id, True
    tags = {**record.tags, "paritylab.uploaded_from": str(directory.resolve())}
    if existing is not None:
        tracker.run_id = existing.run_id  # the orphan of the live run: finish it
    else:
        tracker.start(record.run_name, tags)
        tracker.log_params(record.params)
    record.tags = tags
    try:
        publish(tracker, record, directory)
    except BaseException as failure:  # a signal, a full disk, the store: never leave the run RUNNING
        with signals_ignored(), suppress(Exception):
            tracker.end("KILLED" if isinstance(failure, KeyboardInterrupt) else "FAILED")
        raise  # the run is not marked published: the next upload finds it by its id tag and finishes it
    return tracker.run_id, False
