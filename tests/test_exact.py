"""A pair that replays bit for bit is judged against no noise: what differs there is code, not rounding."""

from __future__ import annotations

import copy

import pytest
import torch

import paritylab
from tests.tiny import tiny_llama, token_ids

IDS = token_ids(length=10)


def _check(tmp_path, reference, candidate, name):
    return paritylab.check(reference, candidate, tmp_path / name, reference_call=lambda m: m(IDS))


def test_an_eps_ten_times_the_references_is_named_in_fp32_and_the_clean_copy_passes(tmp_path):
    """RMSNorm eps 1e-5 where the reference has 1e-6: an own error of a few 1e-6, under float32's tolerance
    margin (5.2e-6), but every other module of this pair replays with exactly 0 error: a code difference."""
    reference = tiny_llama(num_hidden_layers=2, rms_norm_eps=1e-6)
    with torch.no_grad():
        reference.model.embed_tokens.weight.mul_(80)  # unit-sized activations, as a trained model has
    candidate = copy.deepcopy(reference)
    assert _check(tmp_path, reference, candidate, "clean").verdict == "pass"
    candidate.model.layers[1].post_attention_layernorm.variance_epsilon = 1e-5
    result = _check(tmp_path, reference, candidate, "eps")
    assert result.verdict == "fail"
    first = result.report.first_divergence
    assert first.path == "model.layers.1.post_attention_layernorm"
    assert "of this pair's modules replay bit for bit" in first.note
    assert 1e-6 < first.local["local_rel_l2"] < 5.2e-6  # under the fixed fp32 margin: only the exact pair sees it


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_low_precision_pair_that_replays_exactly_is_judged_against_no_noise(tmp_path, dtype):
    """Both sides in low precision, the candidate a copy: its clean replay is bit for bit, so 1 % noise in one
    projection (under the bf16 floor's margin) is a bug, named there; the clean copy passes."""
    reference = tiny_llama(num_hidden_layers=2).to(dtype)
    candidate = copy.deepcopy(reference)
    assert _check(tmp_path, reference, candidate, "clean").verdict == "pass"
    generator = torch.Generator().manual_seed(0)

    def noisy(_m, _a, out: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(out.shape, generator=generator).to(out.dtype)
        return out + 0.0085 * out.float().std().to(out.dtype) * noise

    candidate.model.layers[0].mlp.down_proj.register_forward_hook(noisy)
    result = _check(tmp_path, reference, candidate, "noise")
    assert result.verdict == "fail" and result.report.first_divergence.path == "model.layers.0.mlp.down_proj"
