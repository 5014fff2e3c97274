"""A pair's history in MLflow: its golden baseline, regressions against it, and a trend run over time.

Runs of one pair share the tag ``paritylab.fingerprint``: a digest of everything that defines "the same
comparison" (the model's and the candidate's build configuration, the inputs, the dtype, the device and the
comparison settings), so a sweep over a build argument, a dtype override or other tolerances never compares
against another pair's baseline. ``paritylab.pair`` (``model/candidate``) is for people. A run's baseline is
the newest run promoted with ``paritylab-promote RUN_ID`` (tag ``paritylab.baseline=golden``), else
the newest run of the pair that was judged (its ``paritylab.verdict`` pass or fail: the verdict, not the run's
status, says it, since a failing run ends FAILED). Each layer's relative error is compared with the
baseline's: it *regressed* when ``error > factor × baseline + floor`` (the absolute floor keeps changes at
noise level from firing), or when it is NaN/Inf where the baseline's was finite; it *improved* when
``error × factor + floor < baseline``.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paritylab.sink.keys import metric_key

if TYPE_CHECKING:
    from paritylab.sink.store import Store, StoredRun

PAIR = "paritylab.pair"
FINGERPRINT = "paritylab.fingerprint"
UNFINISHED = ("running", "error", "interrupted", "none")
"""Verdicts of a run that did not finish its comparison: never a baseline, even forced."""
BASELINE = "paritylab.baseline"
TREND = "paritylab.trend"
LAYER_PREFIX = "layer/"
LAYER_SUFFIX = "/rel_l2"


FINGERPRINT_KEYS = ("model", "candidate", "inputs", "dtype", "device", "compare", "seed")
"""The resolved configuration keys that define a pair (tracking, output and resident settings do not)."""


def pair_fingerprint(config: Mapping[str, Any]) -> str:
    """A short, stable digest of the configuration that defines "the same comparison"."""
    chosen = {key: config.get(key) for key in FINGERPRINT_KEYS}
    compare = chosen.get("compare")
    if isinstance(compare, Mapping):  # which alignment is pinned does not change the pair
        chosen["compare"] = {k: v for k, v in compare.items() if k != "alignment"}
    text = json.dumps(chosen, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


@dataclass
class Regression:
    verdict: str
    """``none``, ``regressed``, ``improved`` or ``no-baseline``."""
    baseline_run_id: str | None = None
    regressed: list[str] = field(default_factory=list)
    improved: list[str] = field(default_factory=list)
    ratios: dict[str, float] = field(default_factory=dict)
    """Layer path -> current / baseline relative error."""

    def tags(self) -> dict[str, str]:
        return {
            "paritylab.regression": self.verdict,
            "paritylab.regressed_layers": ",".join(self.regressed) or "none",
            "paritylab.baseline_run": self.baseline_run_id or "none",
        }

    @classmethod
    def from_tags(cls, tags: Mapping[str, str]) -> Regression:
        """The verdict as :meth:`tags` wrote it (ratios are not kept in tags)."""
        baseline = tags.get("paritylab.baseline_run", "none")
        layers = tags.get("paritylab.regressed_layers", "none")
        return cls(
            tags.get("paritylab.regression", "none"),
            None if baseline == "none" else baseline,
            [] if layers == "none" else layers.split(","),
        )


def layer_errors(metrics: Mapping[str, float]) -> dict[str, float]:
    """Layer key -> relative error, from a run's ``layer/<path>/rel_l2`` metrics. Keys are taken as MLflow
    stores them (module names with characters MLflow rejects are renamed), so a run's own metrics and a
    baseline read back from MLflow line up whatever the module names are."""

    found: dict[str, float] = {}
    for raw, value in metrics.items():
        key = metric_key(raw)
        if key.startswith(LAYER_PREFIX) and key.endswith(LAYER_SUFFIX):
            found[key[len(LAYER_PREFIX) : -len(LAYER_SUFFIX)]] = value
    return found


NONFINITE = 1e300
"""MLflow stores Inf as the largest float: anything this large, or NaN, is a non-finite error."""


def _finite(value: float) -> bool:
    return math.isfinite(value) and abs(value) < NONFINITE


def assess(
    current: Mapping[str, float], baseline: Mapping[str, float] | None, factor: float, floor: float
) -> Regression:
    """Compare per-layer errors with the baseline's."""
    if baseline is None:
        return Regression("no-baseline")
    result = Regression("none")
    for layer, value in current.items():
        before = baseline.get(layer)
        if before is None:
            continue
        if not _finite(value) or not _finite(before):
            if not _finite(value) and _finite(before):  # NaN/Inf where the baseline was finite
                result.ratios[layer] = math.inf
                result.regressed.append(layer)
            elif _finite(value):
                result.improved.append(layer)
            continue
        result.ratios[layer] = value / before if before > 0 else (math.inf if value > 0 else 1.0)
        if value > factor * before + floor:
            result.regressed.append(layer)
        elif value * factor + floor < before:
            result.improved.append(layer)
    if result.regressed:
        result.verdict = "regressed"
    elif result.improved:
        result.verdict = "improved"
    return result


def usable_baseline(run: StoredRun, exclude: str | None, judged: bool) -> bool:
    """Whether ``run`` can be a baseline: never ``exclude`` (the run itself) or a trend run; a run found by
    status (``judged``) must also have been judged (pass or fail) and hold per-layer metrics, so a killed or
    errored run is never one."""
    if run.run_id == exclude or run.tags.get(TREND) == "true":
        return False
    return not judged or (run.tags.get("paritylab.verdict") in ("pass", "fail") and bool(layer_errors(run.metrics)))


def promotable(run: StoredRun) -> tuple[str | None, bool]:
    """Why ``run`` cannot be a baseline (None when it can), and whether ``--force`` may override that: a
    trend run, a run that did not finish or one with no per-layer metrics is never a baseline; a finished
    run whose verdict is not pass can be forced."""
    tags = run.tags
    if tags.get(TREND) == "true":
        return "it is a trend run, not a parity run", False
    if not tags.get(PAIR) or not tags.get(FINGERPRINT):
        return f"it is not a paritylab parity run (no {PAIR} / {FINGERPRINT} tags)", False
    verdict = tags.get("paritylab.verdict", "none")
    if run.status not in ("FINISHED", "FAILED"):  # a FAIL ends FAILED (the verdict tells it from an error)
        return f"it did not finish (status {run.status})", False
    if verdict in UNFINISHED:
        return f"it did not finish (verdict {verdict!r})", False
    if verdict != "pass":  # the reason a person needs first
        if not layer_errors(run.metrics):
            return f"its verdict is {verdict!r}, not 'pass', and it has no per-layer metrics to compare against", False
        return f"its verdict is {verdict!r}, not 'pass'", True
    if not layer_errors(run.metrics):
        return "it has no per-layer metrics to compare against", False
    return None, False


def baseline_alignment(store: Store, fingerprint: str, exclude: str | None, directory: Path) -> tuple[str, Path] | None:
    """The pair's baseline run and its ``report/alignment.yaml``, downloaded into ``directory``; ``None`` when the
    pair has no baseline yet."""
    baseline = store.find_baseline(fingerprint, exclude)
    if baseline is None:
        return None
    return baseline.run_id, store.download(baseline.run_id, "report/alignment.yaml", directory)
