"""Arguments of any type reach the forward as they were given, through every cast and copy a run makes: a
``ModelOutput`` passed as ``encoder_outputs`` is still one (transformers indexes it by position), a named tuple keeps
its fields, a dataclass stays a dataclass."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutput

from paritylab.reports.render import headline
from paritylab.run.lifting import cast_call
from paritylab.run.parity import check
from paritylab.tracing.values import map_tensors


class Pair(NamedTuple):
    hidden: torch.Tensor
    steps: int


@dataclasses.dataclass
class Box:
    hidden: torch.Tensor
    label: str = "x"


class Decoder(nn.Module):
    """Reads its encoder's output by position, as transformers' encoder-decoders do."""

    def __init__(self) -> None:
        super().__init__()
        self.cross = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, encoder_outputs: BaseModelOutput, extra: Pair, box: Box) -> torch.Tensor:
        memory = encoder_outputs[0] + extra.hidden * extra.steps + box.hidden
        return self.head(torch.tanh(self.cross(memory)))


def arguments() -> dict[str, object]:
    generator = torch.Generator().manual_seed(0)
    return {
        "encoder_outputs": BaseModelOutput(last_hidden_state=torch.randn(2, 5, 8, generator=generator)),
        "extra": Pair(torch.randn(2, 5, 8, generator=generator), 2),
        "box": Box(torch.randn(2, 5, 8, generator=generator)),
    }


def test_map_tensors_keeps_every_container_type():
    given = arguments()
    mapped = map_tensors(given, lambda tensor, _: tensor.to(torch.bfloat16))
    assert isinstance(mapped["encoder_outputs"], BaseModelOutput)
    assert mapped["encoder_outputs"][0].dtype == torch.bfloat16
    assert mapped["encoder_outputs"].last_hidden_state is mapped["encoder_outputs"][0]
    assert isinstance(mapped["extra"], Pair) and mapped["extra"].steps == 2
    assert isinstance(mapped["box"], Box) and mapped["box"].label == "x"
    assert mapped["box"].hidden.dtype == torch.bfloat16
    assert given["encoder_outputs"][0].dtype == torch.float32  # the caller's arguments are left as they were


def test_a_cast_call_hands_a_model_output_on_as_one():
    seen: list[object] = []

    class Probe(nn.Module):
        def forward(self, encoder_outputs: BaseModelOutput) -> torch.Tensor:
            seen.append(type(encoder_outputs))
            return encoder_outputs[0]

    call = cast_call(lambda model: model(encoder_outputs=arguments()["encoder_outputs"]), torch.bfloat16)
    assert call(Probe()).dtype == torch.bfloat16
    assert seen == [BaseModelOutput]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_model_output_argument_survives_a_low_precision_run(tmp_path, dtype):
    torch.manual_seed(0)
    reference = Decoder()
    candidate = Decoder()
    candidate.load_state_dict(reference.state_dict())
    candidate = candidate.to(dtype)
    given = arguments()

    def call(model: nn.Module) -> torch.Tensor:
        low = next(model.parameters()).dtype
        return model(**map_tensors(given, lambda tensor, _: tensor.to(low)))

    report = check(reference, candidate, tmp_path, reference_call=call).report
    assert report.verdict == "pass", headline(report)
