"""The wheel works apart from the checkout: configs and the example port ship inside ``paritylab``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # setuptools builds in the source tree (build/, *.egg-info): a copy of it, so that test workers building at
    # once do not share one, and the checkout is left as it was
    source = tmp_path_factory.mktemp("source") / "paritylab"
    shutil.copytree(REPOSITORY, source, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(out), "."],
        cwd=source, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return next(out.glob("paritylab-*.whl"))


NOT_SOURCE = (
    ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", "mlflow.db*", "mlruns",
    "mlartifacts", "outputs", "multirun", "traces",
)  # fmt: skip
"""What the copy leaves out: what .gitignore does. CI's virtual environments are ``.venv-ci-*`` (3 GB each, and the
third suite's checkout holds all three): ``.venv`` alone let every wheel build copy them first."""


def test_wheel_ships_configs_and_the_port_inside_paritylab(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"paritylab"}  # no top-level experiments or conf
    assert "paritylab/conf/config.yaml" in names and "paritylab/conf/candidate/port.yaml" in names
    assert "paritylab/experiments/llava_port/weights.yaml" in names
    assert {"paritylab/assets/sample.png", "paritylab/reports/templates/report.html.j2", "paritylab/py.typed"} <= set(
        names
    )
    for group in ("candidate", "compare", "experiment", "inputs", "model", "tracking"):
        shipped = {Path(n).name for n in names if n.startswith(f"paritylab/conf/{group}/")}
        assert shipped == {p.name for p in (REPOSITORY / "conf" / group).glob("*.yaml")}, group
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    for script in ("paritylab =", "paritylab-compare =", "paritylab-promote =", "paritylab-upload ="):
        assert script in text


@pytest.mark.slow
def test_installed_wheel_runs_the_main_command_from_an_empty_directory(wheel, tmp_path):
    target, empty = tmp_path / "site", tmp_path / "empty"
    empty.mkdir()
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run(
        [sys.executable, "-c", "import paritylab, paritylab.run.config as c\nprint(paritylab.__file__)\n"
         "print(c.CONF_DIR)"],
        cwd=empty, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert all(line.startswith(str(target)) for line in where.stdout.split())  # not the checkout
    result = subprocess.run(
        [sys.executable, "-m", "paritylab", "tracking=off", "compare.replay=false", "hydra.run.dir=run"],
        cwd=empty, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "PASS:" in result.stdout
    summary = json.loads((empty / "run" / "run.json").read_text())
    assert summary["verdict"] == "pass" and any(n.startswith("weight parity: 40 parameters") for n in summary["notes"])
    helped = subprocess.run(
        [sys.executable, "-m", "paritylab", "--help"], cwd=empty, env=env, capture_output=True, text=True, timeout=120
    )
    assert "model: clip_vision, llama, llava" in helped.stdout and "__main__ is powered by Hydra" not in helped.stdout
    assert "port:" not in helped.stdout.split("== Examples ==")[0]


@pytest.mark.slow
def test_a_failing_test_shows_what_explains_it_not_torch_compile_debug_records(tmp_path):
    """Under the project's pytest settings a failure prints warnings and errors, not the ~1,500 DEBUG records
    torch.compile logs to ``torch.__trace`` (which pytest would otherwise capture and dump)."""
    (tmp_path / "test_failing.py").write_text(
        "import logging\nimport torch\n\n\ndef test_fails():\n"
        "    torch.compile(lambda x: x + 1, backend='aot_eager')(torch.ones(2))\n"
        "    logging.getLogger('paritylab').warning('the line that explains it')\n"
        "    assert False\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(REPOSITORY / "pyproject.toml"), "--rootdir", str(tmp_path),
         "-n0", "-p", "no:cacheprovider", str(tmp_path / "test_failing.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout[-2000:]
    assert "WARNING  paritylab" in result.stdout and "the line that explains it" in result.stdout
    assert "DEBUG" not in result.stdout
