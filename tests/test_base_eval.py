"""The base evaluation shared by runs that would compute the same one (``turnrl.train.base_eval``).

A run that takes another run's base evaluation writes the same bytes as one that evaluates (eval episodes,
eval row, run record), and trains on the same rollouts (skipping the evaluation changes no random state the
training reads); kept on disk, it is taken by another process's store the same way, and a file for another
key or one that does not read back is a miss; the key keeps what the evaluation reads and drops what the arms
of an experiment vary; ``turnrl experiment`` evaluates each seed's base once, across its processes too.
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


def test_a_base_evaluation_kept_on_disk_is_taken_by_another_process_store(tmp_path, monkeypatch):
    calls = _counting(monkeypatch)
    store = tmp_path / "base_eval"
    credit = {"estimator": "stepwise", "gamma": 0.5}
    train(_cfg(tmp_path, "first"), base_evaluations=BaseEvaluations(store))
    (kept,) = store.iterdir()
    n_first = len(calls)
    later = BaseEvaluations(store)  # what another process opens: nothing in memory
    assert len(later) == 0
    train(_cfg(tmp_path, "took", credit=credit), base_evaluations=later)
    assert len(calls) - n_first == n_first - 1  # every evaluation but the base's
    train(_cfg(tmp_path, "own", credit=credit))
    took, own = RunDir(tmp_path / "runs" / "took"), RunDir(tmp_path / "runs" / "own")
    assert took.eval_rollouts(0).read_bytes() == own.eval_rollouts(0).read_bytes()
    assert took.eval_csv.read_text() == own.eval_csv.read_text()
    assert took.train_rollouts(0).read_bytes() == own.train_rollouts(0).read_bytes()
    assert kept.name == BaseEvalKey.from_config(_cfg(tmp_path, "x")).file_name()


@pytest.mark.parametrize(
    "spoil",
    [
        lambda rec: {**rec, "key": rec["key"].replace('"seed": 0', '"seed": 1')},  # another key's evaluation
        lambda rec: {**rec, "episodes": [{"turns": "not a list"}]},  # not episodes
        lambda rec: "truncated",
    ],
    ids=["another-key", "not-episodes", "not-a-record"],
)
def test_a_kept_file_for_another_key_or_unreadable_is_a_miss(tmp_path, spoil):
    store = tmp_path / "base_eval"
    cfg = _cfg(tmp_path, "first")
    train(cfg, base_evaluations=BaseEvaluations(store))
    key = BaseEvalKey.from_config(cfg)
    path = store / key.file_name()
    assert BaseEvaluations(store).get(key) is not None
    path.write_text(json.dumps(spoil(json.loads(path.read_text()))))
    assert BaseEvaluations(store).get(key) is None  # evaluated again, never another run's numbers
    path.write_text(path.read_text()[:50])
    assert BaseEvaluations(store).get(key) is None


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


def test_an_experiment_run_one_arm_at_a_time_evaluates_each_seeds_base_once(tmp_path, monkeypatch):
    calls = _counting(monkeypatch)
    (tmp_path / "base.yaml").write_text(BASE)
    for arm in ("a", "b"):  # the same experiment, one arm per process (what two queues on two cores do)
        one = SPEC.replace("primary: {treatment: b, baseline: a}", "").replace(
            "  - {name: b" if arm == "a" else "  - {name: a", "  # - {name: "
        )
        (tmp_path / f"shared_{arm}.yaml").write_text(one)
        run_experiment(load_spec(tmp_path / f"shared_{arm}.yaml"), output_root=tmp_path / "runs", out=io.StringIO())
    assert len(calls) == 3  # one base evaluation, two final ones
    a, b = (RunDir(tmp_path / "runs" / "shared" / arm / "seed0") for arm in ("a", "b"))
    assert a.eval_rollouts(0).read_bytes() == b.eval_rollouts(0).read_bytes()
    assert len(list((tmp_path / "runs" / "shared" / "base_eval").iterdir())) == 1
    run_experiment(load_spec(tmp_path / "shared_a.yaml"), output_root=tmp_path / "runs", out=io.StringIO(), fresh=True)
    assert len(calls) == 5  # --fresh: the kept base evaluation went with the runs
