"""A value whose features are another value's in another order: a module whose weight a conversion changed can
no longer tell the weight ledger which order its input's features arrive in (x-transformers' output projection
reads its heads in its own order; with a block of its rows overwritten its columns' order is not proven by any
fingerprint), but the two inputs themselves still show it: each feature of the candidate's input is one of the
reference's, across every position."""

from __future__ import annotations

import torch

MATCH = 0.999
"""Each reference feature's best candidate feature agrees at least this well (cosine across positions), and is no
other reference feature's best."""
MAX_WORK = 2e9
"""At most this many multiply-adds (features squared times positions) are spent on one pair of values."""


def features_in_order(reference: torch.Tensor, candidate: torch.Tensor) -> tuple[int, ...] | None:
    """For each of the reference's features (the last dimension), the candidate's feature holding it, when the two
    values are the same features in another order (and not in the same one); None otherwise, or when the values are
    too large to match (:data:`MAX_WORK`) or hold fewer than two positions."""
    if reference.shape != candidate.shape or reference.dim() < 2 or reference.shape[-1] < 2:
        return None
    features = reference.shape[-1]
    ours, theirs = (value.reshape(-1, features).to(torch.float64) for value in (reference, candidate))
    if ours.shape[0] < 2 or features * features * ours.shape[0] > MAX_WORK:
        return None
    ours = ours - ours.mean(0)
    theirs = theirs - theirs.mean(0)
    norms = ours.norm(dim=0)[:, None] * theirs.norm(dim=0)[None, :]
    if not bool((norms > 0).all()):
        return None  # a constant feature matches any other
    cosine = (ours.T @ theirs) / norms
    best, order = cosine.max(dim=1)
    if bool((best < MATCH).any()) or len(set(order.tolist())) != features:
        return None
    found = tuple(int(at) for at in order.tolist())
    return None if found == tuple(range(features)) else found
