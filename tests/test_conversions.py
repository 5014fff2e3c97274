"""Conversion bugs found by trying pairs from outside the suite: a fused projection whose shape an embedding table
shares, a bias a conversion dropped, a rotary table built from another base, and a flat port (no module per layer)
whose attention's code goes wrong or whose fused projections hold their parts in an order its code does not read.
Each is named where it is, and the clean port passes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paritylab.run.parity import check

D, HEADS = 32, 4


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, tokens, HEADS, -1).transpose(1, 2)

        mixed = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)))
        return self.o(mixed.transpose(1, 2).reshape(batch, tokens, D))


class _FusedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q, k, v = (t.view(batch, tokens, HEADS, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, tokens, D))


class _Model(nn.Module):
    def __init__(self, vocab: int, fused: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, D)
        self.blocks = nn.ModuleList([_FusedAttention() if fused else _Attention() for _ in range(2)])
        self.head = nn.Linear(D, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_projection_shaped_like_the_embedding_is_not_taken_for_it(tmp_path, dtype):
    """A fused [q; k; v] weight of the embedding table's shape (vocabulary 96, width 32), one element of its k block
    x1.01, the table held twice (tied by copy): the ledger took the fused weight for a defective copy of the table
    (two tensors named ``weight``, rel_l2 0.99) and bfloat16 PASSED. Now it is the k block, named at k."""
    torch.manual_seed(0)
    reference = _Model(96, fused=False).eval()
    with torch.no_grad():
        reference.head.weight.copy_(reference.embed.weight)
        for block in reference.blocks:
            for linear in (block.q, block.k, block.v, block.o):
                linear.weight.normal_(0, (D * 8) ** -0.5)
    candidate = _Model(96, fused=True).eval()
    state = {"embed.weight": reference.embed.weight, "head.weight": reference.head.weight}
    for index, block in enumerate(reference.blocks):
        state[f"blocks.{index}.qkv.weight"] = torch.cat([block.q.weight, block.k.weight, block.v.weight])
        state[f"blocks.{index}.out.weight"] = block.o.weight
    state = {key: value.detach().clone() for key, value in state.items()}
    candidate.load_state_dict(state)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    call = lambda model: model(ids)  # noqa: E731
    clean = check(reference, candidate.to(dtype), tmp_path / "clean", reference_call=call, echo=None, drilldown=False)
    assert clean.report.passed, clean.report.summary()
    state["blocks.1.qkv.weight"][D + 10, 10] *= 1.01
    candidate.load_state_dict(state)
    result = check(reference, candidate.to(dtype), tmp_path / "k", reference_call=call, echo=None, drilldown=False)
    assert not result.report.passed and result.report.origin == "blocks.1.k", result.report.summary()
    assert not any("embed" in finding.reference for finding in result.report.alignment.weights.findings)


class _Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.ln, self.act, self.fc2 = nn.Linear(16, 48), nn.LayerNorm(48), nn.GELU(), nn.Linear(48, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.ln(self.fc1(x))))


class _NormPort(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(16, 48), nn.LayerNorm(48), nn.Linear(48, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp[2](F.gelu(self.mlp[1](self.mlp[0](x))))


def test_a_bias_the_conversion_dropped_is_named_at_its_module(tmp_path):
    """A LayerNorm whose bias the conversion zeroed: fingerprints leave all-zero tensors out (they compute nothing),
    so the module held the reference's weight alone and paired with nothing, and the GELU after it was named. The
    ledger now says the bias was dropped, the modules pair, and the norm is named."""
    torch.manual_seed(0)
    reference = _Norm().eval()
    with torch.no_grad():
        reference.ln.weight.copy_(1 + 0.2 * torch.randn(48))
        reference.ln.bias.copy_(0.1 * torch.randn(48))
    names = {"fc1": "mlp.0", "ln": "mlp.1", "fc2": "mlp.2"}
    state = {
        names[key.split(".")[0]] + key[key.index(".") :]: value.clone() for key, value in reference.state_dict().items()
    }
    candidate = _NormPort().eval()
    candidate.load_state_dict(state)
    x = torch.randn(4, 16)
    clean = check(reference, candidate, tmp_path / "clean", reference_call=lambda m: m(x), echo=None, drilldown=False)
    assert clean.report.passed, clean.report.summary()
    state["mlp.1.bias"] = torch.zeros(48)
    candidate.load_state_dict(state)
    result = check(reference, candidate, tmp_path / "bias", reference_call=lambda m: m(x), echo=None, drilldown=False)
    assert result.report.origin == "ln", result.report.summary()
    (finding,) = result.report.alignment.weights.differing
    assert (finding.reference, finding.candidate) == ("ln.bias", "mlp.1.bias") and "dropped" in finding.detail


HIDDEN, THETA, POSITIONS = 32, 1e6, 64


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, -1)
    return torch.cat((-second, first), -1)


class _Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", THETA ** -(torch.arange(0, HIDDEN // HEADS, 2).float() / (HIDDEN // HEADS)))

    def forward(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.arange(tokens).float()[:, None] * self.inv_freq[None]
        angles = torch.cat((angles, angles), -1)
        return angles.cos(), angles.sin()


class _RotaryAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(3))
        self.o = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.o(_attend(self.q(x), self.k(x), self.v(x), cos, sin))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    batch, tokens, _ = q.shape
    q, k, v = (t.view(batch, tokens, HEADS, -1).transpose(1, 2) for t in (q, k, v))
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)
    return (scores.to(v.dtype) @ v).transpose(1, 2).reshape(batch, tokens, -1)


class _RotaryModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.rotary, self.attention = nn.Embedding(64, HIDDEN), _Rotary(), _RotaryAttention()
        self.post = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, 64, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + self.attention(x, *self.rotary(ids.shape[1]))
        return self.head(self.post(x))


class _FlatPort(nn.Module):
    """Every layer in the root's own code: a fused projection, a cos/sin table built once, a norm by function."""

    def __init__(self, base: float = THETA, sine: float = 1.0) -> None:
        super().__init__()
        self.sine = sine
        self.tokens = nn.Embedding(64, HIDDEN)
        self.qkv, self.out = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False), nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.norm_weight, self.norm_bias = nn.Parameter(torch.ones(HIDDEN)), nn.Parameter(torch.zeros(HIDDEN))
        self.unembed = nn.Linear(HIDDEN, 64, bias=False)
        half = HIDDEN // HEADS
        inverse = 1.0 / base ** (torch.arange(0, half, 2, dtype=torch.float64) / half)
        angles = torch.outer(torch.arange(POSITIONS, dtype=torch.float64), inverse)
        angles = torch.cat((angles, angles), -1)
        self.register_buffer("table_cos", angles.cos().float(), persistent=False)
        self.register_buffer("table_sin", angles.sin().float(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids)
        cos, sin = self.table_cos[: ids.shape[1]], self.table_sin[: ids.shape[1]]
        x = x + self.out(_attend(*self.qkv(x).chunk(3, -1), cos, self.sine * sin))
        return self.unembed(F.layer_norm(x, (HIDDEN,), self.norm_weight, self.norm_bias))


def _flat_pair(base: float = THETA, swap_kv: bool = False, sine: float = 1.0) -> tuple[_RotaryModel, _FlatPort]:
    torch.manual_seed(0)
    reference = _RotaryModel().eval()
    with torch.no_grad():
        reference.attention.q.weight.mul_(4)
        reference.attention.k.weight.mul_(4)
        reference.post.weight.copy_(1 + 0.2 * torch.randn(HIDDEN))
        reference.post.bias.copy_(0.1 * torch.randn(HIDDEN))
    attention = reference.attention
    k, v = (attention.v, attention.k) if swap_kv else (attention.k, attention.v)
    candidate = _FlatPort(base, sine).eval()
    state = {
        "tokens.weight": reference.embed.weight, "out.weight": attention.o.weight,
        "qkv.weight": torch.cat([attention.q.weight, k.weight, v.weight]), "unembed.weight": reference.head.weight,
        "norm_weight": reference.post.weight, "norm_bias": reference.post.bias,
    }  # fmt: skip
    candidate.load_state_dict({key: value.detach().clone() for key, value in state.items()})
    return reference, candidate


def test_a_flat_port_whose_attention_code_goes_wrong_names_the_attention_not_a_later_norm(tmp_path):
    """A port with no module per layer whose rotary code turns the wrong way (the sine's sign flipped): every
    projection agrees, and the attention's computation, in the root's code, goes wrong. The norm after it, which
    has no counterpart either, was named ("its own input agrees", though the output projection before it already
    failed); the attention is, and no layout of the fused projection is taken for the bug."""
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))
    reference, clean_port = _flat_pair()
    clean = check(reference, clean_port, tmp_path / "clean", reference_call=lambda m: m(ids), echo=None)
    assert clean.report.passed, clean.report.summary()
    reference, candidate = _flat_pair(sine=-1.0)
    result = check(reference, candidate, tmp_path / "sin", reference_call=lambda m: m(ids), echo=None, drilldown=False)
    assert result.report.origin == "attention", result.report.summary()
    post = next(row for row in result.report.rows if row.path == "post")
    assert post.cause != "origin"


def _swap_q_heads(candidate: _FlatPort) -> None:
    with torch.no_grad():
        weight = candidate.qkv.weight
        weight[:HIDDEN] = weight[:HIDDEN].clone().view(HEADS, -1, HIDDEN)[[1, 0, 3, 2]].reshape(HIDDEN, HIDDEN)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bug", ["kv", "q-heads"])
def test_a_fused_projection_laid_out_wrongly_in_a_flat_port_is_named_at_its_part(tmp_path, dtype, bug):
    """A flat port (the attention computed in the root's own code) whose conversion put the fused qkv's key and
    value blocks in each other's place, or its query's heads in another order: every part agrees with the rows it
    holds, so the attention, which has no counterpart, was named. The isolated replay of the root's code now tries
    the fused parts in another order (and a part's features in the reference's order) and names the part whose
    layout the code does not read, with the order under which it agrees."""
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))
    reference, candidate = _flat_pair(swap_kv=bug == "kv")
    if bug == "q-heads":
        _swap_q_heads(candidate)
    call = lambda m: m(ids)  # noqa: E731
    result = check(reference, candidate.to(dtype), tmp_path, reference_call=call, echo=None, drilldown=False)
    named = result.report.first_divergence
    assert not result.report.passed and named is not None, result.report.summary()
    assert named.candidate is not None and named.candidate.key == "qkv#0"
    if bug == "kv":
        assert named.path == "attention.k"
        held = "it holds attention.q at 0-31, attention.v at 32-63, attention.k at 64-95"
        assert f"{held}): read as attention.q at 0-31, attention.k at 32-63, attention.v at 64-95" in named.note
    else:
        assert named.path == "attention.q" and "with its features in the reference's order, <root> agrees" in named.note
    assert "<root>'s own code, which computes attention, does not read them" in named.note
    attention = next(row for row in result.report.rows if row.path == "attention")
    assert attention.cause == "contains-origin"


class _GatedMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(HIDDEN, 64, bias=False), nn.Linear(HIDDEN, 64, bias=False)
        self.down = nn.Linear(64, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class _GatedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mlp, self.norm = nn.Embedding(64, HIDDEN), _GatedMlp(), nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, 64, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.head(self.norm(x + self.mlp(x)))


class _FlatGatedPort(nn.Module):
    """The MLP in the root's own code: one fused [gate; up] projection, split by position."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.gate_up = nn.Embedding(64, HIDDEN), nn.Linear(HIDDEN, 128, bias=False)
        self.down, self.norm = nn.Linear(64, HIDDEN, bias=False), nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, 64, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        gate, up = self.gate_up(x).chunk(2, -1)
        return self.head(self.norm(x + self.down(F.silu(gate) * up)))


@pytest.mark.parametrize("swapped", [False, True])
def test_a_fused_gate_and_up_exchanged_in_a_flat_port_is_named_at_the_projection(tmp_path, swapped):
    """The conversion wrote [up; gate] where the port's code splits [gate; up]: the MLP (no counterpart: the root
    computes it) was named; the fused projection is, and the clean conversion passes."""
    torch.manual_seed(0)
    reference, candidate = _GatedModel().eval(), _FlatGatedPort().eval()
    mlp = reference.mlp
    parts = [mlp.up.weight, mlp.gate.weight] if swapped else [mlp.gate.weight, mlp.up.weight]
    state = {key: value for key, value in reference.state_dict().items() if not key.startswith("mlp.")}
    state |= {"gate_up.weight": torch.cat(parts), "down.weight": mlp.down.weight}
    candidate.load_state_dict({key: value.detach().clone() for key, value in state.items()})
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))
    result = check(reference, candidate, tmp_path, reference_call=lambda m: m(ids), echo=None, drilldown=False)
    assert result.report.passed is not swapped, result.report.summary()
    if swapped:
        named = result.report.first_divergence
        assert named is not None and named.path == "mlp.gate" and named.candidate is not None
        assert named.candidate.key == "gate_up#0" and "read as mlp.gate at 0-63, mlp.up at 64-127" in named.note


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rotary_table_built_from_another_base_says_so(tmp_path, dtype):
    """The port builds its cos/sin tables with base 10,000 where the reference's frequencies have base 1,000,000:
    no reference tensor holds such a table, so it was left unmatched. The ledger now finds the base its row sums
    fit and says so, a certain finding, and the run fails in both precisions."""
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))
    reference, candidate = _flat_pair(base=1e4)
    call = lambda m: m(ids)  # noqa: E731
    result = check(reference, candidate.to(dtype), tmp_path, reference_call=call, echo=None, drilldown=False)
    assert not result.report.passed
    found = {finding.candidate: finding for finding in result.report.alignment.weights.differing}
    assert set(found) >= {"table_cos", "table_sin"} and all(found[name].certain for name in ("table_cos", "table_sin"))
    built = float(found["table_cos"].detail.split("built with base ")[1].split(",")[0])
    assert (
        abs(math.log(built / 1e4)) < 1e-2 and "the reference's frequencies have base 1e+06" in found["table_cos"].detail
    )


class _Stem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.gn, self.act = nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU()
        self.conv2 = nn.Conv2d(16, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.act(self.gn(self.stem(x))))


class _StemPort(nn.Module):
    """The norm and the activation as functions in the root's code, the norm's scale and shift held by the root."""

    def __init__(self) -> None:
        super().__init__()
        self.entry, self.mix = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 8, 3, padding=1)
        self.norm_scale, self.norm_shift = nn.Parameter(torch.ones(16)), nn.Parameter(torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.group_norm(self.entry(x), 4, self.norm_scale, self.norm_shift, 1e-5)
        return self.mix(F.silu(normed))


def test_a_norm_applied_by_a_function_is_named_by_its_differing_weight(tmp_path):
    """The norm's scale x1.01, applied by ``F.group_norm`` in the root's code: the ledger finds the scale, yet the
    activation after the norm (no counterpart either) was named. Nothing shows that activation's input agreeing, and
    the root that holds the scale is no row where divergence starts, so the norm is named."""
    torch.manual_seed(0)
    reference = _Stem().eval()
    with torch.no_grad():
        reference.gn.weight.copy_(1 + 0.2 * torch.randn(16))
        reference.gn.bias.copy_(0.1 * torch.randn(16))
    state = {
        "entry.weight": reference.stem.weight, "entry.bias": reference.stem.bias,
        "mix.weight": reference.conv2.weight, "mix.bias": reference.conv2.bias,
        "norm_scale": reference.gn.weight * 1.01, "norm_shift": reference.gn.bias,
    }  # fmt: skip
    candidate = _StemPort().eval()
    candidate.load_state_dict({key: value.detach().clone() for key, value in state.items()})
    x = torch.randn(2, 3, 8, 8)
    result = check(reference, candidate, tmp_path, reference_call=lambda m: m(x), echo=None, drilldown=False)
    assert result.report.origin == "gn", result.report.summary()


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _Residual(nn.Module):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.inp, self.mlp, self.out = nn.Linear(16, 32), mlp, nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.inp(x)
        return self.out(hidden + self.mlp(hidden))


class _TanhMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 128), nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_activation_done_otherwise_by_a_function_is_named_in_either_precision(tmp_path, dtype):
    """GELU's tanh form by ``F.gelu`` where the reference's ``nn.GELU`` is exact: named at the activation in float32;
    in bfloat16 only the lifted replay sees it, and it named the MLP's own code. What the second projection was
    given came straight from the activation, fed what agrees: the activation is named in both."""
    torch.manual_seed(0)
    reference = _Residual(_Mlp()).eval()
    with torch.no_grad():
        reference.mlp.fc1.weight.mul_(8)
    names = {"inp": "inp", "mlp.fc1": "mlp.up", "mlp.fc2": "mlp.down", "out": "out"}
    state = {}
    for key, value in reference.state_dict().items():
        module = key.rsplit(".", 1)[0]
        state[names[module] + key[len(module) :]] = value.clone()
    candidate = _Residual(_TanhMlp())
    candidate.load_state_dict(state)
    candidate = candidate.to(dtype).eval()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    result = check(
        reference, candidate, tmp_path, reference_call=lambda m: m(x), candidate_call=lambda m: m(x.to(dtype)),
        cast_inputs=lambda wanted: lambda m: m(x.to(wanted)), echo=None, drilldown=False,
    )  # fmt: skip
    assert result.report.origin == "mlp.act", result.report.summary()
