"""Candidates with planted faults, built through config ``_target_``s like any user candidate."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from experiments.llava_port import from_reference


def scaled_port(reference: nn.Module, module: str, scale: float = 1.01, dtype: str | None = None) -> nn.Module:
    """The LLaVA port with one module's output scaled: a bug at a known place (the port cast to ``dtype``)."""
    port = from_reference(reference)
    if dtype is not None:
        port = port.to(getattr(torch, dtype))

    def hook(_: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        return output * scale

    port.get_submodule(module).register_forward_hook(hook)
    return port


def element_port(reference: nn.Module, parameter: str, scale: float = 1.01) -> nn.Module:
    """The LLaVA port with the largest element of one weight scaled: a conversion's bug, in the weights, not in
    any module's output."""
    port = from_reference(reference)
    with torch.no_grad():
        flat = port.get_parameter(parameter).view(-1)
        at = int(flat.abs().argmax())
        flat[at] = flat[at] * scale
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
    from paritylab.run.references import llava

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


def decode_bug_port(reference: nn.Module, bug: str, step: int = 2) -> nn.Module:
    """The LLaVA port with a bug that first changes a value at decode step ``step`` (step 0 is the prompt):
    ``position`` (positions one too far), ``stale`` (the cache keeps a stale copy of the keys and values written
    the step before, read from ``step`` on), or ``mask`` (the decode mask hides the first token)."""

    from experiments.llava_port import model as port_model

    port = from_reference(reference)
    prompt: list[int] = []  # the prefill's length, seen at step 0

    def decoding_from(past: int) -> int:  # the decode step a forward with ``past`` cached positions is
        return 0 if past == 0 else past - prompt[0] + 1

    if bug == "position":
        positions = port.llm.positions

        def shifted(past: int, length: int, device: torch.device) -> torch.Tensor:
            if past == 0:
                prompt[:] = [length]
            return positions(past, length, device) + (1 if past and decoding_from(past) >= step else 0)

        port.llm.positions = shifted  # type: ignore[method-assign]
    elif bug == "stale":

        class StaleCache(port_model.KVCache):
            def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                if layer not in self.keys:
                    prompt[:] = [k.shape[2]]
                    return super().update(layer, k, v)
                if decoding_from(self.keys[layer].shape[2]) != step - 1:  # this layer's own count
                    return super().update(layer, k, v)
                full = torch.cat([self.keys[layer], k], dim=2), torch.cat([self.values[layer], v], dim=2)
                stale = self.keys[layer][:, :, -1:], self.values[layer][:, :, -1:]  # the last entry again
                self.keys[layer] = torch.cat([self.keys[layer], stale[0]], dim=2)
                self.values[layer] = torch.cat([self.values[layer], stale[1]], dim=2)
                return full

        port.new_cache = StaleCache  # type: ignore[method-assign]
    elif bug == "mask":
        causal_mask = port_model.causal_mask

        def wrong(length: int, device: torch.device, padding: torch.Tensor | None, past: int = 0) -> torch.Tensor:
            mask = causal_mask(length, device, padding, past)
            if past == 0:
                prompt[:] = [length]
            elif decoding_from(past) >= step:
                mask = mask.clone()
                mask[..., 0] = False
            return mask

        forward = port.llm.forward

        def patched(*args: Any, **kwargs: Any) -> Any:
            port_model.causal_mask = wrong
            try:
                return forward(*args, **kwargs)
            finally:
                port_model.causal_mask = causal_mask

        port.llm.forward = patched  # type: ignore[method-assign]
    else:
        raise ValueError(f"unknown decode bug {bug!r}: position, stale or mask")
    return port
