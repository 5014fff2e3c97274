"""Test helpers: trace a model into a fresh directory and load it back; plant bugs with hooks."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

import paritylab
from paritylab import Trace

_counter = itertools.count()


def traced(model: nn.Module, run: Callable[[nn.Module], Any], root: Path, **options: Any) -> Trace:
    """Trace ``run(model)`` with tensors saved, and return the trace as loaded from disk."""
    directory = root / f"trace-{next(_counter)}"
    options.setdefault("save_tensors", True)
    with paritylab.trace(model, directory, **options):
        run(model)
    return Trace.load(directory)


@contextmanager
def planted(model: nn.Module, path: str, scale: float = 1.05):
    """Scale the output of one module: a bug at a known place."""

    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if isinstance(output, tuple):
            return (output[0] * scale, *output[1:])
        return output * scale

    handle = model.get_submodule(path).register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def llava_inputs(model: nn.Module, batch: int = 2, text: int = 6, seed: int = 3) -> dict[str, torch.Tensor]:
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    image_tokens = (config.vision_config.image_size // config.vision_config.patch_size) ** 2
    ids = torch.randint(0, config.image_token_index, (batch, text + image_tokens), generator=generator)
    ids[:, 1 : 1 + image_tokens] = config.image_token_index
    size = config.vision_config.image_size
    pixels = torch.randn(batch, 3, size, size, generator=generator)
    return {"input_ids": ids, "pixel_values": pixels}


def parity_runs(client) -> list:
    """The parity runs of the ``paritylab`` experiment (not its sweep parents or trend runs)."""
    experiment = client.get_experiment_by_name("paritylab")
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    return [r for r in runs if "paritylab.pair" in r.data.tags and r.data.tags.get("paritylab.trend") != "true"]


_TEMPLATE: list[Path] = []


def migrated_store(path: Path) -> str:
    """The URI of a real SQLite MLflow store at ``path``, created by copying one this process migrated once
    (creating and migrating a store costs about 2.5 s; the copy is the same database). For tests that use a
    store, not for those about creating one (fresh stores, concurrent creation, "no store was created")."""
    import atexit
    import shutil
    import tempfile

    from mlflow.tracking import MlflowClient

    if not _TEMPLATE:
        folder = Path(tempfile.mkdtemp(prefix="paritylab-mlflow-template-"))
        atexit.register(shutil.rmtree, folder, True)
        MlflowClient(f"sqlite:///{folder / 'mlflow.db'}").search_experiments(max_results=1)
        _TEMPLATE.append(folder / "mlflow.db")
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        shutil.copyfile(_TEMPLATE[0], path)
    return f"sqlite:///{path}"


def ctrl_c_heard() -> None:
    """A terminal's foreground job hears Ctrl-C; a test run from a background shell (``&``, nohup) inherits SIGINT
    ignored, and so would the run it starts: give the run the terminal's default (``preexec_fn`` of a process a
    test sends SIGINT to)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
