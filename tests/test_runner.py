"""The parity run: the Hydra app end to end, checked through MLflow's client API."""

from __future__ import annotations

import csv
import json
import math
import pstats
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from paritylab import Trace
from paritylab.cli.app import compose, preflight
from paritylab.comparison.report import compare_traces
from paritylab.reports.render import headline
from paritylab.run.config import fresh_directory
from paritylab.run.runner import EXIT_ERROR, EXIT_FAIL, EXIT_PASS, run
from paritylab.sink.tracking import runs_link
from tests.helpers import migrated_store, parity_runs


def run_with(tmp_path: Path, *overrides: str):
    uri = migrated_store(tmp_path / "mlflow.db")
    cfg = compose([f"tracking.uri={uri}", *overrides])
    result = run(cfg, fresh_directory(str(tmp_path / "run")), echo=lambda _: None)  # run, run-2, ...: never shared
    return result, MlflowClient(uri)


def app(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "paritylab", *overrides, f"hydra.run.dir={tmp_path / 'hydra'}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )


@pytest.mark.slow
def test_default_run_end_to_end(tmp_path):
    result = app(tmp_path, "model=llava", "candidate=port")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "PASS" in result.stdout and "mlflow ui --backend-store-uri sqlite:///" in result.stdout
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run_info,) = parity_runs(client)
    assert run_info.info.status == "FINISHED" and run_info.info.run_name == "PASS llava/port seed=0"
    tags = run_info.data.tags
    assert tags["paritylab.verdict"] == "pass" and tags["paritylab.first_divergence"] == "none"
    assert tags["paritylab.model"] == "llava" and tags["paritylab.candidate"] == "port"
    assert tags["paritylab.torch_version"] == torch.__version__ and tags["paritylab.dtype"] == "float32"
    assert "**pass**" in tags["mlflow.note.content"]
    assert run_info.data.params["model.build.hidden_size"] == "32"
    metrics = run_info.data.metrics
    assert metrics["summary/failing_modules"] == 0 and metrics["summary/output_rel_l2"] < 1e-6
    assert metrics["summary/first_divergence_index"] == -1
    # Where the time went, phase by phase: printed, in run.json and as metrics.
    seconds = json.loads(next((tmp_path / "hydra").glob("**/run.json")).read_text())["seconds"]
    phases = ["imports", "tracking start", "model imports", "memory plan", "build reference", "trace reference"]
    assert list(seconds)[:6] == phases and all(value >= 0 for value in seconds.values())
    assert 0.1 < seconds["imports"] < 60  # torch, Hydra and the configuration: never the age of the process
    assert metrics["seconds/build_reference"] == pytest.approx(seconds["build reference"], abs=1e-3)
    assert "paritylab: seconds: imports " in result.stdout

    history = client.get_metric_history(run_info.info.run_id, "divergence/rel_l2")
    report = json.loads((tmp_path / "hydra" / "report" / "report.json").read_text())
    compared = {row["index"]: row["metrics"]["rel_l2"] for row in report["rows"] if "rel_l2" in row["metrics"]}
    assert 0 not in {m.step for m in history}  # the root (the whole model) is left out of the per-call charts
    assert {m.step: m.value for m in history} == pytest.approx({k: v for k, v in compared.items() if k != 0})
    layer = client.get_metric_history(run_info.info.run_id, "layer/model.language_model.layers.1/rel_l2")
    assert len(layer) == 1 and layer[0].value < 1e-6
    depth = client.get_metric_history(run_info.info.run_id, "depth/model.language_model.layers/log10_rel_l2")
    by_layer = {
        int(row["path"].rsplit(".", 1)[1]): row["metrics"]["rel_l2"]
        for row in report["rows"]
        if row["path"].startswith("model.language_model.layers.") and row["path"].count(".") == 3
    }
    assert sorted(m.step for m in depth) == sorted(by_layer)  # step = layer index
    for point in depth:
        expected = by_layer[point.step]
        assert point.value == pytest.approx(max(-12.0, math.log10(expected)) if expected > 0 else -12.0, abs=1e-6)
    vision = client.get_metric_history(run_info.info.run_id, "depth/model.vision_tower.encoder.layers/log10_rel_l2")
    vision_layers = [
        r
        for r in report["rows"]
        if r["path"].startswith("model.vision_tower.encoder.layers.") and "rel_l2" in r["metrics"]
    ]  # the port never runs the last vision layer (LLaVA reads the one before): nothing to chart there
    charted = sorted({int(r["path"].split(".")[4]) for r in vision_layers})
    # a one-layer tower gets no depth chart (MLflow draws one point as a bar): its layer/* keys hold the value
    assert sorted(m.step for m in vision) == (charted if len(charted) > 1 else [])
    blocks = [r["path"] for r in vision_layers if r["path"].count(".") == 4]  # model.vision_tower.encoder.layers.N
    assert blocks and all(client.get_metric_history(run_info.info.run_id, f"layer/{path}/rel_l2") for path in blocks)

    artifacts = Path(client.download_artifacts(run_info.info.run_id, "", str(tmp_path / "downloaded")))
    for name in ("report/report.html", "report/alignment.yaml", "report/divergence_by_depth.svg", ".hydra/config.yaml"):
        assert (artifacts / name).is_file(), name
    assert (artifacts / "comparison_table.json").is_file()
    table = json.loads((artifacts / "comparison_table.json").read_text())
    assert "model.language_model.layers.1.self_attn.o_proj" in [row[1] for row in table["data"]]
    # a passing run uploads statistics and reports, not tensors (tracking.log_tensors=on_failure); they stay local
    assert not list(artifacts.rglob("*.safetensors")) and list((tmp_path / "hydra" / "candidate").glob("*.safetensors"))
    downloaded = Trace.load(artifacts / "reference")
    node = downloaded.call("lm_head#0").outputs
    local = Trace.load(tmp_path / "hydra" / "reference")
    assert node["stats"]["mean"] == pytest.approx(local.tensor(local.call("lm_head#0").outputs).mean().item(), abs=1e-6)
    again = compare_traces(downloaded, Trace.load(artifacts / "candidate"))
    assert again.verdict == "inconclusive"  # the uploaded copy holds statistics only: never a plain PASS


def test_port_matches_reference_logits_in_fp32():
    from experiments.llava_port import from_reference
    from paritylab.run.references import llava
    from tests.helpers import llava_inputs

    reference = llava(seed=5)
    port = from_reference(reference)
    inputs = llava_inputs(reference, batch=2)
    with torch.no_grad():
        expected = reference(**inputs).logits
        actual = port(inputs["input_ids"], inputs["pixel_values"])
    torch.testing.assert_close(actual, expected)


def test_bf16_is_flagged_under_fp32_tolerances(tmp_path):
    strict, client = run_with(tmp_path, "candidate=bf16", "compare.rtol=1.3e-6", "compare.atol=1e-5",
                              "compare.noise_floor=off", "compare.replay=false")  # fmt: skip
    assert strict.exit_code == EXIT_FAIL
    run_data = client.get_run(strict.run_id)
    assert run_data.info.status == "FAILED" and run_data.data.tags["paritylab.verdict"] == "fail"  # red in MLflow
    assert run_data.data.tags["paritylab.first_divergence"] != "none"
    # a failing run uploads its tensors (tracking.log_tensors=on_failure), bit-exact
    artifacts = Path(client.download_artifacts(strict.run_id, "", str(tmp_path / "downloaded")))
    downloaded, local = Trace.load(artifacts / "candidate"), Trace.load(strict.directory / "candidate")
    key = downloaded.calls[-1].key
    torch.testing.assert_close(
        downloaded.tensor(downloaded.call(key).outputs), local.tensor(local.call(key).outputs), rtol=0, atol=0
    )
    shard = load_file(artifacts / "candidate" / "tensors-00000.safetensors")
    assert len(shard) == len(downloaded.files)
    # One copy on disk: the local artifact store holds a hard link to the run directory's shard, not a copy.
    stored = Path(urlparse(run_data.info.artifact_uri).path) / "candidate" / "tensors-00000.safetensors"
    own = strict.directory / "candidate" / "tensors-00000.safetensors"
    assert stored.stat().st_ino == own.stat().st_ino and own.stat().st_nlink == 2
    loose, _ = run_with(tmp_path, "candidate=bf16")
    assert loose.exit_code == EXIT_PASS
    assert loose.report.rows[0].floor is not None  # auto noise floor for a bf16 candidate
    # The candidate is the reference in bf16: its trace is the floor's bf16 side, not run again, and a replay
    # of it would be judged against itself, so none is run.
    assert any("two forwards saved" in note for note in loose.notes)
    assert any("isolated replay not run: the candidate is the reference's own code" in n for n in loose.notes)
    # the reference's own trace is the floor's exact side: no other run
    assert not (loose.directory / "noise-low").exists() and not (loose.directory / "noise-exact").exists()
    assert not (loose.directory / "replay").exists() and not any(row.local for row in loose.report.rows)
    assert "replay" not in json.loads((loose.directory / "run.json").read_text())["seconds"]
    assert not [a for a in client.list_artifacts(loose.run_id, "candidate") if a.path.endswith(".safetensors")]


def test_a_bug_under_bf16_rounding_in_a_bf16_port_is_named_through_the_app(tmp_path):
    """A ×1.001 gain in one projection of the port cast to bf16: under bf16's rounding, so only the lifted
    replay (both sides in float32 with the port's bf16 weights) sees it; the run fails and names it and, inside
    it, the operation; the phase is timed like the others."""
    result, client = run_with(
        tmp_path,
        "candidate.ports.llava.build._target_=tests.faulty.scaled_port",
        "+candidate.ports.llava.build.module=llm.layers.1.feed_forward.w2",
        "+candidate.ports.llava.build.scale=1.001",
        "+candidate.ports.llava.build.dtype=bfloat16",
    )
    assert result.exit_code == EXIT_FAIL
    tags = client.get_run(result.run_id).data.tags
    assert tags["paritylab.first_divergence"] == "model.language_model.layers.1.mlp.down_proj"
    culprit = result.report.first_divergence
    assert "with the same bfloat16 weights computed in float32" in culprit.note
    assert 5e-4 < culprit.local["lifted_rel_l2"] < 2e-3
    assert "(lifted replay)" in result.report.culprit_reason
    assert "(own error 1.00e-03 in float32)" in headline(result.report)
    # Opened in the lifted copies, the planted operation shows with its constant (in bf16 it is under rounding).
    assert tags["paritylab.first_operation"] == "mul"
    drilled = json.loads((result.directory / "report" / "drilldown.json").read_text())
    assert drilled["operations"][0]["scalars"] == ["1.001"]
    with (result.directory / "report" / "comparison.csv").open() as table:
        rows = {row["module"]: row for row in csv.DictReader(table)}
    assert float(rows["model.language_model.layers.1.mlp.down_proj"]["lifted_rel_l2"]) == pytest.approx(1e-3, 0.01)
    assert float(rows["model.language_model.layers.1.mlp.up_proj"]["lifted_rel_l2"]) < 1e-5  # its code agrees
    run = json.loads((result.directory / "run.json").read_text())
    assert run["seconds"]["lifted replay"] > 0
    metrics = client.get_run(result.run_id).data.metrics
    assert metrics["seconds/lifted_replay"] == pytest.approx(run["seconds"]["lifted replay"], abs=0.01)


def test_planted_port_bug_is_localised_through_the_app(tmp_path):
    result, client = run_with(
        tmp_path,
        "candidate.ports.llava.build._target_=tests.faulty.scaled_port",
        "+candidate.ports.llava.build.module=llm.layers.1.attention.wo",
    )
    assert result.exit_code == EXIT_FAIL
    tags = client.get_run(result.run_id).data.tags
    assert tags["paritylab.first_divergence"] == "model.language_model.layers.1.self_attn.o_proj"
    assert tags["paritylab.verdict"] == "fail"
    assert [row.path for row in result.report.replay_origins] == ["model.language_model.layers.1.self_attn.o_proj"]
    # Inside it: the planted hook's multiplication, with its constant, in the report, the file and MLflow.
    assert tags["paritylab.first_operation"] == "mul"
    drilled = json.loads((result.directory / "report" / "drilldown.json").read_text())
    assert drilled["candidate"] == "llm.layers.1.attention.wo#0" and drilled["operations"][0]["scalars"] == ["1.01"]
    assert drilled["counterparts"] == [] and "the reference has no operation on the same inputs" in drilled["message"]
    assert (
        "inside model.language_model.layers.1.self_attn.o_proj: the floating-point inputs agree"
        in tags["mlflow.note.content"]
    )
    assert "report/drilldown.json" in {a.path for a in client.list_artifacts(result.run_id, "report")}
    page = (result.directory / "report" / "report.html").read_text()
    assert "Inside model.language_model.layers.1.self_attn.o_proj: where the values part" in page
    assert "<code>mul(linear[1, 20, 32], 1.01)</code>" in page
    heatmap = (result.directory / "report" / "layer_heatmap.svg").read_text()
    assert heatmap.startswith("<svg") and "language_model.1 rel_l2" in heatmap


def test_a_wrong_weight_element_is_named_through_the_app_with_no_weight_map(tmp_path):
    """One element of one weight ×1.01 (a conversion's bug) through the Hydra route with the port's weight map
    switched off: the weight ledger, which needs no map, names the module holding it, and MLflow gets the count."""
    result, client = run_with(
        tmp_path,
        "candidate.ports.llava.weight_map=null",
        "candidate.ports.llava.build._target_=tests.faulty.element_port",
        "+candidate.ports.llava.build.parameter=llm.layers.1.feed_forward.w2.weight",
    )
    assert result.exit_code == EXIT_FAIL
    run_data = client.get_run(result.run_id).data
    assert run_data.tags["paritylab.first_divergence"] == "model.language_model.layers.1.mlp.down_proj"
    assert run_data.metrics["summary/weights_differing"] == 1
    assert (
        "llm.layers.1.feed_forward.w2.weight differs from the reference's "
        "model.language_model.layers.1.mlp.down_proj.weight"
    ) in run_data.tags["mlflow.note.content"]


def test_forward_that_raises_fails_the_run_and_keeps_the_partial_trace(tmp_path):
    result, client = run_with(
        tmp_path,
        "candidate.ports.llava.build._target_=tests.faulty.raising_port",
        "+candidate.ports.llava.build.module=llm.layers.1.attention",
    )
    assert result.exit_code == EXIT_ERROR
    run_data = client.get_run(result.run_id)
    assert run_data.info.status == "FAILED" and run_data.data.tags["paritylab.verdict"] == "error"
    partial = Trace.load(result.directory / "candidate")
    assert partial.meta["status"] == "error" and partial.meta["error"]["module"] == "llm.layers.1.attention"
    assert "planted failure" in partial.meta["error"]["message"]
    assert partial.call("llm.layers.0#0").outputs is not None
    assert result.report is not None and "llm.layers.1.attention" in json.dumps(result.report.errors)
    names = {a.path for a in client.list_artifacts(result.run_id, "candidate")}
    assert "candidate/trace.json" in names


def test_port_of_a_model_without_one_lists_what_exists_before_any_work(tmp_path):
    result, _ = run_with(tmp_path, "model=llama", "candidate=port")
    assert result.exit_code == EXIT_ERROR
    assert "no port of a 'llama' model; ports exist for: llava" in result.error
    assert not (tmp_path / "run" / "reference").exists()  # failed before the reference was built


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("compare.rtool=1", "compare.rtool"),
        ("candidate=nope", "nope"),
        ("compare.rtol=abc", "compare.rtol"),
        ("model.build._target_=nowhere.build", "cannot import 'nowhere'"),
        ("+model.build.hidden_sise=8", "hidden_sise"),
        ("resident=two", "expected one of [auto, both, one]"),
    ],
)
def test_bad_configuration_is_one_line_and_exit_2(tmp_path, capsys, override, expected):
    """In process, as the app does it: preflight composition, then the run's checks before any model is built."""
    overrides = [override, f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    said: list[str] = []
    try:
        preflight(overrides)
        code = run(compose(overrides), tmp_path / "run", echo=said.append).exit_code
    except SystemExit as stop:
        code = stop.code
    output = "\n".join([capsys.readouterr().err.strip(), *said]).strip()
    assert code == 2, output
    assert len(output.splitlines()) == 1, output
    assert expected in output
    assert not (tmp_path / "mlflow.db").exists()  # failed before any tracking: no run to leave RUNNING


def test_bad_configuration_across_the_process_boundary(tmp_path):
    result = app(tmp_path, "compare.rtool=1", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "compare.rtool" in result.stderr and not (tmp_path / "mlflow.db").exists()


def test_cfg_job_and_help_work_as_hydra_users_expect(tmp_path):
    mine = _user_candidate(tmp_path)  # a config from another directory, found through --config-dir
    shown = app(tmp_path, "--profile=job.prof", "--config-dir", str(mine), "--cfg", "job", "candidate=scaled")
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "name: scaled" in shown.stdout and "scale: 1.05" in shown.stdout and "kind: target" in shown.stdout
    assert "paritylab: profile written to job.prof" in shown.stdout
    profile = pstats.Stats(str(tmp_path / "job.prof"))
    assert any(name == "preflight" and "app.py" in path for path, _, name in profile.stats)  # type: ignore[attr-defined]
    helped = app(tmp_path, "--help")
    assert helped.returncode == 0 and "candidate: bf16, compiled, eager, pipeline, port, sdpa, tp" in helped.stdout


def test_pretrained_checkpoint_with_its_processor_and_image(tmp_path):
    from tests.tiny import save_tiny_llava_checkpoint

    checkpoint = tmp_path / "checkpoint"
    save_tiny_llava_checkpoint(checkpoint)
    result, client = run_with(tmp_path, f"model.build.pretrained={checkpoint}", "inputs=image", "compare.replay=false")
    assert result.exit_code == EXIT_PASS, result.error
    reference = Trace.load(result.directory / "reference")
    kwargs = reference.call("#0").inputs["items"]["kwargs"]["items"]
    assert kwargs["pixel_values"]["shape"] == [1, 3, 28, 28]
    ids = reference.tensor(kwargs["input_ids"])
    assert int((ids == 127).sum()) == 4  # the processor expanded <image> into the image's tokens
    from paritylab.run.references import llava  # the weights come from the checkpoint, not from a seed

    loaded = llava(pretrained=str(checkpoint))
    assert torch.equal(loaded.lm_head.weight, llava(seed=11).lm_head.weight)
    assert client.get_run(result.run_id).data.params["model.build.pretrained"] == str(checkpoint)


@pytest.mark.slow
@pytest.mark.parametrize("candidate", ["sdpa", "compiled"])
def test_generic_candidates_apply_to_any_reference(tmp_path, candidate):
    overrides = ["model=llama", f"candidate={candidate}", "compare.replay=false"]
    if candidate == "compiled":  # aot_eager: the same graph capture, without C++ compilation; and a decode
        overrides += ["candidate.backend=aot_eager", "generate.steps=1"]  # step: the compiled model's cache works
    result, client = run_with(tmp_path, *overrides)
    assert result.exit_code == EXIT_PASS, result.error
    if candidate == "compiled":
        decode = result.report.decode
        assert decode["summary"]["verdict"] == "pass" and [s["step"] for s in decode["steps"]] == [0, 1]
        assert all(s["token_agreement"] == 1.0 and s["kl"] < 1e-9 for s in decode["steps"])
        # run once more untraced, as one graph: it agrees; the decode step after it is traced call by call again
        graph = result.report.whole_graph
        assert graph["verdict"] == "pass" and graph["rel_l2"] < 1e-6 and graph["traced_rel_l2"] < 1e-6, graph
        assert len(Trace.load(result.directory / "steps" / "1" / "candidate").calls) > 10
        assert client.get_run(result.run_id).data.tags["paritylab.whole_graph"] == "pass"
    rows = [row for row in result.report.rows if row.status == "compared"]
    assert len(rows) == len(Trace.load(result.directory / "reference").calls)
    assert all(row.source == "identity" for row in rows)
    assert not any("never called" in note for note in result.notes)
    if candidate == "compiled":
        assert Trace.load(result.directory / "candidate").meta["compiled"] is True
        assert any("compiled" in note for note in result.notes)


def _user_candidate(tmp_path: Path) -> Path:
    mine = tmp_path / "my_conf" / "candidate"
    mine.mkdir(parents=True)
    (mine / "scaled.yaml").write_text(
        "name: scaled\nkind: target\nbuild:\n  _target_: tests.faulty.scaled_port\n"
        "  module: llm.layers.0.feed_forward.w2\n  scale: 1.05\n"
        "weight_map: pkg://paritylab.experiments.llava_port/weights.yaml\n"
    )
    return mine.parent


@pytest.mark.slow
def test_user_configs_from_another_directory(tmp_path):
    """A user's candidate config beside their code (``--config-dir``: the command line's form is checked in
    ``test_cfg_job_and_help_work_as_hydra_users_expect``), run in this process."""
    store = migrated_store(tmp_path / "mlflow.db")
    cfg = compose(["candidate=scaled", "compare.replay=false", f"tracking.uri={store}"], str(_user_candidate(tmp_path)))
    result = run(cfg, tmp_path / "h", echo=lambda _: None)
    assert result.exit_code == 1, result.error
    assert result.report.first_divergence.path == "model.language_model.layers.0.mlp.down_proj"
    notes = json.loads((tmp_path / "h" / "run.json").read_text())["notes"]
    assert any(note.startswith("weight parity: 40 parameters compared, 0 differ") for note in notes), notes


def test_per_module_tolerance_overrides(tmp_path):
    strict = ["candidate=bf16", "compare.rtol=1.3e-6", "compare.atol=1e-5", "compare.noise_floor=off"]
    strict.append("compare.replay=false")
    plain, _ = run_with(tmp_path / "a", *strict)
    overridden, _ = run_with(tmp_path / "b", *strict, "+compare.modules.lm_head={rtol: 0.05}")
    before = {row.path: row for row in plain.report.rows}
    after = {row.path: row for row in overridden.report.rows}
    assert before["lm_head"].verdict == "fail" and after["lm_head"].verdict == "pass"
    assert after["lm_head"].tolerance.rtol == 0.05 and after["lm_head"].tolerance.atol == 1e-5
    assert (
        after["model.language_model.norm"].tolerance.rtol == 1.3e-6
        and after["model.language_model.norm"].verdict == "fail"
    )


def test_a_run_pinned_to_an_earlier_runs_alignment_uses_exactly_its_pairs(tmp_path):
    first, _ = run_with(tmp_path / "a", "compare.replay=false", "tracking=off")
    frozen = first.directory / "report" / "alignment.yaml"
    second, _ = run_with(tmp_path / "b", "compare.replay=false", "tracking=off", f"compare.alignment={frozen}")
    assert first.exit_code == second.exit_code == 0
    assert [(p.reference, p.candidate) for p in second.report.alignment.pairs] == [
        (p.reference, p.candidate) for p in first.report.alignment.pairs
    ]
    assert {p.source for p in second.report.alignment.pairs} == {"rule"}


def test_runs_of_one_pair_reuse_the_baseline_alignment_and_a_lost_pair_is_a_finding(tmp_path, monkeypatch):
    """By default a run pins the alignment of its pair's baseline run in MLflow: a nightly run cannot re-pair
    modules, and a module paired then whose counterpart is gone now fails its row (and the run)."""
    import paritylab.experiments.llava_port as port_module

    first, client = run_with(tmp_path, "compare.replay=false")
    second, _ = run_with(tmp_path, "compare.replay=false")
    assert first.exit_code == second.exit_code == EXIT_PASS
    assert client.get_run(second.run_id).data.tags["paritylab.alignment_from"] == first.run_id
    assert [(p.reference, p.candidate) for p in second.report.alignment.pairs] == [
        (p.reference, p.candidate) for p in first.report.alignment.pairs
    ]
    original = port_module.from_reference

    def without_a_norm(reference):  # tonight's candidate code dropped a norm; the configuration is unchanged
        port = original(reference)
        port.llm.layers[1].ffn_norm = torch.nn.Identity()
        return port

    monkeypatch.setattr(port_module, "from_reference", without_a_norm)
    third, _ = run_with(tmp_path, "compare.replay=false")
    assert third.exit_code == EXIT_FAIL
    assert third.report.alignment.lost == ["model.language_model.layers.1.post_attention_layernorm#0"]
    row = next(r for r in third.report.rows if r.path == "model.language_model.layers.1.post_attention_layernorm")
    assert row.verdict == "fail" and "no longer exists" in row.note
    fresh, _ = run_with(tmp_path, "compare.replay=false", "compare.alignment=fresh")
    assert (
        fresh.report.alignment.lost == [] and "paritylab.alignment_from" not in client.get_run(fresh.run_id).data.tags
    )


def test_a_port_in_bf16_is_one_override_candidate_dtype(tmp_path):
    """``candidate.dtype=bfloat16`` casts the port (after its weight parity is checked as built): the commonest
    question, "my port in bf16 against the float32 reference", in one override; a clean port passes within the
    bf16 noise floor and a 1 % bug in it is named."""
    clean, _ = run_with(tmp_path, "candidate.dtype=bfloat16")
    assert clean.exit_code == EXIT_PASS, clean.error
    assert "candidate cast to bfloat16 (candidate.dtype=bfloat16)" in clean.notes
    compared = [row for row in clean.report.rows if row.status == "compared" and row.candidate is not None]
    assert compared and {
        row.candidate.dtype for row in compared if row.candidate.dtype.startswith(("float", "bfloat"))
    } == {"bfloat16"}
    assert any(note.startswith("weight parity: 40 parameters") for note in clean.notes)
    wrong, _ = run_with(
        tmp_path, "candidate.dtype=bfloat16", "candidate.ports.llava.build._target_=tests.faulty.scaled_port",
        "+candidate.ports.llava.build.module=llm.layers.1.feed_forward.w2",
    )  # fmt: skip
    assert wrong.exit_code == EXIT_FAIL
    assert wrong.report.first_divergence.path == "model.language_model.layers.1.mlp.down_proj"


@pytest.mark.slow
def test_start_up_is_timed_from_paritylab_not_from_the_shell_that_became_the_process(tmp_path):
    """``bash -c "... && python -m paritylab"`` runs the last command in the shell's own process: its start is
    the chain's. The start-up figure counts from paritylab's import, so seconds spent before do not show."""
    started = time.monotonic()
    command = f"sleep 4 && {sys.executable} -m paritylab tracking=off compare.replay=false hydra.run.dir=run"
    result = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    seconds = json.loads((tmp_path / "run" / "run.json").read_text())["seconds"]
    # the 4 s of the sleep are in the process's age and not in the figure, however slow the machine is
    whole = time.monotonic() - started
    assert (
        "interpreter" not in seconds
        and 0.1
        < seconds["imports"]
        < whole - 4 - sum(value for key, value in seconds.items() if key != "imports") + 1.0
    )


def test_the_experiment_description_leads_with_the_newest_run_and_keeps_what_a_person_wrote(tmp_path):
    """The description's first line is replaced after each run (the newest run's name, the verdicts of the newest
    runs); what a person wrote below it stays; an experiment paritylab did not make keeps its description."""
    uri = migrated_store(tmp_path / "mlflow.db")
    client = MlflowClient(uri)

    def one(*overrides: str):
        cfg = compose([f"tracking.uri={uri}", "compare.replay=false", *overrides])
        return run(cfg, fresh_directory(str(tmp_path / "run")), echo=lambda _: None)

    first = one("tracking.experiment=ours")
    experiment = client.get_experiment_by_name("ours")
    lines = experiment.tags["mlflow.note.content"].split("\n")
    link = f" \u00b7 [runs list]({runs_link(experiment.experiment_id)})"
    assert lines[0] == f"{client.get_run(first.run_id).info.run_name} (the newest run: 1 pass){link}"
    assert lines[2].startswith("**paritylab: [the runs list]")  # paritylab's own text below it
    client.set_experiment_tag(experiment.experiment_id, "mlflow.note.content", f"{lines[0]}\n\nour notes")
    second = one("tracking.experiment=ours", "candidate=sdpa")
    described = client.get_experiment_by_name("ours").tags["mlflow.note.content"]
    newest = client.get_run(second.run_id).info.run_name
    assert newest == "PASS llava/sdpa seed=0"
    assert described == f"{newest} (the newest of 2 runs: 2 pass){link}\n\nour notes"

    theirs = client.create_experiment("theirs", tags={"mlflow.note.content": "team notes"})
    one("tracking.experiment=theirs")
    assert client.get_experiment(theirs).tags["mlflow.note.content"] == "team notes"
    assert "paritylab.summary" not in client.get_experiment(theirs).tags
