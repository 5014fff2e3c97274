"""The tracer on one tiny module per edge case: exact call keys and recorded values."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

import paritylab
from paritylab import CaptureSpec, Trace
from paritylab.tracing.stats import STAT_NAMES
from tests.helpers import traced


def keys(trace: Trace) -> list[str]:
    return [call.key for call in trace.calls]


def hook_count(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._forward_hooks_always_called) for m in model.modules()
    )


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.heads = nn.ModuleDict({"a": nn.Linear(4, 2), "b": nn.Linear(4, 3)})

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.heads["a"](x), self.heads["b"](x)


def test_module_list_and_dict_in_execution_order():
    model = Stack()
    with paritylab.trace(model) as trace:
        model(torch.randn(2, 4))
    assert keys(trace) == ["#0", "blocks.0#0", "blocks.1#0", "heads.a#0", "heads.b#0"]
    assert [c.parent for c in trace.calls] == [None, 0, 0, 0, 0]
    assert [c.depth for c in trace.calls] == [0, 1, 1, 1, 1]
    assert trace.calls[3].cls == "Linear"
    assert [slot for slot, _ in trace.calls[0].tensors("outputs")] == ["outputs.0", "outputs.1"]


class Shared(nn.Module):
    """One module used twice, and a child called in a loop."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 3)
        self.act = nn.Tanh()

    def forward(self, x):
        x = self.proj(x)
        for _ in range(3):
            x = self.act(x)
        return self.proj(x)


def test_repeated_calls_get_distinct_keys():
    model = Shared()
    x = torch.randn(2, 3)
    with paritylab.trace(model) as trace:
        out = model(x)
    assert keys(trace) == ["#0", "proj#0", "act#0", "act#1", "act#2", "proj#1"]
    first, second = trace.call("proj#0"), trace.call("proj#1")
    expected_first = model.proj(x)
    assert first.outputs["stats"]["mean"] == pytest.approx(expected_first.mean().item(), abs=1e-6)
    assert second.outputs["stats"]["mean"] == pytest.approx(out.mean().item(), abs=1e-6)


@dataclasses.dataclass
class Pair:
    left: torch.Tensor
    right: torch.Tensor | None


class Structured(nn.Module):
    def forward(self, x, *, scale: float, mask=None):
        return {"sum": x * scale, "parts": (x, [x.t()])}, Pair(x + 1, None)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Structured()

    def forward(self, x):
        result, pair = self.inner(x=x, scale=2.0, mask=None)
        return result["sum"] + pair.left


def test_nested_outputs_and_kwargs_only_inputs():
    model = Outer()
    with paritylab.trace(model) as trace:
        model(torch.ones(2, 3))
    inner = trace.call("inner#0")
    assert inner.inputs["items"]["args"] == {"t": "tuple", "items": []}
    kwargs = inner.inputs["items"]["kwargs"]["items"]
    assert kwargs["scale"] == {"t": "scalar", "v": 2.0}
    assert kwargs["mask"] == {"t": "none"}
    assert kwargs["x"]["shape"] == [2, 3]
    slots = [slot for slot, _ in inner.tensors("outputs")]
    assert slots == ["outputs.0.sum", "outputs.0.parts.0", "outputs.0.parts.1.0", "outputs.1.left"]
    pair = inner.outputs["items"][1]
    assert pair["type"] == "Pair" and pair["items"]["right"] == {"t": "none"}
    assert inner.outputs["items"][0]["items"]["parts"]["items"][1]["t"] == "list"
    assert dict(inner.tensors("outputs"))["outputs.0.sum"]["stats"]["mean"] == 2.0
    assert dict(inner.tensors("outputs"))["outputs.1.left"]["stats"]["mean"] == 2.0


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        y = x * 1.0
        return self.relu(y)


def test_in_place_module_records_input_before_and_output_after(tmp_path):
    model = InPlace()
    x = torch.tensor([[-1.0, 2.0], [3.0, -4.0]])
    with paritylab.trace(model, tmp_path, save_tensors=True) as trace:
        model(x)
    relu = trace.call("relu#0")
    ((_, before),) = relu.tensors("inputs")
    ((_, after),) = relu.tensors("outputs")
    assert before["stats"]["min"] == -4.0 and after["stats"]["min"] == 0.0
    loaded = Trace.load(tmp_path)
    torch.testing.assert_close(loaded.tensor(before), x, rtol=0, atol=0)
    torch.testing.assert_close(loaded.tensor(after), x.clamp(min=0), rtol=0, atol=0)


class Transposer(nn.Module):
    def forward(self, x):
        return x.t()[:, ::2]


def test_non_contiguous_output_saved_with_its_values(tmp_path):
    model = Transposer()
    x = torch.arange(24.0).reshape(4, 6)
    with paritylab.trace(model, tmp_path, save_tensors=True) as trace:
        out = model(x)
    assert not out.is_contiguous()
    node = trace.calls[0].outputs
    assert node["shape"] == [6, 2]
    torch.testing.assert_close(Trace.load(tmp_path).tensor(node), out, rtol=0, atol=0)


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.low = nn.Linear(4, 4).to(torch.bfloat16)
        self.full = nn.Linear(4, 4)

    def forward(self, x):
        return self.full(self.low(x.to(torch.bfloat16)).float())


def test_tensors_of_other_dtypes_keep_their_dtype(tmp_path):
    model = Mixed()
    with paritylab.trace(model, tmp_path, save_tensors=True) as trace:
        model(torch.randn(2, 4))
    half = trace.call("low#0")
    assert half.outputs["dtype"] == "bfloat16"
    assert trace.call("full#0").outputs["dtype"] == "float32"
    value = Trace.load(tmp_path).tensor(half.outputs)
    assert value.dtype == torch.bfloat16
    assert half.outputs["stats"]["mean"] == pytest.approx(value.float().mean().item(), rel=1e-5)


class Exploding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(2, 2)
        self.bad = nn.Linear(3, 3)
        self.never = nn.Linear(2, 2)

    def forward(self, x):
        return self.never(self.bad(self.first(x)))


def test_forward_that_raises_keeps_partial_trace_and_removes_hooks(tmp_path):
    model = Exploding()
    x = torch.randn(1, 2)
    with pytest.raises(RuntimeError), paritylab.trace(model, tmp_path, save_tensors=True) as trace:
        model(x)
    assert hook_count(model) == 0
    assert keys(trace) == ["#0", "first#0", "bad#0"]
    assert trace.meta["status"] == "error"
    assert trace.meta["error"]["module"] == "bad"
    assert trace.meta["error"]["type"] == "RuntimeError"
    assert trace.call("bad#0").error.startswith("RuntimeError")
    assert trace.meta["modules_not_called"] == ["never"]
    saved = Trace.load(tmp_path)
    assert keys(saved) == keys(trace)
    assert saved.meta["error"]["module"] == "bad"
    with torch.no_grad():
        expected = model.first(x)
    torch.testing.assert_close(saved.tensor(saved.call("first#0").outputs), expected, rtol=0, atol=0)


def test_traced_forward_is_bit_identical_and_leaves_no_state():
    from tests.tiny import tiny_llama, token_ids

    model = tiny_llama()
    ids = token_ids()
    before_attrs = {name: set(vars(m)) for name, m in model.named_modules()}
    plain = model(ids).logits
    with paritylab.trace(model, capture="auto") as trace:
        traced = model(ids).logits
    assert torch.equal(plain, traced)
    assert hook_count(model) == 0
    assert {name: set(vars(m)) for name, m in model.named_modules()} == before_attrs
    assert torch.is_grad_enabled()
    assert len(trace.calls) > 20


def test_no_grad_by_default_with_opt_out():
    model = nn.Linear(2, 2)
    with paritylab.trace(model):
        assert model(torch.randn(1, 2)).requires_grad is False
    with paritylab.trace(model, grad=True):
        assert model(torch.randn(1, 2)).requires_grad is True


def test_stats_match_torch():
    model = nn.Identity()
    x = torch.tensor([[1.0, -3.0], [float("nan"), float("inf")], [2.0, float("-inf")]])
    y = torch.randn(5, 7)
    with paritylab.trace(model) as trace:
        model(x)
        model(y)
    special = trace.calls[0].outputs["stats"]
    assert special["nan"] == 1 and special["inf"] == 2
    assert (special["mean"], special["min"], special["max"]) == (0.0, -3.0, 2.0)  # over the finite values
    stats = trace.calls[1].outputs["stats"]
    assert list(stats) == list(STAT_NAMES)
    assert stats["mean"] == pytest.approx(y.mean().item(), abs=1e-6)
    assert stats["std"] == pytest.approx(y.std(correction=0).item(), rel=1e-5)
    assert stats["min"] == y.min().item() and stats["max"] == y.max().item()
    assert stats["absmax"] == y.abs().max().item()
    assert stats["norm"] == pytest.approx(y.norm().item(), rel=1e-5)
    assert stats["nan"] == 0 and stats["inf"] == 0
    huge = torch.full((4,), 1e30)
    with paritylab.trace(model) as trace:
        model(huge)
    assert trace.calls[0].outputs["stats"]["norm"] == pytest.approx(2e30, rel=1e-6)  # float32 squares overflow


def test_selection_by_pattern_depth_and_side():
    model = Stack()
    with paritylab.trace(model, include=["blocks.*"]) as trace:
        model(torch.randn(1, 4))
    assert keys(trace) == ["blocks.0#0", "blocks.1#0"]
    assert [c.parent for c in trace.calls] == [None, None]
    with paritylab.trace(model, exclude=["heads.*"], max_depth=2, inputs=False) as trace:
        model(torch.randn(1, 4))
    assert keys(trace) == ["#0", "blocks.0#0", "blocks.1#0"]
    assert all(c.inputs is None and c.outputs is not None for c in trace.calls)
    with paritylab.trace(model, max_depth=0, outputs=False) as trace:
        model(torch.randn(1, 4))
    assert keys(trace) == ["#0"] and trace.calls[0].outputs is None


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.crossattention = Attention()

    def forward(self, x):
        return self.crossattention(self.attn(x)[0])[0] + 1, "extra"


class Attention(nn.Module):
    def forward(self, x):
        return x * 2, x.sum(-1)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)[0]
        return x


def test_named_capture_by_class_suffix_layer_name_and_index(tmp_path):
    model = Net()
    specs = [
        CaptureSpec("hidden_states", Block, index=0),
        CaptureSpec("attentions", "Attention", index=1, layer_name="attn"),
        CaptureSpec("cross_attentions", Attention, index=1, layer_name="crossattention"),
    ]
    x = torch.ones(2, 3)
    with paritylab.trace(model, tmp_path, capture=specs) as trace:
        out = model(x)
    captured = trace.captured
    assert [len(captured[name]) for name in ("hidden_states", "attentions", "cross_attentions")] == [2, 2, 2]
    torch.testing.assert_close(captured["hidden_states"][1], out)
    torch.testing.assert_close(captured["hidden_states"][0], x * 4 + 1)
    torch.testing.assert_close(captured["attentions"][0], x.sum(-1))
    torch.testing.assert_close(captured["cross_attentions"][1], (x * 4 + 1).sum(-1) * 2)
    assert [e["call"] for e in trace.captures["attentions"]] == ["layers.0.attn#0", "layers.1.attn#0"]
    assert trace.captures["hidden_states"][0]["slot"] == "outputs.0"
    reloaded = Trace.load(tmp_path).captured  # saved with the trace even without save_tensors
    torch.testing.assert_close(reloaded["cross_attentions"][1], captured["cross_attentions"][1])


def test_capture_specs_derived_from_transformers_model():
    from tests.tiny import tiny_llama, token_ids

    model = tiny_llama()
    model.config._attn_implementation = "eager"
    with paritylab.trace(model, capture="auto") as trace:
        out = model(token_ids(), output_hidden_states=True)
    captured = trace.captured
    assert sorted(captured) == ["model.attentions", "model.hidden_states"]
    assert len(captured["model.hidden_states"]) == 2 and len(captured["model.attentions"]) == 2
    # transformers prepends the embeddings and replaces the last entry by the normed output
    torch.testing.assert_close(captured["model.hidden_states"][0], out.hidden_states[1])
    assert captured["model.attentions"][0].shape == (1, 2, 6, 6)


def test_round_trip_save_load(tmp_path):
    model = Stack()
    x = torch.randn(3, 4)
    with paritylab.trace(model, tmp_path, save_tensors=True, metadata={"seed": 7}) as trace:
        _, out_b = model(x)
    loaded = Trace.load(tmp_path)
    assert [c.to_json() for c in loaded.calls] == [c.to_json() for c in trace.calls]
    torch.testing.assert_close(loaded.tensor(loaded.call("heads.b#0").outputs), out_b, rtol=0, atol=0)
    torch.testing.assert_close(loaded.tensor(loaded.call("#0").inputs["items"]["args"]["items"][0]), x)
    assert loaded.meta["seed"] == "7" and loaded.meta["model_class"] == "Stack"
    document = json.loads((tmp_path / "trace.json").read_text())
    assert document["schema_version"] == 1
    index = json.loads((tmp_path / "tensors.index.json").read_text())
    ref = index["slot_map"]["heads.b#0/outputs"]
    assert index["tensor_map"][ref] == "tensors-00000.safetensors"


def test_device_stats_path_agrees_with_the_cpu_path():
    """The accelerator path (tensors staged into buffers, reduced many at once, fetched once) run on CPU tensors."""
    from paritylab.tracing.stats import StatsBatch, cpu_stats, stats_dict

    torch.manual_seed(0)
    finite = torch.randn(3, 1000) * 5 + 2
    batch = StatsBatch(staged=True)
    tensors = [finite, torch.tensor([1.0, float("nan"), float("inf")]), finite.bfloat16(), finite.double()]
    assert [batch.add(tensor) for tensor in tensors] == [0, 1, 2, 3]
    resolved = batch.resolve()
    expected = stats_dict(cpu_stats(finite))
    assert resolved[0] == pytest.approx(expected, rel=1e-6)
    assert resolved[1]["nan"] == 1 and resolved[1]["inf"] == 1  # counted on the device; NaN propagates
    assert resolved[1]["mean"] is None and resolved[1]["absmax"] is None
    assert resolved[2] == pytest.approx(stats_dict(cpu_stats(finite.bfloat16())), rel=1e-6)
    assert resolved[3] == pytest.approx(expected, rel=1e-6)
    assert len(batch) == 0 and batch.resolve() == []  # resolving empties the batch


def test_staged_stats_span_buffers_and_snapshot_their_tensors():
    """Tensors staged across several small buffers, one too large to stage, non-contiguous and integer ones: every
    row equals the CPU path's, in the order added, and a change in place after ``add`` does not reach the stats."""
    from paritylab.tracing.stats import StatsBatch, cpu_stats, stats_dict

    torch.manual_seed(1)
    tensors = [
        torch.randn(100),
        torch.randn(40, 30).t(),  # not contiguous
        torch.randn(5000) * 3 - 1,  # larger than a buffer: its own reduction
        torch.arange(-50, 250).reshape(3, 100),
        torch.randn(700).half(),
        torch.randn(2, 3, 4, dtype=torch.float64),
        torch.tensor(2.5),
    ]
    batch = StatsBatch(staged=True, staging_bytes=4096)
    rows = [batch.add(tensor) for tensor in tensors]
    expected = [stats_dict(cpu_stats(tensor)) for tensor in tensors]
    tensors[0].add_(100)  # after add: the staged copy keeps the values it had
    resolved = batch.resolve()
    assert rows == list(range(len(tensors)))
    for got, want in zip(resolved, expected, strict=True):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-9)


def test_a_trace_with_staged_stats_records_what_the_cpu_path_records(monkeypatch):
    """The accelerator path inside a traced forward, on the CPU: a ReLU(inplace=True) changes its input after the
    input was staged, and the staged copy keeps the values it was recorded with."""
    import functools

    import paritylab.tracing.tracer as tracer
    from paritylab.tracing.stats import StatsBatch

    def stats_of(model: nn.Module, x: torch.Tensor) -> list[dict[str, float | None]]:
        with paritylab.trace(model) as trace:
            model(x)
        return [
            node["stats"] for call in trace.calls for side in ("inputs", "outputs") for _, node in call.tensors(side)
        ]

    torch.manual_seed(0)
    cases = [(InPlace(), torch.tensor([[-1.0, 2.0], [3.0, -4.0]])), (Stack(), torch.randn(5, 4))]
    expected = [stats_of(model, x) for model, x in cases]
    monkeypatch.setattr(tracer, "StatsBatch", functools.partial(StatsBatch, staged=True, staging_bytes=64))
    staged = [stats_of(model, x) for model, x in cases]
    assert [len(rows) for rows in staged] == [len(rows) for rows in expected] == [4, 11]
    for got, want in zip(staged, expected, strict=True):
        for row, wanted in zip(got, want, strict=True):
            assert row == pytest.approx(wanted, rel=1e-6, abs=1e-9)
    assert staged[0][2]["min"] == -4.0 and staged[0][3]["min"] == 0.0  # relu's input before, its output after


class _Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.same = nn.Identity()
        self.drop = nn.Dropout(0.5)
        self.relu = nn.ReLU(inplace=True)
        self.last = nn.Linear(4, 4)

    def forward(self, x):
        return self.last(self.relu(self.drop(self.same(self.first(x)))))


def test_identity_calls_and_dataflow_links(tmp_path):
    model = _Chain().eval()
    trace = traced(model, lambda m: m(torch.randn(2, 4)), tmp_path)
    calls = {call.path: call for call in trace.calls}
    assert calls["same"].identity and calls["drop"].identity  # returned their input unchanged
    assert not calls["relu"].identity  # returned its input, but modified in place
    assert not calls["first"].identity and not calls["last"].identity
    from paritylab.tracing.values import iter_tensors

    def producer(path: str) -> int | None:
        return next(node for _, node in iter_tensors(calls[path].inputs, "inputs")).get("from")

    assert producer("same") == calls["first"].index  # each input points back to the call that produced it
    assert producer("relu") == calls["first"].index  # through the identity calls
