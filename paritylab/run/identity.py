"""A run's identity: its name in the runs list and its tags (the pair, versions, host and process, commits)."""

from __future__ import annotations

import platform
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from paritylab.sink.history import FINGERPRINT, pair_fingerprint
from paritylab.sink.processes import owner_tags
from paritylab.sink.store import RUN_UID


def run_name(cfg: DictConfig, overrides: list[str]) -> str:
    """``model/candidate`` plus what varies: the input seed and every other command-line override (Hydra's
    ``override_dirname``), each as its last key and value (``scale=1.05``; the full overrides are the tag
    ``paritylab.overrides``), so runs of a sweep tell themselves apart in the runs list. Where a run is logged
    (``tracking=...``, ``tracking.*``) and where it writes are not what it is."""
    skip = ("model=", "candidate=", "inputs.seed=", "tracking=", "tracking.", "hydra.", "output_dir=")
    extra = []
    for item in overrides:
        key, _, value = item.lstrip("+~").partition("=")
        if item.lstrip("+~").startswith(skip):
            continue
        if key.endswith("_target_"):
            key, value = "build", value.rsplit(".", 1)[-1]
        extra.append(f"{key.rsplit('.', 1)[-1]}={value}")
    name = f"{cfg.model.name}/{cfg.candidate.name} seed={cfg.inputs.seed}"
    return f"{name} {' '.join(extra)}"[:250] if extra else name


def run_tags(
    cfg: DictConfig, device: torch.device, directory: Path, start_ms: int, sweep: dict[str, Any] | None
) -> dict[str, str]:
    """What identifies a run in the runs list: the pair, its fingerprint, versions, where and by whom it ran
    (host, pid and process start, so a run left RUNNING by a dead process can be closed), the code's commits."""
    from importlib.metadata import PackageNotFoundError, version

    from paritylab import __version__

    try:
        transformers_version = version("transformers")  # read from metadata: importing it takes seconds
    except PackageNotFoundError:
        transformers_version = "not installed"

    resolved: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    tags = {
        "paritylab.model": str(cfg.model.name),
        "paritylab.candidate": str(cfg.candidate.name),
        "paritylab.verdict": "running",
        "paritylab.first_divergence": "none",
        "paritylab.inputs_seed": str(cfg.inputs.seed),
        "paritylab.version": __version__,
        "paritylab.torch_version": torch.__version__,
        "paritylab.transformers_version": transformers_version,
        "paritylab.python_version": platform.python_version(),
        "paritylab.device": str(device),
        "paritylab.dtype": str(cfg.dtype),
        "paritylab.output_dir": str(directory),
        "paritylab.pair": f"{cfg.model.name}/{cfg.candidate.name}",
        "paritylab.inputs": f"{cfg.inputs.kind} seed {cfg.inputs.seed}",
        FINGERPRINT: pair_fingerprint(resolved),
        **owner_tags(),
        "paritylab.start_ms": str(start_ms),
        RUN_UID: uuid.uuid4().hex,
        "mlflow.user": _user(),
        "mlflow.source.name": _source_name(),
        "mlflow.source.type": "LOCAL",
    }
    if sweep:
        tags["paritylab.sweep_number"] = str(sweep.get("number", ""))
    commit = _git_commit(Path(__file__).parent)
    if commit:
        tags["paritylab.git_commit"] = commit
    code = _candidate_code(cfg)
    candidate_commit = _git_commit(code) if code is not None else None
    if candidate_commit:  # the candidate's own code, when it lives in a git repository
        tags["mlflow.source.git.commit"] = candidate_commit
        tags["paritylab.candidate_commit"] = candidate_commit
    return tags


def _user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (OSError, KeyError):
        return "unknown"


def _source_name() -> str:
    """The command as run (``python -m paritylab`` or the console script), for MLflow's source column."""
    program = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "paritylab"
    return "python -m paritylab" if program in ("__main__.py", "-m", "-c") else program


def _candidate_code(cfg: DictConfig) -> Path | None:
    """The directory of the candidate's own code (its build target's module), when it is a file on disk."""
    import importlib.util

    target = OmegaConf.select(cfg, "candidate.build._target_") or OmegaConf.select(
        cfg, f"candidate.ports.{cfg.model.name}.build._target_"
    )
    if not isinstance(target, str) or "." not in target:
        return None
    module = target.rsplit(".", 1)[0]
    while module:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.origin and spec.origin not in ("built-in", "frozen"):
            return Path(spec.origin).parent
        module = module.rsplit(".", 1)[0] if "." in module else ""
    return None


def _git_commit(directory: Path) -> str | None:
    try:
        result = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=2, cwd=directory)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() or None if result.returncode == 0 else None
