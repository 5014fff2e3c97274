"""Candidates with planted faults, built through config ``_target_``s like any user candidate."""

from __future__ import annotations

from typing import Any

from torch import nn

from experiments.llava_port import from_reference


def scaled_port(reference: nn.Module, module: str, scale: float = 1.01) -> nn.Module:
    """The LLaVA port with one module's output scaled: a bug at a known place."""
    port = from_reference(reference)

    def hook(_: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        return output * scale

    port.get_submodule(module).register_forward_hook(hook)
    return port


def raising_port(reference: nn.Module, module: str) -> nn.Module:
    """The LLaVA port whose ``module`` raises during the forward."""
    port = from_reference(reference)

    def hook(_: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        raise RuntimeError(f"planted failure in {module}")

    port.get_submodule(module).register_forward_hook(hook)
    return port


def raising_reference(module: str, **build: Any) -> nn.Module:
    """The configured transformers LLaVA, with ``module`` raising during the forward."""
    from paritylab.references import llava

    model = llava(**build)

    def hook(_: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        raise RuntimeError(f"planted failure in {module}")

    model.get_submodule(module).register_forward_hook(hook)
    return model


def slow_port(reference: nn.Module, seconds: float = 30.0) -> nn.Module:
    """The LLaVA port with a decoder layer that sleeps (to be interrupted mid-forward)."""
    import time

    port = from_reference(reference)
    port.llm.layers[1].register_forward_hook(lambda *_: time.sleep(seconds))
    return port
