"""Bugs that live in the weights: a conversion that scales, changes one element, transposes or reorders a weight, a
table built from a wrong constant. The weight ledger names the tensor and what differs, the module holding it keeps
its pair whatever its code is called, and the run names that module in fp32 and under bf16's rounding."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paritylab.comparison.report import compare_traces
from paritylab.comparison.weights import weight_ledger
from paritylab.reports.render import headline
from paritylab.run.parity import check, trace_model
from paritylab.sink.dashboard import final_tags
from paritylab.tracing.structure import ModulePrint, fingerprint


def reference_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8))


class HandWritten(nn.Module):
    """The same MLP written by hand: other attribute names, ``F.gelu`` (no module for the activations)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc_in, self.fc_mid, self.fc_out = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_mid(F.gelu(self.fc_in(x)))))


def ported(reference: nn.Sequential, plant: str = "") -> HandWritten:
    port = HandWritten()
    with torch.no_grad():
        for mine, theirs in ((port.fc_in, reference[0]), (port.fc_mid, reference[2]), (port.fc_out, reference[4])):
            mine.weight.copy_(theirs.weight)
            mine.bias.copy_(theirs.bias)
        if plant == "element":
            port.fc_mid.weight[3, 5] *= 1.01
        elif plant == "scaled":
            port.fc_mid.weight *= 1.01
        elif plant == "transposed":
            port.fc_mid.weight.copy_(port.fc_mid.weight.T.clone())
        elif plant == "bias":
            port.fc_in.bias *= 1.01
    return port


def run(reference: nn.Module, candidate: nn.Module, tmp_path, dtype: torch.dtype = torch.float32):
    candidate = candidate.to(dtype)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    return check(reference, candidate, tmp_path, reference_call=lambda m: m(x.to(next(m.parameters()).dtype)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("plant", "origin", "says"),
    [
        ("element", "2", "fc_mid.weight differs from the reference's 2.weight: 1 of 1024 elements, at [3, 5]"),
        ("scaled", "2", "fc_mid.weight differs from the reference's 2.weight: every row and column of 1024 elements, "
                        "scaled by 1.01"),
        ("bias", "0", "fc_in.bias differs from the reference's 0.bias: scaled by 1.01"),
        ("transposed", "2", "fc_mid.weight holds the reference's 2.weight: the same values, transposed"),
    ],
)  # fmt: skip
def test_a_weight_bug_in_a_hand_written_port_is_named_at_its_module(tmp_path, plant, origin, says, dtype):
    reference = reference_mlp()
    result = run(reference, ported(reference, plant), tmp_path, dtype)
    report = result.report
    assert report.verdict == "fail"
    assert report.first_divergence is not None and report.first_divergence.path == origin
    line = headline(report)
    assert f"divergence starts at {origin} " in line
    assert "its weights differ: " + says in line
    pair = report.alignment.by_reference()[f"{origin}#0"]
    assert pair.candidate.startswith({"0": "fc_in", "2": "fc_mid"}[origin])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_clean_hand_written_port_passes_with_every_weight_matched(tmp_path, dtype):
    reference = reference_mlp()
    result = run(reference, ported(reference), tmp_path, dtype)
    assert result.report.verdict == "pass", headline(result.report)
    ledger = result.report.alignment.weights
    assert ledger.matched == 6 and ledger.findings == [] and ledger.unmatched == []
    assert result.report.summary()["weights_differing"] == 0


def test_the_ledger_measures_an_element_and_a_scale_from_the_fingerprints_alone():
    reference = reference_mlp()
    port = ported(reference, "element")
    ledger = weight_ledger(fingerprint(reference), fingerprint(port))
    (finding,) = ledger.differing
    assert (finding.candidate, finding.reference) == ("fc_mid.weight", "2.weight")
    expected = 0.01 * abs(reference[2].weight[3, 5].item()) / reference[2].weight.norm().item()
    assert finding.rel_l2 == pytest.approx(expected, rel=1e-3)
    assert ledger.module_pairs == {"2": "fc_mid"}
    assert ledger.matched == 5


def test_fused_halves_swapped_are_named_as_rows_in_another_order():
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 64))
    candidate = nn.Sequential(nn.Linear(8, 64))
    with torch.no_grad():
        candidate[0].weight.copy_(torch.cat([reference[0].weight[32:], reference[0].weight[:32]]))
        candidate[0].bias.copy_(reference[0].bias)
    ledger = weight_ledger(fingerprint(reference), fingerprint(candidate))
    (layout,) = ledger.findings
    assert layout.kind == "layout" and layout.candidate == "0.weight"
    assert layout.detail == (
        "the same rows in another order: rows 0-31 hold the reference's rows 32-63, "
        "rows 32-63 hold the reference's rows 0-31"
    )


def test_value_sketches_survive_the_trace_file(tmp_path):
    reference = reference_mlp()
    port = ported(reference, "scaled")
    x = torch.randn(2, 16)
    traces = [trace_model(model, lambda m: m(x), tmp_path / name) for model, name in ((reference, "r"), (port, "c"))]
    report = compare_traces(*traces)
    (finding,) = report.alignment.weights.differing
    assert finding.rel_l2 == pytest.approx(0.01, rel=1e-3)
    item = ModulePrint.from_json(fingerprint(port)["fc_mid"].to_json())
    sums = item.params[0].sums
    assert sums is not None
    assert sums[0] == pytest.approx(port.fc_mid.weight.sum(dim=1).tolist(), rel=1e-5)
    assert sums[2] == pytest.approx(port.fc_mid.weight.norm().item(), rel=1e-6)


class Rotary(nn.Module):
    """Rotary frequencies as a buffer, applied to a query."""

    def __init__(self, dim: int, base: float) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2).float() / dim), persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        angles = positions[:, None].float() * self.inv_freq[None, :]
        return torch.cat([angles.cos(), angles.sin()], dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, base: float, rotary_name: str) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        setattr(self, rotary_name, Rotary(dim, base))
        self.rotary_name = rotary_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = getattr(self, self.rotary_name)(torch.arange(x.shape[0]))
        return self.proj(x) * table.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_rotary_table_from_a_wrong_base_is_never_a_pass(tmp_path, dtype):
    torch.manual_seed(0)
    reference = Attention(32, 10000.0, "rotary_emb")
    candidate = Attention(32, 500000.0, "rope")
    candidate.proj.load_state_dict(reference.proj.state_dict())
    x = torch.randn(6, 32)
    candidate = candidate.to(dtype)
    result = check(reference, candidate, tmp_path, reference_call=lambda m: m(x.to(next(m.parameters()).dtype)))
    report = result.report
    assert report.verdict == "fail"
    assert report.first_divergence is not None and report.first_divergence.path == "rotary_emb"
    (finding,) = report.alignment.weights.differing
    assert (finding.candidate, finding.reference) == ("rope.inv_freq", "rotary_emb.inv_freq")
    built = re.search(r"built from base ([0-9.e+]+) against ([0-9.e+]+)", finding.detail)
    assert built is not None, finding.detail
    assert float(built.group(1)) == pytest.approx(500000, rel=0.02)
    assert float(built.group(2)) == pytest.approx(10000, rel=0.02)


def test_a_rotary_table_from_the_same_base_passes_in_bf16(tmp_path):
    torch.manual_seed(0)
    reference = Attention(32, 10000.0, "rotary_emb")
    candidate = Attention(32, 10000.0, "rope")
    candidate.proj.load_state_dict(reference.proj.state_dict())
    x = torch.randn(6, 32)
    candidate = candidate.to(torch.bfloat16)
    result = check(reference, candidate, tmp_path, reference_call=lambda m: m(x.to(next(m.parameters()).dtype)))
    assert result.report.verdict == "pass", headline(result.report)
    assert result.report.alignment.weights.differing == []


class Named(nn.Module):
    def __init__(self, swap: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.swap = nn.Linear(8, 8), nn.Linear(8, 8), swap

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.a(x)
        logits = self.b(torch.tanh(hidden))
        return {"logits": hidden, "hidden": logits} if self.swap else {"logits": logits, "hidden": hidden}


@pytest.mark.parametrize("swap", [False, True], ids=["same", "swapped"])
def test_named_outputs_are_compared_by_name(tmp_path, swap):
    torch.manual_seed(0)
    reference, candidate = Named(), Named(swap)
    candidate.load_state_dict(reference.state_dict())
    x = torch.randn(3, 8)
    report = check(reference, candidate, tmp_path, reference_call=lambda m: m(x)).report
    root = report.rows[0]
    assert (root.reference.slot, root.candidate.slot if root.candidate else None) == ("outputs.logits",) * 2
    (other,) = root.outputs
    assert (other.reference, other.candidate, other.how) == ("outputs.hidden", "outputs.hidden", "same key")
    assert report.verdict == ("fail" if swap else "pass")
    assert other.verdict == ("fail" if swap else "pass")


class TwoOutputs(nn.Module):
    def __init__(self, offset: float = 0.0) -> None:
        super().__init__()
        self.a, self.offset = nn.Linear(8, 8), offset

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.a(x)
        return hidden, hidden * 2 + self.offset


@pytest.mark.parametrize("options", [{"max_bytes": 0}, {"save_tensors": False}], ids=["max_bytes=0", "no-tensors"])
def test_a_wrong_second_output_without_stored_tensors_is_a_fail_not_a_crash(tmp_path, options):
    torch.manual_seed(0)
    reference, candidate = TwoOutputs(), TwoOutputs(0.5)
    candidate.load_state_dict(reference.state_dict())
    x = torch.randn(3, 8)
    traces = [
        trace_model(model, lambda m: m(x), tmp_path / name, **options)
        for model, name in ((reference, "r"), (candidate, "c"))
    ]
    report = compare_traces(*traces)
    assert report.verdict == "fail"
    assert headline(report).startswith("FAIL: divergence starts at <root> (outputs.1 differs (judged on stats))")


class Encoder(nn.Module):
    """A position table its own code reads (never called), as Whisper's encoder reads ``embed_positions.weight``."""

    def __init__(self, names: tuple[str, str, str, str]) -> None:
        super().__init__()
        self.names = names
        projection, table, norm, head = names
        setattr(self, projection, nn.Linear(8, 16))
        setattr(self, table, nn.Embedding(5, 16))
        setattr(self, norm, nn.LayerNorm(16))
        setattr(self, head, nn.Linear(16, 16))

    def forward(self, features: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        projection, table, norm, head = (getattr(self, name) for name in self.names)
        hidden = projection(features) + table.weight[: features.shape[1]]
        return head(norm(hidden))


class Speech(nn.Module):
    def __init__(self, names: tuple[str, str, str, str]) -> None:
        super().__init__()
        self.encoder, self.proj_out = Encoder(names), nn.Linear(16, 4)

    def forward(self, features: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.proj_out(self.encoder(features, mask))


def speech_pair(scale: float) -> tuple[Speech, Speech]:
    torch.manual_seed(0)
    reference = Speech(("conv", "embed_positions", "ln", "fc"))
    candidate = Speech(("proj", "pos", "norm", "mlp"))
    renames = {".conv.": ".proj.", ".embed_positions.": ".pos.", ".ln.": ".norm.", ".fc.": ".mlp."}
    state = {}
    for key, value in reference.state_dict().items():
        for old, new in renames.items():
            key = key.replace(old, new)
        state[key] = value
    candidate.load_state_dict(state)
    with torch.no_grad():
        candidate.encoder.pos.weight.mul_(scale)
    return reference, candidate


@pytest.mark.parametrize("order", ["features-first", "mask-first"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_table_read_by_its_containers_code_is_named_at_the_tables_module(tmp_path, dtype, order):
    reference, candidate = speech_pair(1.01)
    candidate = candidate.to(dtype)
    features, mask = torch.randn(2, 5, 8), torch.ones(2, 5)

    def call(model: nn.Module) -> torch.Tensor:
        low = features.to(next(model.parameters()).dtype)
        return model(mask=mask, features=low) if order == "mask-first" else model(features=low, mask=mask)

    report = check(reference, candidate, tmp_path, reference_call=call).report
    assert report.verdict == "fail"
    assert report.summary()["first_divergence"] == "encoder.embed_positions"
    line = headline(report)
    assert line.startswith("FAIL: divergence starts at encoder.embed_positions ")
    assert "encoder.pos.weight differs from the reference's encoder.embed_positions.weight" in line
    assert "encoder's own code reads it" in line


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_table_read_by_its_containers_code_passes_clean(tmp_path, dtype):
    reference, candidate = speech_pair(1.0)
    candidate = candidate.to(dtype)
    features = torch.randn(2, 5, 8)
    report = check(
        reference, candidate, tmp_path, reference_call=lambda m: m(features.to(next(m.parameters()).dtype))
    ).report
    assert report.verdict == "pass", headline(report)
    assert report.weight_origin is None


class SideComputation(nn.Module):
    """The reference computes ``aux`` and keeps it aside (nothing returned reads it); the candidate never calls it."""

    def __init__(self, candidate: bool = False) -> None:
        super().__init__()
        self.a, self.aux, self.candidate, self.kept = nn.Linear(8, 8), nn.Linear(8, 8), candidate, {}

    def forward(self, x: torch.Tensor) -> dict[str, int]:
        hidden = self.a(x)
        if not self.candidate:
            self.kept["aux"] = self.aux(hidden)
        return {"n": 3}


@pytest.mark.parametrize("scale", [1.0, 1.01], ids=["same-weights", "differing-weights"])
def test_every_reference_call_is_accounted_for_and_an_unchecked_difference_is_never_a_pass(tmp_path, scale):
    torch.manual_seed(0)
    reference, candidate = SideComputation(), SideComputation(candidate=True)
    candidate.load_state_dict(reference.state_dict())
    with torch.no_grad():
        candidate.aux.weight.mul_(scale)
    report = check(reference, candidate, tmp_path, reference_call=lambda m: m(torch.randn(3, 8))).report
    ledger = report.ledger
    assert ledger.compared == ["#0", "a#0"] and ledger.unaccounted == ["aux#0"] and ledger.covered == {}
    if scale == 1.0:
        assert report.verdict == "pass" and ledger.differing == []
        assert "1 reference calls not checked (first aux: no counterpart, none around it)" in headline(report)
    else:
        assert report.verdict == "inconclusive" and ledger.differing == ["aux#0"]
        assert headline(report).startswith(
            "INCONCLUSIVE: every compared module agrees, but 1 reference calls holding weights that differ were never "
            "checked (first aux: aux.weight differs from the reference's aux.weight:"
        )
    assert report.to_json()["calls"]["unaccounted"] == ["aux#0"]
    tags = final_tags(report, report.verdict, None, [])  # what the MLflow run is tagged with
    assert tags["paritylab.unaccounted"] == "aux" and "checked (first aux" in tags["mlflow.note.content"]


def test_calls_inside_a_compared_call_that_agrees_are_covered(tmp_path):
    reference = reference_mlp()
    report = run(reference, ported(reference), tmp_path).report
    assert report.ledger.covered == {"1#0": "", "3#0": ""}
    assert report.ledger.unaccounted == []
    assert report.summary()["unaccounted_calls"] == 0


H = 32


class Separate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(H, H) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        return self.o(torch.softmax(q @ k.transpose(-1, -2) / H**0.5, -1) @ v)


class Fused(nn.Module):
    """The same attention with one ``[q; k; v]`` projection, as vLLM and Megatron fuse it."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(H, 3 * H), nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(H, -1)
        return self.out(torch.softmax(q @ k.transpose(-1, -2) / H**0.5, -1) @ v)


def fused_pair(plant: str) -> tuple[Separate, Fused]:
    torch.manual_seed(0)
    reference, candidate = Separate(), Fused()
    with torch.no_grad():
        candidate.qkv.weight.copy_(torch.cat([reference.q.weight, reference.k.weight, reference.v.weight]))
        candidate.qkv.bias.copy_(torch.cat([reference.q.bias, reference.k.bias, reference.v.bias]))
        candidate.out.load_state_dict(reference.o.state_dict())
        if plant == "block":
            candidate.qkv.weight[H : 2 * H] *= 1.01
        elif plant == "bias":
            candidate.qkv.bias[H : 2 * H] *= 1.01
        elif plant == "element":
            candidate.qkv.weight[H + 3, 5] *= 1.01
    return reference, candidate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("plant", "says"),
    [
        ("block", "qkv.weight rows 32-63 differs from the reference's k.weight: scaled by 1.01"),
        ("bias", "qkv.bias [32:64] differs from the reference's k.bias: scaled by 1.01"),
        ("element", "qkv.weight row 35 differs from the reference's k.weight row 3"),
        ("none", ""),
    ],
)
def test_a_wrong_block_of_a_fused_projection_is_named_at_the_separate_module_it_stands_for(
    tmp_path, plant, says, dtype
):
    reference, candidate = fused_pair(plant)
    candidate = candidate.to(dtype)
    x = torch.randn(2, 6, H, generator=torch.Generator().manual_seed(1))
    report = check(reference, candidate, tmp_path, reference_call=lambda m: m(x.to(next(m.parameters()).dtype))).report
    ledger = report.alignment.weights
    assert ledger.unmatched == []
    if plant == "none":
        assert report.verdict == "pass", headline(report)
        assert ledger.findings == [] and ledger.matched == 4
        return
    assert report.verdict == "fail"
    assert report.first_divergence is not None and report.first_divergence.path == "k", headline(report)
    (finding,) = ledger.differing
    assert finding.line().startswith(says)
    pair = report.alignment.by_reference()["k#0"]
    assert pair.candidate == "qkv#0" and pair.candidate_part is not None
    assert (pair.candidate_part.start, pair.candidate_part.stop) == (H, 2 * H)


def test_a_block_of_rows_loaded_from_the_wrong_place_keeps_its_pair_and_says_where_it_came_from():
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    candidate = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    candidate.load_state_dict(reference.state_dict())
    with torch.no_grad():
        candidate[1].weight[0:16] = candidate[1].weight[16:32].clone()
    ledger = weight_ledger(fingerprint(reference), fingerprint(candidate))
    (finding,) = ledger.differing
    assert finding.detail.startswith("rows 0-15 of 64 differ: they hold the reference's rows 16-31")
    assert ledger.module_pairs == {"1": "1"}


def test_a_1x1_kernel_with_rows_from_the_wrong_place_is_read_as_its_rows_not_as_single_elements(tmp_path):
    """ConvNeXt's pwconv2 ported as a 1x1 convolution (``[out, in, 1, 1]``) beside depthwise kernels (``[C, 1, 7,
    7]``), its first quarter of rows overwritten by the next: the size-1 axes are fibers of one element, and runs of
    single values lie "near" runs of other tensors' by chance, so the kernel was found to hold a depthwise conv's
    fibers ("scaled by 1.015"), lost its pair, and the block was named. Fibers of one element are no evidence: its
    rows are read, as a matrix's are, and pwconv2 is named."""
    from tests.pairs import PAIRS, planted_weight

    case = PAIRS["convnext"](torch.float32)
    with planted_weight(case.candidate, "stages.0.blocks.0.fc2", "w-rows"):
        result = check(
            case.reference, case.candidate, tmp_path, reference_call=case.reference_call,
            candidate_call=case.candidate_call, echo=None, drilldown=False,
        )  # fmt: skip
    assert result.report.origin == "encoder.stages.0.layers.0.pwconv2", result.report.culprit_reason
    (finding,) = result.report.alignment.weights.differing
    assert finding.candidate.startswith("stages.0.blocks.0.fc2.weight [0:4, :, :, :]"), finding.line()
    assert finding.detail.endswith("they hold the reference's encoder.stages.0.layers.0.pwconv2.weight rows 4-7")


def test_one_element_of_a_transposed_table_is_located_in_the_references_layout():
    """TransformerLens' unembedding is GPT-2's embedding table transposed: one element changed there is found."""
    torch.manual_seed(0)
    reference = nn.ModuleDict({"wte": nn.Embedding(100, 32)})
    candidate = nn.ParameterDict({"W_U": nn.Parameter(reference["wte"].weight.detach().T.clone())})
    with torch.no_grad():
        candidate["W_U"][7, 42] *= 1.01
    ledger = weight_ledger(fingerprint(reference), fingerprint(candidate))
    (finding,) = ledger.differing
    assert (finding.candidate, finding.reference) == ("W_U", "wte.weight")
    assert finding.detail.startswith("transposed (positions in the reference's layout), 1 of 3200 elements, at [42, 7]")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_two_halves_of_a_weight_swapped_are_named_at_its_module_with_the_rows_they_hold(tmp_path, dtype):
    reference = reference_mlp()
    candidate = ported(reference)
    with torch.no_grad():
        weight = candidate.fc_mid.weight
        weight.copy_(torch.cat([weight[16:], weight[:16]]))
    report = run(reference, candidate, tmp_path, dtype).report
    assert report.verdict == "fail"
    assert report.first_divergence is not None and report.first_divergence.path == "2"
    assert (
        "fc_mid.weight holds the reference's 2.weight: the same rows in another order: rows 0-15 hold the "
        "reference's rows 16-31, rows 16-31 hold the reference's rows 0-15"
    ) in headline(report)


class ActMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class FunctionalMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1, self.linear2 = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.gelu(self.linear1(x)))


class Block(nn.Module):
    def __init__(self, mlp: type[nn.Module]) -> None:
        super().__init__()
        self.inp, self.mlp, self.head = nn.Linear(16, 16), mlp(), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mlp(torch.relu(self.inp(x))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_halves_swapped_before_an_activation_with_no_counterpart_are_named_at_the_projection(tmp_path, dtype):
    """MONAI's MLP calls GELU as a function where the reference has a module: the swapped halves are still charged
    to the projection that made them, not to the activation nor to the MLP's own code."""
    torch.manual_seed(0)
    reference, candidate = Block(ActMLP), Block(FunctionalMLP)
    state = {
        key.replace("fc1", "linear1").replace("fc2", "linear2"): value for key, value in reference.state_dict().items()
    }
    candidate.load_state_dict(state)
    with torch.no_grad():
        for tensor in (candidate.mlp.linear1.weight, candidate.mlp.linear1.bias):
            tensor.copy_(torch.cat([tensor[32:], tensor[:32]]))
    candidate = candidate.to(dtype)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    report = check(reference, candidate, tmp_path, reference_call=lambda m: m(x.to(next(m.parameters()).dtype))).report
    assert report.first_divergence is not None and report.first_divergence.path == "mlp.fc1", headline(report)
    assert "its output agrees only with its features in another order, and mlp.fc2 is handed them" in headline(report)


class Norms(nn.Module):
    """Three pre-norm residual blocks and a final norm, all untrained: every norm holds the same ones."""

    def __init__(self, names: tuple[str, str, str]) -> None:
        super().__init__()
        self.names = names
        for index in range(3):
            setattr(self, f"{names[0]}{index}", nn.Linear(16, 16))
            setattr(self, f"{names[1]}{index}", nn.LayerNorm(16))
        setattr(self, names[2], nn.LayerNorm(16))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index in range(3):
            x = x + getattr(self, f"{self.names[0]}{index}")(getattr(self, f"{self.names[1]}{index}")(x))
        return self.head(getattr(self, self.names[2])(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("site", "origin"), [("pre1", "ln1"), ("ln_final", "norm")])
def test_a_norm_among_identical_copies_is_paired_in_order_and_named(tmp_path, site, origin, dtype):
    torch.manual_seed(0)
    reference, candidate = Norms(("lin", "ln", "norm")), Norms(("proj", "pre", "ln_final"))
    renamed = {}
    for key, value in reference.state_dict().items():
        key = key.replace("lin", "proj").replace("norm.", "ln_final.")
        renamed["pre" + key[2:] if key.startswith("ln") and not key.startswith("ln_final") else key] = value
    candidate.load_state_dict(renamed)
    with torch.no_grad():
        getattr(candidate, site).weight.mul_(1.01)
    report = run(reference, candidate, tmp_path, dtype).report
    assert report.first_divergence is not None and report.first_divergence.path == origin, headline(report)
    (finding,) = report.alignment.weights.differing
    assert finding.candidate == f"{site}.weight"
    assert "(the reference holds these values 4 times: in ln0, ln1, ln2, norm)" in finding.detail
    assert report.alignment.weights.module_pairs == {}  # which copy, the order told


class ReturningMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(16, 64), nn.Linear(64, 32), nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(torch.relu(self.fc1(x))))


class ReturningBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp, self.head = ReturningMLP(), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mlp(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_halves_swapped_in_the_projection_a_block_returns_are_named_at_the_projection(tmp_path, dtype):
    """The MLP returns its last projection's output (through a dropout): the MLP diverges, the projection agrees
    only reordered, and the projection is named."""
    torch.manual_seed(0)
    reference, candidate = ReturningBlock(), ReturningBlock()
    candidate.load_state_dict(reference.state_dict())
    with torch.no_grad():
        for tensor in (candidate.mlp.fc2.weight, candidate.mlp.fc2.bias):
            tensor.copy_(torch.cat([tensor[16:], tensor[:16]]))
    candidate = candidate.to(dtype).eval()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    report = check(
        reference.eval(), candidate, tmp_path, reference_call=lambda m: m(x.to(next(m.parameters()).dtype))
    ).report
    assert report.first_divergence is not None and report.first_divergence.path == "mlp.fc2", headline(report)
    assert "its output agrees only with its features in another order" in headline(report)


class Heads(nn.Module):
    """An attention whose own code splits its query, key and value into heads."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(32, 32) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(t.shape[0], t.shape[1], 4, 8).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        mixed = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, -1) @ v
        return self.o(mixed.transpose(1, 2).reshape(x.shape))


class HeadsBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.head = Heads(), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.attn(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_query_rows_swapped_are_named_at_the_query_not_at_the_attention_reading_them(tmp_path, dtype):
    torch.manual_seed(0)
    reference, candidate = HeadsBlock(), HeadsBlock()
    candidate.load_state_dict(reference.state_dict())
    with torch.no_grad():
        for tensor in (candidate.attn.q.weight, candidate.attn.q.bias):
            tensor.copy_(torch.cat([tensor[16:], tensor[:16]]))
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))
    candidate = candidate.to(dtype)
    report = check(reference, candidate, tmp_path, reference_call=lambda m: m(x.to(next(m.parameters()).dtype))).report
    assert report.first_divergence is not None and report.first_divergence.path == "attn.q", headline(report)
    assert "its output agrees only with its features in another order" in headline(report)


class _Tied(nn.Module):
    """A token embedding whose table the output head reads too (one parameter, two modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(24, 16)
        self.head = nn.Linear(16, 24, bias=False)
        self.head.weight = self.embed.weight


def test_a_tied_table_with_a_block_of_rows_copied_over_another_differs():
    """The reference holds its tied table under two modules; a conversion that copies rows 4-7 over rows 0-3 leaves
    every row of the candidate's table one the reference holds, rows 4-7 twice: counted once per distinct tensor,
    the reference holds them once, so the table differs (it was taken as matched, and the bug passed unnamed)."""
    torch.manual_seed(0)
    reference, candidate = _Tied(), _Tied()
    candidate.load_state_dict(reference.state_dict())
    with torch.no_grad():
        candidate.embed.weight[0:4] = candidate.embed.weight[4:8].clone()
    ledger = weight_ledger(fingerprint(reference), fingerprint(candidate))
    said = ledger.differing[0].line()
    assert said.startswith("embed.weight differs from the reference's embed.weight: rows 0-3 of 24 differ: they hold")
    assert "the reference's rows 4-7" in said


class _HeadsReadOtherwise(nn.Module):
    """An output projection whose input features (attention heads) a port lays out in another order: its weight's
    columns permuted to match, so it computes the reference's projection of the reference's features."""

    def __init__(self, reference: nn.Linear, order: torch.Tensor) -> None:
        super().__init__()
        self.proj = nn.Linear(reference.in_features, reference.out_features, bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(reference.weight[:, order])


@pytest.mark.parametrize(
    ("plant", "said"),
    [
        ("scale", "its columns in another order (compared in the reference's order), scaled by 1.01, rel_l2 0.01"),
        ("element", "its columns in another order (compared in the reference's order), 1 of 512 elements, at [3, 5]"),
    ],
)
def test_a_weight_held_in_another_column_order_with_a_defect_is_near_its_twin(plant, said):
    """A weight whose columns a port holds in another order (a layout its code reads so), then changed by a
    conversion: no hash matches the reference's any more (scaled), or most do in other places (one element). The
    ledger finds the twin with that axis set aside (row sums do not depend on the columns' order; the columns'
    hashes move with them), says what differs in the reference's order, and keeps the order for the alignment."""
    torch.manual_seed(3)
    reference = nn.Sequential(nn.Linear(32, 16, bias=False))
    order = torch.randperm(32)
    candidate = _HeadsReadOtherwise(reference[0], order)
    with torch.no_grad():
        if plant == "scale":
            candidate.proj.weight.mul_(1.01)
        else:
            at = int((order == 5).nonzero())  # the reference's column 5, where the candidate holds it
            candidate.proj.weight[3, at] *= 1.01
    ledger = weight_ledger(fingerprint(reference), fingerprint(candidate))
    (finding,) = ledger.differing
    assert (finding.candidate, finding.reference) == ("proj.weight", "0.weight")
    assert said in finding.detail
    axis, held = ledger.orders[("0", "proj")]
    assert axis == 1 and list(held) == torch.argsort(order).tolist()  # where the candidate holds each column
    assert ledger.module_pairs == {"0": "proj"}


def test_an_unrelated_weight_of_the_same_shape_is_near_nothing_in_any_order():
    """Sorted column sums of two independent draws lie close (order statistics of one distribution); the row sums,
    compared in place, keep them apart: a weight of another draw is no near twin, in place or reordered."""
    torch.manual_seed(3)
    reference = nn.Sequential(nn.Linear(32, 16, bias=False))
    torch.manual_seed(4)
    other = nn.Sequential(nn.Linear(32, 16, bias=False))
    ledger = weight_ledger(fingerprint(reference), fingerprint(other))
    assert ledger.differing == [] and ledger.orders == {} and ledger.unmatched == ["0.weight"]


class _Projected(nn.Module):
    """A projection module then an output one; ``inline``: the projection's weight read by the block's own code
    (``F.linear`` on it), its module never called, as mambapy reads ``dt_proj``."""

    def __init__(self, inline: bool) -> None:
        super().__init__()
        self.inline = inline
        self.inner, self.out = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.linear(x, self.inner.weight, self.inner.bias) if self.inline else self.inner(x)
        return self.out(F.gelu(hidden))


def test_a_weight_whose_reference_module_runs_unpaired_is_named_at_that_module(tmp_path):
    """The reference calls ``inner``; the candidate reads the same weight in its own code, so the reference's calls
    of ``inner`` have no counterpart and no row judges the weight. Scaled by 1.01 by a conversion, it is named at
    ``inner`` through the weight ledger, not at the model around it; the clean port passes."""
    torch.manual_seed(0)
    reference, candidate = _Projected(inline=False), _Projected(inline=True)
    candidate.load_state_dict(reference.state_dict())
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    clean = check(reference, candidate, tmp_path / "clean", reference_call=lambda m: m(x)).report
    assert clean.passed, headline(clean)
    with torch.no_grad():
        candidate.inner.weight.mul_(1.01)
    report = check(reference, candidate, tmp_path / "scaled", reference_call=lambda m: m(x)).report
    assert not report.passed and report.weight_origin is not None
    assert report.summary()["first_divergence"] == "inner"
    line = headline(report)
    assert line.startswith("FAIL: divergence starts at inner (weight rel_l2 0.01): its weight differs, inner.weight")
    assert "its calls have no counterpart: the candidate computes it in <root>'s own code" in line


class _Halved(_Projected):
    """The projection stored halved and doubled by the block's own code: a correct port whose weight the ledger
    finds "scaled by 0.5" (as MONAI's cls_token holds the reference's plus its position)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(F.linear(x, 2 * self.inner.weight, self.inner.bias)))


def test_a_standing_weight_difference_is_not_named_for_a_bug_elsewhere(tmp_path):
    """A weight finding of a correct port (stored halved, doubled in code) at a reference module that runs unpaired
    explains nothing when divergence starts at another module whose input agrees: a 1 % error in ``out``'s output is
    named at ``out``."""
    torch.manual_seed(0)
    reference, candidate = _Projected(inline=False), _Halved(inline=True)
    candidate.load_state_dict(reference.state_dict())
    with torch.no_grad():
        candidate.inner.weight.mul_(0.5)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    clean = check(reference, candidate, tmp_path / "clean", reference_call=lambda m: m(x)).report
    assert clean.passed and [f.detail for f in clean.alignment.weights.differing] != []
    candidate.out.register_forward_hook(lambda _m, _a, out: out * 1.01)
    report = check(reference, candidate, tmp_path / "planted", reference_call=lambda m: m(x)).report
    assert report.weight_origin is None and report.summary()["first_divergence"] == "out", headline(report)


def test_a_norm_held_more_often_by_the_candidate_still_has_a_twin_when_one_copy_differs():
    """GPT-J's parallel block normalises once for attention and MLP; TransformerLens holds two norms (``ln1``,
    ``ln2``) with the same values, so the candidate holds untrained norms more often than the reference. One of them
    x1.01 was near no reference tensor (every copy claimed by the exact ones) and went unnamed."""
    reference, candidate = nn.Module(), nn.Module()
    reference.ln_1, reference.ln_f = nn.LayerNorm(16), nn.LayerNorm(16)
    candidate.ln1, candidate.ln2, candidate.ln_final = nn.LayerNorm(16), nn.LayerNorm(16), nn.LayerNorm(16)
    with torch.no_grad():
        candidate.ln1.weight.mul_(1.01)
    ledger = weight_ledger(fingerprint(reference), fingerprint(candidate))
    (finding,) = ledger.differing
    assert finding.candidate == "ln1.weight" and finding.reference in ("ln_1.weight", "ln_f.weight")
    assert finding.detail.startswith("scaled by 1.01, rel_l2 0.01 (the reference holds these values 2 times")


class Backbone(nn.Module):
    """A stack of pre-norm residual blocks and its final norm, all norms untrained (transformers' ``MambaModel``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(16), "mixer": nn.Linear(16, 16)}) for _ in "ab")
        self.norm_f = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer["mixer"](layer["norm"](x))
        return self.norm_f(x)


class WithBackbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone, self.head = Backbone(), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(16), "mixer": nn.Linear(16, 16)}) for _ in "ab")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer["mixer"](layer["norm"](x))
        return x


class FinalNormOutside(nn.Module):
    """The port: the final norm beside the stack, not in it (mambapy's ``LM``)."""

    def __init__(self) -> None:
        super().__init__()
        self.mamba, self.norm_f, self.head = Blocks(), nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm_f(self.mamba(x)))


def final_norm_outside(plants: tuple[str, ...] = ()) -> tuple[WithBackbone, FinalNormOutside]:
    torch.manual_seed(0)
    reference, candidate = WithBackbone(), FinalNormOutside()
    weights = {key.replace("backbone.layers", "mamba.layers").replace("backbone.", ""): value
               for key, value in reference.state_dict().items()}  # fmt: skip
    candidate.load_state_dict(weights)
    with torch.no_grad():
        for site in plants:
            candidate.get_submodule(site).weight.mul_(1.01)
    return reference, candidate


@pytest.mark.parametrize("plants", [("norm_f",), ("mamba.layers.1.norm", "norm_f")], ids=["final", "two"])
def test_a_copy_of_values_the_reference_holds_several_times_is_the_one_no_exact_copy_took(plants):
    """The reference's three norms hold the same ones; the port's two block norms are exact copies and take the
    blocks' copies, so the final norm x1.01 is near the reference's final norm, not the first block's (which no
    module of the port stands for): the run named the stack around it. Two near ones each take their own copy."""
    reference, candidate = final_norm_outside(plants)
    ledger = weight_ledger(fingerprint(reference), fingerprint(candidate))
    found = {finding.candidate: finding.reference for finding in ledger.differing}
    expected = {f"{site}.weight": f"backbone.{site.removeprefix('mamba.')}.weight" for site in plants}
    assert found == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_final_norm_among_identical_copies_held_outside_the_stack_is_named(tmp_path, dtype):
    reference, candidate = final_norm_outside(("norm_f",))
    report = run(reference, candidate, tmp_path, dtype).report
    assert report.first_divergence is not None and report.first_divergence.path == "backbone.norm_f", headline(report)
    assert "norm_f.weight differs from the reference's backbone.norm_f.weight: scaled by" in headline(report)
