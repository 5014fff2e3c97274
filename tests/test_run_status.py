"""How a judged run ends in MLflow, read back through MLflow's client from a real store: a FAIL or an error ends
FAILED (red in the runs list, as ``mlflow run`` ends a command that exits non-zero), a PASS or an INCONCLUSIVE
run FINISHED, an interrupted one KILLED; the verdict tag still tells them apart, and baselines and promotion read
the tag, not the status. Also the run's short name, and the links a run writes."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from paritylab.sink.history import FINGERPRINT
from paritylab.sink.publish import RunRecord, end_status, parity_name, publish, short_module
from paritylab.sink.store import MlflowStore
from paritylab.sink.tracking import LOCAL_UI, Metric, MlflowTracker, run_link, runs_link
from tests.helpers import migrated_store

MODULE = "model.language_model.layers.1.mlp.down_proj"


@pytest.fixture(scope="module")
def uri(tmp_path_factory):
    return migrated_store(tmp_path_factory.mktemp("status") / "mlflow.db")


def published(uri, tmp_path, verdict, status="FINISHED", **tags):
    """A parity run opened and published as the runner does (``record.status``: how the run itself ended)."""
    tracker = MlflowTracker(uri, "status")
    first = MODULE if verdict == "fail" else "none"
    note = f"### paritylab: **{verdict}**\n\nthe report"
    all_tags = {"paritylab.verdict": verdict, "paritylab.first_divergence": first, "mlflow.note.content": note, **tags}
    tracker.start("llava/port seed=0", {"paritylab.verdict": "running"})
    record = RunRecord("llava/port seed=0", "status", uri, all_tags, {}, status=status)
    directory = tmp_path / f"run-{verdict}-{status}"
    directory.mkdir()
    record.save(directory)
    publish(tracker, record, directory)
    return MlflowClient(uri).get_run(tracker.run_id), tracker


@pytest.mark.parametrize(
    ("verdict", "status", "extra", "expected", "name"),
    [
        ("pass", "FINISHED", {}, "FINISHED", "PASS llava/port seed=0"),
        ("fail", "FINISHED", {}, "FAILED", "FAIL layers.1.mlp.down_proj @ llava/port seed=0"),
        ("error", "FAILED", {}, "FAILED", "ERROR llava/port seed=0"),
        ("inconclusive", "FINISHED", {}, "FINISHED", "INCONCLUSIVE llava/port seed=0"),
        ("interrupted", "KILLED", {}, "KILLED", "INTERRUPTED llava/port seed=0"),
        (
            "pass",
            "FINISHED",
            {"paritylab.regression": "regressed", "paritylab.regressed_layers": "model.language_model.layers.1"},
            "FAILED",
            "REGRESSED layers.1 @ llava/port seed=0",
        ),
    ],
)
def test_a_judged_run_ends_with_the_status_its_verdict_maps_to(uri, tmp_path, verdict, status, extra, expected, name):
    run, _ = published(uri, tmp_path, verdict, status, **extra)
    assert run.info.status == expected
    assert run.data.tags["paritylab.verdict"] == verdict  # the tag still tells a fail from an error
    assert run.info.run_name == name
    assert end_status(verdict, extra.get("paritylab.regression"), status) == expected


def test_baselines_and_promotion_read_the_verdict_not_the_status(uri, tmp_path):
    store = MlflowStore(MlflowTracker(uri, "baselines"))
    client = MlflowClient(uri)
    experiment = store.experiment_id

    def stored(verdict, status):
        run = client.create_run(experiment, tags={FINGERPRINT: "fp", "paritylab.pair": "llava/port",
                                                  "paritylab.verdict": verdict})  # fmt: skip
        store.log_metrics_to(run.info.run_id, [Metric("layer/m.layers.0/rel_l2", 1e-7)])
        client.set_terminated(run.info.run_id, status)
        return run.info.run_id

    failing = stored("fail", "FAILED")  # a FAIL ends FAILED: still judged, still a baseline
    errored = stored("error", "FAILED")
    assert store.find_baseline("fp").run_id == failing
    with pytest.raises(ValueError, match=r"did not finish \(verdict 'error'\)"):
        store.promote(errored, force=True)
    with pytest.raises(ValueError, match="verdict is 'fail'"):
        store.promote(failing)
    assert store.promote(failing, force=True) == []
    passing = stored("pass", "FINISHED")
    assert store.find_baseline("fp", exclude=failing).run_id == passing
    killed = stored("pass", "KILLED")
    assert store.find_baseline("fp", exclude=failing).run_id == passing  # newer, but it did not finish
    with pytest.raises(ValueError, match=r"did not finish \(status KILLED\)"):
        store.promote(killed)


def test_every_link_a_run_writes_opens_the_model_training_view(uri, tmp_path):
    run, tracker = published(uri, tmp_path, "fail")
    experiment = run.info.experiment_id
    runs = runs_link(experiment)
    assert runs == f"#/experiments/{experiment}/runs?viewStateShareKey=paritylab&workflowType=machine_learning"
    page = f"#/experiments/{experiment}/runs/{run.info.run_id}?workflowType=machine_learning"
    assert run_link(experiment, run.info.run_id) == page
    # the console line: a local store's runs list where `mlflow ui` serves it, after the command that starts it
    assert tracker.link() == (
        f"start mlflow ui --backend-store-uri {uri} and open {LOCAL_UI}/{runs} (this run: {LOCAL_UI}/{page})"
    )
    tracker.uri = "http://mlflow.internal:5000/"
    server = "http://mlflow.internal:5000"
    assert tracker.link() == f"{server}/{runs} (this run: {server}/{page})"
    # the run's description and the experiment's, each on its first line (before MLflow's "more")
    assert run.data.tags["mlflow.note.content"].split("\n")[0] == f"### paritylab: **fail** \u00b7 [runs list]({runs})"
    described = MlflowClient(uri).get_experiment(experiment).tags["mlflow.note.content"].split("\n")[0]
    assert described.startswith("FAIL layers.1.mlp.down_proj @ llava/port seed=0 (the newest of ")
    assert described.endswith(f" \u00b7 [runs list]({runs})")


def test_a_run_name_puts_the_verdict_and_the_modules_last_parts_first():
    assert short_module(MODULE) == "layers.1.mlp.down_proj"  # a layer's number stays with its container
    assert short_module("model.language_model.layers.1") == "layers.1"
    assert short_module("model.vision_tower.encoder.layers.0.self_attn") == "layers.0.self_attn"
    assert short_module("encoder.fc") == "encoder.fc" and short_module("fc") == "fc"
    assert short_module("step3/model.layers.0.mlp") == "step3/layers.0.mlp"
    tags = {"paritylab.verdict": "fail", "paritylab.first_divergence": "a." * 100 + "down_proj"}
    name = parity_name("llava/port seed=0", tags, "FINISHED")
    assert name == "FAIL a.down_proj @ llava/port seed=0"
    long = parity_name("llava/port " + "x=1 " * 100, tags, "FINISHED")
    assert len(long) == 250 and long.startswith("FAIL a.down_proj @ llava/port x=1") and long.endswith("\u2026")
    regressed = {"paritylab.verdict": "pass", "paritylab.regression": "regressed", "paritylab.first_divergence": "none"}
    assert parity_name("p", regressed, "FINISHED", ["m.layers.2", "m.layers.3"]) == "REGRESSED layers.2 (+1) @ p"
