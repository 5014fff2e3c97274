"""The state a model's modules held before their first traced forward: what a forward caches is not the model.

Code caches values during a forward in plain attributes (fair-esm keeps its rotary cosine and sine in
``_cos_cached``, computed in the dtype of the first input it met, and reuses them while the sequence length stays
the same). A copy made after a low-precision run carries those caches along: a float32 copy of a bfloat16
candidate would then compute with bfloat16 tables it never made itself. The first tracer to attach to a model
remembers each module's plain attributes as they were (a shallow snapshot: names and the objects they held), and
:func:`reset_caches` puts a copy's attributes back to that state, so the copy computes its caches afresh.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

_INTERNAL = frozenset(vars(nn.Module()))
"""What ``nn.Module.__init__`` sets (parameters, buffers, modules, hooks, ``training``): never a cache."""
_initial: weakref.WeakKeyDictionary[nn.Module, dict[str, dict[str, Any]]] = weakref.WeakKeyDictionary()


def remember(model: nn.Module) -> None:
    """Keep ``model``'s modules' plain attributes as they are now, unless a tracer already did (its first run)."""
    if model in _initial:
        return
    _initial[model] = {path: _plain(module) for path, module in model.named_modules()}


def initial_state(model: nn.Module, path: str) -> dict[str, Any] | None:
    """The plain attributes the module at ``path`` held before ``model``'s first traced run (``None``: not kept)."""
    kept = _initial.get(model)
    return kept.get(path) if kept is not None else None


def reset_caches(copy: nn.Module, original: nn.Module) -> list[str]:
    """Put every plain attribute that ``original``'s traced runs set, replaced or removed since its first one back,
    in ``copy``, to what ``original`` held before (removed when it did not exist). Returns ``path.name`` of each
    attribute reset. ``copy`` is a copy of ``original`` made since (the same module paths); attributes the runs
    left alone (a config object, which the copy holds a copy of) are left as they are."""
    kept = _initial.get(original)
    if kept is None:
        return []
    reset = []
    copies = dict(copy.named_modules())
    for path, module in original.named_modules():
        before, target = kept.get(path), copies.get(path)
        if before is None or target is None:
            continue
        now = _plain(module)
        for name in sorted(now.keys() | before.keys()):
            if name in now and name in before and now[name] is before[name]:
                continue
            if name in before:
                object.__setattr__(target, name, before[name])
            elif name in vars(target):
                delattr(target, name)
            reset.append(f"{path}.{name}" if path else name)
    return reset


@contextmanager
def caches_reset(model: nn.Module) -> Iterator[None]:
    """While inside, ``model``'s caches are as before its first traced run (:func:`reset_caches` on itself), so a
    run inside computes them afresh; afterwards every plain attribute is as it was on entering
    (:func:`attributes_kept`)."""
    with attributes_kept(model):
        reset_caches(model, model)
        yield


@contextmanager
def attributes_kept(model: nn.Module) -> Iterator[None]:
    """Afterwards, every plain attribute of every module of ``model`` is what it was on entering (those set inside
    are removed): a run inside (in another precision) leaves no cache of its own behind."""
    before = {module: _plain(module) for module in model.modules()}
    try:
        yield
    finally:
        for module, attributes in before.items():
            now = _plain(module)
            for name in now.keys() - attributes.keys():
                object.__delattr__(module, name)
            for name, value in attributes.items():
                if now.get(name, _ABSENT) is not value:
                    object.__setattr__(module, name, value)


_ABSENT = object()


def _plain(module: nn.Module) -> dict[str, Any]:
    return {name: value for name, value in vars(module).items() if name not in _INTERNAL}
