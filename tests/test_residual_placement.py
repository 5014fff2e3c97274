"""Modules holding the same weights whose outputs differ by one of their inputs: transformers' BLOOM adds the residual
inside its attention and MLP, a port adds it in its block (``tests/bloom_port.py``). Paired by their weights, the two
modules differed by O(1) on a bit-exact port: FAIL at the first attention, and every later bug hidden behind it. The
clean pair and output plants at every site are in ``tests/test_pairs.py`` (``bloom``); here are conversion and code
bugs in fp32 and bf16, what the refuted row says, and the pairs the check must keep: a module that forgot its
residual, and a module whose only user is blind to the change (a norm after a scale)."""

from __future__ import annotations

import pytest
import torch

from paritylab.reports.render import headline
from paritylab.run.parity import ParityResult, check
from tests.bloom_port import from_bloom
from tests.pairs import _ids, bloom_reference

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def _run(candidate: torch.nn.Module, reference: torch.nn.Module, dtype: torch.dtype, tmp_path) -> ParityResult:
    ids = _ids(128)
    return check(
        reference, candidate.to(dtype), tmp_path, reference_call=lambda m: m(input_ids=ids),
        candidate_call=lambda m: m(ids), echo=None,
    )  # fmt: skip


def _scaled(name: str, factor: float, element: tuple[int, int] | None = None):
    def convert(state: dict[str, torch.Tensor]) -> None:
        if element is None:
            state[name].mul_(factor)
        else:
            state[name][element] *= factor

    return convert


def test_the_refuted_pairs_say_which_input_the_other_side_adds(tmp_path):
    reference = bloom_reference()
    result = _run(from_bloom(reference), reference, torch.float32, tmp_path)
    assert result.verdict == "pass", headline(result.report)
    rows = {row.path: row for row in result.report.rows}
    for layer in (0, 1):
        for module, user in (("self_attention", "post_attention_layernorm"), ("mlp", None)):
            row = rows[f"transformer.h.{layer}.{module}"]
            assert row.status == "unmatched", (row.path, row.status)
            assert "paired by its weights" in row.note and "adds its input inputs.args.1" in row.note, row.note
            if user is not None:
                assert f"transformer.h.{layer}.{user}, which uses it, does not" in row.note, row.note
        for child in ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_4h_to_h"):
            assert rows[f"transformer.h.{layer}.{child}"].status == "compared"  # the projections stay paired


@DTYPES
@pytest.mark.parametrize(
    ("weight", "element", "named"),
    [
        ("blocks.1.ffn.up.weight", (3, 5), "transformer.h.1.mlp.dense_h_to_4h"),
        ("blocks.0.ffn.down.weight", None, "transformer.h.0.mlp.dense_4h_to_h"),
    ],
    ids=["one-element", "whole-weight"],
)
def test_a_conversion_bug_behind_a_residual_placed_elsewhere_is_named_at_its_weight(
    dtype, weight, element, named, tmp_path
):
    reference = bloom_reference()
    result = _run(from_bloom(reference, convert=_scaled(weight, 1.01, element)), reference, dtype, tmp_path)
    assert result.verdict == "fail" and result.report.origin == named, headline(result.report)


@DTYPES
def test_a_wrong_alibi_constant_is_named_at_the_first_attention_reading_it(dtype, tmp_path):
    reference = bloom_reference()
    result = _run(from_bloom(reference, base=7.0), reference, dtype, tmp_path)  # 2**(-7/n) for BLOOM's 2**(-8/n)
    line = headline(result.report)
    assert result.verdict == "fail" and result.report.origin == "transformer.h.0.self_attention", line
    assert line.startswith("FAIL: divergence starts at transformer.h.0.self_attention (no counterpart in the"), line


def test_an_attention_whose_residual_the_port_forgot_stays_paired_and_is_named(tmp_path):
    """What uses the attention's output disagrees too: the outputs differing by an input is then the bug."""
    reference = bloom_reference()
    port = from_bloom(reference)
    port.blocks[1].residual = False
    result = _run(port, reference, torch.float32, tmp_path)
    assert result.verdict == "fail", headline(result.report)
    assert result.report.origin in ("transformer.h.1.self_attention", "transformer.h.1"), headline(result.report)


@DTYPES
def test_a_scaled_norm_whose_user_cannot_see_the_scale_is_not_refuted(dtype, tmp_path):
    """The embedding's norm x1.1: its output differs by 10 %, and the first layer's own norm, which uses it, does
    not see a scale; but the outputs do not differ by an input, so the pair of equal weights stands and is named."""
    reference = bloom_reference()
    port = from_bloom(reference, convert=_scaled("emb_norm.weight", 1.1))
    result = _run(port, reference, dtype, tmp_path)
    assert result.verdict == "fail", headline(result.report)
    assert result.report.origin == "transformer.word_embeddings_layernorm", headline(result.report)


@DTYPES
def test_a_down_projection_with_its_rows_halves_swapped_is_named_at_its_weight(dtype, tmp_path):
    """Its output agrees only with its features in another order; the reference's MLP, now unpaired, adds it to the
    residual, and holds BLOOM's GELU module, which a port computes as a function: a module with no counterpart handed
    a value that agrees is no other suspect, so the reordered projection is named, not the MLP around it."""

    def swapped(state: dict[str, torch.Tensor]) -> None:
        weight = state["blocks.0.ffn.down.weight"]
        half = weight.shape[0] // 2
        state["blocks.0.ffn.down.weight"] = torch.cat([weight[half:], weight[:half]])

    reference = bloom_reference()
    result = _run(from_bloom(reference, convert=swapped), reference, dtype, tmp_path)
    assert result.verdict == "fail", headline(result.report)
    assert result.report.origin == "transformer.h.0.mlp.dense_4h_to_h", headline(result.report)
