"""The lifted replay: a bf16/fp16 candidate's code judged in float32 with the weights it holds, so errors
under the precision's rounding are found, where the weights are provably the same and nowhere else."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paritylab.comparison.lifted import lifts, same_weights
from paritylab.comparison.report import compare_traces
from paritylab.comparison.twins import Twins, twins
from paritylab.run.lifting import configured_wide, lift, widened
from paritylab.run.parity import check, converted_copy, trace_model
from paritylab.tracing.initial import reset_caches


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.act = nn.GELU()
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


class Tower(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _pair() -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    reference = Tower().eval()
    for parameter in reference.parameters():  # norms with weights that rounding changes
        nn.init.normal_(parameter, std=0.3)
    return reference, converted_copy(reference, torch.bfloat16), torch.randn(2, 5, 8)


def _scaled(module: nn.Module, factor: float) -> None:
    module.register_forward_hook(lambda _m, _a, out: out * factor)


def test_a_tenth_of_a_percent_in_a_bf16_candidate_is_named_and_the_clean_one_passes(tmp_path):
    """×1.001 in bf16 is a quarter of one rounding step: the bf16 judgement cannot see it, the lifted replay
    (same bf16 weights, float32 arithmetic) names the module. The clean candidate passes."""
    reference, candidate, x = _pair()
    calls = {"reference_call": lambda m: m(x), "candidate_call": lambda m: m(x.bfloat16())}
    clean = check(reference, candidate, tmp_path / "clean", **calls)
    assert clean.passed and clean.report.first_divergence is None
    lifted = [row.local["lifted_rel_l2"] for row in clean.report.rows if "lifted_rel_l2" in row.local]
    assert len(lifted) >= 8 and max(lifted) < 1e-6  # same weights, float32: code alone differs (it does not)
    _scaled(candidate.blocks[1].up, 1.001)
    buggy = check(reference, candidate, tmp_path / "buggy", **calls)
    assert not buggy.passed and buggy.report.first_divergence.path == "blocks.1.up"
    culprit = buggy.report.first_divergence
    assert "with the same bfloat16 weights computed in float32" in culprit.note
    assert math.isclose(culprit.local["lifted_rel_l2"], 1e-3, rel_tol=0.05)
    assert [row.path for row in buggy.report.replay_origins] == ["blocks.1.up"]


def test_without_the_lifted_replay_the_same_bug_goes_unseen(tmp_path):
    """The control for the test above: the bf16 judgement alone (no reference model given to lift) passes."""
    from paritylab.run.parity import compare_and_replay, estimate_floors

    reference, candidate, x = _pair()
    _scaled(candidate.blocks[1].up, 1.001)
    reference_trace = trace_model(reference, lambda m: m(x), tmp_path / "reference")
    candidate_trace = trace_model(candidate, lambda m: m(x.bfloat16()), tmp_path / "candidate")
    floors = estimate_floors(reference, lambda m: m(x), reference_trace, torch.bfloat16, tmp_path)
    alone = compare_and_replay(
        reference_trace, candidate_trace, candidate, lambda m: m(x.bfloat16()), tmp_path, floors=floors
    )
    assert alone.passed


class Float32Norm(nn.LayerNorm):
    """A LayerNorm kept in float32 inside a bf16 model, as implementations do for stability: it computes in
    float32 and hands back the input's precision."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.normalized_shape, self.weight, self.bias, self.eps).to(x.dtype)


def _float32_norms(reference: nn.Module) -> nn.Module:
    """The reference in bf16 with its norms kept in float32, holding the reference's exact weights."""
    candidate = converted_copy(reference, torch.bfloat16)
    for block, original in zip(candidate.blocks, reference.blocks, strict=True):
        block.norm = Float32Norm(original.norm.normalized_shape)
        block.norm.load_state_dict(original.norm.state_dict())
    return candidate


def test_norms_kept_in_float32_with_the_references_weights_are_lifted_and_a_bug_there_is_named(tmp_path):
    """Norms held in float32 with the reference's exact values: provably the same weights (the lifted
    reference leaves their twins unrounded), so the norms and the blocks holding them are judged lifted; a
    x1.001 gain in one, a quarter of a bf16 rounding step, is named there, and the clean candidate passes."""
    reference, _, x = _pair()
    candidate = _float32_norms(reference)
    calls = {"reference_call": lambda m: m(x), "candidate_call": lambda m: m(x.bfloat16())}
    clean = check(reference, candidate, tmp_path / "clean", **calls)
    assert clean.passed, clean.report.first_divergence
    lifted = {row.path: row.local["lifted_rel_l2"] for row in clean.report.rows if "lifted_rel_l2" in row.local}
    assert {"blocks.0.norm", "blocks.1.norm", "blocks.0", "blocks.1"} <= set(lifted)
    assert max(lifted.values()) < 1e-6  # the same weights in float32: the code alone differs, and it does not
    _scaled(candidate.blocks[1].norm, 1.001)
    buggy = check(reference, candidate, tmp_path / "buggy", **calls)
    assert not buggy.passed and buggy.report.first_divergence.path == "blocks.1.norm"
    assert math.isclose(buggy.report.first_divergence.local["lifted_rel_l2"], 1e-3, rel_tol=0.05)


class ShiftedNorm(nn.Module):
    """A LayerNorm storing its scale minus one, multiplying by ``1 + g`` (x-transformers', Gemma's norms)."""

    def __init__(self, norm: nn.LayerNorm) -> None:
        super().__init__()
        self.shape, self.eps = norm.normalized_shape, norm.eps
        self.g = nn.Parameter(norm.weight.detach() - 1)
        self.bias = nn.Parameter(norm.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.shape, 1 + self.g, self.bias, self.eps)


def _shifted_norms(reference: nn.Module, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    candidate = converted_copy(reference, torch.float32)
    for block in candidate.blocks:
        block.norm = ShiftedNorm(block.norm)
    return candidate.to(dtype)


def test_norms_stored_minus_one_are_lifted_with_the_scale_the_candidate_computes_with(tmp_path):
    """A norm stored as ``g = w - 1`` rounds to bf16 more finely than ``w``: the two sides' scales differ by
    rounding, as much as a 0.1 % bug. The lifted reference holds ``g + 1``, what the candidate computes with,
    so the norms are judged lifted: the clean candidate passes with its norms' code identical, and a x1.001
    gain in one norm is named there."""
    reference, _, x = _pair()
    candidate = _shifted_norms(reference)
    found = twins(reference, candidate, torch.bfloat16)
    assert found.shifted == {id(block.norm.weight) for block in reference.blocks}
    norm = reference.blocks[0].norm
    assert torch.equal(found.given[id(norm.weight)], candidate.blocks[0].norm.g.float() + 1)
    assert not torch.equal(found.given[id(norm.weight)], norm.weight.detach().bfloat16().float())  # finer
    calls = {"reference_call": lambda m: m(x), "candidate_call": lambda m: m(x.bfloat16())}
    clean = check(reference, candidate, tmp_path / "clean", **calls)
    assert clean.passed, clean.report.first_divergence
    lifted = {row.path: row.local["lifted_rel_l2"] for row in clean.report.rows if "lifted_rel_l2" in row.local}
    assert {"blocks.0.norm", "blocks.1.norm", "blocks.0", "blocks.1", ""} <= set(lifted)
    assert max(lifted.values()) < 1e-6
    _scaled(candidate.blocks[1].norm, 1.001)
    buggy = check(reference, candidate, tmp_path / "buggy", **calls)
    assert not buggy.passed and buggy.report.first_divergence.path == "blocks.1.norm"
    assert math.isclose(buggy.report.first_divergence.local["lifted_rel_l2"], 1e-3, rel_tol=0.05)


def test_a_norm_of_ones_beside_a_bias_of_zeros_is_no_shift():
    """Untrained norms: weight ones, bias zeros. The candidate's zeros are the reference's bias, not its ones
    shifted, since the candidate holds the ones too: nothing is shifted, nothing given. A norm of ones that
    the candidate stores as zeros, with no bias to explain them, is shifted (and gives ones: the same)."""
    torch.manual_seed(0)
    reference = Tower().eval()
    assert twins(reference, converted_copy(reference, torch.bfloat16), torch.bfloat16) == Twins()
    rms = nn.Sequential(nn.Linear(8, 16, bias=False), nn.RMSNorm(16), nn.Linear(16, 4, bias=False))
    shifted = converted_copy(rms, torch.bfloat16)
    with torch.no_grad():
        shifted[1].weight.zero_()  # as a norm multiplying by 1 + weight would hold it
    found = twins(rms, shifted, torch.bfloat16)
    assert found.shifted == {id(rms[1].weight)} and torch.equal(found.given[id(rms[1].weight)], torch.ones(16))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Rotary(nn.Module):
    """Rotary angles of positions from an ``inv_freq`` buffer (a cast rounds it); their cosine and sine
    (``tables``) as transformers' rotary modules give them, else the angles as x-transformers' does."""

    def __init__(self, width: int, tables: bool) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, width, 2).float() / width)))
        self.tables = tables

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        angles = torch.outer(positions, self.inv_freq.to(positions.dtype))
        angles = torch.cat([angles, angles], dim=-1)
        return (angles.cos(), angles.sin()) if self.tables else (angles,)


class Angles(Rotary):
    """The port's own rotary module (another class), kept under the original's name."""


class Attention(nn.Module):
    """One head, rotary: given cos and sin, or the angles to take them of."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor, *rotary: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary if len(rotary) == 2 else (rotary[0].cos(), rotary[0].sin())
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        q, k = _rotate(self.q(x), cos, sin), _rotate(self.k(x), cos, sin)
        return x + self.o(F.scaled_dot_product_attention(q, k, self.v(x), is_causal=True))


class RotaryTower(nn.Module):
    """The reference's rotary module makes cos and sin once; the candidate's (``angles``) the angles, each
    attention taking cos and sin itself, as x-transformers does."""

    def __init__(self, width: int = 16, angles: bool = False) -> None:
        super().__init__()
        self.rotary = Angles(width, tables=False) if angles else Rotary(width, tables=True)
        self.blocks = nn.ModuleList(Attention(width) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rotary = self.rotary(torch.arange(x.shape[1], dtype=torch.float32))
        for block in self.blocks:
            x = block(x, *rotary)
        return x


def test_a_buffer_a_cast_rounded_is_restored_and_angles_made_from_it_are_the_candidates_own(tmp_path):
    """The candidate's ``inv_freq`` rounded by the cast is the rounding of the reference's: the lifted candidate
    holds the reference's values again. The angles it makes from positions alone have no counterpart (the
    reference hands on cos and sin), yet they are what the candidate computes in float32, so each attention is
    judged lifted: the clean candidate passes, a x1.001 gain in one attention is named there."""
    torch.manual_seed(0)
    reference = RotaryTower().eval()
    candidate = RotaryTower(angles=True).eval()
    candidate.load_state_dict(reference.state_dict())
    candidate = candidate.to(torch.bfloat16)
    found = twins(reference, candidate, torch.bfloat16)
    assert list(found.restored) == [id(candidate.rotary.inv_freq)]
    assert torch.equal(found.restored[id(candidate.rotary.inv_freq)], reference.rotary.inv_freq)
    x = torch.randn(1, 12, 16)
    calls = {"reference_call": lambda m: m(x), "candidate_call": lambda m: m(x.bfloat16())}
    clean = check(reference, candidate, tmp_path / "clean", **calls)
    assert clean.passed, clean.report.first_divergence
    lifted = {row.path: row.local["lifted_rel_l2"] for row in clean.report.rows if "lifted_rel_l2" in row.local}
    assert {"blocks.0", "blocks.1"} <= set(lifted) and max(lifted.values()) < 1e-6
    _scaled(candidate.blocks[1], 1.001)
    buggy = check(reference, candidate, tmp_path / "buggy", **calls)
    assert not buggy.passed and buggy.report.first_divergence.path == "blocks.1"
    assert math.isclose(buggy.report.first_divergence.local["lifted_rel_l2"], 1e-3, rel_tol=0.1)


class CachedAngles(Angles):
    """fair-esm's way: the angles computed in its buffer's dtype on the first call and cached for the next ones."""

    def __init__(self, width: int) -> None:
        super().__init__(width, tables=False)
        self._cached: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self._cached is None or len(self._cached) != len(positions):
            angles = torch.outer(positions.to(self.inv_freq.dtype), self.inv_freq)
            self._cached = torch.cat([angles, angles], dim=-1)
        return (self._cached,)


def _cached_pair() -> tuple[nn.Module, nn.Module, torch.Tensor]:
    """A rotary reference and a bf16 candidate whose angles are cached on the module (:class:`CachedAngles`)."""
    torch.manual_seed(0)
    reference = RotaryTower().eval()
    candidate = RotaryTower(angles=True).eval()
    candidate.rotary = CachedAngles(16)
    candidate.load_state_dict(reference.state_dict())
    return reference, candidate.to(torch.bfloat16), torch.randn(1, 12, 16)


def test_what_a_low_precision_run_cached_is_made_afresh_in_the_lifted_copy(tmp_path):
    """The bf16 run caches its angles in bf16 on the module; a float32 copy made afterwards would reuse them. The
    lifted copy puts the cache back as it was before the first traced run (none), so the angles are computed
    again in float32 from the restored ``inv_freq``, the attentions are judged lifted, and a x1.001 gain in one
    is named there."""
    reference, candidate, x = _cached_pair()
    calls = {"reference_call": lambda m: m(x), "candidate_call": lambda m: m(x.bfloat16())}
    clean = check(reference, candidate, tmp_path / "clean", **calls)
    assert clean.passed, clean.report.first_divergence
    assert candidate.rotary._cached is not None and candidate.rotary._cached.dtype == torch.bfloat16
    copy = converted_copy(candidate, torch.float32)
    assert reset_caches(copy, candidate) == ["rotary._cached"] and copy.rotary._cached is None
    lifted = {row.path: row.local["lifted_rel_l2"] for row in clean.report.rows if "lifted_rel_l2" in row.local}
    assert {"blocks.0", "blocks.1"} <= set(lifted) and max(lifted.values()) < 1e-6
    _scaled(candidate.blocks[1], 1.001)
    buggy = check(reference, candidate, tmp_path / "buggy", **calls)
    assert not buggy.passed and buggy.report.first_divergence.path == "blocks.1"
    assert math.isclose(buggy.report.first_divergence.local["lifted_rel_l2"], 1e-3, rel_tol=0.1)


def test_weights_kept_wider_or_state_a_cast_rounded_are_not_lifted(tmp_path):
    """Only pairs whose weights are provably the same are judged lifted: a norm the candidate keeps in float32
    with values no reference parameter holds (exactly or rounded), and a table a cast rounded (a rotary
    table), stay with the bf16 judgement, as do the modules that hold them. A norm widened after the cast holds
    the reference's rounded values: that is provable, and it is lifted."""
    reference, candidate, x = _pair()
    candidate.blocks[0].norm.float()
    candidate.blocks[1].norm.float()
    with torch.no_grad():
        candidate.blocks[0].norm.weight.mul_(1 + 2**-12)  # kept wide, with values of its own
    candidate.blocks[1].register_buffer("table", torch.linspace(0.1, 0.9, 7).to(torch.bfloat16))
    candidate.blocks[1].up.register_buffer("mask", torch.tensor([0.0, -math.inf, 1.0, 0.125]).to(torch.bfloat16))
    reference_trace = trace_model(reference, lambda m: m(x), tmp_path / "reference")
    candidate_trace = trace_model(candidate, lambda m: m(x.bfloat16()), tmp_path / "candidate")
    alignment = compare_traces(reference_trace, candidate_trace).alignment
    eligible = same_weights(reference, candidate, reference_trace, candidate_trace, alignment, torch.bfloat16)
    paths = {reference_trace.call(key).path for key in eligible}
    assert not {"blocks.0.norm", "blocks.0", "blocks.1", ""} & paths  # they hold, or sit above, either
    assert "blocks.1.up" in paths  # a mask of 0, -inf, 1 and 1/8 survives any cast
    assert {"inp", "blocks.0.up", "blocks.0.act", "blocks.0.down", "blocks.1.norm", "head"} <= paths
    assert twins(reference, candidate, torch.bfloat16).given == {}  # rounded twins need no exception
    assert lifts(reference, candidate) == torch.bfloat16
    assert lifts(reference, converted_copy(reference, torch.float64)) is None  # nothing in low precision
    assert lifts(candidate, reference) is None  # the reference in low precision: nothing to lift


def test_a_precision_named_in_a_config_is_lifted_too():
    """TransformerLens casts norms and attention patterns to ``cfg.dtype``: the lifted copy's config names
    float32, on the module and on the config object it shares."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    config = SimpleNamespace(dtype=torch.bfloat16, d_model=2, precision="bf16", name="bf16-tiny")
    for module in model:
        module.cfg = config
    model[1].compute_dtype = torch.bfloat16
    model[1].torch_dtype = "torch.bfloat16"
    configured_wide(model, torch.bfloat16)
    assert config.dtype == torch.float32 and model[1].compute_dtype == torch.float32 and config.d_model == 2
    assert config.precision == "fp32" and model[1].torch_dtype == "float32" and config.name == "bf16-tiny"


def test_widened_calls_give_both_copies_the_candidates_rounded_inputs():
    """Whether a call passes float32 inputs or bf16 ones, the lifted copies receive the bf16 values in float32
    (what the candidate itself computes from), integers untouched."""
    model = _Recorder()
    x, ids = torch.tensor([1.0 + 2**-10, 3.0]), torch.tensor([1, 2])
    widened(lambda m: m(x, ids=ids), torch.bfloat16)(model)
    widened(lambda m: m(x.bfloat16(), ids=ids), torch.bfloat16)(model)
    assert len(model.seen) == 2
    for value, index in model.seen:
        assert value.dtype == torch.float32 and value.tolist() == [1.0, 3.0] and index.tolist() == [1, 2]


class _Recorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        self.seen.append((x, ids))
        return x


@pytest.mark.parametrize("dtype", [torch.float16], ids=["fp16"])
def test_an_fp16_candidate_is_lifted_on_its_own_grid(dtype, tmp_path):
    reference, _, x = _pair()
    candidate = converted_copy(reference, dtype)
    _scaled(candidate.blocks[0].down, 1 + 2e-4)  # a fifth of an fp16 rounding step
    buggy = check(reference, candidate, tmp_path, reference_call=lambda m: m(x), candidate_call=lambda m: m(x.half()))
    culprit = buggy.report.first_divergence
    assert culprit.path == "blocks.0.down" and math.isclose(culprit.local["lifted_rel_l2"], 2e-4, rel_tol=0.05)


def test_a_precision_the_copy_cannot_lift_is_not_taken_for_bugs(tmp_path):
    """Code that rounds to bf16 by itself (a hard-coded cast the lifted copy cannot see) makes most modules
    differ in float32: the lifted replay is then set aside with a note, and the clean candidate passes."""
    reference, candidate, x = _pair()
    for module in candidate.modules():
        if isinstance(module, nn.Linear | nn.LayerNorm):
            module.register_forward_hook(lambda _m, _a, out: out + (out.bfloat16().to(out.dtype) - out) * 0.5)
    lifted, notes = _lifted(reference, candidate, x, tmp_path)
    assert lifted is None and len(notes) == 1 and "lifted replay not used" in notes[0]


def test_the_lifted_replay_runs_in_place_as_its_float32_copies_do(tmp_path, monkeypatch):
    """No float32 copy of either model is made: each module's tensors are converted while it runs (the reference's
    parameters rounded, the candidate widened, its cached angles made afresh, its rounded ``inv_freq`` restored),
    with the very values the copies compute, and both models are as they were afterwards, caches included."""
    import paritylab.run.lifting as lifting

    reference, candidate, x = _cached_pair()
    reference_trace = trace_model(reference, lambda m: m(x), tmp_path / "reference")
    candidate_trace = trace_model(candidate, lambda m: m(x.bfloat16()), tmp_path / "candidate")
    alignment = compare_traces(reference_trace, candidate_trace).alignment
    cache = candidate.rotary._cached
    held = [(id(m), name, t) for m in (reference, candidate) for name, t in m.state_dict(keep_vars=True).items()]
    weights = {(model, name): (t, t.clone()) for model, name, t in held}
    args = (reference, lambda m: m(x), candidate, lambda m: m(x.bfloat16()), reference_trace, candidate_trace)

    def copied(*_: object, **__: object) -> None:
        raise AssertionError("a float32 copy was made")

    with monkeypatch.context() as patch:
        patch.setattr(lifting, "converted_copy", copied)
        in_place = lift(*args, alignment, tmp_path / "in-place")
    assert in_place is not None and not in_place.copies
    assert candidate.rotary._cached is cache and cache.dtype == torch.bfloat16  # the bf16 run's cache, kept
    for model in (reference, candidate):
        for name, tensor in model.state_dict(keep_vars=True).items():
            kept, values = weights[id(model), name]
            assert tensor is kept and torch.equal(tensor, values), name
    monkeypatch.setattr(lifting, "_narrowed", lambda traces, dtype: True)  # as if in place could not run
    copied_replay = lift(*args, alignment, tmp_path / "copies")
    assert copied_replay is not None and copied_replay.copies
    for made, expected in (
        (in_place.reference, copied_replay.reference),
        (in_place.candidate, copied_replay.candidate),
    ):
        assert [c.key for c in made.calls] == [c.key for c in expected.calls]
        for call, twin in zip(made.calls, expected.calls, strict=True):
            for (slot, node), (_, other) in zip(call.tensors(), twin.tensors(), strict=True):
                value, wanted = made.tensor(node), expected.tensor(other)
                assert value.dtype == torch.float32 and torch.equal(value, wanted), (call.key, slot)


class TiedTower(Tower):
    """Reads a grandchild's weight outside its call (x-transformers' tied logits ``x @ token_emb.emb.weight.T``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return h @ self.blocks[0].up.weight[:16].T


def test_a_weight_read_from_outside_its_module_is_never_met_unconverted(tmp_path, monkeypatch):
    """In place, a weight read while its module is not running would be the original (the reference's unrounded):
    it is stood in for by a meta tensor, so the in-place run fails and the lifted replay runs on float32 copies;
    where a copy does not fit, it is skipped with a note saying both, never judged on the wrong weights."""
    import paritylab.run.lifting as lifting

    torch.manual_seed(0)
    reference = TiedTower().eval()
    for parameter in reference.parameters():
        nn.init.normal_(parameter, std=0.3)
    candidate = converted_copy(reference, torch.bfloat16)
    x = torch.randn(2, 5, 8)
    lifted, notes = _lifted(reference, candidate, x, tmp_path / "fits")
    assert lifted is not None and lifted.copies and len(notes) == 1
    assert notes[0].startswith("lifted replay on float32 copies (0.00 GiB): in place, RuntimeError: aten.")
    assert "read a weight of a module that was not running" in notes[0]
    rows = lifted.judged()
    assert rows and max(row.rel_l2 for row in rows.values()) < 1e-6  # the copies: same weights, same code
    monkeypatch.setattr(lifting, "available_memory", lambda device: 1000)
    lifted, notes = _lifted(reference, candidate, x, tmp_path / "tight")
    assert lifted is None and len(notes) == 2 and notes[0].startswith("lifted replay skipped: RuntimeError")
    assert "a float32 copy (0.0 GiB), which might have run, does not fit in the 0.0 GiB available" in notes[1]
    assert all(p.device.type == "cpu" for model in (reference, candidate) for p in model.parameters())


def _lifted(reference: nn.Module, candidate: nn.Module, x: torch.Tensor, directory) -> tuple[object, list[str]]:
    """:func:`lift` on the two traced models (bf16 inputs for the candidate), and the notes it left."""
    reference_trace = trace_model(reference, lambda m: m(x), directory / "reference")
    candidate_trace = trace_model(candidate, lambda m: m(x.bfloat16()), directory / "candidate")
    alignment = compare_traces(reference_trace, candidate_trace).alignment
    notes: list[str] = []
    lifted = lift(
        reference, lambda m: m(x), candidate, lambda m: m(x.bfloat16()), reference_trace, candidate_trace, alignment,
        directory, notes,
    )  # fmt: skip
    return lifted, notes


class Tabled(nn.Module):
    """A layer holding a position table (sin and cos side by side, as GPT-J's ``embed_positions``)."""

    def __init__(self, rows: int, interleaved: bool = False) -> None:
        super().__init__()
        angles = torch.arange(rows, dtype=torch.float64)[:, None] * (0.37 ** torch.arange(4, dtype=torch.float64))
        table = torch.cat([angles.sin(), angles.cos()], dim=-1).float()
        self.register_buffer("table", table.repeat_interleave(2, dim=-1) if interleaved else table)


def test_a_table_a_cast_rounded_is_proven_from_every_reference_table_it_rounds(tmp_path):
    """The candidate's rounded tables (another number of rows, columns repeated: interleaved) are, column for column,
    the rounding of the reference's, whatever their order: proven, and every reference buffer holding the table
    (one per layer) is rounded in the lifted reference; a table that matches none (another frequency) is not."""
    reference = nn.Sequential(Tabled(16), Tabled(16))
    candidate = nn.Sequential(Tabled(32, interleaved=True), Tabled(32, interleaved=True)).to(torch.bfloat16)
    found = twins(reference, candidate, torch.bfloat16)
    assert {id(b) for b in candidate.buffers()} <= found.proven
    assert set(found.given) == {id(b) for b in reference.buffers()}  # both layers' tables, not only the first
    for buffer in reference.buffers():
        assert torch.equal(found.given[id(buffer)], buffer.to(torch.bfloat16))
    wrong = nn.Sequential(Tabled(32)).to(torch.bfloat16)
    with torch.no_grad():
        wrong[0].table[:, 0] = (torch.arange(32.0) * 0.5).sin().to(torch.bfloat16)  # a column no reference holds
    assert not {id(b) for b in wrong.buffers()} & twins(reference, wrong, torch.bfloat16).proven
