"""The workload: which named tensors each side is fed, and how they reach its forward.

Both sides receive the same named tensors (``input_ids``, ``pixel_values``, ...). How a tensor reaches a
forward is a :class:`CallSpec`: positional arguments and keyword arguments, read from the forward's signature
by default, so a TransformerLens-style ``forward(input)``, a litgpt-style ``forward(idx)`` or a vision
``forward(x)`` runs with no adapter module (module paths stay the model's own). A mapping that does not fit
the forward is a one-line :class:`~paritylab.run.config.ConfigError` naming the parameter and the fix, raised
before that side runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from paritylab.run.errors import ConfigError
from paritylab.tracing.values import Node, pick, select

ALIASES: dict[str, tuple[str, ...]] = {
    "input_ids": ("input", "inputs", "idx", "tokens", "ids", "token_ids", "input_tokens", "x"),
    "pixel_values": ("pixels", "images", "image", "img", "x", "input", "inputs"),
    "input_values": ("waveform", "audio", "x", "input", "inputs"),
    "input_features": ("features", "mel", "x", "input", "inputs"),
}
"""Parameter names that commonly stand for a named input in other libraries' forwards."""
OPTIONAL = ("attention_mask",)
"""Inputs left out, with a note, when a forward has no parameter for them (an all-ones mask changes nothing)."""


@dataclass(frozen=True)
class CallSpec:
    """How one side is called: ``forward(*[inputs[n] for n in args], **{p: inputs[n] for p, n in kwargs})``."""

    args: tuple[str, ...] = ()
    kwargs: Mapping[str, str] = field(default_factory=dict)
    cast: bool = True
    """Cast floating-point inputs to the model's floating-point parameter dtype (a bf16 candidate gets bf16)."""
    dropped: tuple[str, ...] = ()
    output: int | str | None = None
    """Which part of the return value is "the output" (:meth:`select`); ``None``: all of it."""

    def bind(
        self, inputs: Mapping[str, torch.Tensor], extra: Mapping[str, Any] | None = None
    ) -> Callable[[nn.Module], Any]:
        """A call ``run(model)`` with the inputs bound; floating-point inputs are cast to the dtype of the
        model it is given when ``cast`` (so one call serves a model and its float64 or bf16 copies).
        ``extra`` keyword arguments are passed as they are (a decode step's cache)."""

        def run(model: nn.Module) -> Any:
            dtype = _float_dtype(model) if self.cast else None

            def prepared(name: str) -> torch.Tensor:  # a copy per call: no forward changes what the next is fed
                value = inputs[name]
                if dtype is not None and value.is_floating_point() and value.dtype != dtype:
                    return value.to(dtype)
                return value.clone() if isinstance(value, torch.Tensor) else value

            args = [prepared(name) for name in self.args]
            keywords = {parameter: prepared(name) for parameter, name in self.kwargs.items()}
            return model(*args, **keywords, **(extra or {}))

        return run

    def select(self, output: Any) -> Any:
        """The part of a forward's return value that is "the output": a key or attribute (a ModelOutput's
        ``logits``), an index into a tuple or list, or all of it."""
        return select_output(output, self.output)

    def describe(self) -> str:
        parts = [*self.args, *(f"{p}={n}" for p, n in self.kwargs.items())]
        text = f"forward({', '.join(parts)})"
        text += f"[{self.output!r}]" if self.output is not None else ""
        return text + (f"; left out: {', '.join(self.dropped)}" if self.dropped else "")


def output_choice(value: Any, side: str) -> int | str | None:
    """``{side}.call.output`` as an index, a key or ``None``; anything else is a one-line error."""
    if value is None or (isinstance(value, int | str) and not isinstance(value, bool)):
        return int(value) if isinstance(value, str) and value.lstrip("-").isdigit() else value
    raise ConfigError(f"{side}.call.output={value!r}: give a key (logits), an index (0), or null for the whole output")


def select_output(output: Any, choice: int | str | None) -> Any:
    """Element ``choice`` of a forward's return value (:func:`~paritylab.tracing.values.pick`: a key, an
    attribute of a dataclass, an index); ``None``: all of it. Missing: a one-line error."""
    chosen = pick(output, choice)
    if chosen is None:
        raise ConfigError(f"output {choice!r} is not in what the forward returned ({describe_output(output)})")
    return chosen


def check_output(node: Node | None, choice: int | str | None, side: str, name: str) -> None:
    """A traced root output (``node``) holds element ``choice``; else a one-line error naming what it holds."""
    if choice is None or select(node, choice) is not None:
        return
    kind = (node or {}).get("t")
    items = (node or {}).get("items")
    if kind == "dict" and isinstance(items, dict):
        held = "keys " + ", ".join(items)
    elif kind in ("tuple", "list") and isinstance(items, list):
        held = f"a {kind} of {len(items)} (indices 0..{len(items) - 1})"
    else:
        held = "a single value (index 0)" if kind == "tensor" else f"a {kind or 'value'}"
    raise ConfigError(f"{side}.call.output={choice!r}: {name}.forward returned {held}; choose one of those, or null")


def describe_output(output: Any) -> str:
    """A short description of a return value's structure, for error messages."""
    if isinstance(output, torch.Tensor):
        return f"a tensor {list(output.shape)}"
    if isinstance(output, Mapping):
        return "keys " + ", ".join(map(str, output))
    if isinstance(output, tuple | list):
        return f"a {type(output).__name__} of {len(output)}"
    return type(output).__name__


def infer_call(
    model: nn.Module,
    inputs: Mapping[str, torch.Tensor],
    side: str,
    args: Sequence[str] | None = None,
    kwargs: Mapping[str, str] | None = None,
    drop: Sequence[str] = (),
) -> CallSpec:
    """The call spec for ``model``: the given ``args``/``kwargs`` checked against its forward, else read
    from the signature (exact names, then :data:`ALIASES`, then the one positional parameter left).

    ``side`` (``model`` or ``candidate``) names the config key in error messages.
    """
    forward = _forward(model)
    parameters = _parameters(forward)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    name = f"{type(_unwrap(model)).__name__}.forward"
    known = ", ".join(inputs) or "none"
    for wanted in [*(args or ()), *(kwargs or {}).values()]:
        if wanted not in inputs:
            raise ConfigError(f"{side}.call names input {wanted!r}, but the inputs are: {known}; use one of those")
    if args is not None or kwargs is not None:
        return _checked(CallSpec(tuple(args or ()), dict(kwargs or {})), parameters, takes_any, name, side)
    remaining = [key for key in inputs if key not in drop]
    bound: dict[str, str] = {}
    for key in list(remaining):  # exact names
        if key in parameters and _keyword(parameters[key]):
            bound[key] = key
            remaining.remove(key)
    for key in list(remaining):  # aliases
        for alias in ALIASES.get(key, ()):
            if alias in parameters and alias not in bound and _keyword(parameters[alias]):
                bound[alias] = key
                remaining.remove(key)
                break
    free = [p for p in parameters.values() if p.name not in bound and _positional(p)]
    positional: tuple[str, ...] = ()
    required = [key for key in remaining if key not in OPTIONAL]
    if len(required) == 1 and free and free[0].default is inspect.Parameter.empty:
        positional = (required[0],)
        remaining.remove(required[0])
    dropped = tuple(key for key in remaining if key in OPTIONAL)
    left = [key for key in remaining if key not in OPTIONAL]
    if left and takes_any:
        bound.update({key: key for key in left})
        left = []
    if left:
        signature = ", ".join(parameters) or "no parameters"
        raise ConfigError(
            f"input {left[0]!r} fits no parameter of {name}({signature}): map it with "
            f"{side}.call.kwargs={{<parameter>: {left[0]}}} or {side}.call.args=[{left[0]}], or drop it with "
            f"{side}.call.drop=[{left[0]}]"
        )
    spec = CallSpec(positional, bound, dropped=dropped)
    return _checked(spec, parameters, takes_any, name, side)


def _checked(
    spec: CallSpec, parameters: Mapping[str, inspect.Parameter], takes_any: bool, name: str, side: str
) -> CallSpec:
    """Refuse a spec the forward cannot take: unknown keywords, too many positionals, required ones unset."""
    positional = [p for p in parameters.values() if _positional(p)]
    takes_more = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters.values())
    if len(spec.args) > len(positional) and not takes_more:
        raise ConfigError(
            f"{side}.call.args has {len(spec.args)} inputs but {name} takes {len(positional)} positionally"
        )
    filled = {p.name for p in positional[: len(spec.args)]}
    for parameter in spec.kwargs:
        if parameter in filled:
            raise ConfigError(f"{side}.call: {name} parameter {parameter!r} is given both positionally and by keyword")
        if parameter not in parameters and not takes_any:
            takes = ", ".join(parameters)
            key = f"{side}.call.kwargs.{parameter}"
            raise ConfigError(f"{key}: {name} has no parameter {parameter!r}; it takes: {takes}")
    for declared in parameters.values():
        unset = declared.name not in filled and declared.name not in spec.kwargs
        needed = declared.default is inspect.Parameter.empty and declared.kind in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.KEYWORD_ONLY,
        )
        if unset and needed:
            key = f"{side}.call.kwargs.{declared.name}"
            raise ConfigError(f"{name} needs {declared.name!r}, which no input feeds: set {key}=<input name>")
    return spec


def synthetic_inputs(model: nn.Module, batch: int, length: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Seeded inputs for whatever the forward takes, sized from the model's config: token ids (text), pixels
    (vision), raw audio or audio features; an all-ones attention mask beside token ids."""
    config = getattr(_unwrap(model), "config", None)
    parameters = _parameters(_forward(model))
    inputs: dict[str, torch.Tensor] = {}
    if "pixel_values" in parameters:
        size = _config_value(config, "image_size")
        if size is None:
            raise ConfigError("synthetic pixel_values need image_size in the model config: pass inputs from a file")
        size = size if isinstance(size, int) else int(size[0])
        channels = int(_config_value(config, "num_channels") or 3)
        inputs["pixel_values"] = torch.randn(batch, channels, size, size, generator=generator)
    if "input_values" in parameters:
        inputs["input_values"] = torch.randn(batch, 400 * length, generator=generator)
    if "input_features" in parameters:
        bins = int(_config_value(config, "num_mel_bins") or 80)
        frames = 2 * int(_config_value(config, "max_source_positions") or length)
        inputs["input_features"] = torch.randn(batch, bins, frames, generator=generator)
    vocab = _config_value(config, "vocab_size")
    wants_ids = "input_ids" in parameters or (not inputs and any(a in parameters for a in ALIASES["input_ids"]))
    if wants_ids and vocab is not None:
        ids = torch.randint(0, int(vocab), (batch, length), generator=generator)
        inputs["input_ids"] = ids
        if "attention_mask" in parameters:
            inputs["attention_mask"] = torch.ones_like(ids)
    if "decoder_input_ids" in parameters and inputs:  # an encoder-decoder: the decoder's prompt too
        inputs.update(_decoder_inputs(config, parameters, batch, length, generator))
    if not inputs:
        raise ConfigError(
            f"cannot make synthetic inputs for {type(_unwrap(model)).__name__}.forward({', '.join(parameters)}): "
            "its config has no vocab_size/image_size; give inputs=file with a safetensors file of named tensors"
        )
    return inputs


def _decoder_inputs(
    config: Any, parameters: Mapping[str, inspect.Parameter], batch: int, length: int, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Decoder token ids for an encoder-decoder (Whisper, T5, BART, vision-encoder-decoder): the config's
    decoder start token, then seeded tokens from the decoder's vocabulary; an all-ones mask where it is taken."""
    vocab = _config_value(getattr(config, "decoder", None), "vocab_size") or _config_value(config, "vocab_size")
    if vocab is None:
        raise ConfigError("synthetic decoder_input_ids need vocab_size in the model config: pass inputs from a file")
    start = _config_value(config, "decoder_start_token_id")
    if start is None:
        start = _config_value(config, "pad_token_id") or 0
    steps = max(2, length // 2)
    ids = torch.randint(0, int(vocab), (batch, steps), generator=generator)
    ids[:, 0] = int(start)
    found = {"decoder_input_ids": ids}
    if "decoder_attention_mask" in parameters:
        found["decoder_attention_mask"] = torch.ones_like(ids)
    return found


def _config_value(config: Any, name: str) -> Any:
    """``config.name``, else the same in its text/vision/audio sub-configs."""
    if config is None:
        return None
    value = getattr(config, name, None)
    if value is not None:
        return value
    for sub in ("text_config", "vision_config", "audio_config", "encoder", "decoder"):
        nested = getattr(config, sub, None)
        if nested is not None and getattr(nested, name, None) is not None:
            return getattr(nested, name)
    return None


def _unwrap(model: nn.Module) -> nn.Module:
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else model


def _forward(model: nn.Module) -> Callable[..., Any]:
    return _unwrap(model).forward


def _parameters(forward: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        return {}


def _keyword(parameter: inspect.Parameter) -> bool:
    return parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _positional(parameter: inspect.Parameter) -> bool:
    return parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _float_dtype(model: nn.Module) -> torch.dtype | None:
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return None
