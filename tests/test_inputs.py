"""Every input counts: a module whose own input agrees but whose other input (an encoder's states, given by
keyword) differs is not where divergence starts, whatever the order of the model's keyword arguments."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import paritylab


class Enc(nn.Module):
    def __init__(s):
        super().__init__()
        s.conv = nn.Linear(8, 16)
        s.pos = nn.Parameter(torch.randn(6, 16))
        s.layer = nn.Linear(16, 16)
        s.norm = nn.LayerNorm(16)

    def forward(s, x):
        return s.norm(s.layer(s.conv(x) + s.pos))


class Cross(nn.Module):
    def __init__(s):
        super().__init__()
        s.q = nn.Linear(16, 16)
        s.k = nn.Linear(16, 16)
        s.o = nn.Linear(16, 16)

    def forward(s, hidden_states, key_value_states):
        a = torch.softmax(s.q(hidden_states) @ s.k(key_value_states).transpose(-1, -2), -1)
        return s.o(a @ key_value_states)


class Dec(nn.Module):
    def __init__(s):
        super().__init__()
        s.embed = nn.Embedding(32, 16)
        s.self_proj = nn.Linear(16, 16)
        s.cross = Cross()
        s.head = nn.Linear(16, 32)

    def forward(s, ids, enc):
        h = s.self_proj(s.embed(ids))
        return s.head(s.cross(h, key_value_states=enc))


class Ref(nn.Module):
    def __init__(s):
        super().__init__()
        s.encoder = Enc()
        s.decoder = Dec()

    def forward(s, features, decoder_ids):
        return s.decoder(decoder_ids, s.encoder(features))


class Cand(nn.Module):  # no encoder module: its parts sit at the top, its own code adds the positions
    def __init__(s, ref, scale):
        super().__init__()
        e = ref.encoder
        s.conv, s.layer, s.norm = e.conv, e.layer, e.norm
        s.pos = nn.Parameter(e.pos.detach() * scale)
        s.decoder = ref.decoder

    def forward(s, features, decoder_ids):
        enc = s.norm(s.layer(s.conv(features) + s.pos))
        return s.decoder(decoder_ids, enc)


@pytest.mark.parametrize("order", ["features-first", "ids-first"])
def test_a_cross_attention_fed_other_encoder_states_is_not_blamed(tmp_path, order):
    """The candidate has no encoder module (its parts sit at the top) and its positions are 1 % off: the
    cross-attention's own input (the decoder's states) agrees, its encoder states do not. The blame lands on the
    reference's encoder, the module whose counterpart code differs, in either keyword order."""
    torch.manual_seed(0)
    reference = Ref().eval()
    features, ids = torch.randn(1, 6, 8), torch.randint(0, 32, (1, 4))

    def call(model):
        if order == "features-first":
            return model(features=features, decoder_ids=ids)
        return model(decoder_ids=ids, features=features)

    clean = paritylab.check(reference, Cand(copy.deepcopy(reference), 1.0).eval(), tmp_path / "clean",
                            reference_call=call, noise_floor="off")  # fmt: skip
    assert clean.verdict == "pass"
    result = paritylab.check(reference, Cand(copy.deepcopy(reference), 1.01).eval(), tmp_path / "bug",
                             reference_call=call, noise_floor="off")  # fmt: skip
    assert result.verdict == "fail"
    assert result.report.first_divergence is not None and result.report.first_divergence.path == "encoder"
    cross = next(row for row in result.report.rows if row.path == "decoder.cross")
    assert cross.input_verdict == "fail" and cross.input_diverged  # its encoder states differ


def test_an_earlier_own_error_the_replay_finds_takes_the_headline_from_a_later_free_run_origin():
    """Free run and replay reconciled: the free run named ``dec.layer`` (its input looked as if it agreed), the
    isolated replay finds an own error at ``enc.pos_add``, earlier, whose free-run output diverges too, and none
    at ``dec.layer``. The earlier one is where divergence starts; the reason says why; both stay listed."""
    from paritylab.comparison.alignment import Alignment
    from paritylab.comparison.attribution import _name_culprit
    from paritylab.comparison.report import Report, Row, Side
    from paritylab.tracing.tracefile import Trace

    def row(index: int, path: str, diverged: bool, own: bool, parent: int | None = 0) -> Row:
        made = Row(index, path, Side(f"{path}#0"), Side(f"{path}#0"), "compared", "fail" if diverged else "pass")
        made.diverged, made.parent = diverged, parent
        made.local = {"local_rel_l2": 0.02 if own else 0.0, "local_diverged": float(own)}
        return made

    root, encoder, decoder = (
        row(0, "", True, False, None),
        row(1, "enc.pos_add", True, True),
        row(2, "dec.layer", True, False),
    )
    report = Report([root, encoder, decoder], Alignment(), decoder, [decoder], replay_origins=[encoder])
    report.culprit_reason = "the earliest module whose output diverges while its input agrees"
    _name_culprit(report, Trace(calls=[]), Trace(calls=[]), low_precision=False)
    assert report.first_divergence is encoder and [r.path for r in report.origins] == ["enc.pos_add", "dec.layer"]
    assert report.culprit_reason == (
        "its own error (isolated replay) diverges before the free-run origin dec.layer, whose own error does not"
    )
    # an enclosing module's own code is not "earlier": a parent starts before its children
    parent, child = row(1, "dec", True, True), row(2, "dec.layer", True, False, parent=1)
    nested = Report([root, parent, child], Alignment(), child, [child], replay_origins=[parent])
    _name_culprit(nested, Trace(calls=[]), Trace(calls=[]), low_precision=False)
    assert nested.first_divergence is child
