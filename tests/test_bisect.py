"""paritylab.cli.bisect over a small generated git repository whose third of five commits breaks parity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.helpers import migrated_store

pytestmark = pytest.mark.slow
REPOSITORY = Path(__file__).resolve().parents[1]
PORT = """from tests.faulty import scaled_port


def build(reference):  # {note}
    return scaled_port(reference, module="llm.layers.0.feed_forward.w2", scale={scale})
"""


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.slow
def test_bisect_names_the_commit_that_broke_parity(tmp_path):
    repo = tmp_path / "candidate-code"
    repo.mkdir()
    git(repo, "init", "-q")
    git(repo, "config", "user.email", "dev@example.com")
    git(repo, "config", "user.name", "dev")
    commits = []
    for number, (scale, subject) in enumerate(
        [("1.0", "port"), ("1.0", "tidy"), ("1.01", "fuse the MLP"), ("1.01", "docs"), ("1.01", "rename")], 1
    ):
        (repo / "nightly_port.py").write_text(PORT.format(note=f"commit {number}", scale=scale))
        git(repo, "add", "nightly_port.py")
        git(repo, "commit", "-q", "-m", subject)
        commits.append(git(repo, "rev-parse", "HEAD"))
    uri = migrated_store(tmp_path / "mlflow.db")
    result = subprocess.run(
        [sys.executable, "-m", "paritylab.cli.bisect", "--repo", str(repo), "--good", commits[0], "--bad", commits[-1],
         "--tracking-uri", uri, "--output", str(tmp_path / "bisect"), "--",
         "model=llava", "candidate=port", "candidate.ports.llava.build._target_=nightly_port.build",
         "compare.replay=false"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPOSITORY)},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"first commit where parity broke: {commits[2]} fuse the MLP" in result.stdout
    found = json.loads((tmp_path / "bisect" / "bisect.json").read_text())
    assert found["first_bad_commit"] == commits[2]
    verdicts = {step["commit"]: step["verdict"] for step in found["steps"]}
    assert verdicts and all((v == "pass") == (commits.index(c) < 2) for c, v in verdicts.items())
    assert all(step["first_divergence"] == "model.language_model.layers.0.mlp.down_proj"
               for step in found["steps"] if step["verdict"] == "fail")  # fmt: skip
    assert git(repo, "rev-parse", "HEAD") == commits[-1] and not git(repo, "status", "--porcelain")  # left as it was
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("paritylab").experiment_id])
    assert run.info.run_name == "bisect/llava/port" and run.info.status == "FINISHED"
    assert run.data.tags["paritylab.first_bad_commit"] == commits[2]
    assert run.data.metrics["bisect/commits_tested"] == len(found["steps"])
    assert "bisect_steps.json" in {a.path for a in client.list_artifacts(run.info.run_id)}


def test_bisect_refuses_a_dirty_tree_in_one_line(tmp_path):
    repo = tmp_path / "code"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    git(repo, "add", "a.py")
    git(repo, "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "-m", "a")
    (repo / "a.py").write_text("x = 2\n")
    result = subprocess.run(
        [sys.executable, "-m", "paritylab.cli.bisect", "--repo", str(repo), "--good", "HEAD", "--bad", "HEAD"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2 and "has uncommitted changes" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
