"""Streamed tensor storage: de-duplication, budget, shards, cast, provenance, failures."""

from __future__ import annotations

import errno
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import paritylab
from paritylab import Trace
from paritylab.tracing.storage import TensorStore


class Chain(nn.Module):
    """Each layer's output is the next one's input; ``shared`` is passed to every layer."""

    def __init__(self, width: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(width) for _ in range(depth)])

    def forward(self, x):
        shared = torch.ones(x.shape[-1])
        for layer in self.layers:
            x = layer(x, shared=shared)
        return x


class Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x, shared):
        return self.proj(x) * shared


def test_each_tensor_is_stored_once(tmp_path):
    model = Chain()
    x = torch.randn(2, 8)
    with paritylab.trace(model, tmp_path, save_tensors=True) as trace:
        model(x)
    refs = [node["ref"] for call in trace.calls for side in ("inputs", "outputs") for _, node in call.tensors(side)]
    # x, shared, then per layer: proj output and layer output (proj's input is the layer's input)
    assert len(set(refs)) == 2 + 2 * 4
    assert len(refs) > len(set(refs))
    layer1_input = trace.call("layers.1#0").inputs["items"]["args"]["items"][0]
    assert layer1_input["ref"] == trace.call("layers.0#0").outputs["ref"]
    stored = load_file(tmp_path / "tensors-00000.safetensors")
    assert len(stored) == len(set(refs))
    assert trace.meta["storage"]["bytes"] == sum(t.numel() * t.element_size() for t in stored.values())


class Bump(nn.Module):
    """An in-place module that says so, as torch's own in-place modules do."""

    inplace = True

    def forward(self, x):
        return x.add_(1)


@pytest.mark.parametrize("pending_bytes", [0, 1 << 20], ids=["synchronous", "background-writer"])
def test_in_place_change_is_stored_again(tmp_path, pending_bytes):
    model = nn.Sequential(nn.Linear(3, 3), Bump())
    with paritylab.trace(model, tmp_path, save_tensors=True, pending_bytes=pending_bytes) as trace:
        expected = model[0](torch.zeros(3))
        model(torch.zeros(3))
    loaded = Trace.load(tmp_path)
    bump = loaded.call("1#0")
    (_, before), (_, after) = bump.tensors("inputs") + bump.tensors("outputs")
    assert before["ref"] != after["ref"]
    torch.testing.assert_close(loaded.tensor(before), expected, rtol=0, atol=0)
    torch.testing.assert_close(loaded.tensor(after), expected + 1, rtol=0, atol=0)
    assert trace.call("1#0").outputs["stats"]["mean"] == pytest.approx((expected + 1).mean().item())


def test_byte_budget_stops_values_but_not_stats(tmp_path):
    model = Chain(width=16, depth=4)
    budget = 3 * 2 * 16 * 4  # room for three (2, 16) float32 tensors
    with paritylab.trace(model, tmp_path, save_tensors=True, max_bytes=budget) as trace:
        model(torch.randn(2, 16))
    nodes = [n for c in trace.calls for s in ("inputs", "outputs") for _, n in c.tensors(s)]
    saved = {n["ref"] for n in nodes if "ref" in n}
    skipped = [n for n in nodes if "skipped" in n]
    assert trace.meta["storage"]["bytes"] <= budget
    assert skipped and all("budget" in n["skipped"] for n in skipped)
    assert all("stats" in n for n in nodes)
    assert trace.meta["storage"]["skipped"] == len(skipped)
    assert len(saved) >= 3
    loaded = Trace.load(tmp_path)
    assert all(loaded.tensor(n) is None for n in skipped)


def test_shards_are_bounded_and_indexed(tmp_path):
    model = Chain(width=32, depth=6)
    shard_bytes = 2 * 32 * 4 * 3
    with paritylab.trace(model, tmp_path, save_tensors=True, shard_bytes=shard_bytes):
        out = model(torch.randn(2, 32))
    shards = sorted(tmp_path.glob("tensors-*.safetensors"))
    assert len(shards) >= 4
    assert all(s.stat().st_size - 8 - 256 * 1024 <= shard_bytes for s in shards)
    assert not list(tmp_path.glob("*.partial"))
    index = json.loads((tmp_path / "tensors.index.json").read_text())
    assert set(index["tensor_map"].values()) == {s.name for s in shards}
    loaded = Trace.load(tmp_path)
    torch.testing.assert_close(loaded.tensor(loaded.call("#0").outputs), out, rtol=0, atol=0)


def test_cast_and_provenance(tmp_path):
    model = nn.Linear(4, 4).to(torch.bfloat16)
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    with paritylab.trace(model, tmp_path, save_tensors=True, save_dtype=torch.float32, metadata={"seed": 3}) as t:
        out = model(x)
    assert t.calls[0].outputs["dtype"] == "bfloat16"  # the record keeps the model's dtype
    with safe_open(str(tmp_path / "tensors-00000.safetensors"), "pt") as handle:
        meta = handle.metadata()
        value = handle.get_tensor(t.calls[0].outputs["ref"])
    assert value.dtype == torch.float32
    torch.testing.assert_close(value, out.float(), rtol=0, atol=0)
    assert meta["torch_version"] == torch.__version__
    assert meta["model_class"] == "Linear" and meta["device"] == "cpu" and meta["seed"] == "3"
    assert meta["saved_dtype"] == "float32"


def test_tensors_are_streamed_during_the_forward(tmp_path):
    seen: list[bytes] = []
    header = 8 + 256 * 1024

    class Probe(nn.Module):
        def forward(self, x):
            (partial,) = tmp_path.glob("*.partial")
            with open(partial, "rb") as handle:
                handle.seek(header)
                seen.append(handle.read(2 * x.numel() * 4))
            return x * 2

    model = nn.Sequential(nn.Linear(64, 64), Probe())
    x = torch.randn(16, 64)
    options = paritylab.TraceOptions(save_tensors=True, pending_bytes=0)
    with paritylab.tracing.tracer.Tracer(model, tmp_path, options):
        model(x)
    hidden = model[0](x).detach()
    assert seen == [x.numpy().tobytes() + hidden.numpy().tobytes()]  # input and first output already on disk


def test_disk_error_keeps_whole_tensors_and_leaves_no_corrupt_file(tmp_path, monkeypatch):
    import paritylab.tracing.storage as storage

    writes = {"n": 0}
    real_write_all = storage._write_all

    def failing_write_all(handle, data):
        writes["n"] += 1
        if writes["n"] == 5:  # header placeholder, then 3 tensors succeed, the 4th hits a full disk
            half = data[: len(data) // 2]
            real_write_all(handle, half)
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write_all(handle, data)

    monkeypatch.setattr(storage, "_write_all", failing_write_all)
    model = Chain(width=8, depth=3)
    with paritylab.trace(model, tmp_path, save_tensors=True) as trace:
        out = model(torch.randn(2, 8))
    monkeypatch.setattr(storage, "_write_all", real_write_all)
    assert trace.meta["storage"]["failure"] == "disk error: No space left on device"
    nodes = [n for c in trace.calls for s in ("inputs", "outputs") for _, n in c.tensors(s)]
    assert {n["ref"] for n in nodes if "ref" in n} == {"t0", "t1", "t2"}
    assert any(n.get("skipped", "").startswith("disk error") for n in nodes)
    assert all("stats" in n for n in nodes)
    assert trace.call("#0").outputs["stats"]["mean"] == pytest.approx(out.mean().item(), abs=1e-6)
    assert not list(tmp_path.glob("*.partial"))
    assert len(load_file(tmp_path / "tensors-00000.safetensors")) == 3


def test_a_nearly_full_disk_still_stores_what_fits(tmp_path, monkeypatch):
    """Shards reserve 64 MiB ahead; on a disk with less free than that (here: 1 MiB), they reserve only what
    each tensor needs, so a small trace is stored whole instead of losing every tensor."""
    import os

    free = {"bytes": 1 << 20}
    real = os.posix_fallocate

    def small_disk(fd, offset, length):
        if length > free["bytes"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        free["bytes"] -= length
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", small_disk)
    model = Chain(width=8, depth=3)
    with paritylab.trace(model, tmp_path, save_tensors=True) as trace:
        model(torch.randn(2, 8))
    assert trace.meta["storage"]["failure"] is None and trace.meta["storage"]["skipped"] == 0
    nodes = [n for c in trace.calls for s in ("inputs", "outputs") for _, n in c.tensors(s)]
    assert nodes and all("ref" in n for n in nodes)
    assert free["bytes"] < 1 << 20  # it did reserve, just no more than fits


def test_store_reports_unsupported_dtype(tmp_path):
    store = TensorStore(tmp_path)
    ref, reason = store.put(torch.zeros(2, dtype=torch.complex64), "c")
    assert ref is None and "complex64" in reason
    store.close()
    assert not list(tmp_path.iterdir())


def test_tensor_changed_in_place_before_its_write_is_not_stored_wrong(tmp_path, monkeypatch):
    import threading

    import paritylab.tracing.storage as storage

    release = threading.Event()
    real_write_all = storage._write_all
    first_tensor = {"seen": False}

    def slow_write_all(handle, data):
        if len(data) == 16 and not first_tensor["seen"]:
            first_tensor["seen"] = True
            release.wait(timeout=10)
        real_write_all(handle, data)

    monkeypatch.setattr(storage, "_write_all", slow_write_all)
    store = TensorStore(tmp_path)
    assert store.put(torch.ones(4), "a") == ("a", None)
    changed = torch.zeros(4)
    assert store.put(changed, "b") == ("b", None)
    changed.add_(1)  # the writer is still busy with "a"
    release.set()
    store.close()
    assert store.files == {"a": "tensors-00000.safetensors"}
    assert store.skipped == {"b": "modified in place before it was written"}
    assert load_file(tmp_path / "tensors-00000.safetensors")["a"].tolist() == [1.0] * 4


def test_host_copy_path_for_device_tensors_writes_the_same_bytes(tmp_path):
    """The accelerator path (asynchronous copy into host memory, written by the writer thread) on CPU."""
    from paritylab.tracing.storage import _device_to_host

    tensors = {f"x{i}": torch.randn(64, 33) * i for i in range(5)}
    store = TensorStore(tmp_path, pending_bytes=1 << 20)
    for name, tensor in tensors.items():
        pending = _device_to_host(tensor, name)
        assert pending.data.data_ptr() != tensor.data_ptr() and pending.ready is None
        store._enqueue(pending)
    store.close()
    loaded = load_file(tmp_path / store.files["x0"])
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], v) for k, v in tensors.items())
