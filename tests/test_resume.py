"""Kill a training subprocess with SIGKILL at many points; --resume must finish it exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from turnrl.tracking import read_csv

HERE = Path(__file__).parent
CONFIG = """
run_name: {name}
seed: 3
model: {{name: tiny}}
env: {{name: count}}
sampler: {{max_tokens: 4}}
rollout: {{tasks_per_step: 2, group_size: 2}}
train: {{steps: 3, lr: 0.01, micro_batch_size: 4}}
loop: {{iterations: 2}}
eval: {{every: 2}}
data: {{num_eval_tasks: 2}}
tracking: {{backends: [csv], plots: false, report: false}}
paths: {{output_dir: {out}}}
"""
COMPARED = ("step", "iteration", "reward", "reward_std", "loss", "grad_norm", "num_tokens")


def _run(args, kill_at=None):
    env = {**os.environ, "KILL_AT": kill_at or ""}
    return subprocess.run(
        [sys.executable, str(HERE / "resume_runner.py"), *args], env=env, capture_output=True, text=True, timeout=600
    )


def _config(tmp: Path, name: str) -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(CONFIG.format(name=name, out=tmp / "runs"))
    return path


def _table(path: Path, keys):
    return [
        tuple(round(float(r[k]), 6) if isinstance(r.get(k), float) else r.get(k) for k in keys) for r in read_csv(path)
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    result = _run(["train", str(_config(tmp, "ref"))])
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "runs" / "ref"


@pytest.mark.parametrize("kill_at", ["checkpoint:3", "step:2", "eval:3", "adapter:1", "rollouts:4", "step:5"])
def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path, reference, kill_at):
    config = _config(tmp_path, "killed")
    run_dir = tmp_path / "runs" / "killed"
    killed = _run(["train", str(config)], kill_at=kill_at)
    assert killed.returncode == -9, (kill_at, killed.stderr[-2000:])
    resumed = _run(["train", str(config), "--resume", str(run_dir)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    ref_train = _table(reference / "progress/train.csv", COMPARED)
    assert [r[0] for r in ref_train] == list(range(1, 7))  # one row per step, 2 iterations x 3 steps
    assert _table(run_dir / "progress/train.csv", COMPARED) == ref_train
    eval_keys = ("step", "iteration", "label", "mean_reward", "success_rate")
    assert _table(run_dir / "progress/eval.csv", eval_keys) == _table(reference / "progress/eval.csv", eval_keys)
    steps = (run_dir / "progress/steps.jsonl").read_text().splitlines()
    assert len(steps) == 6
    for it in (0, 1):
        a = (run_dir / f"rollouts/iter_{it:03d}.jsonl").read_text().splitlines()
        b = (reference / f"rollouts/iter_{it:03d}.jsonl").read_text().splitlines()
        assert len(a) == len(b) == 3 * 2 * 2
        assert [line[:200] for line in a] == [line[:200] for line in b]
    for it in (0, 1):
        assert (run_dir / f"adapters/iter_{it:03d}/adapter_model.safetensors").exists()


def test_resume_refuses_a_changed_config(tmp_path):
    config = _config(tmp_path, "changed")
    killed = _run(["train", str(config)], kill_at="step:1")
    assert killed.returncode == -9
    result = _run(
        [
            "train",
            str(config),
            "--resume",
            str(tmp_path / "runs" / "changed"),
            "--set",
            "train.lr=0.5",
            "--set",
            "rollout.group_size=3",
        ]
    )
    assert result.returncode == 2
    assert "rollout.group_size" in result.stdout and "train.lr" in result.stdout
    assert "--allow-config-change" in result.stdout


CLEAN_START = CONFIG.replace("eval: {{every: 2}}", "eval: {{every: 2, before: false}}").replace(
    "loop: {{iterations: 2}}", "loop: {{iterations: 1}}"
)


@pytest.fixture(scope="module")
def reference_without_base_eval(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref_clean")
    path = tmp / "ref.yaml"
    path.write_text(CLEAN_START.format(name="ref", out=tmp / "runs"))
    result = _run(["train", str(path)])
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "runs" / "ref"


@pytest.mark.parametrize("kill_at", ["step:1", "rollouts:1"])
def test_a_kill_before_the_first_checkpoint_resumes_from_a_clean_start(tmp_path, reference_without_base_eval, kill_at):
    """No base evaluation: the first checkpoint comes after step 1's rows. Killed before it (with step 1's rows
    written, or with a torn first rollout line), --resume must neither duplicate step 1 nor glue onto the tear."""
    ref = reference_without_base_eval
    config = tmp_path / "killed.yaml"
    config.write_text(CLEAN_START.format(name="killed", out=tmp_path / "runs"))
    run_dir = tmp_path / "runs" / "killed"
    killed = _run(["train", str(config)], kill_at=kill_at)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (run_dir / "checkpoint/state.pt").exists()
    resumed = _run(["train", str(config), "--resume", str(run_dir)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _table(run_dir / "progress/train.csv", COMPARED) == _table(ref / "progress/train.csv", COMPARED)
    assert len((run_dir / "progress/steps.jsonl").read_text().splitlines()) == 3
    a = (run_dir / "rollouts/iter_000.jsonl").read_text().splitlines()
    b = (ref / "rollouts/iter_000.jsonl").read_text().splitlines()
    assert len(a) == len(b) == 3 * 2 * 2
    assert [json.loads(line)["episode_id"] for line in a] == [json.loads(line)["episode_id"] for line in b]


def test_a_planted_lock_link_stops_the_trainer_with_one_line(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    config = _config(tmp_path, "planted")
    run_dir = tmp_path / "runs" / "planted"
    run_dir.mkdir(parents=True)
    (run_dir / ".lock").symlink_to(victim)
    result = _run(["train", str(config)])
    assert result.returncode == 2, result.stderr[-2000:]
    assert ".lock is a symbolic link" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert victim.read_text() == "precious\n"
