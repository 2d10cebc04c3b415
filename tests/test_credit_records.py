"""``turnrl credit RECORDS --estimator NAME --out FILE``: advantages for records written elsewhere."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from turnrl.cli import app
from turnrl.records import read_records, write_records
from turnrl.types import Episode, StopReason, Turn


def _episode(eid: str, group: str, rewards: list[float], branch=(), task: str | None = None) -> Episode:
    turns, context = [], [1, 2]
    for k, r in enumerate(rewards):
        action = [10 + k, 20 + k]
        turns.append(Turn(k, list(context), action, [-0.5, -0.5], f"a{k}", reward=r, policy_version=0))
        context = context + action + [3]
    return Episode(
        eid, task or f"task-{group}", turns, float(sum(rewards)), True, False, StopReason.SUCCESS, group_id=group,
        branch=list(branch),
    )  # fmt: skip


def _credit(tmp_path, episodes, *args, source="verl"):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_records(src, episodes, source=source)
    result = CliRunner().invoke(app, ["credit", str(src), "--out", str(out), *args])
    return result, out


def test_group_mean_and_stepwise_by_hand(tmp_path):
    flat = [_episode(f"e{i}", "g", [0.0, r]) for i, r in enumerate([0.0, 1.0, 1.0, 0.0])]
    result, out = _credit(tmp_path, flat, "--estimator", "group_mean")
    assert result.exit_code == 0, result.output
    assert "8 of 8 turns of 4 episodes (1 groups) carry an advantage" in result.output
    adv = [[t.advantage for t in e.turns] for e in read_records(out)]
    a = 0.5 / (np.std([0, 1, 1, 0], ddof=1) + 1e-4)
    assert adv == [pytest.approx([-a, -a]), pytest.approx([a, a]), pytest.approx([a, a]), pytest.approx([-a, -a])]
    assert {json.loads(x)["source"] for x in out.read_text().splitlines()} == {"verl"}  # kept as it came

    result, out = _credit(tmp_path, flat, "--estimator", "stepwise", "--set", "credit.gamma=0.5")
    assert result.exit_code == 0, result.output
    r = np.array([0, 0, 0.5, 1, 0.5, 1, 0, 0], dtype=float)  # returns: turn 0 = 0.5 · turn 1's reward
    z = (r - r.mean()) / (r.std() + 1e-8)
    got = [t.advantage for e in read_records(out) for t in e.turns]
    assert got == pytest.approx(z.tolist())


def test_branched_on_tree_records_trains_a_shared_turn_once(tmp_path):
    tree = [_episode(f"l{i}{j}", "t", [0.0, float(i + j)], branch=[i, j]) for i in range(2) for j in range(2)]
    result, out = _credit(tmp_path, tree, "--estimator", "branched", "--set", "credit.scale=none")
    assert result.exit_code == 0, result.output
    adv = {e.episode_id: [t.advantage for t in e.turns] for e in read_records(out)}
    # V(root) = 1, V(0) = 0.5, V(1) = 1.5: first turns −0.5 / +0.5 (trained in leaf j = 0), second R − V(i)
    assert adv == {"l00": [-0.5, -0.5], "l01": [None, 0.5], "l10": [0.5, -0.5], "l11": [None, 0.5]}


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--estimator", "nope"], "unknown credit.estimator 'nope'; choose one of"),
        (["--estimator", "stepwise", "--set", "credit.gamma=2"], "credit.gamma: Input should be less than or equal"),
        (["--estimator", "stepwise", "--set", "credit.colour=red"], "credit.colour: Extra inputs are not permitted"),
        (["--estimator", "stepwise", "--set", "loss.type=clip"], "turnrl credit takes credit.* keys only"),
        (["--estimator", "branched"], "credit.estimator branched needs Episode.branch"),
    ],
)
def test_bad_options_are_one_line(tmp_path, args, expected):
    result, _ = _credit(tmp_path, [_episode("e0", "g", [1.0]), _episode("e1", "g", [0.0])], *args)
    assert result.exit_code == 2 and expected in result.output, result.output
    assert "Traceback" not in result.output


def test_a_corrupted_record_names_its_line(tmp_path):
    src = tmp_path / "in.jsonl"
    write_records(src, [_episode("e0", "g", [1.0]), _episode("e1", "g", [0.0])])
    lines = src.read_text().splitlines()
    lines[1] = lines[1].replace('"reward":0.0', '"reward":"zero"', 1)
    src.write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(app, ["credit", str(src), "--estimator", "group_mean", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and f"{src}:2: reward: Input should be a valid number" in result.output
