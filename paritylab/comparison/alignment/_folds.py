"""Norms folded into the layer before them (:mod:`paritylab.comparison.weights._folds`), found where the data flows:
a reference norm with running statistics whose input is a layer's output, and a candidate weight that is that
layer's with the norm folded into it. The candidate module is paired with the norm's output, as one module against
a run of two (:mod:`._runs`): its input is the layer's, its output the norm's."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy

from paritylab.comparison.alignment._shapes import _primary_input
from paritylab.comparison.weights import WeightLedger
from paritylab.comparison.weights._folds import Fold, RunningNorm, defective_fold, fold_fit, record_fold, running_norm
from paritylab.comparison.weights._records import _named
from paritylab.tracing.structure import ModulePrint, ParamPrint
from paritylab.tracing.tracefile import CallRecord


@dataclass(frozen=True)
class _Layer:
    """A reference layer whose output a norm with running statistics normalises."""

    path: str
    weight: ParamPrint
    bias: ParamPrint | None
    norm: RunningNorm


def read_folds(
    ref_calls: list[CallRecord],
    cand_calls: list[CallRecord],
    ref_prints: Mapping[str, ModulePrint],
    cand_prints: Mapping[str, ModulePrint],
    ledger: WeightLedger,
) -> None:
    """Record in ``ledger`` every candidate weight that is a reference layer's with the norm after it folded in (best
    fit first; one candidate weight a layer, one layer a candidate module). Where the port folds norms, a module
    whose weight is near a normalised layer's but fits no fold is that layer's fold with a defect (the ledger's near
    match names it): a conversion bug in one fold must not cost the module its pair."""
    layers = _normalised_layers(ref_calls, ref_prints, _kept_statistics(cand_prints))
    if not layers:
        return
    by_shape: dict[tuple[int, ...], list[_Layer]] = {}
    for layer in layers:
        by_shape.setdefault(layer.weight.shape, []).append(layer)
        if len(layer.weight.shape) == 2:
            by_shape.setdefault(layer.weight.shape[::-1], []).append(layer)
    fits: list[tuple[float, str, str, _Layer, Fold, ModulePrint, ParamPrint]] = []
    for item in cand_prints.values():
        for param in item.params:
            for layer in by_shape.get(param.shape, ()) if len(param.shape) >= 2 else ():
                if param.digest == layer.weight.digest:
                    continue  # the layer's own weight: nothing folded into it
                fold = fold_fit(layer.weight, layer.bias, layer.norm, param)
                if fold is not None:
                    fits.append((fold.residual, item.path, param.name, layer, fold, item, param))
    fits.sort(key=lambda fit: fit[:3])
    used_layers: set[str] = set()
    chosen: list[float] = []  # the ε of each fold taken: a defective fold is read with their median
    for _, path, _, layer, fold, item, param in fits:
        if path in ledger.folds or layer.path in used_layers:
            continue
        used_layers.add(layer.path)
        chosen.append(fold.eps)
        record_fold(ledger, item, param, layer.path, layer.weight, layer.bias, layer.norm, fold)
    if not chosen:
        return
    eps = float(numpy.median(chosen))
    for layer, item, param in _left_over(layers, used_layers, cand_calls, cand_prints, ledger):
        defect = defective_fold(layer.weight, layer.bias, layer.norm, param, eps)
        if defect is not None:
            record_fold(ledger, item, param, layer.path, layer.weight, layer.bias, layer.norm, defect)


def _left_over(
    layers: list[_Layer],
    used: set[str],
    cand_calls: list[CallRecord],
    cand_prints: Mapping[str, ModulePrint],
    ledger: WeightLedger,
) -> list[tuple[_Layer, ModulePrint, ParamPrint]]:
    """The normalised layers no fold fits, each with the candidate weight that stands in its place: the one the
    ledger found near it, else, shape by shape, the candidate weights of that shape near nothing, in call order
    (as many as the layers left)."""
    found = []
    left: dict[tuple[int, ...], list[_Layer]] = {}
    for layer in layers:
        if layer.path in used:
            continue
        near = [path for path, modules in ledger.near_modules.items() if modules == {layer.path}]
        item = cand_prints.get(near[0]) if len(near) == 1 and near[0] not in ledger.folds else None
        param = _near_weight(item, layer, ledger) if item is not None else None
        if item is not None and param is not None:
            found.append((layer, item, param))
        else:
            left.setdefault(layer.weight.shape, []).append(layer)
    first_call: dict[str, int] = {}
    for position, call in enumerate(cand_calls):
        first_call.setdefault(call.path, position)
    unmatched = set(ledger.unmatched)
    spare: dict[tuple[int, ...], list[tuple[int, ModulePrint, ParamPrint]]] = {}
    for item in cand_prints.values():
        if item.path in ledger.folds or item.path not in first_call:
            continue
        for param in item.params:
            if param.shape in left and _named(item.path, param) in unmatched:
                spare.setdefault(param.shape, []).append((first_call[item.path], item, param))
    for shape, waiting in left.items():
        standing = sorted(spare.get(shape, ()), key=lambda entry: entry[0])
        if len(standing) == len(waiting):
            found += [(layer, item, param) for layer, (_, item, param) in zip(waiting, standing, strict=True)]
    return found


def _near_weight(item: ModulePrint, layer: _Layer, ledger: WeightLedger) -> ParamPrint | None:
    """The tensor of candidate module ``item`` the ledger found a near copy of the layer's weight."""
    names = {finding.candidate for finding in ledger.differing if finding.reference == _named(layer.path, layer.weight)}
    return next((param for param in item.params if _named(item.path, param) in names), None)


def _kept_statistics(prints: Mapping[str, ModulePrint]) -> set[int]:
    """Fingerprints of the running variances the candidate's own norms keep."""
    return {buffer.digest for item in prints.values() for buffer in item.buffers if buffer.name == "running_var"}


def _normalised_layers(
    ref_calls: list[CallRecord], ref_prints: Mapping[str, ModulePrint], kept: set[int]
) -> list[_Layer]:
    """Reference layers (holding one weight of two or more dimensions with a row per channel) whose output is the
    input of a norm with running statistics of as many channels, which the candidate does not keep (``kept``: the
    running variances its own norms hold; a port keeping the norm folded nothing into the layer)."""
    norms: dict[str, RunningNorm | None] = {}
    found: dict[str, _Layer] = {}
    for call in ref_calls:
        if call.call_index != 0 or call.path not in ref_prints:
            continue
        if call.path not in norms:
            norms[call.path] = running_norm(ref_prints[call.path])
        norm = norms[call.path]
        variance = next((b.digest for b in ref_prints[call.path].buffers if b.name == "running_var"), None)
        if norm is None or variance in kept:
            continue
        node = _primary_input(call)
        origin = node.get("from") if node else None
        if not isinstance(origin, int) or not 0 <= origin < len(ref_calls):
            continue
        holder = ref_prints.get(ref_calls[origin].path)
        if holder is None or holder.path in found:
            continue
        weights = [param for param in holder.params if len(param.shape) >= 2]
        if len(weights) != 1 or weights[0].shape[0] != norm.channels:
            continue
        bias = next((p for p in holder.params if len(p.shape) == 1 and p.shape[0] == norm.channels), None)
        found[holder.path] = _Layer(holder.path, weights[0], bias, norm)
    return list(found.values())


def folded_calls(
    ref_calls: list[CallRecord], cand_calls: list[CallRecord], folds: Mapping[str, tuple[str, str]]
) -> list[tuple[int, int, int]]:
    """(the norm's call, the candidate module's call, the layer's call) for each call of a folded module, in order:
    the norm's call is the one whose input the layer's call made."""
    found = []
    for cand_path, (layer, norm) in folds.items():
        theirs = [j for j, call in enumerate(cand_calls) if call.path == cand_path]
        ours = []
        for k, call in enumerate(ref_calls):
            if call.path != norm:
                continue
            node = _primary_input(call)
            origin = node.get("from") if node else None
            if isinstance(origin, int) and 0 <= origin < len(ref_calls) and ref_calls[origin].path == layer:
                ours.append((k, origin))
        found += [(k, j, i) for (k, i), j in zip(ours, theirs, strict=False)]
    return found
