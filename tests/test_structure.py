"""Parameter fingerprints: the same weights, whatever their layout or dtype, fingerprint the same."""

from __future__ import annotations

import torch
from torch import nn

from paritylab.tracing.structure import MASK, fingerprint, inner_digests, restrict_to_called


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


def test_modules_that_never_ran_leave_their_ancestors_fingerprints():
    """A norm kept for a configuration the forward does not use must not make two equal blocks differ; a
    parent's descendants' fingerprints are listed, so a wrapper around a part of it can be told apart."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    padded = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.LayerNorm(4))
    padded.load_state_dict(block.state_dict(), strict=False)
    padded[2].weight.data.fill_(3.0)  # never called
    plain, extra = fingerprint(block), fingerprint(padded)
    assert plain[""].digest != extra[""].digest
    restricted = restrict_to_called(extra, {"", "0", "1"})
    assert (
        restricted[""].digest == plain[""].digest and restricted[""].numel == plain[""].numel == 24
    )  # zero biases hash to nothing
    assert restricted["2"] == extra["2"]  # the unused module itself keeps its own print
    inner = inner_digests(plain)
    assert inner[""] == {plain["0"].digest, plain["1"].digest}
    assert "0" not in inner  # a leaf has no descendants


def test_a_norm_stored_minus_one_fingerprints_as_its_original_on_the_bf16_and_fp16_grids():
    """A norm scale ``w`` (float32) against a copy storing ``g = w - 1`` in bfloat16 or float16: the original's
    ``shifted`` print is the copy's digest on either grid; on the float16 grid the one subtracted before rounding
    (``round(w) - 1`` sits on a grid 16x coarser than ``round(w - 1)`` near one, and hashes differently)."""
    generator = torch.Generator().manual_seed(0)
    original = nn.LayerNorm(64, elementwise_affine=True, bias=False)
    with torch.no_grad():
        original.weight.copy_(1 + 0.1 * torch.randn(64, generator=generator))
    for dtype, grid in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        stored = nn.LayerNorm(64, bias=False).to(dtype)
        with torch.no_grad():
            stored.weight.copy_((original.weight - 1).to(dtype))
        assert fingerprint(original, grid)[""].shifted == fingerprint(stored, grid)[""].digest != 0, grid


def test_a_trace_of_the_same_weights_again_writes_the_fingerprints_it_encoded_once(tmp_path, monkeypatch):
    import json

    import paritylab
    from paritylab.tracing import files
    from paritylab.tracing.structure import fingerprint_json, prints_from_meta

    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3))
    with paritylab.trace(model, tmp_path / "a"):
        model(torch.randn(2, 4))
    encoded: list[object] = []
    real = files.json_text
    monkeypatch.setattr(files, "json_text", lambda document, indent=None: encoded.append(document) or real(document))
    monkeypatch.setattr("paritylab.tracing.structure.json_text", files.json_text)
    with paritylab.trace(model, tmp_path / "b"):
        model(torch.randn(2, 4))
    plain = json.loads(json.dumps(list(fingerprint_json(model))))
    for name in ("a", "b"):  # both files hold the fingerprints whole, as plain JSON a reader parses alone
        meta = json.loads((tmp_path / name / "trace.json").read_text())["meta"]
        assert meta["structure"] == plain and set(prints_from_meta(meta)) == {"", "0", "1", "2"}
    written = [document["meta"] for document in encoded if isinstance(document, dict) and "meta" in document]
    assert len(written) == 1 and isinstance(written[0]["structure"], str)  # the second trace's: not encoded again
    assert not any(isinstance(document, list) for document in encoded)
    with torch.no_grad():
        model[2].weight.mul_(2.0)  # new values: fingerprinted, and so encoded, anew
    with paritylab.trace(model, tmp_path / "c"):
        model(torch.randn(2, 4))
    meta = json.loads((tmp_path / "c" / "trace.json").read_text())["meta"]
    assert meta["structure"] != plain and meta["structure"] == json.loads(json.dumps(list(fingerprint_json(model))))


def test_write_json_puts_each_fragment_in_place_of_its_one_placeholder(tmp_path):
    import json

    import pytest

    from paritylab.tracing.files import write_json

    write_json(tmp_path / "x.json", {"a": "P", "b": [1, float("nan")]}, fragments={"P": '{"pre":[1,2]}'})
    assert json.loads((tmp_path / "x.json").read_text()) == {"a": {"pre": [1, 2]}, "b": [1, "nan"]}
    with pytest.raises(ValueError, match="must occur once"):
        write_json(tmp_path / "y.json", {"a": "P", "b": "P"}, fragments={"P": "1"})
    assert not (tmp_path / "y.json").exists()
