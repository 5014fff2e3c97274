"""Decode-step parity: greedy decoding with a KV cache on both sides, teacher-forced on the reference's tokens.

Step 0 is the prompt (prefill); every later step feeds one token, the reference's greedy choice of the step
before, to both sides, each with its own cache: the one a transformers model makes and returns (``cache=`` from
transformers 5.24, ``past_key_values=`` before), or the one the model's ``new_cache()`` makes (our LLaVA port).
Both sides therefore see the same tokens at every step, so every step stays comparable even after their greedy
choices part, and a bug that only bites with a cache (a position offset from step 2, a stale cache update, a
wrong decode mask) shows at the step where it starts. Each step is traced on both sides (``steps/<n>/reference``
and ``.../candidate``) and compared module by module; the last position's logits give the step's token
agreement, KL divergence, top-k overlap and largest absolute difference.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paritylab.comparison.alignment import Rule, parse_rules
from paritylab.comparison.metrics import Tolerances
from paritylab.comparison.report import Report, compare_traces
from paritylab.reports.plots import LAYER, heatmap, layer_label
from paritylab.run.errors import ConfigError
from paritylab.run.workload import CallSpec
from paritylab.tracing.tracefile import Trace
from paritylab.tracing.tracer import TraceOptions, Tracer

STEPS_DIR = "steps"


@dataclass
class Step:
    """One decode step, compared."""

    step: int
    verdict: str
    first_divergence: str | None
    """The module where divergence starts at this step (free run)."""
    culprit_reason: str
    output_rel_l2: float | None
    token_agreement: float
    """Fraction of the batch whose greedy token is the same on both sides."""
    kl: float
    """Mean KL divergence of the candidate's next-token distribution from the reference's (nats)."""
    top_k_overlap: float
    max_abs: float
    reference_tokens: list[int]
    candidate_tokens: list[int]
    layers: dict[str, float] = field(default_factory=dict)
    """Relative L2 error per numbered layer (``language_model.layers.1``)."""
    failing: int = 0

    @property
    def key(self) -> str:
        return f"step{self.step}/{self.first_divergence}" if self.first_divergence is not None else ""


@dataclass
class Generation:
    """Every step of a generate run and where, over all of them, divergence starts."""

    steps: list[Step]
    top_k: int
    reference_style: str
    candidate_style: str
    drilldown: dict[str, Any] | None = None
    """At the first failing step, the operation inside its origin where the values part (``step`` added)."""

    @property
    def verdict(self) -> str:
        verdicts = {step.verdict for step in self.steps}
        for verdict in ("error", "fail", "inconclusive"):
            if verdict in verdicts:
                return verdict
        return "pass" if self.steps else "inconclusive"

    @property
    def first_failing(self) -> Step | None:
        return next((step for step in self.steps if step.verdict in ("fail", "error")), None)

    @property
    def first_token_mismatch(self) -> int | None:
        return next((step.step for step in self.steps if step.token_agreement < 1.0), None)

    def summary(self) -> dict[str, Any]:
        first = self.first_failing
        return {
            "verdict": self.verdict,
            "steps": len(self.steps),
            "first_failing_step": first.step if first else None,
            "first_divergence": first.key if first else None,
            "culprit_reason": first.culprit_reason if first else "",
            "first_token_mismatch": self.first_token_mismatch,
            "first_operation": self.drilldown.get("operation") if self.drilldown else None,
            "top_k": self.top_k,
            "reference_cache": self.reference_style,
            "candidate_cache": self.candidate_style,
        }

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "steps": [asdict(step) for step in self.steps], "drilldown": self.drilldown}


CACHE_KEYWORDS = ("cache", "past_key_values")
"""The forward argument that carries a KV cache, in the order looked for: transformers calls it ``cache`` from
5.24 (``past_key_values`` before), and a model of one's own may take either."""


class _Side:
    """One side's model, call and cache.

    The cache keyword is read from the forward's signature. A model with a ``new_cache()`` method gets its cache
    from it and grows it in place; any other model (transformers') makes its cache on the first call and returns
    it, as the output's field of the same name (or the other spelling), and it is fed back at the next step.
    """

    def __init__(self, model: nn.Module, spec: CallSpec, name: str) -> None:
        self.model, self.spec, self.name = model, spec, name
        inner = getattr(model, "_orig_mod", model)
        try:
            parameters = inspect.signature(inner.forward).parameters
        except (TypeError, ValueError):
            parameters = {}  # type: ignore[assignment]
        keyword = next((word for word in CACHE_KEYWORDS if word in parameters), None)
        if keyword is None:
            found = ", ".join(parameters) or "no readable signature"
            raise ConfigError(
                f"generate: the {name}'s {type(inner).__name__}.forward({found}) takes no KV cache argument (looked "
                f"for {' or '.join(f'{word}=' for word in CACHE_KEYWORDS)}); give it one, or set generate.steps=0"
            )
        self.style: str = keyword
        self.use_cache = "use_cache" in parameters
        factory = getattr(inner, "new_cache", None)
        self.state: Any = factory() if callable(factory) else None

    def run(self, inputs: Mapping[str, torch.Tensor]) -> Callable[[nn.Module], Any]:
        present = CallSpec(
            tuple(name for name in self.spec.args if name in inputs),
            {parameter: name for parameter, name in self.spec.kwargs.items() if name in inputs},
            self.spec.cast,
        )
        extra: dict[str, Any] = {self.style: self.state}
        if self.use_cache:
            extra["use_cache"] = True
        return present.bind(inputs, extra)

    def absorb(self, output: Any) -> None:
        returned = next(
            (state for word in (self.style, *CACHE_KEYWORDS) if (state := _field(output, word)) is not None), None
        )
        if returned is not None:
            self.state = returned
        elif self.state is None:
            raise ConfigError(
                f"generate: the {self.name} returned no cache (no {' or '.join(CACHE_KEYWORDS)} field in its output) "
                "and has no new_cache() method; it cannot decode with a cache: set generate.steps=0"
            )


def _field(output: Any, name: str) -> Any:
    if isinstance(output, Mapping):
        return output.get(name)
    return getattr(output, name, None)


def generate_parity(
    reference: nn.Module,
    candidate: nn.Module,
    inputs: Mapping[str, torch.Tensor],
    reference_spec: CallSpec,
    candidate_spec: CallSpec,
    directory: Path,
    steps: int,
    *,
    rules: Iterable[Rule] = (),
    tolerances: Tolerances | None = None,
    top_k: int = 5,
    drilldown: bool = True,
    echo: Callable[[str], None] = lambda _: None,
) -> Generation:
    """Prefill plus ``steps`` decode steps on both sides, each traced and compared (see the module docstring).

    With ``drilldown``, the origin at the first failing step is opened operation by operation
    (:mod:`paritylab.comparison.drilldown`): both sides decode afresh up to that step, then record that call.
    """
    if "input_ids" not in inputs:
        raise ConfigError("generate needs token ids: the inputs have no input_ids (a vision-only model cannot decode)")
    sides = _Side(reference, reference_spec, "reference"), _Side(candidate, candidate_spec, "candidate")
    fed: dict[str, torch.Tensor] = dict(inputs)
    mask = inputs.get("attention_mask")
    pinned: list[Rule] | None = None
    done: list[Step] = []
    feeds: list[dict[str, torch.Tensor]] = []
    failure: tuple[int, Report, Trace, Trace] | None = None
    for number in range(steps + 1):
        feeds.append(fed)
        folder = directory / STEPS_DIR / str(number)
        outputs, traces = [], []
        for side in sides:
            output, trace = _traced(side, fed, folder / side.name)
            outputs.append(output)
            traces.append(trace)
        if number == 0:
            report = compare_traces(traces[0], traces[1], rules=rules, tolerances=tolerances)
        else:
            report = compare_traces(
                traces[0], traces[1], rules=pinned or rules, tolerances=tolerances, pinned=bool(pinned)
            )
            if pinned is None:  # decode steps share one structure: pair them once
                pinned = _frozen(report)
        logits = [_last_logits(side.spec.select(output)) for side, output in zip(sides, outputs, strict=True)]
        done.append(_step(number, report, logits[0], logits[1], top_k))
        if failure is None and done[-1].verdict in ("fail", "error"):
            failure = (number, report, traces[0], traces[1])
        echo(f"paritylab: decode step {number}: {done[-1].verdict}, tokens agree {done[-1].token_agreement:.0%}")
        token = logits[0].argmax(dim=-1, keepdim=True).to(fed["input_ids"].dtype)
        fed = {"input_ids": token}
        if mask is not None:  # the mask covers every token so far, cached and new
            mask = fed["attention_mask"] = torch.cat([mask, torch.ones_like(token, dtype=mask.dtype)], dim=-1)
    generation = Generation(done, top_k, sides[0].style, sides[1].style)
    if drilldown and failure is not None:
        specs = reference_spec, candidate_spec
        generation.drilldown = _drill_step(reference, candidate, specs, feeds, *failure, echo)
    return generation


def _drill_step(
    reference: nn.Module,
    candidate: nn.Module,
    specs: tuple[CallSpec, CallSpec],
    feeds: list[dict[str, torch.Tensor]],
    number: int,
    report: Report,
    reference_trace: Trace,
    candidate_trace: Trace,
    echo: Callable[[str], None],
) -> dict[str, Any] | None:
    """Decode both sides afresh up to step ``number`` (the same tokens), then record the origin's call there
    (the candidate teacher-forced up to it with that step's reference values) and name the operation."""
    from paritylab.comparison.drilldown import drill_into
    from paritylab.comparison.replay import teacher_forcing

    first = report.first_divergence
    if first is None or first.candidate is None or first.status != "compared":
        return None
    echo(f"paritylab: drilling into {first.path} at decode step {number}")
    sides = _Side(reference, specs[0], "reference"), _Side(candidate, specs[1], "candidate")
    with torch.no_grad():
        for fed in feeds[:number]:
            for side in sides:
                side.absorb(side.run(fed)(side.model))
        key = first.candidate.key
        found = drill_into(
            reference, sides[0].run(feeds[number]), first.reference.key,
            candidate, sides[1].run(feeds[number]), key,
            lambda model: teacher_forcing(model, reference_trace, candidate_trace, report.alignment, within=key),
            first.candidate.dtype or "float32", first.rel_l2,
        )  # fmt: skip
    result = found.to_dict()
    result["step"] = number
    return result


def _traced(side: _Side, inputs: Mapping[str, torch.Tensor], directory: Path) -> tuple[Any, Trace]:
    call = side.run(inputs)
    with torch.no_grad(), Tracer(side.model, directory, TraceOptions(save_tensors=True, capture=None)):
        output = call(side.model)
    side.absorb(output)
    return output, Trace.load(directory)


def _frozen(report: Report) -> list[Rule]:
    import yaml

    return parse_rules(yaml.safe_load(report.alignment.to_yaml()))


def _last_logits(output: Any) -> torch.Tensor:
    """The last position's logits, ``[batch, vocab]`` in float64."""
    logits = _field(output, "logits")
    if logits is None and isinstance(output, tuple | list):
        logits = next((item for item in output if isinstance(item, torch.Tensor)), None)
    if logits is None and isinstance(output, torch.Tensor):
        logits = output
    if not isinstance(logits, torch.Tensor) or logits.dim() < 2:
        raise ConfigError(
            "generate: a side's output has no logits (a logits field or key, or a [batch, tokens, vocab] tensor)"
        )
    return (logits[:, -1] if logits.dim() == 3 else logits).detach().to(torch.float64)


def _step(number: int, report: Report, reference: torch.Tensor, candidate: torch.Tensor, top_k: int) -> Step:
    summary = report.summary()
    log_p, log_q = torch.log_softmax(reference, dim=-1), torch.log_softmax(candidate, dim=-1)
    kl = float((log_p.exp() * (log_p - log_q)).sum(dim=-1).mean())
    k = min(top_k, reference.shape[-1])
    ours, theirs = reference.topk(k, dim=-1).indices, candidate.topk(k, dim=-1).indices
    overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ours, theirs, strict=True))
    tokens = reference.argmax(dim=-1), candidate.argmax(dim=-1)
    layers = {}
    for row in report.rows:
        match = LAYER.match(row.path)
        if match and row.rel_l2 is not None:
            layers[row.path] = row.rel_l2
    return Step(
        step=number,
        verdict=report.verdict,
        first_divergence=report.first_divergence.path if report.first_divergence is not None else None,
        culprit_reason=report.culprit_reason,
        output_rel_l2=summary["output_rel_l2"],
        token_agreement=float((tokens[0] == tokens[1]).double().mean()),
        kl=max(kl, 0.0) if math.isfinite(kl) else math.inf,  # rounding can make it a hair below zero
        top_k_overlap=overlap / (k * reference.shape[0]),
        max_abs=float((reference - candidate).abs().max()),
        reference_tokens=tokens[0].tolist(),
        candidate_tokens=tokens[1].tolist(),
        layers=layers,
        failing=summary["failed"],
    )


def step_heatmap(generation: Generation) -> str:
    """Layer × decode step, log10 of each layer's relative error."""
    layers = list(dict.fromkeys(path for step in generation.steps for path in step.layers))
    labels = [layer_label(path) for path in layers]
    matrix = [[math.log10(max(step.layers.get(path, 0.0), 1e-12)) for step in generation.steps] for path in layers]
    columns = [f"step {step.step}" for step in generation.steps]
    return heatmap(labels, columns, matrix, "log10 relative error per layer and decode step")
