"""Decode-step parity: the LLaVA port grows its own KV cache, transformers uses its own; both are fed the
reference's greedy tokens. Bugs that only bite with a cache are named at the step and module where they start."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from mlflow import MlflowClient

from paritylab.cli.app import compose
from paritylab.run.candidates import build_candidate
from paritylab.run.errors import ConfigError
from paritylab.run.generate import generate_parity
from paritylab.run.inputs import build_inputs
from paritylab.run.runner import EXIT_FAIL
from paritylab.run.workload import infer_call
from tests.faulty import decode_bug_port
from tests.test_runner import run_with


def cache_keyword(model):
    """What the installed transformers calls the cache, read independently of paritylab: its forward's argument."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def test_decoding_works_with_either_cache_spelling(setting, tmp_path):
    """A forward that takes ``past_key_values=`` (transformers before 5.24) and returns the cache in a field of that
    name decodes like one that takes ``cache=``: both wrappers around the same reference agree at every step."""
    _, reference, _ = setting

    class OldSpelling(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask=None, pixel_values=None, past_key_values=None, use_cache=None):
            out = self.inner(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values,
                             **{cache_keyword(self.inner): past_key_values}, use_cache=use_cache)  # fmt: skip
            return {"logits": out.logits, "past_key_values": getattr(out, cache_keyword(self.inner))}

    generation = _generate(setting, OldSpelling(reference), tmp_path, steps=2)
    assert generation.candidate_style == "past_key_values"
    assert generation.verdict == "pass", [(s.step, s.first_divergence) for s in generation.steps]
    assert [s.token_agreement for s in generation.steps] == [1.0, 1.0, 1.0]


@pytest.fixture(scope="module")
def setting():
    cfg = compose([])
    from paritylab.run.references import llava

    reference = llava().eval()
    inputs = build_inputs(cfg.inputs, "llava", reference, None)
    return cfg, reference, inputs


def _generate(setting, candidate, directory, steps=3):
    _, reference, inputs = setting
    specs = infer_call(reference, inputs, "model"), infer_call(candidate, inputs, "candidate")
    return generate_parity(reference, candidate, inputs, *specs, directory, steps, top_k=5)


@pytest.mark.parametrize("name", ["port", "bf16", "sdpa"])  # compiled: tests/test_runner.py (generic candidates)
def test_clean_candidates_agree_at_every_step(name, setting, tmp_path):
    _, reference, _ = setting
    candidate = build_candidate(compose([f"candidate={name}"]).candidate, "llava", reference).model
    steps = 3
    generation = _generate(setting, candidate, tmp_path, steps)
    assert generation.verdict == "pass", [(s.step, s.first_divergence) for s in generation.steps]
    assert [step.step for step in generation.steps] == list(range(steps + 1))
    for step in generation.steps:
        assert step.token_agreement == 1.0 and step.top_k_overlap == 1.0
        assert 0.0 <= step.kl < (1e-5 if name == "bf16" else 1e-9)
        assert step.reference_tokens == step.candidate_tokens
    assert generation.summary()["first_failing_step"] is None
    # The keyword each forward takes: ``cache`` for the port and for transformers from 5.24, ``past_key_values`` before.
    assert generation.reference_style == cache_keyword(reference)
    assert generation.candidate_style == ("cache" if name == "port" else cache_keyword(reference))
    assert (tmp_path / "steps" / str(steps) / "candidate" / "trace.json").exists()  # every step traced on both sides


@pytest.mark.parametrize(
    ("bug", "step", "module", "inside"),
    [
        # positions reach the model through the rotary tables: the angle computation from them
        ("position", 2, "model.language_model.rotary_emb", "matmul"),
        # the keys the cache held from the step before (a tensor made before the call) are not the reference's
        ("stale", 3, "model.language_model.layers.0.self_attn", "state held by the module"),
        ("mask", 2, "model.language_model.layers.0.self_attn", "masked_fill .. softmax (2 operations)"),
        ("position", 4, "model.language_model.rotary_emb", "matmul"),
    ],
)
def test_a_decode_bug_is_named_at_its_step_and_module(bug, step, module, inside, setting, tmp_path):
    _, reference, _ = setting
    generation = _generate(setting, decode_bug_port(reference, bug, step), tmp_path, steps=4)
    summary = generation.summary()
    assert summary["verdict"] == "fail"
    assert summary["first_failing_step"] == step, [(s.step, s.verdict) for s in generation.steps]
    assert summary["first_divergence"] == f"step{step}/{module}"
    assert all(s.verdict == "pass" for s in generation.steps[:step])  # earlier steps agree
    assert generation.steps[step].max_abs > 1e-6
    # Inside that module at that step (both sides decoded afresh up to it): the operation or state that differs.
    assert generation.drilldown["step"] == step and generation.drilldown["operation"] == inside, generation.drilldown
    assert summary["first_operation"] == inside


def test_a_model_that_cannot_decode_is_refused_in_one_line(setting, tmp_path):
    _, reference, inputs = setting
    vision = torch.nn.Linear(4, 4)
    with pytest.raises(
        ConfigError,
        match=r"Linear.forward\(input\) takes no KV cache argument \(looked for cache= or "
        r"past_key_values=\)",
    ):
        generate_parity(reference, vision, inputs, infer_call(reference, inputs, "model"),
                        infer_call(reference, inputs, "model"), tmp_path, 2)  # fmt: skip


def test_generate_through_the_app_logs_steps_and_names_the_step(tmp_path):
    result, client = run_with(
        tmp_path,
        "generate.steps=3",
        "candidate.ports.llava.build._target_=tests.faulty.decode_bug_port",
        "+candidate.ports.llava.build.bug=mask",
    )
    assert result.exit_code == EXIT_FAIL
    run = client.get_run(result.run_id)
    tags = run.data.tags
    assert tags["paritylab.first_divergence"] == "step2/model.language_model.layers.0.self_attn"
    assert tags["paritylab.decode.first_failing_step"] == "2" and tags["paritylab.verdict"] == "fail"
    assert result.report.first_divergence is None  # the forward itself agrees
    history = MlflowClient(client.tracking_uri).get_metric_history(result.run_id, "decode/token_agreement")
    assert sorted(m.step for m in history) == [0, 1, 2, 3]
    max_abs = {m.step: m.value for m in client.get_metric_history(result.run_id, "decode/max_abs")}
    assert max_abs[0] < 1e-6 and max_abs[1] < 1e-6 and max_abs[2] > 1e-4
    decode = json.loads((result.directory / "report" / "decode.json").read_text())
    assert decode["summary"]["first_divergence"] == "step2/model.language_model.layers.0.self_attn"
    assert [s["verdict"] for s in decode["steps"]] == ["pass", "pass", "fail", "fail"]
    artifacts = {a.path for a in client.list_artifacts(result.run_id, "report")}
    assert {"report/decode.json", "report/decode_heatmap.svg"} <= artifacts
    assert (
        "at decode step 2 divergence starts at model.language_model.layers.0.self_attn" in tags["mlflow.note.content"]
    )
    assert tags["paritylab.first_operation"] == "step2/masked_fill .. softmax (2 operations)"
    assert decode["drilldown"]["candidate"] == "llm.layers.0.attention#0"
