"""The memory plan: models sized on the meta device (7 B and 70 B Llama shapes, nothing allocated), a meta
forward's peak against a real one, checkpoint headers, and the plan's choices and refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_model
from torch import nn

from paritylab.run.budget import (
    Forward,
    _LiveBytes,
    checkpoint_sizes,
    measure_reference,
    meta_forward,
    model_sizes,
    plan,
)
from paritylab.run.errors import ConfigError
from paritylab.run.references import llama
from paritylab.run.resident import model_bytes, tensor_slots
from tests.test_runner import run_with

LLAMA_7B = dict(hidden_size=4096, layers=32, heads=32, kv_heads=32, intermediate_size=11008, vocab_size=32000)
LLAMA_70B = dict(hidden_size=8192, layers=80, heads=64, kv_heads=8, intermediate_size=28672, vocab_size=128256)
GiB = 2**30
H100_FREE = 79 * GiB  # what torch.cuda.mem_get_info reports free on an 80 GB H100 once a context exists
CUDA = torch.device("cuda")


def llama_parameters(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int) -> int:
    """LlamaForCausalLM's parameter count, by hand: embeddings and head untied, q/k/v/o, gate/up/down, 2 norms."""
    kv = hidden // heads * kv_heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * intermediate + 2 * hidden
    return 2 * vocab * hidden + layers * per_layer + hidden


def sized(shape: dict[str, int], tokens: int = 128) -> tuple[int, Forward]:
    model, sizes = measure_reference(lambda: llama(**shape))
    assert model is not None and sizes is not None and sizes.source == "meta"
    assert all(tensor.is_meta for tensor, _ in tensor_slots(model).values())  # nothing was allocated
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    forward = meta_forward(model, lambda m: m(input_ids=ids))
    assert forward is not None
    return sizes.total, forward


@pytest.fixture(scope="module")
def seven_b() -> tuple[int, Forward]:
    return sized(LLAMA_7B)


def test_a_7b_llama_is_sized_exactly_on_the_meta_device(seven_b):
    size, forward = seven_b
    parameters = llama_parameters(4096, 32, 32, 32, 11008, 32000)
    assert parameters == 6_738_415_616
    assert 0 <= size - 4 * parameters < 2**10  # the rest: the rotary inverse frequencies, a few hundred bytes
    # 128 tokens: the KV cache (32 layers x 2 x 128 x 4096 floats = 128 MiB) and the logits (15.6 MiB) stay alive
    assert 128 * 2**20 + 128 * 32000 * 4 <= forward.peak < 256 * 2**20
    assert forward.outputs > 32 * 128 * 4096 * 4 * 8  # every module's outputs: at least 8 per layer


def test_a_7b_fp32_reference_and_bf16_candidate_stay_resident_together_on_one_h100(seven_b):
    size, forward = seven_b
    chosen = plan(size, size // 2, forward, CUDA, H100_FREE, "auto")
    assert chosen.resident == "both"
    assert chosen.needed == size + size // 2 + forward.peak
    assert "memory plan on cuda (79.0 GiB free): reference 25.1 GiB, candidate 12.6 GiB" in chosen.describe()
    assert "both resident, needs 37.8 GiB" in chosen.describe()


def test_a_7b_fp32_port_takes_turns_on_a_40_gib_card_and_asking_for_both_is_refused(seven_b):
    size, forward = seven_b
    assert plan(size, size, forward, CUDA, 40 * GiB, "auto").resident == "one"
    with pytest.raises(ConfigError) as refused:
        plan(size, size, forward, CUDA, 40 * GiB, "both")
    message = str(refused.value)
    assert "\n" not in message
    assert "reference (25.1 GiB) and the candidate (25.1 GiB)" in message and "use resident=one" in message


def test_a_70b_fp32_reference_is_refused_on_one_gpu_before_anything_is_built():
    size, forward = sized(LLAMA_70B)
    parameters = llama_parameters(8192, 80, 64, 8, 28672, 128256)
    assert 0 <= size - 4 * parameters < 2**10 and size > 262 * GiB
    assert forward.peak < 256 * 2**20  # 128 tokens: the KV cache (8 key-value heads) and the logits
    with pytest.raises(ConfigError) as refused:
        plan(size, size // 2, forward, CUDA, H100_FREE, "auto")
    message = str(refused.value)
    assert message.startswith("the reference alone (262.8 GiB, with one forward 263.0 GiB) does not fit in the")
    assert "79.0 GiB free on cuda" in message and "dtype=bfloat16" in message and "candidate=tp" in message
    # a bf16 70B (131 GiB) is refused on one H100 too, and fits one at a time on a host with 192 GiB free
    with pytest.raises(ConfigError):
        plan(size // 2, size // 2, forward, CUDA, H100_FREE, "auto")
    assert plan(size // 2, size // 2, forward, torch.device("cpu"), 192 * GiB, "auto").resident == "one"


def test_unknown_free_memory_refuses_nothing():
    assert plan(10**15, 10**15, None, CUDA, None, "auto").resident == "both"


class Mlp(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(16, 1024), nn.ReLU(), nn.Linear(1024, 16))


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_one_forwards_peak_counts_the_tensors_alive_at_once_and_never_the_weights(device):
    with torch.device(device):
        model = Mlp()
    batch = torch.ones(4, 16, device=device)
    forward = meta_forward(model, lambda m: m(batch))
    # the first linear's output and the ReLU's are alive together; each output counts once (the Sequential
    # returns its last linear's)
    assert forward == Forward(peak=2 * 4 * 1024 * 4, outputs=2 * 4 * 1024 * 4 + 4 * 16 * 4)


def test_a_meta_forward_peak_equals_the_real_forwards():
    shape = dict(hidden_size=256, layers=3, heads=4, vocab_size=1000)
    meta, _ = measure_reference(lambda: llama(**shape))
    assert meta is not None
    ids = torch.arange(64).reshape(1, 64) % 1000
    planned = meta_forward(meta, lambda m: m(input_ids=ids.to("meta")))
    real = llama(**shape)
    counter = _LiveBytes(tensor for tensor, _ in tensor_slots(real).values())
    with torch.no_grad(), counter:
        real(input_ids=ids)
    # equal but for a few scalars the two devices make differently (a CPU position index): under 1 KiB of 1.3 MB
    assert planned is not None and counter.peak > 10**6 and abs(planned.peak - counter.peak) < 2**10


def test_a_forward_that_reads_a_value_is_unmeasured_not_an_error():
    class Reads(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * float(x.sum())

    assert meta_forward(Reads(), lambda m: m(torch.ones(3, device="meta"))) is None


def test_a_local_checkpoint_is_sized_from_its_headers(tmp_path):
    model = llama(hidden_size=64, layers=2, heads=4, vocab_size=100)
    save_model(model, str(tmp_path / "model.safetensors"))
    sizes = checkpoint_sizes(str(tmp_path))
    saved = sum(p.numel() * 4 for p in model.state_dict().values())  # persistent tensors only
    assert sizes is not None and sizes.by_dtype == {"float32": saved} and sizes.source == "checkpoint"
    assert sizes.cast(torch.bfloat16).by_dtype == {"bfloat16": saved // 2}
    assert checkpoint_sizes(str(tmp_path / "absent")) is None and checkpoint_sizes("org/model-on-the-hub") is None
    assert model_sizes(model).total == model_bytes(model)


def test_a_run_says_its_plan_and_its_peak(tmp_path):
    result, _ = run_with(tmp_path, "model=llama", "candidate=bf16", "tracking=off")
    assert result.exit_code == 0
    summary = json.loads((result.directory / "run.json").read_text())
    planned = summary["memory"]["plan"]
    reference = model_bytes(llama())  # the model=llama default: hidden 32, 2 layers, 4 heads, vocabulary 128
    assert planned["reference"] == reference and planned["candidate"] == reference // 2
    assert planned["resident"] == "both" and planned["device"] == "cpu" and planned["forward"] > 0
    assert summary["memory"]["peak"] > reference
    assert any(note.startswith("memory plan on cpu (") for note in result.notes)


def test_a_run_that_cannot_fit_is_refused_in_one_line_before_building(tmp_path, monkeypatch):
    import paritylab.run.runner as runner

    monkeypatch.setattr(runner, "available_memory", lambda device: 2**16)
    result, _ = run_with(tmp_path, "model=llama", "candidate=bf16", "tracking=off")
    assert result.exit_code == 2
    assert result.error is not None and result.error.startswith("the reference alone (")
    assert "does not fit in the 0.1 MiB free on cpu" in result.error and "\n" not in result.error
    seconds = json.loads((result.directory / "run.json").read_text())["seconds"]
    assert "build reference" not in seconds and "trace reference" not in seconds
    unchecked, _ = run_with(tmp_path, "model=llama", "candidate=bf16", "tracking=off", "memory_check=false")
    assert unchecked.exit_code == 0
