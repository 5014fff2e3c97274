"""A child whose weight rows are the reference's in an order its parent's code does not read them in
(:mod:`paritylab.run.layouts`): every module inside the parent agrees (each compared in its own order), so only a
replay with the child's values in another order shows which one a conversion misplaced."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paritylab.comparison.layouts import _block_size, _blocks
from paritylab.run.parity import check

DIM, HEADS, HEAD = 32, 4, 8


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([-odd, even], dim=-1).flatten(-2)


class _Attention(nn.Module):
    """Rotary attention, two key/value heads shared by four query heads; ``interleaved`` turns (2i, 2i+1) pairs
    (GPT-J, x-transformers) where the reference turns the two halves of each head (Llama)."""

    def __init__(self, interleaved: bool = False) -> None:
        super().__init__()
        self.interleaved = interleaved
        self.q, self.o = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.k, self.v = nn.Linear(DIM, DIM // 2, bias=False), nn.Linear(DIM, DIM // 2, bias=False)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (-1, HEAD)).transpose(1, 2)

    def _rotary(self, x: torch.Tensor) -> torch.Tensor:
        position = torch.arange(x.shape[-2], dtype=torch.float32)[:, None]
        frequency = 10000.0 ** (-torch.arange(0, HEAD, 2, dtype=torch.float32) / HEAD)
        angle = position * frequency
        if self.interleaved:
            angle = angle.repeat_interleave(2, dim=-1)
            return x * angle.cos().to(x.dtype) + _rotate_pairs(x) * angle.sin().to(x.dtype)
        angle = torch.cat([angle, angle], dim=-1)
        return x * angle.cos().to(x.dtype) + _rotate_half(x) * angle.sin().to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._heads(self.q(x)), self._heads(self.k(x)), self._heads(self.v(x))
        q, k = self._rotary(q), self._rotary(k)
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        scores = torch.softmax(q @ k.transpose(-1, -2) / HEAD**0.5, dim=-1)
        return self.o((scores @ v).transpose(1, 2).flatten(-2))


class _Block(nn.Module):
    def __init__(self, interleaved: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attention = _Attention(interleaved)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attention(self.norm(x))


def _interleaved_rows(weight: torch.Tensor) -> torch.Tensor:
    """A projection's rows from the halves layout to the interleaved one (the conversion such ports need)."""
    return weight.view(-1, 2, HEAD // 2, DIM).transpose(1, 2).reshape(-1, DIM)


def _attention_pair(dtype: torch.dtype) -> tuple[_Block, _Block, torch.Tensor]:
    torch.manual_seed(0)
    reference = _Block().eval()
    candidate = _Block(interleaved=True).eval()
    with torch.no_grad():
        candidate.norm.load_state_dict(reference.norm.state_dict())
        for name in ("q", "k"):
            getattr(candidate.attention, name).weight.copy_(
                _interleaved_rows(getattr(reference.attention, name).weight)
            )
        for name in ("v", "o"):
            getattr(candidate.attention, name).weight.copy_(getattr(reference.attention, name).weight)
    return reference, candidate.to(dtype), torch.randn(2, 6, DIM)


def _call(x: torch.Tensor):
    return lambda model: model(x.to(next(model.parameters()).dtype))


def _exchange_halves(weight: nn.Parameter) -> None:
    with torch.no_grad():
        half = weight.shape[0] // 2
        weight.copy_(torch.cat([weight[half:], weight[:half]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_heads_in_an_order_the_attention_does_not_read_are_named_at_their_projection(tmp_path, dtype):
    """A port whose query and key rows are laid out for interleaved rotary (a layout the attention's code reads)
    passes; the key's two heads exchanged by its conversion (each row still the reference's) are named at the key
    projection, with the order under which the attention agrees, not at the attention's own code."""
    reference, candidate, x = _attention_pair(dtype)
    clean = check(reference, candidate, tmp_path / "clean", reference_call=_call(x), echo=None)
    assert clean.report.passed, clean.report.summary()

    _exchange_halves(candidate.attention.k.weight)
    result = check(reference, candidate, tmp_path / "k", reference_call=_call(x), echo=None, drilldown=False)
    first = result.report.first_divergence
    assert not result.report.passed and first is not None, result.report.summary()
    assert first.path == "attention.k", result.report.culprit_reason
    assert first.note.count("and attention's own code does not read them in that order") == 1
    assert "with its blocks of 8 features in the order attention.v's output holds them, attention agrees" in first.note
    attention = next(row for row in result.report.rows if row.path == "attention")
    assert attention.cause == "contains-origin"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_query_heads_out_of_the_output_projections_order_are_named_at_the_query(tmp_path, dtype):
    """The query's heads exchanged (the key's and value's still right): the output projection reads the heads in
    the reference's order, so the query is named, with the output projection's input as the order that clears."""
    reference, candidate, x = _attention_pair(dtype)
    _exchange_halves(candidate.attention.q.weight)
    result = check(reference, candidate, tmp_path, reference_call=_call(x), echo=None, drilldown=False)
    first = result.report.first_divergence
    assert not result.report.passed and first is not None, result.report.summary()
    assert first.path == "attention.q", result.report.culprit_reason
    assert "with its blocks of 8 features in the order attention.o's output holds them, attention agrees" in first.note


def test_a_missing_rotary_permutation_is_named_at_the_projection_that_lacks_it(tmp_path):
    """The commonest rotary conversion bug: the key converted to the interleaved layout, the query left in the
    reference's (its rows the reference's, in the reference's order). Named at the query, whose order within each
    head is not the one the key's gives."""
    reference, candidate, x = _attention_pair(torch.float32)
    with torch.no_grad():
        candidate.attention.q.weight.copy_(reference.attention.q.weight)
    result = check(reference, candidate, tmp_path, reference_call=_call(x), echo=None, drilldown=False)
    first = result.report.first_divergence
    assert not result.report.passed and first is not None, result.report.summary()
    assert first.path == "attention.q", result.report.culprit_reason
    assert "with each block of 8 features in the order attention.k's output holds" in first.note


class _Mlp(nn.Module):
    def __init__(self, width: int = 16, inner: int = 24) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(width, inner, bias=False), nn.Linear(width, inner, bias=False)
        self.down = nn.Linear(inner, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


class _FusedMlp(nn.Module):
    """One projection holding [up; gate], split by position in its own code (x-transformers' GLU)."""

    def __init__(self, reference: _Mlp) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 48, bias=False)
        self.down = nn.Linear(24, 16, bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(torch.cat([reference.up.weight, reference.gate.weight]))
            self.down.weight.copy_(reference.down.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, gate = self.proj(x).chunk(2, dim=-1)
        return self.down(torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_projection_whose_whole_parts_are_exchanged_is_named(tmp_path, dtype):
    """A fused [up; gate] projection converted as [gate; up]: each part pairs with the rows it occupies and agrees,
    and either order is a layout a port may mean, so only the code that splits it tells. Named at the fused
    projection's first part with the order under which the MLP agrees; the clean port passes."""
    torch.manual_seed(0)
    reference = _Mlp().eval()
    x = torch.randn(2, 5, 16)
    clean = check(reference, _FusedMlp(reference).to(dtype).eval(), tmp_path / "clean", reference_call=_call(x))
    assert clean.report.passed, clean.report.summary()
    swapped = _FusedMlp(reference).to(dtype).eval()
    _exchange_halves(swapped.proj.weight)
    result = check(reference, swapped, tmp_path / "swapped", reference_call=_call(x), echo=None, drilldown=False)
    first = result.report.first_divergence
    assert not result.report.passed and first is not None, result.report.summary()
    assert first.path == "gate" and first.candidate is not None and first.candidate.key == "proj#0"
    said = "with its parts in another order (it holds gate at 0-23, up at 24-47): read as up at 0-23, gate at 24-47, "
    assert said + "<root> agrees" in first.note


def test_block_orders():
    """The smallest block every order keeps whole: heads of 4 turned as interleaved pairs keep blocks of 4 only;
    a permutation of whole heads keeps every divisor of the head; a block split across two is no block."""
    interleaved = (0, 2, 1, 3, 4, 6, 5, 7)
    heads = (4, 5, 6, 7, 0, 1, 2, 3)
    assert _blocks(interleaved, 4) == ([0, 1], [(0, 2, 1, 3), (0, 2, 1, 3)])
    assert _blocks(interleaved, 2) is None
    assert _block_size([interleaved, heads]) == 4
    assert _block_size([heads]) == 2
    assert _block_size([(1, 0, 2, 3)]) == 2
    assert _block_size([(2, 0, 1, 3)]) is None


class _TwoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.o = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(torch.tanh(self.a(x)))


def _in_own_order(reference: nn.Module, candidate: nn.Module) -> None:
    """``candidate`` as a port holding the reference's hidden features in one other order: the first layer's rows
    and the second's columns permuted alike (a layout its code reads so)."""
    order = torch.randperm(32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        candidate.a.weight.copy_(reference.a.weight[order])
        candidate.a.bias.copy_(reference.a.bias[order])
        candidate.o.weight.copy_(reference.o.weight[:, order])
        candidate.o.bias.copy_(reference.o.bias)


def test_a_wrong_block_in_a_weight_read_in_another_order_is_named_at_its_module(tmp_path):
    """The first layer's rows and the second's columns in one other order (a layout the port's code reads so), and
    a block of the second's rows overwritten by its conversion: its columns' order is proven by no fingerprint any
    more, so its input looked wrong and the code before it was blamed; the input's features, matched across
    positions, are the reference's in that order, so the second layer is named (its input agrees)."""
    torch.manual_seed(0)
    reference, candidate = _TwoLinear().eval(), _TwoLinear().eval()
    _in_own_order(reference, candidate)
    x = torch.randn(4, 6, 16)
    clean = check(reference, candidate, tmp_path / "clean", reference_call=_call(x), echo=None)
    assert clean.report.passed, clean.report.summary()
    with torch.no_grad():
        candidate.o.weight[:2] = candidate.o.weight[2:4].clone()
    result = check(reference, candidate, tmp_path / "rows", reference_call=_call(x), echo=None, drilldown=False)
    first = result.report.first_divergence
    assert first is not None and first.path == "o", result.report.culprit_reason
    assert "its input agrees with its features in another order" in first.note
    assert first.input_verdict == "pass"


def test_features_in_another_order_are_found_across_positions():
    from paritylab.comparison.feature_order import features_in_order

    value = torch.randn(5, 7, 12, generator=torch.Generator().manual_seed(0))
    order = [3, 0, 1, 2, 11, 10, 9, 8, 4, 5, 6, 7]
    assert features_in_order(value, value[..., order]) == tuple(order.index(j) for j in range(12))
    assert features_in_order(value, value) is None  # the same order: nothing to say
    assert features_in_order(value, torch.randn(5, 7, 12)) is None  # unrelated values


class _Conv1D(nn.Module):
    """A projection holding its weight as ``[in, out]`` (GPT-2's ``Conv1D``): the reference's ``Linear`` transposed,
    a layout its own code reads so."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().T.clone())
        self.bias = nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


class _SquareOut(nn.Module):
    def __init__(self, shuffled: torch.Tensor | None = None) -> None:
        super().__init__()
        self.a, self.o = nn.Linear(16, 32), nn.Linear(32, 32)
        self.shuffled = shuffled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.a(x))
        return self.o(hidden if self.shuffled is None else hidden[..., self.shuffled])


def test_a_transposed_weight_read_in_its_own_order_is_named_at_its_module(tmp_path):
    """A square weight whose columns a port holds in its own order (the order the layer before makes its features
    in), transposed by its conversion: the same values, so every fingerprint but the order still matches. Its
    columns, read turned back, give the order its input is in, so the module is named (its input agrees), not the
    code before it; the clean port passes."""
    torch.manual_seed(0)
    reference, candidate = _SquareOut().eval(), _SquareOut().eval()
    _in_own_order(reference, candidate)
    x = torch.randn(4, 6, 16)
    clean = check(reference, candidate, tmp_path / "clean", reference_call=_call(x), echo=None)
    assert clean.report.passed, clean.report.summary()
    with torch.no_grad():
        candidate.o.weight.copy_(candidate.o.weight.T.clone())
    result = check(reference, candidate, tmp_path / "turned", reference_call=_call(x), echo=None, drilldown=False)
    first = result.report.first_divergence
    assert first is not None and first.path == "o", result.report.culprit_reason
    assert first.input_verdict == "pass" and first.cause == "origin"
    assert any(
        finding.candidate == "o.weight" and "transposed, with its lines in another order" in finding.detail
        for finding in result.report.alignment.weights.findings
    )
    with torch.no_grad():  # and scaled on top: a near copy, described in the reference's layout and order
        candidate.o.weight.mul_(1.01)
    result = check(reference, candidate, tmp_path / "scaled", reference_call=_call(x), echo=None, drilldown=False)
    first = result.report.first_divergence
    assert first is not None and first.path == "o" and first.input_verdict == "pass", result.report.culprit_reason
    (finding,) = [finding for finding in result.report.alignment.weights.differing if finding.candidate == "o.weight"]
    assert finding.detail.startswith("transposed, its columns in another order") and "scaled by 1.01" in finding.detail


def test_code_that_reorders_features_before_a_transposed_layout_is_named_not_the_layer_after(tmp_path):
    """The other way round: a port holding the next layer's weight transposed (a layout its code reads so) and its
    code handing that layer the features in another order. The weight, read turned back, is in the reference's
    order, so the layer's input differs and the code before it is named, not the layer."""
    torch.manual_seed(0)
    reference = _SquareOut().eval()
    shuffled = torch.randperm(32, generator=torch.Generator().manual_seed(1))
    candidate = _SquareOut(shuffled).eval()
    with torch.no_grad():
        candidate.a.load_state_dict(reference.a.state_dict())
    candidate.o = _Conv1D(reference.o)
    x = torch.randn(4, 6, 16)
    result = check(reference, candidate, tmp_path, reference_call=_call(x), echo=None, drilldown=False)
    first = result.report.first_divergence
    assert first is not None and first.path == "", result.report.culprit_reason
    o = next(row for row in result.report.rows if row.path == "o")
    assert o.input_verdict == "fail" and o.cause == "inherited"


def test_halves_exchanged_in_a_weight_held_transposed_are_named_at_its_module(tmp_path):
    """A weight a port holds transposed (an unembedding ``W_U [d_model, vocab]``) with its rows' halves exchanged by
    the conversion: the same values, transposed, lines in another order, as a port reading its input in its own order
    holds them. Its input arrives in the reference's order, so that order is not taken: the module is named, its
    input agreeing (taking it named the model)."""
    torch.manual_seed(0)
    reference = _TwoLinear().eval()
    candidate = _TwoLinear().eval()
    with torch.no_grad():
        candidate.a.load_state_dict(reference.a.state_dict())
    candidate.o = _Conv1D(reference.o)
    x = torch.randn(4, 6, 16)
    clean = check(reference, candidate, tmp_path / "clean", reference_call=_call(x), echo=None)
    assert clean.report.passed, clean.report.summary()
    _exchange_halves(candidate.o.weight)
    result = check(reference, candidate, tmp_path / "halves", reference_call=_call(x), echo=None, drilldown=False)
    first = result.report.first_divergence
    assert first is not None and first.path == "o" and first.input_verdict == "pass", result.report.culprit_reason
