"""Anchor-state credit (GiGPO): hand-computed advantages, flat and on trees; the logged anchor fraction."""

from __future__ import annotations

import math

import pytest

from factories import make_turn
from turnrl.config import ConfigError, CreditConfig, parse_config
from turnrl.credit import CreditSettings, assign_credit, gigpo_advantages
from turnrl.credit.gigpo import GigpoParams, anchor_advantages
from turnrl.envs import make_env
from turnrl.tracking import read_csv
from turnrl.train.loop import train
from turnrl.types import Episode, Task


def _ep(eid, group, keys, rewards, branch=()):
    turns = [
        make_turn(k, [1, 2, k], [3 + k], state_key=key, reward=r)
        for k, (key, r) in enumerate(zip(keys, rewards, strict=True))
    ]
    return Episode(
        eid,
        "t",
        turns,
        reward=float(sum(rewards)),
        terminated=True,
        truncated=False,
        group_id=group,
        branch=list(branch),
    )


def test_anchor_advantages_by_hand():
    # anchors A: returns 0.5, 0, 0 (mean 1/6); B: 1, 0 (mean 1/2); C alone; None never grouped
    r = [0.5, 1.0, 0.0, 0.0, 0.0, 0.0, 7.0]
    a = ["A", "B", "A", "C", "A", "B", None]
    assert anchor_advantages(r, a, "mean").tolist() == pytest.approx([1 / 3, 0.5, -1 / 6, 0.0, -1 / 6, -0.5, 0.0])
    s_a = math.sqrt(((1 / 3) ** 2 + 2 * (1 / 6) ** 2) / 2)  # unbiased std of (0.5, 0, 0) = sqrt(1/12)
    s_b = math.sqrt(0.5)
    expected = [
        (1 / 3) / (s_a + 1e-4),
        0.5 / (s_b + 1e-4),
        (-1 / 6) / (s_a + 1e-4),
        0.0,
        (-1 / 6) / (s_a + 1e-4),
        -0.5 / (s_b + 1e-4),
        0.0,
    ]
    assert anchor_advantages(r, a, "mean_std").tolist() == pytest.approx(expected)
    assert anchor_advantages([2.0, 2.0], ["A", "A"], "mean_std").tolist() == [0.0, 0.0]  # all equal: exactly 0


def test_gigpo_flat_by_hand():
    """γ = 0.5, ω = 1, episode scale none, step norm mean. Group h's lone A turn must not join group g's A."""
    eps = [
        _ep("e1", "g", ["A", "B"], [0.0, 1.0]),  # R = 1, returns (0.5, 1)
        _ep("e2", "g", ["A", "C"], [0.0, 0.0]),  # R = 0, returns (0, 0)
        _ep("e3", "g", ["A", "B"], [0.0, 0.0]),  # R = 0, returns (0, 0)
        _ep("h1", "h", ["A"], [5.0]),  # a group of one: A^E = 0, its anchor group has size 1
    ]
    res = gigpo_advantages(eps, GigpoParams(scale="none", step_norm="mean", gamma=0.5, omega=1.0))
    # A^E = R − 1/3; A^S(A) = (0.5, 0, 0) − 1/6; A^S(B) = (1, 0) − 1/2; C alone: 0
    assert res.advantages["e1"] == pytest.approx([2 / 3 + 1 / 3, 2 / 3 + 0.5])
    assert res.advantages["e2"] == pytest.approx([-1 / 3 - 1 / 6, -1 / 3])
    assert res.advantages["e3"] == pytest.approx([-1 / 3 - 1 / 6, -1 / 3 - 0.5])
    assert res.advantages["h1"] == [0.0]
    assert res.metrics["gigpo/anchor_frac"] == pytest.approx(5 / 7)  # A×3 and B×2 of 7 turns
    assert res.metrics["gigpo/anchor_group_size"] == pytest.approx((3 + 2 + 3 + 1 + 3 + 2 + 1) / 7)
    hist = {k.removeprefix("gigpo/anchor_size_"): v for k, v in res.metrics.items() if "anchor_size_" in k}
    assert hist == pytest.approx({"1": 2 / 7, "2_3": 5 / 7, "4_7": 0.0, "8_15": 0.0, "16up": 0.0})
    half = gigpo_advantages(eps, GigpoParams(scale="none", step_norm="mean", gamma=0.5, omega=0.5))
    assert half.advantages["e1"] == pytest.approx([2 / 3 + 1 / 6, 2 / 3 + 0.25])


def test_gigpo_without_keys_is_group_mean():
    eps = [_ep("a", "g", [None, None], [0.0, 1.0]), _ep("b", "g", [None], [0.0])]
    res = assign_credit(eps, CreditSettings.from_config(CreditConfig(estimator="gigpo")))
    assert res["gigpo/anchor_frac"] == 0.0
    grpo = 1.0 / 2 / (math.sqrt(0.5) + 1e-4)
    assert [t.advantage for t in eps[0].turns] == pytest.approx([grpo, grpo])
    assert [t.advantage for t in eps[1].turns] == pytest.approx([-grpo])


def test_gigpo_on_a_tree_by_hand():
    """[2, 2] tree, γ = 1, ω = 1, scale none, step norm mean; every turn 0 from state S0, every turn 1 from X.

    Branched: V0 = 1/4, V(0) = 1/2, V(1) = 0 → a(0) = 1/4, a(1) = −1/4; a(0,0) = 1/2, a(0,1) = −1/2,
    node 1's children are equal → 0. Step level: the shared turn 0 of node 0 returns mean(1, 0) = 1/2, of
    node 1 returns 0 → A^S = ±1/4; turn 1 returns (1, 0, 0, 0) → A^S = 3/4, −1/4, −1/4, −1/4.
    """
    leaves = {(0, 0): 1.0, (0, 1): 0.0, (1, 0): 0.0, (1, 1): 0.0}
    eps = [_ep(f"l{a}{b}", "t", ["S0", "X"], [0.0, r], branch=(a, b)) for (a, b), r in leaves.items()]
    res = gigpo_advantages(eps, GigpoParams(scale="none", step_norm="mean", gamma=1.0, omega=1.0))
    assert res.advantages["l00"] == pytest.approx([0.5, 1.25])
    assert res.advantages["l01"][0] is None and res.advantages["l01"][1] == pytest.approx(-0.75)
    assert res.advantages["l10"] == pytest.approx([-0.5, -0.25])
    assert res.advantages["l11"][0] is None and res.advantages["l11"][1] == pytest.approx(-0.25)
    assert res.metrics["gigpo/anchor_frac"] == 1.0  # 2 shared nodes + 4 leaf turns, all anchored
    assert "branched/V0" in res.metrics


def test_gigpo_config_accepts_trees_and_trains_per_turn():
    cfg = parse_config(
        {"credit": {"estimator": "gigpo", "omega": 0.5, "step_norm": "mean"}, "rollout": {"branching": [2, 2]}}
    )
    assert cfg.per_turn_rows and cfg.credit.params == GigpoParams(omega=0.5, step_norm="mean")
    with pytest.raises(ConfigError, match="step_norm"):
        parse_config({"credit": {"estimator": "gigpo", "step_norm": "median"}})


def test_number_guess_state_key_is_the_implied_interval():
    env = make_env(Task("t", "number_guess", {"target": 12}))
    assert env.state_key() == (1, 20)
    env.step("<answer>10</answer>")
    assert env.state_key() == (11, 20)
    env.step("<answer>15</answer>")
    assert env.state_key() == (11, 14)
    other = make_env(Task("t", "number_guess", {"target": 12}))
    for guess in (5, 15, 10):
        other.step(f"<answer>{guess}</answer>")
    assert other.state_key() == env.state_key()  # another path to the same information state


def test_gigpo_run_logs_the_anchor_fraction(tmp_path):
    cfg = parse_config(
        {
            "run_name": "gigpo",
            "model": {"name": "tiny"},
            "env": {"name": "number_guess"},
            "sampler": {"max_tokens": 4},
            "rollout": {"tasks_per_step": 2, "group_size": 3},
            "credit": {"estimator": "gigpo"},
            "train": {"steps": 1, "micro_batch_size": 8},
            "eval": {"before": False},
            "data": {"num_eval_tasks": 1},
            "tracking": {"backends": ["csv"], "plots": False, "report": False},
            "paths": {"output_dir": str(tmp_path)},
        }
    )
    train(cfg)
    (row,) = read_csv(tmp_path / "gigpo" / "progress" / "train.csv")
    # the random model's first replies all act from the opening interval (1, 20), 3 per group
    assert 0.0 < row["gigpo/anchor_frac"] <= 1.0


def test_gigpo_per_step_episode_stats_follow_verl_agents_rule():
    """verl-agent's default (compute_mean_std_cross_all_data=True, ε = 1e-6), by hand.

    Group g: e1 (keys A, B; rewards 0, 1; R = 1), e2 (A; 0; R = 0), e3 (A, B, C; 0, 0, 0; R = 0).
    Episode level over the 6 step rows [1, 1, 0, 0, 0, 0]: μ = 1/3, σ² = (2·(2/3)² + 4·(1/3)²)/5 = 4/15
    (per trajectory it would be [1, 0, 0]: σ² = 1/3). Step level, γ = 0.5: returns e1 (0.5, 1), e2 (0),
    e3 (0, 0, 0); anchor A = {0.5, 0, 0} (mean 1/6, σ² = 1/12), B = {1, 0} (mean 1/2, σ² = 1/2), C alone → 0.
    Group h is one episode of one turn: verl-agent's single row has μ = 0, σ = 1, so A^E = R / (1 + ε).
    """
    eps = [
        _ep("e1", "g", ["A", "B"], [0.0, 1.0]),
        _ep("e2", "g", ["A"], [0.0]),
        _ep("e3", "g", ["A", "B", "C"], [0.0, 0.0, 0.0]),
        _ep("h1", "h", ["A"], [5.0]),
    ]
    e = 1e-6
    params = GigpoParams(episode_stats="per_step", std_eps=e, gamma=0.5, step_norm="mean_std", scale="group")
    res = gigpo_advantages(eps, params)
    sig = math.sqrt(4 / 15)
    hi, lo = (2 / 3) / (sig + e), (-1 / 3) / (sig + e)
    a_hi, a_lo = (1 / 3) / (math.sqrt(1 / 12) + e), (-1 / 6) / (math.sqrt(1 / 12) + e)
    b = 0.5 / (math.sqrt(0.5) + e)
    assert res.advantages["e1"] == pytest.approx([hi + a_hi, hi + b], rel=1e-12)
    assert res.advantages["e2"] == pytest.approx([lo + a_lo], rel=1e-12)
    assert res.advantages["e3"] == pytest.approx([lo + a_lo, lo - b, lo], rel=1e-12)
    assert res.advantages["h1"] == pytest.approx([5.0 / (1 + e)], rel=1e-12)
    # the default (per trajectory, the paper) differs: σ over [1, 0, 0] and a lone episode gets 0
    default = gigpo_advantages(eps, GigpoParams(gamma=0.5, std_eps=e))
    assert default.advantages["e1"][0] == pytest.approx((2 / 3) / (math.sqrt(1 / 3) + 1e-4) + a_hi, rel=1e-12)
    assert default.advantages["h1"] == [0.0]
    # scale none (verl-agent's mean_norm): R − μ with μ over rows
    plain = gigpo_advantages(eps, GigpoParams(episode_stats="per_step", scale="none", step_norm="mean", gamma=0.5))
    assert plain.advantages["e2"] == pytest.approx([-1 / 3 - 1 / 6])


def test_gigpo_per_step_refuses_batch_scale_and_trees():
    with pytest.raises(ConfigError, match="per_step"):
        parse_config({"credit": {"estimator": "gigpo", "episode_stats": "per_step", "scale": "batch"}})
    tree = [_ep(f"l{a}{b}", "t", ["S", "X"], [0.0, 1.0], branch=(a, b)) for a in (0, 1) for b in (0, 1)]
    with pytest.raises(ValueError, match="flat groups"):
        gigpo_advantages(tree, GigpoParams(episode_stats="per_step"))
