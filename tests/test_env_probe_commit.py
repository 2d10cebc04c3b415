"""Probe, then commit: rules, rewards, shipped task files, scripted oracle/blind policies."""

from __future__ import annotations

import pytest

from turnrl.envs import get_env_class, make_env
from turnrl.envs.probe_commit import (
    EVAL_WORDS,
    MALFORMED_REWARD,
    TRAIN_WORDS,
    ProbeCommitEnv,
    blind_policy,
    build_tasks,
    commit_reward,
    make_tasks,
    oracle_policy,
)
from turnrl.types import StopReason, Task


def _task(**kw):
    params = {"target": "speed", "gauges": ["heat", "speed", "flow"], "readings": {"heat": 2, "speed": 7, "flow": 4}}
    params.update(kw)
    return Task("pc", "probe_commit", params)


def test_reading_the_target_gauge_then_committing_its_value_wins():
    env = make_env(_task())
    assert env.state_key() == "start"
    first = env.step("<probe>speed</probe>")
    assert not first.done and first.reward == 0.0 and "speed gauge reads 7" in first.messages[0]["content"]
    assert env.state_key() == "read:speed"
    end = env.step("I commit <answer>7</answer>")
    assert end.terminated and end.reward == 1.0 and end.stop_reason == StopReason.SUCCESS
    assert end.metrics["success"] == 1.0 and end.metrics["probed_target"] == 1.0


def test_reward_grows_with_closeness_and_a_distractor_misleads():
    assert [commit_reward(n, 7) for n in (7, 6, 3, 1)] == pytest.approx([1.0, 7 / 8, 0.5, 0.25])
    env = make_env(_task())
    obs = env.step("<probe>heat</probe>").messages[0]["content"]
    assert "heat gauge reads 2" in obs
    end = env.step("<answer>2</answer>")
    assert end.stop_reason == StopReason.FAILURE and end.reward == pytest.approx(1 - 5 / 8)


def test_no_probe_blind_commit_and_malformed():
    env = make_env(_task())
    assert "No gauge was read" in env.step("hmm").messages[0]["content"]  # an unreadable probe reads nothing
    assert env.state_key() == "read:None"
    bad = env.step("<answer>12</answer>")
    assert bad.stop_reason == StopReason.MALFORMED and bad.reward == MALFORMED_REWARD < 0
    early = make_env(_task())
    end = early.step("<answer>5</answer>")  # committing on the first reply ends the game
    assert end.terminated and end.reward == pytest.approx(1 - 2 / 8)
    with pytest.raises(RuntimeError, match="over"):
        early.step("<answer>5</answer>")


def test_bad_task_params_are_named():
    with pytest.raises(ValueError, match="params.target"):
        make_env(_task(target="torque"))
    with pytest.raises(ValueError, match="readings"):
        make_env(_task(readings={"heat": 2, "speed": 10, "flow": 4}))


def _play(env, policy) -> float:
    messages = env.initial_messages()
    while True:
        result = env.step(policy(messages))
        if result.done:
            return result.reward
        messages = messages + [{"role": "assistant", "content": "x"}, *result.messages]


def test_shipped_tasks_are_the_builders_and_held_out_words_are_unseen(tmp_path):
    cls = get_env_class("probe_commit")
    train, held = cls.default_tasks("train"), cls.default_tasks("eval")
    assert [t.params for t in train] == [t.params for t in make_tasks("train")]
    assert [t.params for t in held] == [t.params for t in make_tasks("eval")]
    for path in build_tasks(tmp_path):  # the shipped files are what the builder writes
        shipped = get_env_class("probe_commit").load_tasks(path)
        assert [t.task_id for t in shipped] == [t.task_id for t in (train if "train" in path.name else held)]
    assert not set(TRAIN_WORDS) & set(EVAL_WORDS)
    assert {g for t in held for g in t.params["gauges"]} <= set(EVAL_WORDS)
    for tasks in (train, held):
        assert {t.params["readings"][t.params["target"]] for t in tasks} == set(range(1, 10))
        assert all(len(set(t.params["readings"].values())) == 3 for t in tasks)


def test_oracle_wins_every_game_and_blind_is_measurably_worse():
    held = ProbeCommitEnv.default_tasks("eval")
    oracle = [_play(make_env(t), oracle_policy) for t in held]
    blind = [_play(make_env(t), blind_policy) for t in held]
    assert oracle == [1.0] * len(held)
    assert sum(r == 1.0 for r in blind) == 3  # s* = 5 in 3 of 27 tasks
    assert sum(blind) / len(blind) == pytest.approx(1 - (2 * (4 + 3 + 2 + 1) / 9) / 8)
