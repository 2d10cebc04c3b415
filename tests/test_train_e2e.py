"""End to end: a short training run on the tiny model writes the whole run directory."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

from toy_envs import CountEnv
from turnrl.cli import app
from turnrl.config import parse_config
from turnrl.envs import register_env
from turnrl.rundir import RunDir, read_jsonl
from turnrl.tracking import read_csv
from turnrl.train.loop import ResumeError, train
from turnrl.train.summary import read_summary


def tiny_config(tmp_path, **sections):
    data = {
        "run_name": "e2e",
        "model": {"name": "tiny"},
        "env": {"name": "count"},
        "sampler": {"max_tokens": 6},
        "rollout": {"tasks_per_step": 2, "group_size": 4},
        "train": {"steps": 2, "lr": 1e-2, "micro_batch_size": 4},
        "eval": {"every": 1},
        "data": {"num_eval_tasks": 2},
        "tracking": {"backends": ["csv"]},
        "paths": {"output_dir": str(tmp_path / "runs")},
    }
    for key, value in sections.items():
        data.setdefault(key, {}).update(value) if isinstance(value, dict) else data.__setitem__(key, value)
    return parse_config(data)


@pytest.fixture(autouse=True)
def _register():
    register_env("count", CountEnv)


def test_two_step_run_writes_every_file_and_trains_the_adapter(tmp_path):
    cfg = tiny_config(tmp_path)
    summary = train(cfg)
    run = tmp_path / "runs" / "e2e"
    for rel in [
        "config.yaml",
        "progress/train.csv",
        "progress/eval.csv",
        "progress/steps.jsonl",
        "rollouts/iter_000.jsonl",
        "rollouts/eval_step_00000.jsonl",
        "rollouts/eval_step_00002.jsonl",
        "adapters/iter_000/adapter_config.json",
        "adapters/iter_000/adapter_model.safetensors",
        "checkpoint/state.pt",
        "plots/reward.png",
        "report.html",
    ]:
        assert (run / rel).exists(), rel
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == 2
    rows = read_csv(run / "progress/train.csv")
    assert [r["step"] for r in rows] == [1, 2]
    for key in [
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "loss",
        "grad_norm",
        "completions/mean_length",
        "clip_ratio/region_mean",
        "num_turns/mean",
    ]:
        assert key in rows[0], key
    steps = [json.loads(line) for line in (run / "progress/steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    evals = read_csv(run / "progress/eval.csv")
    assert [(r["step"], r["label"]) for r in evals] == [(0, "base"), (1, "step"), (2, "final")]
    assert summary.complete and summary.base is not None and len(summary.iterations) == 1
    assert summary.final is not None and "success_rate" in summary.final
    assert read_summary(RunDir(run)) == summary  # the record on disk is the one returned
    episodes = read_jsonl(run / "rollouts/iter_000.jsonl")
    assert len(episodes) == 2 * 2 * 4
    assert all(ep.validate() == [] for ep in episodes)
    assert all(t.advantage is not None for ep in episodes for t in ep.turns)
    # LoRA B starts at zero: any non-zero B means the optimizer changed the adapter
    weights = load_file(str(run / "adapters/iter_000/adapter_model.safetensors"))
    b = [w for k, w in weights.items() if "lora_B" in k]
    assert b and max(float(w.abs().max()) for w in b) > 0


def test_existing_run_needs_resume(tmp_path):
    cfg = tiny_config(tmp_path, train={"steps": 1}, eval={"before": False, "every": 0})
    train(cfg)
    with pytest.raises(ResumeError, match="--resume"):
        train(cfg)


def test_bad_config_key_names_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  stepz: 3\n")
    result = CliRunner().invoke(app, ["train", str(path)])
    assert result.exit_code == 2
    assert "unknown key 'train.stepz'" in result.output and "steps" in result.output


def test_bad_config_value_names_allowed_values(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("credit:\n  estimator: gru\n")
    result = CliRunner().invoke(app, ["train", str(path)])
    assert result.exit_code == 2
    assert "credit.estimator" in result.output and "'group_mean'" in result.output


def test_override_flag_reaches_the_config(tmp_path):
    from turnrl.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 3\n")
    cfg = load_config(
        path, ["train.steps=7", "loss.eps_hi=0.3", "rollout.branching=[2, 2]", "credit.estimator=branched"]
    )
    assert cfg.train.steps == 7 and cfg.loss.eps_hi == 0.3 and cfg.rollout.branching == [2, 2]


def test_branched_run_trains_first_turn_once(tmp_path):
    cfg = tiny_config(
        tmp_path,
        run_name="tree",
        rollout={"branching": [2, 2], "tasks_per_step": 1},
        credit={"estimator": "branched", "scale": "none"},
        train={"steps": 1},
        eval={"before": False, "every": 0},
    )
    train(cfg)
    episodes = read_jsonl(tmp_path / "runs" / "tree" / "rollouts/iter_000.jsonl")
    assert sorted(tuple(e.branch) for e in episodes) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    first_turn_trained = [e.branch for e in episodes if e.turns[0].advantage is not None]
    assert sorted(first_turn_trained) == [[0, 0], [1, 0]]
    assert torch.isfinite(torch.tensor([t.advantage for e in episodes for t in e.turns[1:]])).all()


def test_sync_to_copies_the_run_and_resume_pulls_it_back(tmp_path):
    import shutil

    remote = tmp_path / "remote"
    cfg = tiny_config(
        tmp_path,
        train={"steps": 1},
        eval={"before": False, "every": 0},
        paths={"output_dir": str(tmp_path / "runs"), "sync_to": f"file://{remote}"},
        tracking={"backends": ["csv"], "plots": False, "report": False},
    )
    train(cfg)
    run = tmp_path / "runs" / "e2e"
    for rel in [
        "config.yaml",
        "progress/train.csv",
        "adapters/iter_000/adapter_model.safetensors",
        "checkpoint/state.pt",
    ]:
        assert (remote / "e2e" / rel).read_bytes() == (run / rel).read_bytes(), rel
    shutil.rmtree(run)  # a new machine: only the remote copy is left
    summary = train(cfg, resume=True)
    assert (run / "checkpoint/state.pt").exists() and summary.complete and summary.final is not None
    assert [r["step"] for r in read_csv(run / "progress/train.csv")] == [1]
