"""transformers' T5 encoder-decoder against a port written as ports are (``tests/t5_port.py``): each stack computes
its position bias once from a table it holds, where transformers' first attention of each stack holds it; fused
``qkv`` and ``kv`` projections; a tied head with no module. The clean pair and planted outputs are in
``tests/test_pairs.py`` with every other pair; here are the bugs T5 ports make in their code (the attention scale
torch's SDPA applies by default, which T5 does not, a wrong bucket distance, a norm's eps) and in their conversion
(a position table, fused rows in the wrong order, a gate projection's rows out of order), in fp32 and bf16."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paritylab.reports.render import headline
from paritylab.run.parity import check
from tests.pairs import PAIRS, planted_weight

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def _sdpa_scale(port):
    """Layer 1's self-attention scaled by 1/sqrt(d), SDPA's default: T5 folds the scale into its weights."""
    port.encoder.layers[1].attn.scale = port.config.head_width**-0.5


def _cross_scale(port):
    port.decoder.layers[0].cross.scale = port.config.head_width**-0.5


def _bucket_distance(port):
    """The decoder's buckets computed with another maximum distance: other indices into a right table."""
    port.decoder.config = dataclasses.replace(port.decoder.config, max_distance=8)


def _norm_eps(port):
    port.decoder.layers[1].ff_norm.eps = 1e-2


def _exact_gelu(port):
    """The exact GELU where T5 v1.1 uses the tanh approximation, in a function of the port's feed-forward."""
    port.encoder.layers[0].ff.approximate = "none"


CODE_BUGS = {
    "sdpa-scale": (_sdpa_scale, "encoder.block.1.layer.0.SelfAttention"),
    "cross-scale": (_cross_scale, "decoder.block.0.layer.1.EncDecAttention"),
    "bucket-distance": (_bucket_distance, "decoder.block.0.layer.0.SelfAttention.relative_attention_bias"),
    "norm-eps": (_norm_eps, "decoder.block.1.layer.2.layer_norm"),
    "exact-gelu": (_exact_gelu, "encoder.block.0.layer.1.DenseReluDense.act"),  # a function in the port
}


def _run(case, tmp_path):
    return check(
        case.reference, case.candidate, tmp_path, reference_call=case.reference_call,
        candidate_call=case.candidate_call, echo=None,
    )  # fmt: skip


@DTYPES
@pytest.mark.parametrize("bug", list(CODE_BUGS))
def test_a_t5_port_code_bug_is_named_where_it_is(bug, dtype, tmp_path):
    plant, expected = CODE_BUGS[bug]
    case = PAIRS["t5"](dtype)
    plant(case.candidate)
    report = _run(case, tmp_path).report
    assert report.verdict == "fail" and report.origin == expected, headline(report)


def test_buckets_computed_otherwise_are_told_as_other_indices(tmp_path):
    """The bucket function has no module on either side: the embedding reading the buckets is named, and inside it
    the drill-down says the integers it reads differ (not its arithmetic: the same lookup in the same table)."""
    case = PAIRS["t5"](torch.float32)
    _bucket_distance(case.candidate)
    report = _run(case, tmp_path).report
    assert report.origin == "decoder.block.0.layer.0.SelfAttention.relative_attention_bias", headline(report)
    found = report.drilldown
    assert found is not None and [op["name"] for op in found["operations"]] == ["embedding"], found
    assert "integers of its input [7, 7] differ from the reference's, so embedding(" in found["message"], found


WEIGHT_PLANTS = {  # a conversion's bugs: (candidate site, kind) and the reference module named
    ("encoder.position_bias", "w-scale"): "encoder.block.0.layer.0.SelfAttention.relative_attention_bias",
    ("decoder.position_bias", "w-rows"): "decoder.block.0.layer.0.SelfAttention.relative_attention_bias",
    ("decoder.layers.1.attn.qkv", "w-rows"): "decoder.block.1.layer.0.SelfAttention.q",
    ("encoder.layers.0.attn_norm", "w-bias"): "encoder.block.0.layer.0.layer_norm",
    # its rows' halves swapped: the reference's `act` module (a function in the port) hands that order on to the
    # product with wi_1; named at wi_0, not at the activation
    ("decoder.layers.1.ff.gate", "w-halves"): "decoder.block.1.layer.2.DenseReluDense.wi_0",
    ("encoder.layers.1.ff.up", "w-halves"): "encoder.block.1.layer.1.DenseReluDense.wi_1",  # act fed by wi_0 here
}


@DTYPES
def test_a_t5_port_conversion_bug_is_named_where_it_is(dtype, tmp_path):
    named = {}
    for number, (site, kind) in enumerate(WEIGHT_PLANTS):
        case = PAIRS["t5"](dtype)
        with planted_weight(case.candidate, site, kind, probe=case.candidate_call) as effect:
            report = _run(case, tmp_path / str(number)).report
        assert effect["changed"], (site, kind)
        named[site, kind] = (report.origin, report.verdict)
    assert named == {key: (expected, "fail") for key, expected in WEIGHT_PLANTS.items()}
