"""A pair's history in MLflow: its golden baseline, regressions against it, and a trend run over time.

Runs of one model/candidate/inputs combination share the tags ``paritylab.pair`` and
``paritylab.inputs`` (a digest of the model and inputs configuration). A run's baseline is the newest
run promoted with ``python -m paritylab.promote RUN_ID`` (tag ``paritylab.baseline=golden``), else the
previous finished run of the pair. Each layer's relative error is compared with the baseline's: it
*regressed* when ``error > factor × baseline + floor`` (the absolute floor keeps changes at noise level
from firing), and *improved* when ``error × factor + floor < baseline``.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

PAIR = "paritylab.pair"
INPUTS = "paritylab.inputs"
BASELINE = "paritylab.baseline"
TREND = "paritylab.trend"
LAYER_PREFIX = "layer/"
LAYER_SUFFIX = "/rel_l2"


def inputs_digest(config: Mapping[str, Any]) -> str:
    """A short, stable digest of the configuration that defines "the same inputs"."""
    text = json.dumps(config, sort_keys=True, default=str)
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


def layer_errors(metrics: Mapping[str, float]) -> dict[str, float]:
    """Layer path -> relative error, from a run's ``layer/<path>/rel_l2`` metrics."""
    return {
        key[len(LAYER_PREFIX) : -len(LAYER_SUFFIX)]: value
        for key, value in metrics.items()
        if key.startswith(LAYER_PREFIX) and key.endswith(LAYER_SUFFIX)
    }


def assess(
    current: Mapping[str, float], baseline: Mapping[str, float] | None, factor: float, floor: float
) -> Regression:
    """Compare per-layer errors with the baseline's."""
    if baseline is None:
        return Regression("no-baseline")
    result = Regression("none")
    for layer, value in current.items():
        before = baseline.get(layer)
        if before is None or not math.isfinite(value):
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


def find_baseline(client: Any, experiment_id: str, pair: str, digest: str, exclude: str | None) -> Any | None:
    """The golden run of this pair and inputs, else its newest finished run (never ``exclude``)."""
    scope = f"tags.`{PAIR}` = '{_quote(pair)}' and tags.`{INPUTS}` = '{digest}'"
    for condition in (f" and tags.`{BASELINE}` = 'golden'", " and attributes.status = 'FINISHED'"):
        runs = client.search_runs(
            [experiment_id], filter_string=scope + condition, order_by=["attributes.start_time DESC"], max_results=5
        )
        for run in runs:
            if run.info.run_id != exclude and run.data.tags.get(TREND) != "true":
                return run
    return None


def promote(client: Any, run_id: str) -> list[str]:
    """Make ``run_id`` the golden baseline of its pair and inputs; returns the runs it supersedes."""
    run = client.get_run(run_id)
    pair, digest = run.data.tags.get(PAIR), run.data.tags.get(INPUTS)
    if not pair or not digest:
        raise ValueError(f"run {run_id} is not a paritylab parity run (no {PAIR} / {INPUTS} tags)")
    scope = f"tags.`{PAIR}` = '{_quote(pair)}' and tags.`{INPUTS}` = '{digest}' and tags.`{BASELINE}` = 'golden'"
    previous = [r.info.run_id for r in client.search_runs([run.info.experiment_id], filter_string=scope)]
    for other in previous:
        if other != run_id:
            client.set_tag(other, BASELINE, "superseded")
    client.set_tag(run_id, BASELINE, "golden")
    return [other for other in previous if other != run_id]


def trend_run(client: Any, experiment_id: str, pair: str, digest: str) -> str:
    """The long-lived run that charts this pair's per-layer divergence over successive runs."""
    scope = f"tags.`{TREND}` = 'true' and tags.`{PAIR}` = '{_quote(pair)}' and tags.`{INPUTS}` = '{digest}'"
    found = client.search_runs([experiment_id], filter_string=scope, max_results=1)
    if found:
        return found[0].info.run_id
    run = client.create_run(experiment_id, run_name=f"trend/{pair}", tags={TREND: "true", PAIR: pair, INPUTS: digest})
    client.set_terminated(run.info.run_id, "FINISHED")  # finished runs still take metrics; never "stale"
    return run.info.run_id


def next_trend_step(client: Any, run_id: str) -> int:
    run = client.get_run(run_id)
    step = int(run.data.tags.get("paritylab.trend_steps", "0")) + 1
    client.set_tag(run_id, "paritylab.trend_steps", str(step))
    return step


def _quote(text: str) -> str:
    return text.replace("\\", "\\\\").replace("'", "\\'")
