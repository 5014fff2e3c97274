"""A pair's history in a real MLflow store: baselines keyed by the whole pair, promote's refusals, and
regressions that mean something (NaN, renamed keys)."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
from mlflow.entities import Metric, RunTag
from mlflow.tracking import MlflowClient

from paritylab.sink.history import FINGERPRINT, assess, layer_errors, pair_fingerprint
from paritylab.sink.keys import metric_key
from paritylab.sink.store import MlflowStore
from paritylab.sink.tracking import MlflowTracker
from tests.helpers import migrated_store


@pytest.fixture
def store(tmp_path):
    uri = migrated_store(tmp_path / "history.db")
    client = MlflowClient(uri)
    return uri, client, client.create_experiment("history")


def parity_run(client, experiment, fingerprint, verdict="pass", status="FINISHED", errors=None, trend=False):
    tags = {"paritylab.pair": "llava/port", FINGERPRINT: fingerprint, "paritylab.verdict": verdict}
    if trend:
        tags["paritylab.trend"] = "true"
    run = client.create_run(experiment, tags=tags)
    metrics = [Metric(metric_key(f"layer/{k}/rel_l2"), v, 0, 0) for k, v in (errors or {"m.layers.0": 1e-7}).items()]
    client.log_batch(run.info.run_id, metrics=metrics, tags=[RunTag("x", "y")])
    if status != "RUNNING":
        client.set_terminated(run.info.run_id, status)
    return run.info.run_id


def test_the_fingerprint_covers_the_whole_pair_and_nothing_else():
    base = {"model": {"name": "llava"}, "candidate": {"name": "port", "build": {"scale": 1}}, "inputs": {"seed": 0},
            "dtype": "float32", "device": "cpu", "compare": {"rtol": None}, "seed": 0}  # fmt: skip
    same = pair_fingerprint({**base, "tracking": {"uri": "elsewhere"}, "resident": "one"})
    assert same == pair_fingerprint(base)
    for key, value in (("candidate", {"name": "port", "build": {"scale": 2}}), ("dtype", "bfloat16"),
                       ("compare", {"rtol": 1e-2}), ("inputs", {"seed": 1}), ("model", {"name": "llama"})):  # fmt: skip
        assert pair_fingerprint({**base, key: value}) != pair_fingerprint(base), key


def test_baselines_never_cross_pairs_and_skip_killed_or_errored_runs(store):
    uri, client, experiment = store
    fp32 = parity_run(client, experiment, "aaa")
    parity_run(client, experiment, "bbb")  # another pair (a bf16 override): never fp32's baseline
    parity_run(client, experiment, "aaa", status="KILLED")
    parity_run(client, experiment, "aaa", verdict="error", status="FAILED")
    parity_run(client, experiment, "aaa", trend=True)
    store = MlflowStore(MlflowTracker(uri, "history"))
    assert store.find_baseline("aaa").run_id == fp32
    assert store.find_baseline("aaa", exclude=fp32) is None  # a run is never its own baseline
    assert store.find_baseline("ccc") is None


def test_promote_refuses_what_cannot_be_a_baseline_unless_forced(store):
    uri, client, experiment = store
    refusals = {
        parity_run(client, experiment, "aaa", trend=True): "trend run",
        parity_run(client, experiment, "aaa", status="KILLED"): "did not finish (status KILLED)",
        parity_run(client, experiment, "aaa", verdict="fail"): "verdict is 'fail'",
        parity_run(client, experiment, "aaa", status="RUNNING"): "did not finish (status RUNNING)",
    }
    promote = MlflowStore(MlflowTracker(uri, "history")).promote
    for run_id, reason in refusals.items():
        with pytest.raises(ValueError, match=re.escape(reason)):
            promote(run_id)
        if "verdict" not in reason:
            with pytest.raises(ValueError, match=re.escape(reason)):
                promote(run_id, force=True)  # only a verdict can be forced
    failing = next(r for r, why in refusals.items() if "fail" in why)
    assert promote(failing, force=True) == []
    good = parity_run(client, experiment, "aaa")
    assert promote(good) == [failing]
    assert client.get_run(failing).data.tags["paritylab.baseline"] == "superseded"
    killed = next(r for r, why in refusals.items() if "KILLED" in why)
    result = subprocess.run(
        [sys.executable, "-m", "paritylab.cli.promote", killed, "--tracking-uri", uri],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "cannot be a baseline: it did not finish (status KILLED)" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_nan_where_the_baseline_was_finite_is_a_regression():
    result = assess({"a": math.nan, "b": math.inf, "c": 1e-7}, {"a": 1e-7, "b": 1e-7, "c": 1e-7}, 2.0, 1e-6)
    assert result.verdict == "regressed" and result.regressed == ["a", "b"] and result.improved == []
    stored_inf = 1.7976931348623157e308  # what MLflow stores for Inf
    recovered = assess({"a": 1e-7}, {"a": stored_inf}, 2.0, 1e-6)
    assert recovered.verdict == "improved"


def test_renamed_keys_are_assessed_like_any_other(store):
    """Module names MLflow rejects are renamed in its keys; the run's own metrics and the baseline read back
    from MLflow must still line up, or 50x regressions go unflagged."""
    _, client, experiment = store
    odd = "model.blocks[0]<attn>"  # characters MLflow rejects
    baseline = parity_run(client, experiment, "aaa", errors={odd: 1e-4, "plain.0": 1e-4})
    before = layer_errors(client.get_run(baseline).data.metrics)
    current = layer_errors({f"layer/{odd}/rel_l2": 5e-3, "layer/plain.0/rel_l2": 1e-4})
    result = assess(current, before, 2.0, 1e-6)
    assert result.regressed == [metric_key(odd)] and result.ratios[metric_key(odd)] == pytest.approx(50)


def test_an_upload_gets_the_regression_and_the_trend_point_a_live_run_gets_and_only_once(tmp_path, monkeypatch):
    """A scheduled run whose store failed mid-run is uploaded later, twice: one run, assessed against the pair's
    baseline, with one trend point (the second upload changes nothing)."""
    from paritylab.sink.publish import upload
    from paritylab.sink.tracking import MlflowTracker, TrackingError
    from tests.test_runner import run_with

    baseline, client = run_with(tmp_path / "first", "compare.replay=false", "tracking.trend=true")
    uri = client.tracking_uri
    assert baseline.exit_code == 0

    def broken(self, metrics):
        raise TrackingError("MLflow failed to log metrics: connection reset")

    monkeypatch.setattr(MlflowTracker, "log_metrics", broken)
    from paritylab.cli.app import compose
    from paritylab.run.runner import run

    overrides = [f"tracking.uri={uri}", "compare.replay=false", "tracking.trend=true", "seed=0"]
    cfg = compose([*overrides, "tracking.process=inline"])  # the patched tracker is this process's
    failed = run(cfg, tmp_path / "second", echo=lambda _: None)
    assert failed.exit_code == 2 and failed.tracking_error
    monkeypatch.undo()
    run_id, already = upload(failed.directory)
    assert run_id == failed.run_id and not already
    assert upload(failed.directory) == (run_id, True)
    tags = client.get_run(run_id).data.tags
    assert tags["paritylab.regression"] == "none" and tags["paritylab.baseline_run"] == baseline.run_id
    trend = tags["paritylab.trend_run"]
    assert trend == client.get_run(baseline.run_id).data.tags["paritylab.trend_run"]  # the pair's one trend run
    points = client.get_metric_history(trend, "summary/failing_modules")
    assert len(points) == 2  # the live run's night and the uploaded one's, not three
    assert sorted(p.timestamp for p in points)[1] == int(tags["paritylab.start_ms"])  # stamped with its own start


def test_opening_a_fresh_store_says_nothing(tmp_path):
    """A user's first run creates the SQLite store: MLflow's and alembic's INFO lines about its tables (two under
    MLflow 3.17, ten under 3.9) are not the user's business; the store is still created and usable."""
    database = tmp_path / "fresh.db"
    script = (
        "import sys\nfrom paritylab.sink.tracking import MlflowTracker\n"
        "tracker = MlflowTracker(sys.argv[1], 'first')\nprint(tracker.ensure_experiment())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, f"sqlite:///{database}"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert MlflowClient(f"sqlite:///{database}").get_experiment_by_name("first").experiment_id == result.stdout.strip()


def test_promote_gives_the_verdict_as_the_reason_for_a_failing_run_without_layer_metrics(store):
    """A run that failed before any layer was compared (no per-layer metrics) is refused for its verdict first."""
    uri, client, experiment = store
    run = client.create_run(experiment, tags={"paritylab.pair": "llava/port", FINGERPRINT: "bbb",
                                              "paritylab.verdict": "fail"})  # fmt: skip
    client.set_terminated(run.info.run_id, "FINISHED")
    promote = MlflowStore(MlflowTracker(uri, "history")).promote
    expected = "its verdict is 'fail', not 'pass', and it has no per-layer metrics to compare against"
    for force in (False, True):
        with pytest.raises(ValueError, match=re.escape(expected)):
            promote(run.info.run_id, force)
