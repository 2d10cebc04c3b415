"""The base evaluation shared by runs that would compute the same one (``turnrl.train.base_eval``).

A run that takes another run's base evaluation writes the same bytes as one that evaluates (eval episodes,
eval row, run record), and trains on the same rollouts (skipping the evaluation changes no random state the
training reads); the key keeps what the evaluation reads and drops what the arms of an experiment vary;
``turnrl experiment`` evaluates each seed's base once.
"""

from __future__ import annotations

import io
import json

import pytest

import turnrl.train.loop as loop
from test_train_e2e import tiny_config
from toy_envs import CountEnv
from turnrl.envs import register_env
from turnrl.experiments import load_spec, run_experiment
from turnrl.rundir import RunDir
from turnrl.train.base_eval import BaseEvalKey, BaseEvaluations
from turnrl.train.loop import train


@pytest.fixture(autouse=True)
def _register():
    register_env("count", CountEnv)


def _cfg(tmp_path, name: str, **sections):
    return tiny_config(tmp_path, run_name=name, **sections)


def _counting(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = loop.evaluate

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(loop, "evaluate", counted)
    return calls


def test_a_run_that_takes_the_base_evaluation_writes_and_trains_as_one_that_evaluates(tmp_path, monkeypatch):
    calls = _counting(monkeypatch)
    shared = BaseEvaluations()
    credit = {"estimator": "stepwise", "gamma": 0.5}
    train(_cfg(tmp_path, "first"), base_evaluations=shared)  # group_mean: evaluates its base, keeps it
    assert len(shared) == 1
    n_first = len(calls)
    train(_cfg(tmp_path, "took", credit=credit), base_evaluations=shared)  # another estimator: takes it
    assert len(calls) - n_first == n_first - 1  # every evaluation but the base's
    train(_cfg(tmp_path, "own", credit=credit))  # the same run, evaluating its own base
    took, own = RunDir(tmp_path / "runs" / "took"), RunDir(tmp_path / "runs" / "own")
    assert took.eval_rollouts(0).read_bytes() == own.eval_rollouts(0).read_bytes()
    assert took.eval_csv.read_text() == own.eval_csv.read_text()
    assert took.train_rollouts(0).read_bytes() == own.train_rollouts(0).read_bytes()  # training unchanged
    base = [json.loads((r.root / "progress/summary.json").read_text())["base"] for r in (took, own)]
    assert base[0] == base[1] and base[0]


def test_the_key_keeps_what_the_evaluation_reads_and_drops_what_arms_vary(tmp_path):
    def key(**sections):
        return BaseEvalKey.from_config(_cfg(tmp_path, "k", **sections))

    same = key()
    assert key(credit={"estimator": "critic", "lam": 0.0}) == same
    assert key(rollout={"group_size": 8}, train={"steps": 5, "lr": 1e-3}) == same
    assert key(loss={"type": "cispo"}, eval={"every": 3}) == same
    assert BaseEvalKey.from_config(_cfg(tmp_path, "another_name")) == same
    assert key(seed=1) != same
    assert key(eval={"samples_per_task": 2}) != same
    assert key(sampler={"temperature": 0.7}) != same
    assert key(model={"lora": {"r": 4}}) != same
    assert key(data={"num_eval_tasks": 3}) != same


SPEC = """
name: shared
title: two arms, one base
hypothesis: none
base_config: base.yaml
budget: {steps: 1}
seeds: [0]
evaluation: {every: 0, greedy: true, before: true}
arms:
  - {name: a, overrides: {credit.estimator: group_mean}}
  - {name: b, overrides: {credit.estimator: stepwise}}
primary: {treatment: b, baseline: a}
"""

BASE = """
model: {name: tiny}
env: {name: count}
sampler: {max_tokens: 4}
rollout: {tasks_per_step: 2, group_size: 2}
train: {steps: 1, lr: 0.01, micro_batch_size: 4}
data: {num_eval_tasks: 2}
tracking: {backends: [csv], plots: false, report: false}
"""


def test_an_experiment_evaluates_each_seeds_base_once(tmp_path, monkeypatch):
    calls = _counting(monkeypatch)
    (tmp_path / "base.yaml").write_text(BASE)
    (tmp_path / "shared.yaml").write_text(SPEC)
    run_experiment(load_spec(tmp_path / "shared.yaml"), output_root=tmp_path / "runs", out=io.StringIO())
    assert len(calls) == 3  # one base evaluation, two final ones
    a, b = (RunDir(tmp_path / "runs" / "shared" / arm / "seed0") for arm in ("a", "b"))
    assert a.eval_rollouts(0).read_bytes() == b.eval_rollouts(0).read_bytes()
