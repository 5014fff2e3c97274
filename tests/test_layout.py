"""The package's layers, as the tree shows them, with every import pointing down (checked from the source)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "paritylab"
ALLOWED = {
    "tracing": {"tracing"},
    "comparison": {"tracing", "comparison"},
    "reports": {"tracing", "comparison", "reports"},
    "sink": {"tracing", "comparison", "reports", "sink"},  # the trend heatmap is drawn for MLflow
    "distributed": {"tracing", "comparison", "distributed"},  # runs the candidate's ranks, compares merged traces
    "run": {"tracing", "comparison", "reports", "sink", "distributed", "run"},  # candidate.kind=distributed
    "cli": {"tracing", "comparison", "reports", "sink", "run", "distributed", "cli"},
}
"""Per layer, the layers its modules may import (at any depth: function-level imports count too)."""


def _imported_layers(path: Path) -> set[str]:
    layers = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "paritylab" and len(parts) > 1 and parts[1] in ALLOWED:
                layers.add(parts[1])
    return layers


def test_every_module_sits_in_a_layer_and_imports_only_below_it():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert loose == [], "modules belong in a layer's subpackage"
    wrong = []
    for layer, allowed in ALLOWED.items():
        for path in sorted((PACKAGE / layer).rglob("*.py")):  # subpackages too (comparison/alignment/)
            for imported in sorted(_imported_layers(path) - allowed):
                wrong.append(f"{layer}/{path.name} imports paritylab.{imported}")
    assert wrong == []


def test_the_layers_are_an_order_so_imports_point_one_way():
    """Each layer may import itself and the layers listed before it, never one after it: no two layers import
    each other, at any distance."""
    order = list(ALLOWED)
    above = {layer: set(order[index + 1 :]) for index, layer in enumerate(order)}
    upward = {layer: sorted(allowed & above[layer]) for layer, allowed in ALLOWED.items()}
    assert upward == {layer: [] for layer in order}


def test_each_layer_is_a_package_with_a_docstring():
    for layer in ALLOWED:
        init = PACKAGE / layer / "__init__.py"
        assert ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))), layer


def test_only_the_tracker_and_the_store_talk_to_mlflow():
    """MLflow's client and modules are used by ``sink/tracking.py`` (logging one run) and ``sink/store.py`` (the
    :class:`~paritylab.sink.store.Store` interface's MLflow implementation) only; everything else goes through
    them."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).as_posix() in ("sink/tracking.py", "sink/store.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "client":
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} .client")
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.relative_to(PACKAGE)}:{node.lineno} imports {n}" for n in names if n.startswith("mlflow")]
    assert found == []


def test_every_third_party_import_is_a_declared_dependency():
    """What the package imports (at any depth) is what ``pyproject.toml`` declares, by distribution name."""
    import re
    import sys
    import tomllib
    from importlib.metadata import packages_distributions

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    declared = {
        re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0].lower().replace("_", "-") for spec in project["dependencies"]
    }
    distributions = packages_distributions()
    missing = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            for top in {name.split(".")[0] for name in names if name}:
                if top == "paritylab" or top in sys.stdlib_module_names:
                    continue
                owners = {owner.lower().replace("_", "-") for owner in distributions.get(top, [top])}
                if not owners & declared:
                    missing.add(f"{path.relative_to(PACKAGE)} imports {top} ({', '.join(sorted(owners))})")
    assert sorted(missing) == []


def _module_imports(layer: str) -> dict[str, set[str]]:
    """Module -> the modules of ``layer`` it imports (dotted names under ``paritylab``; function-level imports too,
    imports for annotations only, under ``if TYPE_CHECKING:``, not: nothing runs them; a package's ``__init__`` left
    out: it re-exports what its modules define)."""
    root = PACKAGE.parent
    names = {
        ".".join(path.relative_to(root).with_suffix("").parts): path
        for path in (PACKAGE / layer).rglob("*.py")
        if path.name != "__init__.py"
    }
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
            for inner in ast.walk(node)
        }
        found = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.module:
                found |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        graph[name] = (found & names.keys()) - {name}
    return graph


LAYERS = tuple(ALLOWED)
READERS = ("paritylab.tracing.recovery", "paritylab.tracing.debugger_format")
"""The readers of other trace formats, which register themselves with ``tracefile.OTHER_FORMATS`` when imported:
``Trace.load`` imports them when a directory holds no ``trace.json`` (importing them with the package would import
torch with ``tracing.files``, which the MLflow worker reads without it)."""


@pytest.mark.parametrize("layer", LAYERS)
def test_the_modules_of_each_layer_import_one_another_without_a_cycle(layer):
    """One direction within each layer too, read from the bottom up: no module imports one that imports it back,
    at any distance, even from inside a function (``report`` and ``verify`` imported each other once; so did the
    tracker and the store it made, the run's config and its memory budget, the parity phases and the decisions)."""
    from graphlib import CycleError, TopologicalSorter

    graph = _module_imports(layer)
    for reader in READERS:  # a registry's lazy import of its plugins, not a dependency of the format on them
        graph.get("paritylab.tracing.tracefile", set()).discard(reader)
    if layer == "comparison":
        assert "paritylab.comparison.report" in graph["paritylab.comparison.attribution"]  # the graph is read
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as error:
        raise AssertionError(f"an import cycle: {' -> '.join(error.args[1])}") from None
