"""A table one side holds in a module the other holds elsewhere: T5's first attention computes the relative position
bias every layer receives and holds its table; a port computes the bias once in the stack. Its attention holds all
of the reference attention's weights but the table, and no block paired by weights: the first layer was judged only
through what surrounds it. The table is taken out of the fingerprints of the modules around it that have no
counterpart (``alignment._weight_reads.held_elsewhere``), so they pair by what remains."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paritylab.comparison.alignment._weight_reads import _read_prints, held_elsewhere
from paritylab.reports.render import headline
from paritylab.run.parity import check, trace_model

D, H, B = 16, 2, 8
"""Width, heads, relative position buckets."""


def relative(n: int) -> torch.Tensor:
    """Each query's bucket for each key: the offset, clamped to the table."""
    positions = torch.arange(n)
    return (positions[None, :] - positions[:, None]).clamp(-B // 2, B // 2 - 1) + B // 2


class Attention(nn.Module):
    def __init__(self, bias):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))
        if bias:
            self.relative_attention_bias = nn.Embedding(B, H)

    def compute_bias(self, n):
        return self.relative_attention_bias(relative(n)).permute(2, 0, 1)

    def forward(self, x, bias=None):
        n = x.shape[0]
        if bias is None:
            bias = self.compute_bias(n)
        q, k, v = (f(x).view(n, H, -1).transpose(0, 1) for f in (self.q, self.k, self.v))
        a = (q @ k.transpose(1, 2) + bias).softmax(-1)
        return self.o((a @ v).transpose(0, 1).reshape(n, D)), bias


class Block(nn.Module):
    def __init__(self, bias):
        super().__init__()
        self.norm, self.attn, self.ff = nn.LayerNorm(D), Attention(bias), nn.Linear(D, D)

    def forward(self, x, bias=None):
        h, bias = self.attn(self.norm(x), bias)
        x = x + h
        return x + self.ff(x), bias


class Stack(nn.Module):
    """T5's stack: the first layer's attention computes the position bias (and holds its table), the others receive
    it."""

    def __init__(self):
        super().__init__()
        self.block = nn.ModuleList([Block(True), Block(False), Block(False)])
        self.final = nn.LayerNorm(D)

    def forward(self, x):
        bias = None
        for block in self.block:
            x, bias = block(x, bias)
        return self.final(x)


class PortAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.temperature = 1.0  # a code bug where it is not one

    def forward(self, x, bias):
        n = x.shape[0]
        q, k, v = (f(x).view(n, H, -1).transpose(0, 1) for f in (self.wq, self.wk, self.wv))
        a = (q @ k.transpose(1, 2) * self.temperature + bias).softmax(-1)
        return self.wo((a @ v).transpose(0, 1).reshape(n, D))


class PortBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.attention, self.mlp = nn.LayerNorm(D), PortAttention(), nn.Linear(D, D)

    def forward(self, x, bias):
        x = x + self.attention(self.ln(x), bias)
        return x + self.mlp(x)


class Port(nn.Module):
    """A port computing the bias once in the stack, from a table of its own: every attention receives it."""

    def __init__(self):
        super().__init__()
        self.rel_bias = nn.Embedding(B, H)
        self.layers = nn.ModuleList([PortBlock() for _ in range(3)])
        self.ln_f = nn.LayerNorm(D)

    def forward(self, x):
        bias = self.rel_bias(relative(x.shape[0])).permute(2, 0, 1)
        for layer in self.layers:
            x = layer(x, bias)
        return self.ln_f(x)


def converted(port_first: bool = False) -> tuple[nn.Module, nn.Module]:
    """The stack and its port with the same weights (norms randomised away from their constants); with
    ``port_first`` the port is the reference."""
    torch.manual_seed(0)
    stack, port = Stack(), Port()
    with torch.no_grad():
        for module in stack.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.normal_(1, 0.1)
                module.bias.normal_(0, 0.1)
        port.rel_bias.weight.copy_(stack.block[0].attn.relative_attention_bias.weight)
        for theirs, mine in zip(stack.block, port.layers, strict=True):
            mine.ln.load_state_dict(theirs.norm.state_dict())
            mine.mlp.load_state_dict(theirs.ff.state_dict())
            for a, b in (("q", "wq"), ("k", "wk"), ("v", "wv"), ("o", "wo")):
                getattr(mine.attention, b).load_state_dict(getattr(theirs.attn, a).state_dict())
        port.ln_f.load_state_dict(stack.final.state_dict())
    return (port, stack) if port_first else (stack, port)


def run(reference: nn.Module, candidate: nn.Module, tmp_path, dtype: torch.dtype):
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(1))
    candidate = candidate.to(dtype)
    return check(reference, candidate, tmp_path, reference_call=lambda m: m(x.to(next(m.parameters()).dtype))).report


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("port_first", [False, True], ids=["table-in-attention", "table-in-stack"])
def test_modules_around_a_table_held_elsewhere_pair_and_a_clean_port_passes(tmp_path, dtype, port_first):
    reference, candidate = converted(port_first)
    report = run(reference, candidate, tmp_path, dtype)
    assert report.verdict == "pass", headline(report)
    pairs = {pair.reference.rsplit("#", 1)[0]: pair.candidate.rsplit("#", 1)[0] for pair in report.alignment.pairs}
    first = ("layers.0", "layers.0.attention") if port_first else ("block.0", "block.0.attn")
    other = ("block.0", "block.0.attn") if port_first else ("layers.0", "layers.0.attention")
    assert [pairs.get(path) for path in first] == list(other)
    assert report.summary()["unaccounted_calls"] == 0, headline(report)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("plant", "origin"),
    [
        ("output", "block.0.attn"),  # its output x1.01
        ("code", "block.0.attn"),  # its scores x1.01 before the softmax: the first layer's code only
        ("table", "block.0.attn.relative_attention_bias"),  # the table x1.01, held at the stack
        ("later", "block.1.attn"),
    ],
)
def test_a_bug_around_a_table_held_elsewhere_is_named_where_it_is(tmp_path, dtype, plant, origin):
    reference, candidate = converted()
    attention = candidate.layers[0].attention
    if plant == "output":
        attention.register_forward_hook(lambda _m, _a, out: out * 1.01)
    elif plant == "code":
        attention.temperature = 1.05
    elif plant == "table":
        with torch.no_grad():
            candidate.rel_bias.weight.mul_(1.01)
    else:
        candidate.layers[1].attention.register_forward_hook(lambda _m, _a, out: out * 1.01)
    report = run(reference, candidate, tmp_path, dtype)
    assert report.verdict == "fail" and report.origin == origin, headline(report)


class PostNorm(nn.Module):
    """BERT's attention output: a projection, the residual and a norm in one module."""

    def __init__(self) -> None:
        super().__init__()
        self.dense, self.norm = nn.Linear(D, D), nn.LayerNorm(D)

    def forward(self, hidden: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.dense(hidden) + x)


class PostNormAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self, self.output = nn.Linear(D, D), PostNorm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x), x)


class NormOutside(nn.Module):
    """A port applying that norm in the block: its attention holds all the reference attention's weights but the
    norm, which it holds elsewhere, and returns another value (before the residual and the norm)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Sequential(nn.Linear(D, D), nn.Linear(D, D))
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.attn(x) + x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_module_taking_values_held_elsewhere_is_never_taken_out(tmp_path, dtype):
    """Only a table looked up by positions moves: a norm computes on the value the module around it returns, so
    pairing that module by what remains would compare values taken before and after the norm (a false alarm)."""
    torch.manual_seed(0)
    reference = nn.Sequential(PostNormAttention(), nn.Linear(D, 4))
    candidate = NormOutside()
    with torch.no_grad():
        reference[0].output.norm.weight.normal_(1, 0.1)
        candidate.attn[0].load_state_dict(reference[0].self.state_dict())
        candidate.attn[1].load_state_dict(reference[0].output.dense.state_dict())
        candidate.ln.load_state_dict(reference[0].output.norm.state_dict())
        candidate.head.load_state_dict(reference[1].state_dict())
    report = run(reference, candidate, tmp_path / "run", dtype)
    assert report.verdict == "pass", headline(report)
    x = torch.randn(6, D)
    traces = [
        trace_model(model, lambda m: m(x.to(next(m.parameters()).dtype)), tmp_path / name)
        for model, name in ((reference, "r"), (candidate, "c"))
    ]
    prints = _read_prints(*traces)
    assert held_elsewhere(*traces, *prints) == prints  # nothing taken out
