"""``python -m paritylab.cli.compare`` on trace directories, including ones written by transformers' debugger."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers.model_debugging_utils import model_addition_debugger_context

from tests.tiny import tiny_llama, token_ids

IDS = token_ids(batch=1, length=5)


def debugger_trace(model, directory):
    with model_addition_debugger_context(model, debug_path=str(directory), do_prune_layers=False, use_repr=False):
        model(IDS)
    return directory


def compare(*args):
    """The CLI across the process boundary: its exit code and output as a user's shell sees them."""
    return subprocess.run(
        [sys.executable, "-m", "paritylab.cli.compare", *map(str, args)], capture_output=True, text=True, timeout=120
    )


def compare_here(capsys, *args):
    """The CLI's ``main`` in this process (the boundary is crossed once, in the first test): same exit code
    and output, without a second interpreter importing torch."""
    from paritylab.cli.compare import main

    capsys.readouterr()
    code = main([str(arg) for arg in args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["paritylab-compare", *map(str, args)], code, out, err)


@pytest.mark.slow
def test_debugger_traces_compare_through_the_cli(tmp_path, capsys):
    reference = debugger_trace(tiny_llama(), tmp_path / "ref")
    same = debugger_trace(tiny_llama(), tmp_path / "same")
    result = compare(reference, same, "--json", tmp_path / "same.json")
    assert result.returncode == 0, result.stderr
    assert "PASS" in result.stdout
    summary = json.loads((tmp_path / "same.json").read_text())["summary"]
    assert summary["verdict"] == "pass" and summary["failed"] == 0 and summary["passed"] > 20

    model = tiny_llama()
    with torch.no_grad():  # the debugger records inside forward, before hooks: plant through the weights
        model.model.layers[1].self_attn.v_proj.weight.mul_(1.05)
    buggy = debugger_trace(model, tmp_path / "buggy")
    result = compare_here(
        capsys, reference, buggy, "--markdown", tmp_path / "buggy.md", "--write-alignment", tmp_path / "a.yaml"
    )
    assert result.returncode == 1
    assert "divergence starts at model.layers.1.self_attn.v_proj" in result.stdout
    assert "model.layers.1.self_attn.v_proj" in (tmp_path / "buggy.md").read_text()
    assert "rules:" in (tmp_path / "a.yaml").read_text()


@pytest.mark.slow
def test_tolerance_flags_and_bad_input(tmp_path, capsys):
    reference = debugger_trace(tiny_llama(), tmp_path / "ref")
    model = tiny_llama()
    with torch.no_grad():
        model.lm_head.weight.mul_(1 + 1e-3)
    candidate = debugger_trace(model, tmp_path / "cand")
    assert compare_here(capsys, reference, candidate).returncode == 1
    assert compare_here(capsys, reference, candidate, "--rtol", "1e-2", "--atol", "1e-5").returncode == 0

    # Bad input, in process too.
    from paritylab.cli.compare import main

    def errors(*args):
        code = main([str(arg) for arg in args])
        return code, capsys.readouterr().err

    code, stderr = errors(reference, tmp_path / "nowhere")
    assert code == 2 and stderr.count("\n") == 1 and "is not a directory" in stderr
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "trace.json").write_text("{not json")
    code, stderr = errors(reference, tmp_path / "broken")
    assert code == 2 and "not valid JSON" in stderr
    bad_rules = tmp_path / "rules.yaml"
    bad_rules.write_text("- {reference: a}\n")
    code, stderr = errors(reference, reference, "--align", bad_rules)
    assert code == 2 and "needs 'reference' and 'candidate'" in stderr


def test_debugger_traces_with_reprs_are_inconclusive_never_a_pass(tmp_path, capsys):
    """The debugger's default use_repr=True keeps summaries, not values: judged on them, never a PASS."""
    traces = []
    for name in ("ref", "same"):
        model = tiny_llama()
        with model_addition_debugger_context(model, debug_path=str(tmp_path / name), do_prune_layers=False):
            model(IDS)
        traces.append(tmp_path / name)
    result = compare_here(capsys, *traces, "--json", tmp_path / "r.json")
    assert result.returncode == 3, result.stdout[-800:] + result.stderr[-800:]
    assert "INCONCLUSIVE" in result.stdout and "could not be compared by value" in result.stdout
    summary = json.loads((tmp_path / "r.json").read_text())["summary"]
    assert summary["verdict"] == "inconclusive" and summary["not_compared"] > 0


@pytest.mark.parametrize(
    ("module", "needed"),
    [
        ("compare", ["exit codes:", "3  inconclusive", "model_addition_debugger_context", "example:"]),
        ("promote", ["exit codes: 0 promoted, 2 refused", "run_id  ", "--force", "example:"]),
        ("upload", ["Exit codes: 0 published", "--experiment EXPERIMENT", "the MLflow experiment", "example:"]),
        ("bisect", ["-- [OVERRIDES ...]", "required:\n  --repo", "--good REV", "exit codes: 0", "example:"]),
    ],
)
def test_every_console_script_help_is_enough_to_use_it(module, needed, capsys):
    """``--help`` alone tells how to call each script, what it reads and what its exit codes mean."""
    import importlib

    with pytest.raises(SystemExit) as exited:
        importlib.import_module(f"paritylab.cli.{module}").main(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for phrase in needed:
        assert phrase in text, (module, phrase)


def test_a_wrong_weight_element_is_named_from_saved_traces_with_no_map(tmp_path, capsys):
    """paritylab's own traces of the user's MLP and a hand-written port with one weight element x1.01, compared by
    the console script with nothing else: the traces' fingerprints carry the weight ledger's evidence."""
    from paritylab.run.parity import trace_model
    from tests.test_weight_ledger import ported, reference_mlp

    reference = reference_mlp()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    trace_model(reference, lambda m: m(x), tmp_path / "ref")
    trace_model(ported(reference, "element"), lambda m: m(x), tmp_path / "port")
    result = compare_here(capsys, tmp_path / "ref", tmp_path / "port")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "divergence starts at 2 " in result.stdout
    assert "fc_mid.weight differs from the reference's 2.weight: 1 of 1024 elements, at [3, 5]" in result.stdout
