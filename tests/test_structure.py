"""Parameter fingerprints: the same weights, whatever their layout or dtype, fingerprint the same."""

from __future__ import annotations

import torch
from torch import nn

from paritylab.structure import MASK, fingerprint


class Fused(nn.Module):
    def __init__(self, q: torch.Tensor, k: torch.Tensor) -> None:
        super().__init__()
        self.qk = nn.Parameter(torch.cat([q, k]).t().contiguous())  # fused and stored transposed


class Split(nn.Module):
    def __init__(self, q: torch.Tensor, k: torch.Tensor) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(4, 3, bias=False), nn.Linear(4, 3, bias=True)
        with torch.no_grad():
            self.q.weight.copy_(q)
            self.k.weight.copy_(k)
            self.k.bias.zero_()  # computes nothing: must not change the fingerprint


def test_layout_fusion_cast_and_zeros_do_not_change_a_fingerprint():
    q, k = torch.randn(3, 4), torch.randn(3, 4)
    split, fused = fingerprint(Split(q, k)), fingerprint(Fused(q, k))
    assert split[""].digest == fused[""].digest != 0
    assert (split["q"].digest + split["k"].digest) & MASK == fused[""].digest  # a fused weight is its parts' sum
    assert fingerprint(Split(q, k).to(torch.bfloat16))[""].digest == split[""].digest
    other = fingerprint(Split(q, k * 1.5))
    assert other["k"].digest != split["k"].digest and other["q"].digest == split["q"].digest


def test_rows_locate_a_part_of_a_fused_weight():
    q, k = torch.randn(3, 4), torch.randn(3, 4)
    fused = fingerprint(Fused(q, k))[""].params[0]  # stored [4, 6]: q's rows are its columns 0..2
    assert fused.cols[:3] == fingerprint(Split(q, k))["q"].params[0].rows


def test_a_changed_parameter_is_hashed_again():
    model = Split(torch.randn(3, 4), torch.randn(3, 4))
    before = fingerprint(model)["q"].digest
    assert fingerprint(model)["q"].digest == before  # cached
    with torch.no_grad():
        model.q.weight.mul_(2)  # in place: the version counter moves
    assert fingerprint(model)["q"].digest != before
