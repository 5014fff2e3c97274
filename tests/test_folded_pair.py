"""transformers' ResNet against an inference port with every batch norm folded into the convolution before it
(``tests/folded_port.py``): one module computes what a convolution and its norm compute, with weights equal to none of
the reference's. The clean basic pair and planted outputs are in ``tests/test_pairs.py`` with every other pair; here
are the bottleneck layout, the bugs a folding conversion makes (the scale divided by the variance, the mean left out
of the bias) in fp32 and bf16, what the weight ledger reads from the fingerprints alone, and the port's tuple of
outputs against the reference's ``ModelOutput``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paritylab.comparison.weights._folds import fold_fit, running_norm
from paritylab.reports.render import headline
from paritylab.run.parity import check
from paritylab.tracing.structure import fingerprint
from tests.folded_port import from_resnet
from tests.pairs import PairCase, folded_resnet

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def _run(case: PairCase, tmp_path):
    return check(
        case.reference, case.candidate, tmp_path, reference_call=case.reference_call,
        candidate_call=case.candidate_call, cast_inputs=case.cast_inputs, echo=None,
    )  # fmt: skip


def _with(case: PairCase, candidate: nn.Module, dtype: torch.dtype) -> PairCase:
    """The pair with another candidate (at the pair's precision: its call casts the images to it)."""
    return PairCase(
        case.name, case.reference, candidate.to(dtype), case.reference_call, case.candidate_call, case.sites,
        case.cast_inputs,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_a_bottleneck_port_with_folded_norms_passes(dtype, tmp_path):
    case = folded_resnet(dtype, layer_type="bottleneck")
    result = _run(case, tmp_path)
    assert result.verdict == "pass", headline(result.report)
    pairs = {pair.candidate.rsplit("#", 1)[0]: pair for pair in result.report.alignment.pairs}
    for site, expected in case.sites.items():  # each folded convolution against its norm, fed the convolution's input
        assert pairs[site].reference.rsplit("#", 1)[0] == expected[0]
        assert pairs[site].reference_input == expected[0].replace("normalization", "convolution") + "#0"
    folded = [f for f in result.report.alignment.weights.findings if f.kind == "folded"]
    assert len(folded) == len(case.sites) and not result.report.alignment.weights.differing


@DTYPES
@pytest.mark.parametrize(
    ("site", "mistake", "finding"),
    [
        ("blocks.1.convs.0", "std", "blocks.1.convs.0.weight differs"),  # the scale divides by the variance
        ("blocks.2.shortcut", "std", "blocks.2.shortcut.weight differs"),
        ("blocks.3.convs.1", "shift", "blocks.3.convs.1.bias differs"),  # the mean left out of the bias
    ],
)
def test_a_wrong_fold_is_named_at_its_norm(dtype, site, mistake, finding, tmp_path):
    case = folded_resnet(dtype)
    port = from_resnet(case.reference, {site: mistake})
    result = _run(_with(case, port, dtype), tmp_path)
    assert result.verdict == "fail"
    assert result.report.origin == case.sites[site][0], headline(result.report)
    assert finding in headline(result.report)


def _layer_and_norm(seed: int = 0, channels: int = 12, eps: float = 1e-5) -> nn.Sequential:
    generator = torch.Generator().manual_seed(seed)
    layer = nn.Linear(20, channels)
    norm = nn.BatchNorm1d(channels, eps=eps).eval()
    with torch.no_grad():
        layer.weight.copy_(torch.randn(channels, 20, generator=generator))
        layer.bias.copy_(torch.randn(channels, generator=generator))
        norm.weight.copy_(0.5 + torch.rand(channels, generator=generator))
        norm.bias.copy_(torch.randn(channels, generator=generator))
        norm.running_mean.copy_(torch.randn(channels, generator=generator))
        norm.running_var.copy_(0.5 + 1.5 * torch.rand(channels, generator=generator))
    return nn.Sequential(layer, norm)


def _folded(model: nn.Sequential, eps: float) -> torch.Tensor:
    layer, norm = model
    scale = norm.weight / torch.sqrt(norm.running_var + eps)
    return (layer.weight * scale[:, None]).detach()


@pytest.mark.parametrize("eps", [1e-5, 1e-3])
def test_the_ledger_reads_a_fold_and_its_eps_from_row_sums(eps):
    model = _layer_and_norm(eps=eps)
    prints = fingerprint(model)
    norm = running_norm(prints["1"])
    assert norm is not None and norm.channels == 12
    weight, bias = (next(p for p in prints["0"].params if p.name == name) for name in ("weight", "bias"))
    candidate = nn.Linear(20, 12)
    with torch.no_grad():
        candidate.weight.copy_(_folded(model, eps))
    found = fold_fit(weight, bias, norm, next(p for p in fingerprint(candidate)[""].params if p.name == "weight"))
    assert found is not None and found.residual < 1e-5
    assert found.eps == pytest.approx(eps, rel=0.2, abs=2e-6)
    layer, batch = model
    expected = batch.bias + (layer.bias - batch.running_mean) * batch.weight / torch.sqrt(batch.running_var + eps)
    assert torch.allclose(torch.from_numpy(found.bias).float(), expected.detach(), atol=1e-5)


def test_a_weight_scaled_as_a_whole_or_another_weight_is_no_fold():
    model = _layer_and_norm()
    prints = fingerprint(model)
    norm = running_norm(prints["1"])
    assert norm is not None
    weight = next(p for p in prints["0"].params if p.name == "weight")
    scaled, other = nn.Linear(20, 12), nn.Linear(20, 12)
    with torch.no_grad():
        scaled.weight.copy_(model[0].weight * 1.01)  # a conversion that scales: a defect, not a fold
        other.weight.copy_(torch.randn(12, 20, generator=torch.Generator().manual_seed(5)))
    for candidate in (scaled, other):
        param = next(p for p in fingerprint(candidate)[""].params if p.name == "weight")
        assert fold_fit(weight, None, norm, param) is None
    assert running_norm(prints["0"]) is None  # a layer keeps no running statistics


class _AvgMaxPort(nn.Module):
    """The folded port, its second output pooled by the maximum where the reference averages."""

    def __init__(self, port: nn.Module) -> None:
        super().__init__()
        self.port = port

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features, _ = self.port(pixels)
        return features, F.adaptive_max_pool2d(features, 1)


def test_a_tuple_is_compared_with_a_model_output_in_its_order(tmp_path):
    """The port returns ``(features, pooled)`` where the reference returns ``last_hidden_state`` and
    ``pooler_output``: the same order (``ModelOutput.to_tuple``), so the pooled values are compared, and a wrong
    pooling fails the run instead of leaving it inconclusive."""
    case = folded_resnet(torch.float32)
    clean = _run(case, tmp_path / "clean")
    root = next(row for row in clean.report.rows if row.path == "")
    pooled = next(check for check in root.outputs if check.reference == "outputs.pooler_output")
    assert (pooled.candidate, pooled.verdict, pooled.how) == ("outputs.1", "pass", "same position")
    wrong = _run(_with(case, _AvgMaxPort(case.candidate), torch.float32), tmp_path / "wrong")
    root = next(row for row in wrong.report.rows if row.path == "")
    pooled = next(check for check in root.outputs if check.reference == "outputs.pooler_output")
    assert (pooled.candidate, pooled.verdict) == ("outputs.1", "fail")
    assert wrong.verdict == "fail"


@DTYPES
def test_a_norm_folded_and_kept_too_is_named_at_its_layer(dtype, tmp_path):
    """A port that folds a norm into its convolution and still applies the norm after it normalises twice: it keeps
    the norm (its running statistics are the reference's), so nothing is read as folded there, and the convolution,
    whose weight is the reference's scaled row by row, is named."""
    case = folded_resnet(dtype)
    port = from_resnet(case.reference)
    norm = copy.deepcopy(case.reference.encoder.stages[1].layers[0].layer[0].normalization)
    port.blocks[2].convs[0] = nn.Sequential(port.blocks[2].convs[0], norm)
    result = _run(_with(case, port, dtype), tmp_path)
    assert result.verdict == "fail"
    assert result.report.origin == "encoder.stages.1.layers.0.layer.0.convolution", headline(result.report)
    assert "blocks.2.convs.0.0.weight differs" in headline(result.report)


class _NormedMLP(nn.Module):
    """A user's own MLP: each linear layer normalised by a batch norm (Linear → BatchNorm1d → ReLU → Linear →
    BatchNorm1d)."""

    def __init__(self) -> None:
        super().__init__()
        _, self.bn1 = _layer_and_norm(1, 48)  # norms holding a trained model's kind of statistics
        _, self.bn2 = _layer_and_norm(3, 8)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(2)
            self.fc1, self.fc2 = nn.Linear(20, 48), nn.Linear(48, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn2(self.fc2(torch.relu(self.bn1(self.fc1(x)))))


class _FoldedMLP(nn.Module):
    def __init__(self, reference: _NormedMLP, scaled: float = 1.0) -> None:
        super().__init__()
        self.first = _folded_linear(reference.fc1, reference.bn1, scaled)
        self.second = _folded_linear(reference.fc2, reference.bn2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def _folded_linear(layer: nn.Linear, norm: nn.BatchNorm1d, scaled: float = 1.0) -> nn.Linear:
    folded = nn.Linear(layer.in_features, layer.out_features)
    with torch.no_grad():
        scale = norm.weight / torch.sqrt(norm.running_var + norm.eps)
        folded.weight.copy_(layer.weight * scale[:, None] * scaled)
        folded.bias.copy_(norm.bias + (layer.bias - norm.running_mean) * scale)
    return folded


@DTYPES
def test_a_users_mlp_with_folded_batch_norms_passes_and_a_scaled_fold_is_named(dtype, tmp_path):
    """Linear layers with a layer bias, each folding a BatchNorm1d: clean, it passes; its first fold's weight scaled
    by 1.01 (a conversion that scales) is named at that norm, with the fold it should have been."""
    reference = _NormedMLP().eval()
    x = torch.randn(16, 20, generator=torch.Generator().manual_seed(6))
    for scaled, tag in ((1.0, "clean"), (1.01, "scaled")):
        candidate = _FoldedMLP(reference, scaled).to(dtype).eval()
        result = check(
            reference, candidate, tmp_path / tag, reference_call=lambda m: m(x),
            candidate_call=lambda m: m(x.to(dtype)), echo=None,
        )  # fmt: skip
        if scaled == 1.0:
            assert result.verdict == "pass", headline(result.report)
        else:
            assert (result.verdict, result.report.origin) == ("fail", "bn1"), headline(result.report)
            assert "first.weight differs from the reference's fc1.weight: with bn1 folded in" in headline(result.report)
