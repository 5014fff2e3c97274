"""A hand-written Megatron-style tensor-parallel port, built on every rank by :func:`build` (a ``"module:function"``
builder for :func:`paritylab.distributed.check_distributed`), of :class:`Reference`: a small transformer whose
attention holds separate q, k, v and o projections.

Each rank fuses its share of q, k and v into one projection as vLLM and Megatron do: rank ``r`` holds the rows
``[q_r; k_r; v_r]`` (its heads' rows of each, laid end to end), so the merged ``qkv`` output is no reference value
and the ranks' pieces are not one block of anything; o and the MLP's down projection are row-parallel (each rank
multiplies its slice, an all-reduce sums, the bias is added once after it); the MLP's up projection is
column-parallel. Norms and the head are replicated.

``options["mlp"] = "gated"`` builds the port of :func:`reference` with ``gated=True``, whose MLP holds separate gate
and up projections (``down(silu(gate(x)) * up(x))``): each rank fuses its rows of both into one ``gate_up`` Linear,
``[gate_r; up_r]``, as vLLM's ``MergedColumnParallelLinear`` does: a second layout of per-rank blocks.

``options["defect"]`` plants a conversion bug (:data:`DEFECTS`); without it the port is correct. The port computes in
the reference weights' dtype, or in ``options["dtype"]`` (``"bfloat16"``: a bfloat16 port of a float32 reference).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paritylab.distributed.launch import RankContext, takes_options

WIDTH, HEADS, INNER, LAYERS, VOCAB = 32, 4, 64, 2, 8
HEAD = WIDTH // HEADS

DEFECTS = {
    "k_block_scaled": "rank 1 loads its k rows of layer 0's fused qkv scaled by 1.01 (a conversion bug on one shard)",
    "k_block_from_v": "rank 1 loads its k rows of layer 0's fused qkv from v's rows (a wrong block)",
    "k_bias_scaled": "rank 1 loads its stretch of k's bias in layer 0's fused qkv bias scaled by 1.01",
    "up_block_scaled": "rank 1 loads its up rows of layer 0's fused gate_up scaled by 1.01 (with mlp=gated)",
    "partial_scaled": "rank 1 scales its partial product of layer 0's MLP down projection before the all-reduce",
    "up_scaled": "rank 1 scales its shard of layer 0's MLP up projection's output (a rank-local error)",
    "down_input_scaled": "rank 1 scales its shard of the input of layer 0's MLP down projection (before its partial)",
}
"""Planted defects (``options["defect"]``); ``options["scale"]`` is the factor of ``partial_scaled`` and
``down_input_scaled`` (default 1.5) and of ``up_scaled`` (default 1.01)."""


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    q, k, v = (part.unflatten(-1, (-1, HEAD)).transpose(1, 2) for part in (q, k, v))
    return (F.softmax(q @ k.transpose(-1, -2) / HEAD**0.5, dim=-1) @ v).transpose(1, 2).flatten(2)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(_attend(self.q(x), self.k(x), self.v(x)))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, INNER), nn.Linear(INNER, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class GatedMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(WIDTH, INNER), nn.Linear(WIDTH, INNER), nn.Linear(INNER, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, attention: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = nn.LayerNorm(WIDTH), attention, nn.LayerNorm(WIDTH), mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Reference(nn.Module):
    """The one-device reference: two blocks and a head."""

    def __init__(self, gated: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(Attention(), GatedMlp() if gated else Mlp()) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def reference(seed: int = 0, gated: bool = False) -> Reference:
    """The reference with seeded weights (biases too: a zero bias counted twice is still right); ``gated``: its MLP
    holds separate gate and up projections."""
    torch.manual_seed(seed)
    model = Reference(gated).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.bias.normal_(0, 0.1)
    return model


class RowParallel(nn.Module):
    """A row-parallel Linear: this rank's columns of the weight, an all-reduce, the bias once."""

    def __init__(self, inner: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(WIDTH, inner))
        self.bias = nn.Parameter(torch.empty(WIDTH))
        self.partial_scale: float | None = None
        """A planted defect: this rank's partial product scaled before the all-reduce."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = x @ self.weight.T
        if self.partial_scale is not None:
            partial = partial * self.partial_scale
        dist.all_reduce(partial)
        return partial + self.bias


class FusedAttention(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.local = WIDTH // size
        self.qkv, self.o = nn.Linear(WIDTH, 3 * self.local), RowParallel(self.local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(self.local, dim=-1)
        return self.o(_attend(q, k, v))


class ShardedMlp(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, INNER // size), RowParallel(INNER // size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class FusedGatedMlp(nn.Module):
    """This rank's gate and up rows fused into one column-parallel Linear, ``[gate_r; up_r]``."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.inner = INNER // size
        self.gate_up, self.down = nn.Linear(WIDTH, 2 * self.inner), RowParallel(self.inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.inner, dim=-1)
        return self.down(F.silu(gate) * up)


class Port(Reference):
    def __init__(self, size: int, gated: bool = False) -> None:
        nn.Module.__init__(self)
        mlp = FusedGatedMlp if gated else ShardedMlp
        self.blocks = nn.ModuleList(Block(FusedAttention(size), mlp(size)) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.head.weight.dtype))  # a bfloat16 port of a float32 reference casts its input


@takes_options("defect", "mlp", "scale", "dtype")
def build(context: RankContext) -> nn.Module:
    """Rank ``context.rank``'s share of :class:`Reference` with the reference's weights (``context.state_dict()``);
    ``options["defect"]`` plants a bug (:data:`DEFECTS`)."""
    defect = context.options.get("defect")
    if defect is not None and defect not in DEFECTS:
        raise ValueError(f"unknown defect {defect!r}; known: {', '.join(DEFECTS)}")
    size, rank = context.world_size, context.rank
    if HEADS % size or INNER % size:
        raise ValueError(f"{HEADS} heads and an inner size of {INNER} must divide by the world size {size}")
    weights = context.state_dict()
    gated = context.options.get("mlp") == "gated"
    given = context.options.get("dtype")
    dtype = getattr(torch, str(given)) if given is not None else weights["head.weight"].dtype  # else the reference's
    model = Port(size, gated).eval().to(dtype)
    local, inner = WIDTH // size, INNER // size
    rows, inner_rows = slice(rank * local, (rank + 1) * local), slice(rank * inner, (rank + 1) * inner)
    with torch.no_grad():
        for index, block in enumerate(model.blocks):
            prefix = f"blocks.{index}"
            for norm in ("norm1", "norm2"):
                getattr(block, norm).load_state_dict(
                    {name: weights[f"{prefix}.{norm}.{name}"] for name in ("weight", "bias")}
                )
            attention = block.attn
            assert isinstance(attention, FusedAttention)
            parts = {name: weights[f"{prefix}.attn.{name}.weight"][rows] for name in "qkv"}
            if index == 0 and rank == 1 and defect == "k_block_scaled":
                parts["k"] = parts["k"] * 1.01
            elif index == 0 and rank == 1 and defect == "k_block_from_v":
                parts["k"] = parts["v"].clone()
            attention.qkv.weight.copy_(torch.cat([parts["q"], parts["k"], parts["v"]]))
            biases = {name: weights[f"{prefix}.attn.{name}.bias"][rows] for name in "qkv"}
            if index == 0 and rank == 1 and defect == "k_bias_scaled":
                biases["k"] = biases["k"] * 1.01
            attention.qkv.bias.copy_(torch.cat([biases["q"], biases["k"], biases["v"]]))
            attention.o.weight.copy_(weights[f"{prefix}.attn.o.weight"][:, rows])
            attention.o.bias.copy_(weights[f"{prefix}.attn.o.bias"])
            _load_mlp(block.mlp, weights, f"{prefix}.mlp", inner_rows, index == 0 and rank == 1 and defect)
        model.head.load_state_dict({name: weights[f"head.{name}"] for name in ("weight", "bias")})
    _plant_rank_local(model, defect, rank, context.options.get("scale"))
    return model.to(context.device)


def _plant_rank_local(model: Port, defect: object, rank: int, scale: object) -> None:
    """The defects of one rank's computation (not its weights), planted on rank 1 in layer 0's MLP."""
    if rank != 1 or defect not in ("partial_scaled", "up_scaled", "down_input_scaled"):
        return
    mlp = model.blocks[0].mlp
    assert isinstance(mlp, ShardedMlp)
    if defect == "partial_scaled":
        assert isinstance(mlp.down, RowParallel)
        mlp.down.partial_scale = float(scale) if scale is not None else 1.5  # type: ignore[arg-type]
    elif defect == "down_input_scaled":
        factor = float(scale) if scale is not None else 1.5  # type: ignore[arg-type]
        mlp.down.register_forward_pre_hook(lambda module, args: (args[0] * factor,))
    else:
        factor = float(scale) if scale is not None else 1.01  # type: ignore[arg-type]
        mlp.up.register_forward_hook(lambda module, args, output: output * factor)


def _load_mlp(mlp: nn.Module, weights: dict[str, torch.Tensor], prefix: str, rows: slice, defect: object) -> None:
    """This rank's rows of the MLP's column-parallel projections (fused ``[gate_r; up_r]`` when gated), its columns
    of the row-parallel down projection."""
    if isinstance(mlp, FusedGatedMlp):
        for name in ("weight", "bias"):
            gate, up = (weights[f"{prefix}.{part}.{name}"][rows] for part in ("gate", "up"))
            if defect == "up_block_scaled" and name == "weight":
                up = up * 1.01
            getattr(mlp.gate_up, name).copy_(torch.cat([gate, up]))
    else:
        assert isinstance(mlp, ShardedMlp)
        mlp.up.weight.copy_(weights[f"{prefix}.up.weight"][rows])
        mlp.up.bias.copy_(weights[f"{prefix}.up.bias"][rows])
    down = mlp.down
    assert isinstance(down, RowParallel)
    down.weight.copy_(weights[f"{prefix}.down.weight"][:, rows])
    down.bias.copy_(weights[f"{prefix}.down.bias"])
