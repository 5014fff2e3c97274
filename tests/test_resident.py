"""resident=one: traced models' weights move to memory-mapped files; results are unchanged."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from paritylab.run.resident import offload
from tests.faulty import scaled_port
from tests.test_runner import run_with

BUILT_FROM: list[str | None] = []


def mapped_file(tensor: torch.Tensor) -> str | None:
    """The file whose mapping holds ``tensor``'s data, or ``None`` for process memory."""
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        low, high = (int(value, 16) for value in fields[0].split("-"))
        if low <= address < high:
            path = fields[5] if len(fields) > 5 else ""
            return path if path.startswith("/") else None  # anonymous, [heap], [stack]: process memory
    return None


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.LayerNorm(16)
        self.norm.weight.requires_grad_(False)
        self.register_buffer("mask", torch.arange(16) % 3 == 0, persistent=False)
        self.scale = torch.full((16,), 0.5, dtype=torch.float64)  # a plain tensor attribute

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(self.embed(ids)) * self.mask
        hidden = hidden * self.scale.to(hidden.dtype)
        return self.head(hidden)


def test_offload_maps_every_tensor_and_keeps_ties_flags_and_outputs(tmp_path):
    torch.manual_seed(0)
    model = Tied().eval()
    ids = torch.arange(10).unsqueeze(0)
    before = model(ids)
    moved = offload(model, tmp_path)
    assert moved == (50 * 16 + 16 + 16) * 4 + 16 + 16 * 8
    assert model.head.weight is model.embed.weight and isinstance(model.head.weight, nn.Parameter)
    assert model.norm.weight.requires_grad is False and model.norm.bias.requires_grad is True
    for tensor in (model.embed.weight, model.norm.bias, model.mask, model.scale):
        assert mapped_file(tensor) == str(tmp_path / "weights-00000.safetensors")
    assert torch.equal(model(ids), before)
    with torch.no_grad():
        model.norm.bias.add_(1.0)  # copy-on-write: the model changes, the file does not
    again = Tied()
    offload(again, tmp_path / "again")
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "weights-00000.safetensors")["norm.bias"], before.new_zeros(16))


def test_offload_leaves_tensor_subclasses_and_complex_tensors_in_memory(tmp_path):
    class Tagged(nn.Parameter):
        """A parameter subclass carrying state, as quantized parameters do."""

    model = nn.Linear(4, 4)
    model.weight = Tagged(model.weight.detach().clone())
    model.register_buffer("phase", torch.ones(3, dtype=torch.complex64))
    weight, phase = model.weight, model.phase
    assert offload(model, tmp_path) == 4 * 4  # the bias alone
    assert model.weight is weight and model.phase is phase
    assert mapped_file(model.bias) is not None and mapped_file(model.weight) is None


def test_offload_returns_the_weights_memory_to_the_os(tmp_path):
    probe = textwrap.dedent(f"""
        import torch
        from paritylab.run.resident import offload, release_freed_memory
        anon = lambda: int(next(l for l in open("/proc/self/status") if l.startswith("RssAnon:")).split()[1]) * 1024
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(48)])  # 192 MiB
        before = anon()
        moved = offload(model, {str(tmp_path)!r})
        release_freed_memory()
        model(torch.ones(1, 1024))
        print(moved, before - anon())
    """)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    moved, freed = (int(value) for value in result.stdout.split())
    assert moved > 190 * 2**20
    assert freed > 0.9 * moved, (moved, freed)


def recording_port(reference: nn.Module, **planted: str) -> nn.Module:
    """The planted-bug port, noting where the reference's weights were when the candidate was built."""
    BUILT_FROM.append(mapped_file(next(reference.parameters())))
    return scaled_port(reference, **planted)


def test_resident_one_maps_the_reference_before_the_candidate_and_changes_no_result(tmp_path):
    planted = ("+candidate.ports.llava.build.module=llm.layers.1.attention.wo",)
    target = "candidate.ports.llava.build._target_=tests.test_resident.recording_port"
    both, _ = run_with(tmp_path / "both", target, *planted, "resident=both")
    one, client = run_with(tmp_path / "one", target, *planted, "resident=one")
    assert BUILT_FROM[0] is None and BUILT_FROM[1].endswith("weights-00000.safetensors")
    assert ".resident/reference" in BUILT_FROM[1]
    assert [(r.path, r.rel_l2, r.verdict) for r in one.report.rows] == [
        (r.path, r.rel_l2, r.verdict) for r in both.report.rows
    ]
    assert [r.path for r in one.report.replay_origins] == ["model.language_model.layers.1.self_attn.o_proj"]
    assert [r.path for r in both.report.replay_origins] == ["model.language_model.layers.1.self_attn.o_proj"]
    notes = client.get_run(one.run_id).data.tags["mlflow.note.content"]
    assert "resident=one: reference weights" in notes and "resident=one: candidate weights" in notes
    assert not (one.directory / ".resident").exists()


def test_offload_on_a_full_disk_raises_and_leaves_the_model_untouched(tmp_path, monkeypatch):
    import errno

    import paritylab.tracing.storage as storage

    def full_disk(handle, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    model = Tied()
    weight = model.embed.weight
    monkeypatch.setattr(storage, "_write_all", full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        offload(model, tmp_path)
    assert model.embed.weight is weight and mapped_file(weight) is None


def test_converted_copy_equals_deepcopy_then_cast_and_keeps_ties():
    import copy

    from paritylab.run.resident import converted_copy

    torch.manual_seed(0)
    model = Tied().eval()
    ids = torch.arange(10).unsqueeze(0)
    converted = converted_copy(model, torch.bfloat16)
    assert torch.equal(converted(ids.clone()), copy.deepcopy(model).to(torch.bfloat16)(ids))
    assert converted.head.weight is converted.embed.weight and converted.embed.weight.dtype == torch.bfloat16
    assert converted.mask.dtype == torch.bool and converted.norm.weight.requires_grad is False
    assert converted.embed.weight.data_ptr() != model.embed.weight.data_ptr()
    assert model.embed.weight.dtype == torch.float32  # the original is untouched
    assert converted.scale.dtype == torch.float64 and converted.scale is not model.scale  # attributes: as Module.to


def test_run_goes_on_with_the_model_in_memory_when_its_weights_cannot_be_moved(tmp_path, monkeypatch):
    import paritylab.run.runner

    def full_disk(model, directory):
        raise OSError(f"could not move the model's weights to {directory}: disk error: No space left on device")

    monkeypatch.setattr(paritylab.run.runner, "offload", full_disk)
    result, _ = run_with(tmp_path, "resident=one", "compare.replay=false")
    assert result.exit_code == 0 and result.report.passed
    assert any(n.startswith("resident=one: reference weights kept in memory: could not move") for n in result.notes)
