"""Declarative capture of named intermediate outputs, after transformers' ``OutputRecorder``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class CaptureSpec:
    """Capture element ``index`` of the output of every module matching ``target``, under ``name``.

    ``target`` is a module class (matched with ``isinstance``) or a string matched as a suffix of the
    module's class name or of its dotted path (transformers' ``class_name``). ``layer_name`` keeps only
    modules whose path contains it as a whole component (``crossattention`` matches
    ``layers.3.crossattention``). ``scope`` restricts matching to modules under that path, minus the
    subtrees in ``exclude``. ``index=None`` captures the whole output.
    """

    name: str
    target: type[nn.Module] | str
    index: int | str | None = 0
    layer_name: str | None = None
    scope: str = ""
    exclude: tuple[str, ...] = ()

    def matches(self, path: str, module: nn.Module) -> bool:
        if self.scope and not _under(path, self.scope):
            return False
        if any(_under(path, excluded) for excluded in self.exclude):
            return False
        if isinstance(self.target, str):
            hit = type(module).__name__.endswith(self.target) or path.endswith(self.target)
        else:
            hit = isinstance(module, self.target)
        if not hit:
            return False
        if self.layer_name is None:
            return True
        return f".{self.layer_name.strip('.')}." in f".{path}."


def transformers_specs(model: nn.Module) -> list[CaptureSpec]:
    """Capture specs derived from the ``_can_record_outputs`` of every transformers model in ``model``.

    Each sub-model's specs apply to its own subtree (not to nested sub-models that declare their own),
    as transformers dispatches them. Names are prefixed with the sub-model's path when it is not the
    root, so ``model.vision_tower.hidden_states`` and ``model.language_model.hidden_states`` stay apart.
    """
    scoped = [(path, declared) for path, module in model.named_modules() if (declared := _declared(module))]
    scopes = [scope for scope, _ in scoped]
    specs: list[CaptureSpec] = []
    for scope, declared in scoped:
        nested = tuple(s for s in scopes if s != scope and (not scope or _under(s, scope)))
        for key, entries in declared.items():
            name = f"{scope}.{key}" if scope else key
            for entry in entries if isinstance(entries, list | tuple) else [entries]:
                spec = _spec_from_recorder(name, key, entry, scope, nested)
                if spec is not None:
                    specs.append(spec)
    return specs


def _declared(module: nn.Module) -> dict[str, object]:
    declared = getattr(type(module), "_can_record_outputs", None)
    return declared if isinstance(declared, dict) and declared else {}


def _spec_from_recorder(name: str, key: str, entry: object, scope: str, nested: tuple[str, ...]) -> CaptureSpec | None:
    default_index = 0 if "hidden_states" in key else 1
    if isinstance(entry, str) or (isinstance(entry, type) and issubclass(entry, nn.Module)):
        return CaptureSpec(name, entry, default_index, scope=scope, exclude=nested)
    target = getattr(entry, "target_class", None) or getattr(entry, "class_name", None)
    if target is None:
        return None
    index = getattr(entry, "index", default_index)
    return CaptureSpec(name, target, index, getattr(entry, "layer_name", None), scope, nested)


def _under(path: str, scope: str) -> bool:
    return path == scope or path.startswith(scope + ".")


def resolve_specs(model: nn.Module, capture: Iterable[CaptureSpec] | str | None) -> list[CaptureSpec]:
    """``"auto"``: specs from transformers models inside ``model``; ``None``: none; else as given."""
    if capture is None:
        return []
    if capture == "auto":
        return transformers_specs(model)
    if isinstance(capture, str):
        raise ValueError(f"capture={capture!r}: pass 'auto', None or a list of CaptureSpec")
    return list(capture)
