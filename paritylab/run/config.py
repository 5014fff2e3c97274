"""Typed schemas of the Hydra configuration, and one-line messages for configuration errors.

``conf/config.yaml`` composes onto :class:`ParityConfig`, so a misspelt key, a wrong type or an unknown
choice fails at composition. ``build`` nodes hold a ``_target_`` and its keyword arguments; those are
checked against the target's signature before any model is built (:func:`check_targets`).
Configs with ``_target_`` import and run code: trust them as you trust code.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import importlib
import importlib.resources
import inspect
import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from paritylab.run.errors import ConfigError

CONF_DIR = Path(str(importlib.resources.files("paritylab.conf")))
"""paritylab's shipped configuration (the checkout's top-level ``conf/``, installed as ``paritylab.conf``)."""


class CandidateKind(enum.StrEnum):
    port = "port"
    dtype = "dtype"
    attention = "attention"
    compiled = "compiled"
    target = "target"
    distributed = "distributed"


class NoiseFloor(enum.StrEnum):
    auto = "auto"
    on = "on"
    off = "off"


class Resident(enum.StrEnum):
    auto = "auto"
    both = "both"
    one = "one"


class LogTensors(enum.StrEnum):
    on_failure = "on_failure"
    always = "always"
    never = "never"


class TrackingProcess(enum.StrEnum):
    auto = "auto"
    child = "child"
    inline = "inline"


class InputKind(enum.StrEnum):
    synthetic = "synthetic"
    processor = "processor"
    file = "file"
    prompts = "prompts"


class DType(enum.StrEnum):
    float32 = "float32"
    float64 = "float64"
    bfloat16 = "bfloat16"
    float16 = "float16"


@dataclass
class CallConfig:
    """How a side's forward receives the named inputs; unset: read from the forward's signature."""

    args: list[str] = field(default_factory=list)
    """Input names passed positionally, in order (``[input_ids]`` for ``forward(idx)``)."""
    kwargs: dict[str, str] = field(default_factory=dict)
    """Forward parameter -> input name (``{tokens: input_ids}``). With neither set, the forward's
    signature decides."""
    drop: list[str] = field(default_factory=list)
    """Inputs this side does not take."""
    cast: bool = True
    """Cast floating-point inputs to the side's parameter dtype."""
    output: Any = None
    """Which part of the forward's return value is "the output", compared at the root and read for decode
    steps' logits: a key or attribute (``logits``), an index (``0``), or null for the whole structure (its
    tensors are then paired by data flow)."""


@dataclass
class ModelConfig:
    """The reference model."""

    name: str = MISSING
    family: str = MISSING
    """Input layout and port lookup key: ``llava``, ``llama`` or ``generic`` (token ids only)."""
    build: dict[str, Any] = MISSING
    """``_target_`` returning an ``nn.Module`` plus its keyword arguments (e.g. ``pretrained``)."""
    call: CallConfig = field(default_factory=CallConfig)


@dataclass
class PortConfig:
    build: dict[str, Any] = MISSING
    """``_target_`` taking ``reference=`` and returning the port."""
    rules: str | None = None
    weight_map: str | None = None


@dataclass
class CandidateConfig:
    """A port, a variant of the reference (dtype, attention kernel, torch.compile), any callable, or a candidate
    run on several ranks (``kind: distributed``, :mod:`paritylab.run.distributed_phase`)."""

    name: str = MISSING
    kind: CandidateKind = MISSING
    dtype: DType | None = None
    attn_implementation: str | None = None
    backend: str = "inductor"
    build: dict[str, Any] | None = None
    rules: str | None = None
    weight_map: str | None = None
    ports: dict[str, PortConfig] = field(default_factory=dict)
    call: CallConfig = field(default_factory=CallConfig)
    world_size: int = 1
    """``kind: distributed``: how many ranks (gloo processes on this machine) run the candidate."""
    builder: str | None = None
    """``kind: distributed``: ``"package.module:function"``, called on every rank with a
    :class:`~paritylab.distributed.launch.RankContext` (rank, world size, the reference's weights, a device mesh,
    ``options``); it returns the rank's share of the candidate, which is called as ``model(**inputs)``."""
    options: dict[str, Any] = field(default_factory=dict)
    """``kind: distributed``: JSON handed to the builder as ``context.options``. A transformers reference's
    ``config.to_dict()`` is added as ``config`` unless set."""
    partial_outputs: list[str] = field(default_factory=list)
    """``kind: distributed``: module path patterns whose plain outputs are partial sums by design (the caller
    all-reduces them), summed when the rank traces are merged."""
    timeout_s: float = 600.0
    """``kind: distributed``: wall-clock limit of the ranks' run (and of any one collective)."""
    dist_backend: str = "gloo"
    """``kind: distributed``: the process group's backend: ``gloo`` (CPU) or ``nccl`` (one CUDA device per rank,
    rank ``r`` on device ``r``; the builder finds it as ``context.device``)."""


@dataclass
class InputsConfig:
    kind: InputKind = InputKind.synthetic
    batch_size: int = 1
    prompt_length: int = 16
    seed: int = 0
    image: str | None = None
    """Image file for ``kind=processor`` (default: the sample image shipped with paritylab)."""
    prompt: str = "USER: <image>\nWhat is shown in this image? ASSISTANT:"
    path: str | None = None
    """``kind=file``: a safetensors file of named tensors (``input_ids``, ``pixel_values``, ...); ``kind=prompts``:
    a JSONL file, one ``{"prompt": "..."}`` or ``{"input_ids": [...]}`` per line (the lines are the batch)."""
    tokenizer: str | None = None
    """``kind=prompts``: the tokenizer (a directory or hub id) for text prompts; default: ``model.build.pretrained``."""


@dataclass
class ModuleTolerance:
    """One ``compare.modules`` entry, ``{pattern: {rtol:, atol:}}``: the tolerances of the reference modules whose
    path matches ``pattern`` (fnmatch); unset keeps the run's. Every entry is checked against these fields
    (:func:`check_module_entries`), so a typo (``rtoll``) is refused, never ignored."""

    rtol: float | None = None
    atol: float | None = None


@dataclass
class CompareConfig:
    rtol: float | None = None
    atol: float | None = None
    modules: dict[str, Any] = field(default_factory=dict)
    """Per-module-path-pattern tolerance overrides: ``{pattern: {rtol:, atol:}}`` (fnmatch on reference
    paths; values are checked when the run starts, with a one-line error)."""
    rules: str | None = None
    """Extra alignment rules YAML, applied before the candidate's own."""
    alignment: str | None = "baseline"
    """The alignment to pin (the only pairs used, so nightly runs never re-pair modules; a pinned pair whose
    candidate call is gone fails its row): ``baseline`` (the pair's baseline run's, when it has one),
    ``fresh`` (align anew), or a file (``report/alignment.yaml`` of an earlier run)."""
    replay: bool = True
    drilldown: bool = True
    """On a failing run, record the origin module's call operation by operation on both sides and name the
    first operation that differs (:mod:`paritylab.comparison.drilldown`)."""
    whole_graph: bool = True
    """A ``torch.compile`` candidate: run it once more untraced, as one graph, and judge its output
    (:mod:`paritylab.run.whole_graph`). Off, the graph breaks tracing inserts can hide a difference, and the run
    says it was not checked (never a plain PASS)."""
    noise_floor: NoiseFloor = NoiseFloor.auto
    noise_multiple: float = 4.0
    save_tensors: bool = True
    max_bytes: int | None = None
    """Byte budget for saved tensor values per trace (stats continue past it)."""
    capture: bool = True


@dataclass
class TrackingConfig:
    enabled: bool = True
    uri: str | None = None
    """MLflow tracking URI; default ``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db`` in the working directory."""
    experiment: str = "paritylab"
    timeout: float = 10.0
    """Seconds an HTTP request to a tracking server may take."""
    retries: int = 1
    process: TrackingProcess = TrackingProcess.auto
    """Where MLflow runs: ``child`` (a child process, so its 3 s import overlaps the models' build), ``inline``
    (this process), or ``auto``: inline when MLflow is already imported here (a notebook, a test, a sweep),
    else a child."""
    log_tensors: LogTensors = LogTensors.on_failure
    """Upload the traces' safetensors shards as artifacts: ``on_failure`` (a run that does not pass, or
    regresses), ``always`` or ``never``. JSON, reports, statistics and plots are always uploaded."""
    keep_local: bool = False
    """Keep the run directory's safetensors shards after they were uploaded. By default they are deleted once
    the store's listing shows them whole (a note in the trace says where they are); a local artifact store
    hard-links them instead, so either way one copy stays on disk. Shards that were not uploaded always stay."""
    regression_factor: float = 2.0
    """A layer regressed when its error grew by more than this factor over the baseline's ..."""
    regression_floor: float = 1e-6
    """... and exceeds this absolute relative error (changes at noise level never fire)."""
    trend: bool = False
    """Also log per-layer divergence to the pair's long-lived trend run (scheduled runs: the nightly preset
    sets it). Each point is stamped with the run's start time, so MLflow's time axis reads as dates."""


@dataclass
class GenerateConfig:
    """Decode-step parity (:mod:`paritylab.run.generate`): after the forward, ``steps`` greedy decode steps with a
    KV cache on both sides, teacher-forced on the reference's tokens; 0 turns it off."""

    steps: int = 0
    top_k: int = 5
    """The top-k overlap of the two sides' next-token distributions is measured over this many tokens."""


@dataclass
class ParityConfig:
    model: ModelConfig = MISSING
    candidate: CandidateConfig = MISSING
    inputs: InputsConfig = field(default_factory=InputsConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    device: str = "auto"
    dtype: DType = DType.float32
    seed: int = 0
    resident: Resident = Resident.auto
    """``one``: each traced model's weights move to a memory-mapped file before the next model is built, so
    the run needs memory for the larger model rather than both; ``both`` keeps them in memory; ``auto``:
    ``both`` when the memory plan says they fit together, else ``one`` (without a plan: ``one`` when the
    reference takes over a quarter of the available memory)."""
    memory_check: bool = True
    """Plan the run's memory before building anything (:mod:`paritylab.run.budget`): ``resident=auto`` then
    chooses from the plan, and a run that cannot fit is refused in one line; ``false`` skips the plan."""
    output_dir: str | None = None
    """Where traces and reports go; default: Hydra's run directory."""


def register() -> None:
    """Register the schema as ``parity_schema`` (the first default of ``conf/config.yaml``), and the
    ``paritylab.dirname`` resolver that names sweep job directories."""
    ConfigStore.instance().store(name="parity_schema", node=ParityConfig)
    OmegaConf.register_new_resolver("paritylab.dirname", job_dirname, replace=True)
    OmegaConf.register_new_resolver("paritylab.fresh", fresh_directory, replace=True, use_cache=True)


def fresh_directory(path: str) -> str:
    """``path``, else ``path-2``, ``path-3``, ...: the first one this call creates. Creation is atomic, so two
    runs started in the same second (one clock reading, one name) never share a directory. The resolver is
    cached: every later reading in this process gets the directory it created."""
    base = Path(path)
    base.parent.mkdir(parents=True, exist_ok=True)
    for number in itertools.count(1):
        chosen = base if number == 1 else base.with_name(f"{base.name}-{number}")
        try:
            chosen.mkdir()
        except FileExistsError:
            continue
        return str(chosen)
    raise AssertionError("unreachable")


DIRNAME_LIMIT = 100


def job_dirname(overrides: str) -> str:
    """One path component naming what a sweep job varies, from Hydra's ``override_dirname``
    (``candidate=bf16,compare.rtol=0.01``): characters outside ``[A-Za-z0-9._=,+-]`` become ``_`` (a value
    holding ``/`` would otherwise nest directories), and a long name is cut with a hash of the whole, so two
    jobs never share a directory."""
    import hashlib
    import re

    name = re.sub(r"[^A-Za-z0-9._=,+-]", "_", overrides).strip(".") or "defaults"
    if len(name) > DIRNAME_LIMIT:
        digest = hashlib.sha1(overrides.encode()).hexdigest()[:8]
        name = f"{name[: DIRNAME_LIMIT - 9]}-{digest}"
    return name


def check_complete(cfg: DictConfig) -> None:
    """Every required value is set (no ``???`` left)."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"{missing[0]} is required but not set: pass {missing[0]}=<value> (or choose a preset)")


TRACKING_SCHEMES = ("", "file", "sqlite", "http", "https", "postgresql", "mysql", "mssql", "databricks")


def check_settings(cfg: DictConfig) -> None:
    """Values that would fail late, checked before any model is built: tolerances, per-module patterns,
    the tracking URI and the output directory. Each failure is one line naming the key and the fix."""
    from urllib.parse import urlparse

    from paritylab.comparison.metrics import Tolerances

    compare = cfg.compare
    for key in ("rtol", "atol"):
        value = compare.get(key)
        if value is not None and not value >= 0:
            raise ConfigError(f"compare.{key}={value} must be zero or positive (null: torch's default for the dtype)")
    if not compare.noise_multiple > 0:
        raise ConfigError(f"compare.noise_multiple={compare.noise_multiple} must be positive (default 4)")
    generate = cfg.get("generate")
    if generate is not None and (generate.steps < 0 or generate.top_k < 1):
        raise ConfigError(
            f"generate.steps={generate.steps} generate.top_k={generate.top_k}: steps must be 0 (off) or more, "
            "top_k 1 or more"
        )
    check_module_entries(compare.get("modules"))
    try:
        tolerances = Tolerances.from_config(OmegaConf.to_container(compare, resolve=True))  # type: ignore[arg-type]
    except ValueError as error:
        raise ConfigError(f"compare.modules: {error}") from error
    for override in tolerances.overrides:
        for key in ("rtol", "atol"):
            value = getattr(override, key)
            if value is not None and value < 0:
                raise ConfigError(f"compare.modules.{override.pattern}.{key}={value} must be zero or positive")
    uri = cfg.tracking.uri
    if cfg.tracking.enabled and uri:
        scheme = urlparse(str(uri)).scheme.split("+")[0]
        if scheme not in TRACKING_SCHEMES and not (len(scheme) == 1 and scheme.isalpha()):  # C:\ on Windows
            raise ConfigError(
                f"tracking.uri={uri!r}: unsupported scheme {scheme!r}; use sqlite:///mlflow.db, a directory, "
                "http(s)://host:port of an MLflow server, or tracking=off"
            )
    if cfg.output_dir:
        check_writable("output_dir", Path(str(cfg.output_dir)))
    kind, path = str(cfg.inputs.kind), cfg.inputs.get("path")
    if kind in ("file", "prompts") and not (path and Path(str(path)).is_file()):
        what = "a safetensors file of named tensors" if kind == "file" else 'a JSONL file of {"prompt": ...} lines'
        raise ConfigError(f"inputs={kind} needs inputs.path=<{what}>; got {path!r}")
    if kind == "file":
        check_input_file(str(path))
    check_ranks(cfg)


def check_input_file(path: str) -> None:
    """``inputs=file``: a readable safetensors file whose every tensor has elements, read from its header only (a
    0-length ``input_ids`` would otherwise compare zero elements and PASS over nothing)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt", device="cpu") as opened:
            shapes = {str(name): list(opened.get_slice(name).get_shape()) for name in opened.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as error:
        raise ConfigError(f"inputs.path={path!r} is not a readable safetensors file: {error}") from error
    if not shapes:
        raise ConfigError(f"inputs.path={path!r} holds no tensors: save named inputs such as input_ids")
    for name, shape in shapes.items():
        if 0 in shape:
            raise ConfigError(
                f"inputs.path={path!r}: {name} has no elements (shape {shape}); a comparison over nothing proves "
                "nothing: save inputs with at least one element each"
            )


MODULE_KEYS = tuple(field.name for field in dataclasses.fields(ModuleTolerance))


def check_module_entries(modules: Any) -> None:
    """Every ``compare.modules`` entry is a mapping of :class:`ModuleTolerance`'s keys; an unknown key is refused
    in one line with the closest known one (``compare.modules.fc2.rtoll``: did you mean ``...fc2.rtol``?)."""
    import difflib

    if modules is None:
        return
    if not isinstance(modules, DictConfig | dict):
        raise ConfigError(f"compare.modules must map module path patterns to {{rtol:, atol:}}, got {modules!r}")
    for pattern, entry in modules.items():
        key = f"compare.modules.{pattern!s}"
        if not isinstance(entry, DictConfig | dict):
            raise ConfigError(f"{key}={entry!r} must be {{rtol:, atol:}} (e.g. +{key}.rtol=1e-3)")
        for named, value in entry.items():
            name = str(named)
            if name in MODULE_KEYS:
                continue
            close = difflib.get_close_matches(name, MODULE_KEYS, n=1, cutoff=0.6)
            hint = f" (did you mean {key}.{close[0]}?)" if close else ""
            dotted = (
                f"; a pattern with dots is given whole: '+compare.modules={{{pattern!s}.{name}: {{rtol: 1e-3}}}}'"
                if isinstance(value, DictConfig | dict)
                else ""
            )
            raise ConfigError(
                f"{key}.{name} is not a per-module setting{hint}: an entry takes {', '.join(MODULE_KEYS)}{dotted}"
            )


def unmatched_patterns(modules: Any, paths: Iterable[str]) -> list[str]:
    """The ``compare.modules`` patterns that match none of ``paths`` (the reference's module paths), as notes: a
    tolerance that was set and never applied is said, not silently dropped."""
    import fnmatch

    patterns = [str(pattern) for pattern in (modules or {})]
    known = list(dict.fromkeys(paths))
    return [
        f"compare.modules.{pattern} matches no module of the reference: its tolerances were not applied "
        "(patterns are fnmatch on module paths, e.g. 'model.layers.*.mlp')"
        for pattern in patterns
        if not any(fnmatch.fnmatchcase(path, pattern) for path in known)
    ]


BUILDER_FORM = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")
"""``package.module:function`` (the function may be an attribute path, ``module:Class.build``)."""


def check_dist_backend(backend: str, world_size: int) -> None:
    """A backend the ranks can use on this machine: ``gloo``, or ``nccl`` with a CUDA device for every rank."""
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"candidate.dist_backend={backend!r} must be gloo (CPU) or nccl (one CUDA device per rank)")
    if backend == "nccl":
        import torch
        import torch.distributed as dist

        devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if devices < world_size or not dist.is_nccl_available():
            raise ConfigError(
                f"candidate.dist_backend=nccl needs one CUDA device per rank and a torch built with NCCL "
                f"({world_size} ranks, {devices} CUDA devices here): use candidate.dist_backend=gloo"
            )


def check_ranks(cfg: DictConfig) -> None:
    """``candidate.world_size`` and, for ``kind: distributed``, what the ranks need: a builder named as
    ``"module:function"``, a forward called as ``model(**inputs)``, and no phase that needs the candidate model
    in this process asked for explicitly."""
    candidate = cfg.candidate
    world_size = candidate.get("world_size", 1)
    if world_size < 1:
        raise ConfigError(f"candidate.world_size={world_size} must be 1 or more (the number of ranks)")
    if str(candidate.kind) != "distributed":
        if world_size > 1:
            raise ConfigError(
                f"candidate.world_size={world_size} needs candidate.kind=distributed and a candidate.builder run on "
                "every rank (e.g. candidate=tp); other candidates run in this process"
            )
        for name in candidate.get("options") or {}:
            where = "candidate.ports.<family>.build" if str(candidate.kind) == "port" else "candidate.build"
            raise ConfigError(
                f"candidate.options.{name!s} is read only by a distributed candidate's builder (candidate.kind="
                f"distributed), and this candidate is a {candidate.kind}: its builder's arguments go under {where}"
            )
        return
    builder = candidate.get("builder")
    if not builder or not BUILDER_FORM.fullmatch(str(builder)):
        raise ConfigError(
            f"candidate.builder={builder!r}: a distributed candidate needs a builder named 'package.module:function' "
            "(e.g. candidate.builder=paritylab.experiments.tp_llama:build)"
        )
    check_dist_backend(str(candidate.get("dist_backend", "gloo")), int(world_size))
    if cfg.get("memory_check", True):  # the ranks' processes and cores, before anything is built
        import torch

        from paritylab.run.budget import cores, plan_ranks  # here: importing torch is not the config's cost
        from paritylab.run.resident import available_memory

        plan_ranks(int(world_size), cores(), available_memory(torch.device("cpu")))
    if candidate.call.args or candidate.call.kwargs:
        raise ConfigError(
            "candidate.call.args/kwargs are not used by a distributed candidate: every rank calls "
            "model(**inputs); remove them (candidate.call.drop still leaves inputs out)"
        )
    if candidate.get("dtype") is not None:
        raise ConfigError(
            f"candidate.dtype={candidate.dtype} is not applied to a distributed candidate (its ranks build it): "
            "cast in the builder (pass the dtype in candidate.options), or set candidate.dtype=null"
        )
    asked = {"compare.noise_floor": str(cfg.compare.noise_floor) == "on"}
    generate = cfg.get("generate")
    asked["generate.steps"] = generate is not None and int(generate.steps) > 0
    for key, value in asked.items():
        if value:
            raise ConfigError(
                f"{key}={OmegaConf.select(cfg, key)} needs the candidate model in this process, and a distributed "
                f"candidate's lives on its ranks (free run only): leave {key} at its default"
            )


def check_writable(key: str, directory: Path) -> None:
    """``directory`` exists as a writable directory, or can be created."""
    import os

    existing = directory.expanduser().absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(
            f"{key}={str(directory)!r}: {str(existing)!r} is a file, not a directory; choose another path"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={str(directory)!r}: {str(existing)!r} is not writable; choose a writable directory")


def check_targets(cfg: DictConfig) -> None:
    """Import every ``_target_`` and check its keyword arguments, before anything is built."""
    check_complete(cfg)
    check_settings(cfg)
    family, ports = str(cfg.model.family), cfg.candidate.ports or {}
    if str(cfg.candidate.kind) == "port" and family not in ports:
        available = ", ".join(sorted(ports)) or "none"
        raise ConfigError(
            f"candidate=port: no port of a {family!r} model; ports exist for: {available} "
            "(add one under candidate.ports, or choose another candidate)"
        )
    nodes = [("model.build", cfg.model.build)]
    if cfg.candidate.build is not None:
        nodes.append(("candidate.build", cfg.candidate.build))
    for family, port in (cfg.candidate.ports or {}).items():
        nodes.append((f"candidate.ports.{family}.build", port.build))
    for key, node in nodes:
        check_target(key, OmegaConf.to_container(node, resolve=True), allowed_extra=("reference",))
    if str(cfg.candidate.kind) == "distributed":
        from paritylab.distributed.launch import unknown_option

        named = str(cfg.candidate.builder)
        builder = resolve_builder("candidate.builder", named)
        unknown = unknown_option(builder, named, OmegaConf.to_container(cfg.candidate.options, resolve=True))  # type: ignore[arg-type]
        if unknown is not None:
            raise ConfigError(f"candidate.options.{unknown}")


def resolve_builder(key: str, named: str) -> Any:
    """The function ``"package.module:function"`` names (each rank imports it as this process does); a one-line
    error says what could not be found."""
    module_name, _, attribute = named.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(
            f"{key}={named!r}: cannot import {module_name!r} ({error}); check the spelling, or put it on PYTHONPATH"
        ) from error
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{key}={named!r}: {module_name} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{key}={named!r} is not callable: name a function taking a RankContext")
    return target


def check_target(key: str, node: Any, allowed_extra: tuple[str, ...] = ()) -> None:
    if not isinstance(node, dict) or "_target_" not in node:
        raise ConfigError(f"{key} needs a _target_ (a dotted path to a callable returning an nn.Module)")
    target = resolve_target(key, str(node["_target_"]))
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return
    parameters = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    unknown = sorted(set(node) - {"_target_", "_partial_", "_recursive_", "_convert_"} - set(parameters))
    if unknown:
        names = [name for name in parameters if name not in allowed_extra]
        close = difflib.get_close_matches(unknown[0], names, n=1, cutoff=0.75)
        hint = f" (did you mean {close[0]}?)" if close else ""
        said = f"{key}.{unknown[0]}: {node['_target_']} takes no argument {unknown[0]!r}{hint}"
        raise ConfigError(f"{said}; it takes: {', '.join(names)}")


def resolve_target(key: str, dotted: str) -> Any:
    """Import ``package.module.attribute``; a one-line error says what could not be found."""
    module_name, _, attribute = dotted.rpartition(".")
    if not module_name:
        raise ConfigError(f"{key}._target_={dotted!r} is not a dotted path like 'package.module.function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(
            f"{key}._target_={dotted!r}: cannot import {module_name!r} ({error}); check the spelling or install it"
        ) from error
    if not hasattr(module, attribute):
        raise ConfigError(f"{key}._target_={dotted!r}: {module_name} has no attribute {attribute!r}")
    return getattr(module, attribute)


def one_line(error: BaseException) -> str:
    """A configuration error (Hydra, OmegaConf, ours) as one line naming the key and the fix."""
    if isinstance(error, ConfigError):
        return str(error)
    parts: list[str] = []
    current: BaseException | None = error
    while current is not None and len(parts) < 3:
        lines = [line.strip() for line in str(current).splitlines() if line.strip()]
        text = "; ".join(line for line in lines if not line.startswith(("full_key:", "object_type", "reference_type")))
        if text and text not in parts:
            parts.append(text)
        current = current.__cause__ or current.__context__
    message = ": ".join(parts) or type(error).__name__
    return f"{message} (see the valid keys and choices with: python -m paritylab --cfg job)"
