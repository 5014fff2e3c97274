"""Run a candidate on N ranks under ``torch.distributed`` (gloo on the CPU), each rank traced into its own directory.

Each rank is a fresh ``python -m paritylab.distributed.worker`` process, not a fork or a ``multiprocessing``
spawn: nothing is pickled across processes (the model is rebuilt on every rank by the user's builder, named
``"module:function"``), a script that forgot its ``if __name__ == "__main__"`` guard is not run again, and a
rank that dies (a segfault, ``os._exit``) is seen by its exit code, not by a broken pipe. Tensors cross
processes as safetensors files only: the reference's weights and the call's inputs.

The rendezvous store is a ``TCPStore`` opened by this process on ``127.0.0.1`` with a port the OS assigns, so no
port is guessed and raced for; the ranks connect to it (``MASTER_ADDR``/``MASTER_PORT`` are set for code that
reads them). When a rank fails, the others get ``grace_s`` to notice (a gloo collective fails once its peer
is gone) and are then stopped, so a run never hangs on a dead peer; ``timeout_s`` bounds the whole run. Each rank
runs in its own session (its own process group), and however the run ends (success, a failure, the time limit,
Ctrl-C) the whole group is killed: a process a rank started (a data loader's worker, a helper it forgot) never
outlives it. The ranks are no part of the terminal's foreground group, so a Ctrl-C reaches this process only,
which then stops them.

Layout of ``directory``: ``launch.json`` (the spec every rank reads), ``weights.safetensors``,
``inputs.safetensors``, ``rank<k>.log`` (each rank's stdout and stderr: tracebacks), and per rank ``rank<k>/``
(``<variant>/rank<k>/`` with :attr:`LaunchSpec.variants`): its trace (``trace.json`` with ``rank`` and
``world_size`` in its meta, safetensors shards), ``placements.json`` (DTensor placements seen at module
boundaries) and ``status.json`` (how far the rank got, and how it ended).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paritylab.tracing.files import write_json

LAUNCH_FILE = "launch.json"
WEIGHTS_FILE = "weights.safetensors"
INPUTS_FILE = "inputs.safetensors"
STATUS_FILE = "status.json"
HOST = "127.0.0.1"
VARIANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")
COLLECTIVE_SIGNS = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout", "gloo", "peer")
"""Words in a rank's error that say it failed because a peer went away (a consequence, not a cause)."""


class DistributedError(RuntimeError):
    """The ranks could not produce traces to compare: one line that names the rank (and phase) at fault."""


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a rank needs, as JSON (``launch.json``): nothing is pickled."""

    builder: str
    """``"module:function"``: ``function(context: RankContext) -> nn.Module``, the rank's share of the candidate."""
    world_size: int
    directory: Path
    call: str | None = None
    """``"module:function"``: ``function(model, inputs, **call_kwargs)`` runs the forward; ``None``:
    ``model(**inputs, **call_kwargs)``."""
    call_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """JSON values passed to the forward beside the tensors (``use_cache: false``)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """JSON given to the builder as ``context.options`` (a config, a defect to plant)."""
    backend: str = "gloo"
    timeout_s: float = 300.0
    """Wall-clock limit of the whole run, and of any one collective on a rank."""
    grace_s: float = 20.0
    """After a rank fails, how long the others may take to fail or finish before they are stopped."""
    threads: int | None = None
    """Compute threads per rank; ``None``: the cores shared out (at least 1)."""
    trace: Mapping[str, Any] = field(default_factory=dict)
    """:class:`~paritylab.tracing.tracer.TraceOptions` fields for every rank (JSON values: include, exclude,
    max_depth, max_bytes, save_dtype as a name)."""
    variants: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Several candidates on the same ranks, one after the other: name -> options laid over ``options``. Each
    is built, run and traced into ``<name>/rank<k>/`` in turn, so the ranks start (import torch, join the
    group) once for all of them. Empty: one candidate, traced into ``rank<k>/``."""
    port: int = 0
    """The rendezvous store's port (filled in by :func:`run_ranks`)."""

    def __post_init__(self) -> None:
        for name in self.variants:
            if not VARIANT_NAME.fullmatch(name):
                raise ValueError(f"variant name {name!r} must be letters, digits, '_', '-' or '.' (it names a folder)")

    @property
    def variant_names(self) -> list[str | None]:
        """The variants in order; ``[None]`` for a spec without variants."""
        return list(self.variants) or [None]

    def options_for(self, variant: str | None) -> dict[str, Any]:
        """The builder's options for ``variant``: the shared ones with the variant's laid over them."""
        return {**self.options, **(self.variants.get(variant, {}) if variant is not None else {})}

    def rank_directory(self, rank: int, variant: str | None = None) -> Path:
        base = self.directory if variant is None else self.directory / variant
        return base / f"rank{rank}"

    def to_json(self) -> dict[str, Any]:
        return {
            "builder": self.builder,
            "world_size": self.world_size,
            "call": self.call,
            "call_kwargs": dict(self.call_kwargs),
            "options": dict(self.options),
            "backend": self.backend,
            "timeout_s": self.timeout_s,
            "grace_s": self.grace_s,
            "threads": self.threads,
            "trace": dict(self.trace),
            "variants": {name: dict(options) for name, options in self.variants.items()},
            "host": HOST,
            "port": self.port,
        }

    @classmethod
    def read(cls, path: Path) -> LaunchSpec:
        data = json.loads(path.read_text(encoding="utf-8"))
        return cls(
            builder=str(data["builder"]),
            world_size=int(data["world_size"]),
            directory=path.parent,
            call=data.get("call"),
            call_kwargs=dict(data.get("call_kwargs") or {}),
            options=dict(data.get("options") or {}),
            backend=str(data.get("backend", "gloo")),
            timeout_s=float(data.get("timeout_s", 300.0)),
            grace_s=float(data.get("grace_s", 20.0)),
            threads=data.get("threads"),
            trace=dict(data.get("trace") or {}),
            variants={str(name): dict(options) for name, options in (data.get("variants") or {}).items()},
            port=int(data["port"]),
        )


@dataclass
class RankContext:
    """What a builder is given on its rank: who it is, the reference's weights, the device mesh, its options."""

    rank: int
    world_size: int
    options: Mapping[str, Any]
    weights: Path | None
    backend: str = "gloo"
    _mesh: Any = field(default=None, repr=False)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The reference's weights (read from safetensors: no pickle is ever loaded); empty when none were given."""
        if self.weights is None:
            return {}
        from safetensors.torch import load_file

        return load_file(str(self.weights))

    @property
    def device(self) -> torch.device:
        """Where this rank's model and inputs go: the CPU with gloo; with nccl the CUDA device the worker chose for
        this rank (``torch.cuda.current_device()``)."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def mesh(self) -> Any:
        """A 1-D ``DeviceMesh`` over all ranks on :attr:`device`'s type (created once), for ``parallelize_module``."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device.type, (self.world_size,))
        return self._mesh


@dataclass(frozen=True)
class RankStatus:
    """How one rank ended (its ``status.json``, or what its exit code says when it wrote none)."""

    rank: int
    ok: bool
    phase: str
    """``init`` (joining the process group), ``build``, ``forward``, ``save``, ``done``; ``start`` when the
    process never reported."""
    error: str = ""
    module: str | None = None
    """The module whose forward raised (from the rank's trace), when known."""
    seconds: float | None = None
    """When it failed, in seconds since the launch (orders the failures: the first is the cause)."""
    exit_code: int | None = None
    consequential: bool = False
    """Its error says a peer went away (a collective failed): it follows another rank's failure."""

    def describe(self) -> str:
        """``rank 1 failed during forward in model.layers.0.mlp: RuntimeError: ...`` (one line)."""
        where = f" in {self.module}" if self.module else ""
        error = _short(self.error, 400) or f"exit code {self.exit_code}"
        return f"rank {self.rank} failed during {self.phase}{where}: {error}"


@dataclass(frozen=True)
class LaunchResult:
    """The ranks' outcomes and where their traces are."""

    spec: LaunchSpec
    ranks: list[RankStatus]
    seconds: float
    variant: str | None = None
    timed_out: bool = False
    """The run passed ``timeout_s`` and the ranks still running were stopped."""

    @property
    def ok(self) -> bool:
        return all(status.ok for status in self.ranks)

    @property
    def failed(self) -> list[RankStatus]:
        return [status for status in self.ranks if not status.ok]

    @property
    def directories(self) -> list[Path]:
        """The ranks' trace directories, in rank order."""
        return [self.spec.rank_directory(rank, self.variant) for rank in range(self.spec.world_size)]

    def culprit(self) -> RankStatus | None:
        """The failure that caused the others: the earliest that is not a peer's consequence (else the earliest)."""
        failed = self.failed
        if not failed:
            return None
        causes = [status for status in failed if not status.consequential] or failed
        return min(causes, key=lambda status: (status.seconds is None, status.seconds or 0.0, status.rank))

    def error_line(self) -> str:
        """One line naming the rank at fault, and what became of the others."""
        culprit = self.culprit()
        if culprit is None:
            return ""
        if self.timed_out and all(status.consequential for status in self.failed):
            where = ", ".join(f"rank {status.rank} in {status.phase}" for status in self.failed)
            return f"the ranks did not finish within timeout_s={self.spec.timeout_s:g} s and were stopped ({where})"
        others = [status for status in self.failed if status is not culprit]
        line = culprit.describe()
        if others:
            line += "; then " + ", ".join(f"rank {s.rank} ({s.phase}: {_short(s.error)})" for s in others)
        log = self.spec.directory / f"rank{culprit.rank}.log"
        return f"{line} (traceback: {log})"


def resolve(spec: str, what: str = "builder") -> Callable[..., Any]:
    """The function named by ``"package.module:function"`` (importable in every rank's process)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"{what} {spec!r} must name a function as 'package.module:function'")
    target: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{what} {spec!r} is not callable")
    return target


OPTIONS_ATTRIBUTE = "paritylab_options"
"""A builder's attribute naming the ``context.options`` it reads (set by :func:`takes_options`)."""
ALWAYS_GIVEN = ("config",)
"""Options paritylab may add itself (a transformers reference's ``config.to_dict()``): every builder takes them."""


def takes_options(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare the ``context.options`` a builder reads (``@takes_options("defect", "layer")``); any other option
    is then refused in one line naming these, before a rank starts (and on a rank, for a launch made without the
    command line). A builder that declares nothing takes any option."""

    def declare(builder: Callable[..., Any]) -> Callable[..., Any]:
        setattr(builder, OPTIONS_ATTRIBUTE, tuple(dict.fromkeys([*ALWAYS_GIVEN, *names])))
        return builder

    return declare


def unknown_option(builder: Callable[..., Any], named: str, options: Mapping[str, Any]) -> str | None:
    """What is wrong with the first option ``builder`` (named ``named``) does not declare, as the end of a line
    (``defetc: ... takes no option 'defetc' (did you mean defect?); it takes: config, defect, layer``); ``None``
    when it declares none or knows them all."""
    import difflib

    known = getattr(builder, OPTIONS_ATTRIBUTE, None)
    if known is None:
        return None
    for name in options:
        if name not in known:
            close = difflib.get_close_matches(str(name), list(known), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else ""
            return f"{name}: {named} takes no option {str(name)!r}{hint}; it takes: {', '.join(known)}"
    return None


ORDER_KEY = "paritylab.order"
"""safetensors metadata: the tensors' names in the order they were given (the file itself sorts them)."""


def save_tensors(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    """Write tensors as safetensors (contiguous CPU copies; tensors sharing memory, such as tied weights, are
    each written whole), with their order (:func:`load_tensors` gives them back in it)."""
    from safetensors.torch import save_file

    seen: set[tuple[int, int]] = set()
    plain: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        value = tensor.detach().to("cpu").contiguous()
        key = (value.untyped_storage().data_ptr(), value.untyped_storage().nbytes())
        plain[name] = value.clone() if key in seen else value  # safetensors refuses shared storage
        seen.add(key)
    save_file(plain, str(path), metadata={ORDER_KEY: json.dumps(list(plain))})


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors :func:`save_tensors` wrote, in the order it was given them: a forward called with
    ``**inputs`` receives its keyword arguments in the reference's order (a trace records them in order)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), "pt") as handle:
        order = json.loads((handle.metadata() or {}).get(ORDER_KEY, "[]"))
    tensors = load_file(str(path))
    return {**{name: tensors[name] for name in order if name in tensors}, **tensors}


def state_dict_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s parameters and persistent buffers by name (what ``load_state_dict`` takes back)."""
    return {name: value for name, value in model.state_dict().items() if isinstance(value, torch.Tensor)}


def run_ranks(
    spec: LaunchSpec, *, python: str | None = None, env: Mapping[str, str] | None = None
) -> list[LaunchResult]:
    """Start ``spec.world_size`` worker processes, wait for them and return how each rank ended, one result per
    variant (:attr:`LaunchSpec.variants`; a single one without variants).

    ``weights.safetensors`` and ``inputs.safetensors`` must already be in ``spec.directory`` (see
    :func:`prepare`). Never raises for a rank's failure: :attr:`LaunchResult.failed` and
    :meth:`LaunchResult.error_line` say what happened.
    """
    import torch.distributed as dist

    found = {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available}.get(spec.backend)
    if not dist.is_available() or found is None or not found():
        raise DistributedError(f"torch.distributed with the {spec.backend} backend is not available in this build")
    if spec.world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {spec.world_size}")
    spec.directory.mkdir(parents=True, exist_ok=True)
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    store = dist.TCPStore(HOST, 0, spec.world_size + 1, True, timeout=timeout, wait_for_workers=False)
    spec = replace(spec, port=int(store.port))
    write_json(spec.directory / LAUNCH_FILE, spec.to_json(), indent=1)
    started = time.monotonic()
    processes: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        for rank in range(spec.world_size):
            for variant in spec.variant_names:
                folder = spec.rank_directory(rank, variant)
                folder.mkdir(parents=True, exist_ok=True)
                (folder / STATUS_FILE).unlink(missing_ok=True)
            log = open(spec.directory / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed below
            logs.append(log)
            command = [
                python or sys.executable,
                "-m",
                "paritylab.distributed.worker",
                str(spec.directory / LAUNCH_FILE),
            ]
            processes.append(
                subprocess.Popen(
                    [*command, str(rank)], stdout=log, stderr=subprocess.STDOUT, env=_rank_env(spec, rank, env),
                    start_new_session=True,  # its own process group: ending the rank ends everything it started
                )
            )  # fmt: skip
        timed_out = _wait(processes, spec, started)
    finally:
        for process in processes:
            end_tree(process)
        for log in logs:
            log.close()
        del store
    seconds = time.monotonic() - started
    return [
        LaunchResult(
            spec,
            [_status(spec, rank, variant, processes[rank].returncode, started) for rank in range(spec.world_size)],
            seconds,
            variant,
            timed_out,
        )
        for variant in spec.variant_names
    ]


def end_tree(process: subprocess.Popen[bytes]) -> None:
    """Kill ``process`` and every process of its group (it leads one: ``start_new_session``), then reap it. Run
    after a rank exits too: what it started and left behind is in its group and goes with it."""
    if hasattr(os, "killpg"):  # an empty group (the rank and all it started are gone) is no error
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    if process.poll() is None:
        process.kill()
    process.wait()


def _wait(processes: Sequence[subprocess.Popen[bytes]], spec: LaunchSpec, started: float) -> bool:
    """Until every rank exits; after the first failure, at most ``grace_s`` more; at most ``timeout_s`` in all.
    Returns whether the time limit ended it (the caller kills what still runs)."""
    failed_at: float | None = None
    while any(process.poll() is None for process in processes):
        now = time.monotonic()
        if failed_at is None and any(process.returncode not in (None, 0) for process in processes):
            failed_at = now
        if failed_at is not None and now - failed_at > spec.grace_s:
            return False
        if now - started > spec.timeout_s:
            return True
        time.sleep(0.05)
    return False


def _rank_env(spec: LaunchSpec, rank: int, extra: Mapping[str, str] | None) -> dict[str, str]:
    """The parent's environment, its import path (the builder must import as it does here), the rank's
    identity, and one share of the cores as its thread count."""
    env = dict(os.environ)
    own = {str(Path(prefix).resolve()) for prefix in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    paths = [
        str(Path(entry or os.getcwd()).resolve())
        for entry in sys.path
        if (entry == "" or Path(entry).is_dir()) and not any(Path(entry).resolve().is_relative_to(p) for p in own)
    ]
    env["PYTHONPATH"] = os.pathsep.join(
        dict.fromkeys([*paths, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    )
    threads = spec.threads or max(1, (_cores() // spec.world_size))
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_WORLD_SIZE=str(spec.world_size),
        MASTER_ADDR=HOST,
        MASTER_PORT=str(spec.port),
        OMP_NUM_THREADS=str(threads),
    )
    env.update(extra or {})
    return env


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _status(spec: LaunchSpec, rank: int, variant: str | None, exit_code: int | None, started: float) -> RankStatus:
    path = spec.rank_directory(rank, variant) / STATUS_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        data = None
    if not isinstance(data, dict):
        data = {"status": "running", "phase": "start"}
    stopped = exit_code in (-9, None)  # killed here: still running after another rank failed, or at the time limit
    if data.get("status") == "running":
        why = "stopped while still running (a peer had failed, or the time limit passed)" if stopped else "died"
        return RankStatus(
            rank, False, str(data.get("phase", "start")), f"{why} (exit code {exit_code})",
            exit_code=exit_code, consequential=stopped,
        )  # fmt: skip
    ok = data.get("status") == "ok"  # its trace is whole; a teardown that hung and was stopped changes nothing
    error = str(data.get("error") or ("" if ok else f"exit code {exit_code}"))
    seconds = data.get("time")
    return RankStatus(
        rank=rank,
        ok=ok,
        phase=str(data.get("phase", "done")),
        error=error,
        module=data.get("module"),
        seconds=None if not isinstance(seconds, int | float) else float(seconds) - _epoch(started),
        exit_code=exit_code,
        consequential=not ok
        and (data.get("consequence") is True or any(sign in error.lower() for sign in COLLECTIVE_SIGNS)),
    )


def _epoch(monotonic: float) -> float:
    """A ``time.monotonic()`` reading as wall-clock seconds (the ranks stamp their failures with ``time.time()``)."""
    return time.time() - (time.monotonic() - monotonic)


def _short(text: str, limit: int = 120) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def prepare(
    directory: Path,
    inputs: Mapping[str, torch.Tensor],
    weights: Mapping[str, torch.Tensor] | None,
) -> None:
    """Write the call's inputs and the reference's weights for the ranks to read."""
    directory.mkdir(parents=True, exist_ok=True)
    save_tensors(inputs, directory / INPUTS_FILE)
    if weights is not None:
        save_tensors(weights, directory / WEIGHTS_FILE)
    else:
        (directory / WEIGHTS_FILE).unlink(missing_ok=True)
