"""Reading traces written by transformers' debugger, and writing its layout ourselves."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.model_debugging_utils import model_addition_debugger_context

import paritylab
from paritylab import Trace, TraceFormatError
from paritylab.tracing.debugger_format import OVERWRITTEN
from tests.tiny import tiny_llama, token_ids


def test_real_debugger_trace_reads_back_with_our_keys(tmp_path):
    model = tiny_llama()
    ids = token_ids()
    with model_addition_debugger_context(model, debug_path=str(tmp_path), do_prune_layers=False, use_repr=False):
        model(ids)
    theirs = Trace.load(tmp_path)
    with paritylab.trace(model, capture=None) as ours:
        out = model(ids)
    assert theirs.keys == ours.keys
    assert theirs.meta["format"] == "transformers-debugger"
    embed = theirs.call("model.embed_tokens#0")
    assert embed.outputs["shape"] == [1, 6, 16] and embed.outputs["dtype"] == "float32"
    torch.testing.assert_close(theirs.tensor(embed.outputs), model.model.embed_tokens(ids), rtol=0, atol=0)
    lm_head = theirs.call("lm_head#0")
    torch.testing.assert_close(theirs.tensor(lm_head.outputs), out.logits, rtol=0, atol=0)
    ours_stats = ours.call("lm_head#0").outputs["stats"]
    assert lm_head.outputs["stats"]["mean"] == pytest.approx(ours_stats["mean"], rel=1e-3, abs=1e-5)
    # the debugger drops non-leaf outputs
    assert theirs.call("model.layers.0#0").outputs is None


def test_repeated_module_values_are_not_misattributed(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    shared = model[0]

    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = shared

        def forward(self, x):
            return self.lin(self.lin(x))

    twice = Twice()
    with model_addition_debugger_context(twice, debug_path=str(tmp_path), do_prune_layers=False, use_repr=False):
        out = twice(torch.randn(1, 2))
    trace = Trace.load(tmp_path)
    assert trace.keys == ["#0", "lin#0", "lin#1"]
    assert trace.call("lin#0").outputs["skipped"] == OVERWRITTEN
    torch.testing.assert_close(trace.tensor(trace.call("lin#1").outputs), out)


def test_repr_traces_read_as_stats_only(tmp_path):
    model = tiny_llama()
    with model_addition_debugger_context(model, debug_path=str(tmp_path), do_prune_layers=False):
        model(token_ids())
    trace = Trace.load(tmp_path)
    node = trace.call("model.norm#0").outputs
    assert "ref" not in node and "repr" in node["skipped"]
    assert set(node["stats"]) == {"mean", "std", "min", "max", "absmax"}


def test_our_debugger_files_keep_non_leaf_outputs(tmp_path):
    model = tiny_llama()
    with paritylab.trace(model, tmp_path, save_tensors=True):
        model(token_ids())
    summary = json.loads(next(tmp_path.glob("*_debug_tree_SUMMARY.json")).read_text())
    assert summary["module_path"] == "LlamaForCausalLM"
    layer0 = next(c for c in summary["children"][0]["children"] if c["module_path"].endswith("layers.0"))
    assert layer0["outputs"]["shape"] == "torch.Size([1, 6, 16])"
    assert '"value":' not in json.dumps(summary)
    full = json.loads(next(tmp_path.glob("*_FULL_TENSORS.json")).read_text())
    assert full["children"][0]["outputs"]["last_hidden_state"]["value"].startswith("./tensors-00000.safetensors#t")
    (tmp_path / "trace.json").unlink()  # force the debugger-format reader on our own files
    reread = Trace.load(tmp_path)
    assert reread.call("model.layers.0#0").outputs["shape"] == [1, 6, 16]
    assert reread.tensor(reread.call("model.layers.0#0").outputs) is not None


def test_values_outside_the_directory_are_refused(tmp_path):
    secret = tmp_path / "secret.safetensors"
    secret.write_bytes(b"x")
    trace_dir = tmp_path / "trace"
    trace_dir.mkdir()
    tree = {"module_path": "M", "outputs": {"shape": "torch.Size([1])", "dtype": "torch.float32", "value": "../x"}}
    tree["outputs"]["value"] = "./../secret.safetensors"
    (trace_dir / "M_debug_tree_FULL_TENSORS.json").write_text(json.dumps(tree))
    with pytest.raises(TraceFormatError, match="outside the trace directory"):
        Trace.load(trace_dir)
