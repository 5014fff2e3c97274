"""A flat port applies its norms by function: where the first thing seen wrong is such a norm (no counterpart), the
function reading its weights tells whether it was given a wrong value (a residual the port's code dropped: the
code before it is named) or the right one (the norm itself is wrong: it stays named, with that evidence)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paritylab.run.parity import check

WIDTH, LAYERS = 32, 3


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.mix, self.ln2, self.mlp = nn.LayerNorm(WIDTH), _Mlp(), nn.LayerNorm(WIDTH), _Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.final = nn.Embedding(64, WIDTH), nn.LayerNorm(WIDTH)
        self.blocks = nn.ModuleList([_Block() for _ in range(LAYERS)])
        self.head = nn.Linear(WIDTH, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final(x))


class _FlatPort(nn.Module):
    """Every block in the root's code: its linear maps in one ModuleDict, its norms' weights applied by function.
    ``dropped`` = (layer, 1 or 2): that residual is left out; ``eps`` = (layer, 1 or 2): that norm's eps."""

    def __init__(self, dropped: tuple[int, int] | None = None, eps: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.dropped, self.eps = dropped, eps
        self.embed, self.final, self.head = nn.Embedding(64, WIDTH), nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 64)
        self.maps = nn.ModuleDict()
        self.norms = nn.ParameterDict()
        for layer in range(LAYERS):
            for which in (1, 2):
                self.maps[f"in{which}_{layer}"] = nn.Linear(WIDTH, 2 * WIDTH)
                self.maps[f"out{which}_{layer}"] = nn.Linear(2 * WIDTH, WIDTH)
                self.norms[f"scale{which}_{layer}"] = nn.Parameter(torch.ones(WIDTH))
                self.norms[f"shift{which}_{layer}"] = nn.Parameter(torch.zeros(WIDTH))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in range(LAYERS):
            for which in (1, 2):
                scale, shift = self.norms[f"scale{which}_{layer}"], self.norms[f"shift{which}_{layer}"]
                eps = 0.5 if self.eps == (layer, which) else 1e-5
                h = F.layer_norm(x, (WIDTH,), scale, shift, eps)
                h = self.maps[f"out{which}_{layer}"](F.gelu(self.maps[f"in{which}_{layer}"](h)))
                x = h if self.dropped == (layer, which) else x + h
        return self.head(self.final(x))


def _pair(**bug: tuple[int, int]) -> tuple[_Model, _FlatPort]:
    torch.manual_seed(0)
    reference = _Model().eval()
    state = {f"{name}.{key}": value for name in ("embed", "final", "head") for key, value in
             getattr(reference, name).state_dict().items()}  # fmt: skip
    with torch.no_grad():
        for layer, block in enumerate(reference.blocks):
            for which, (norm, mlp) in enumerate(((block.ln1, block.mix), (block.ln2, block.mlp)), 1):
                norm.weight.copy_(1 + 0.2 * torch.randn(WIDTH))
                norm.bias.copy_(0.1 * torch.randn(WIDTH))
                state[f"norms.scale{which}_{layer}"], state[f"norms.shift{which}_{layer}"] = norm.weight, norm.bias
                for side, linear in (("in", mlp.fc1), ("out", mlp.fc2)):
                    state[f"maps.{side}{which}_{layer}.weight"] = linear.weight
                    state[f"maps.{side}{which}_{layer}.bias"] = linear.bias
    candidate = _FlatPort(**bug).eval()
    candidate.load_state_dict({key: value.detach().clone() for key, value in state.items()})
    return reference, candidate


IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dropped", [(1, 1), (1, 2)])
def test_a_residual_dropped_in_a_flat_port_is_named_at_the_block_whose_code_holds_it(tmp_path, dtype, dropped):
    """The norm after the dropped residual (applied by ``F.layer_norm``, no counterpart) was named: "its output
    reaches blocks.1.mlp.fc1 changed". The layer_norm reading its weights is given a wrong value, so the code that
    made the value is named: block 1's own code (the residual inside it, or the one its output lacks)."""
    reference, clean = _pair()
    passed = check(reference, clean.to(dtype), tmp_path / "clean", reference_call=lambda m: m(IDS), echo=None)
    assert passed.report.passed, passed.report.summary()
    reference, candidate = _pair(dropped=dropped)
    call = lambda m: m(IDS)  # noqa: E731
    result = check(reference, candidate.to(dtype), tmp_path / "bug", reference_call=call, echo=None, drilldown=False)
    assert result.report.origin == "blocks.1", result.report.summary()
    norm = "blocks.1.ln2" if dropped == (1, 1) else "blocks.2.ln1"
    assert f"the layer_norm reading {norm}'s weights in the candidate is given a value that differs" in (
        result.report.culprit_reason
    )
    row = next(row for row in result.report.rows if row.path == norm)
    assert row.cause == "inherited" and row.note.startswith("its input already differs")


def test_a_norm_applied_by_a_function_with_a_wrong_eps_stays_named(tmp_path):
    """The norm's own computation is wrong (eps 0.5): the layer_norm reading its weights was given its input, so the
    norm is named, with that evidence."""
    reference, candidate = _pair(eps=(1, 2))
    call = lambda m: m(IDS)  # noqa: E731
    result = check(reference, candidate, tmp_path, reference_call=call, echo=None, drilldown=False)
    assert result.report.origin == "blocks.1.ln2", result.report.summary()
    named = result.report.first_divergence
    assert named is not None and "the layer_norm reading its weights in the candidate was given its input" in named.note


def test_weights_every_norm_shares_are_not_read_as_one_norms(tmp_path):
    """A random-init norm's ones and zeros are every norm's: which function call reads which norm's is unknown, so
    nothing is inferred from them (the norm stays named as before)."""
    torch.manual_seed(0)
    reference, candidate = _Model().eval(), _FlatPort(dropped=(1, 1)).eval()
    state = {f"{name}.{key}": value for name in ("embed", "final", "head") for key, value in
             getattr(reference, name).state_dict().items()}  # fmt: skip
    for layer, block in enumerate(reference.blocks):
        for which, mlp in ((1, block.mix), (2, block.mlp)):
            for side, linear in (("in", mlp.fc1), ("out", mlp.fc2)):
                state[f"maps.{side}{which}_{layer}.weight"] = linear.weight
                state[f"maps.{side}{which}_{layer}.bias"] = linear.bias
    candidate.load_state_dict({key: value.detach().clone() for key, value in state.items()}, strict=False)
    result = check(reference, candidate, tmp_path, reference_call=lambda m: m(IDS), echo=None, drilldown=False)
    assert not result.report.passed
    assert "reading" not in result.report.culprit_reason
