"""The credit audit: Monte-Carlo A* against enumeration, estimators against their closed forms."""

from __future__ import annotations

import asyncio
import json
from types import MappingProxyType

import numpy as np
import pytest
from typer.testing import CliRunner

from toy_envs import FORK_P_A, FORK_P_X, FORK_REWARD, ForkEnv, fork_fixed_policy, fork_policy
from turnrl.audit import (
    EstimatorArm,
    Rollouts,
    default_arms,
    default_shapes,
    estimator_runs,
    ground_truth,
    replay_task,
    sample_episodes,
    turn_metrics,
)
from turnrl.audit.run import parse_shapes
from turnrl.chat import ChatTemplate
from turnrl.envs import make_env, register_env
from turnrl.rollout.settings import RolloutSettings
from turnrl.sampling.scripted import ScriptedSampler
from turnrl.types import SamplingParams, Task


@pytest.fixture(autouse=True)
def _fork_env():
    register_env("fork", ForkEnv)


def _exact():
    """Enumerated Q, V and A* of the fork policy: Q(c1) = Σ π(c2|c1) R, V0 = Σ π(c1) Q(c1)."""
    q1 = {c: FORK_P_X[c] * FORK_REWARD[(c, "x")] + (1 - FORK_P_X[c]) * FORK_REWARD[(c, "y")] for c in "ab"}
    v0 = FORK_P_A * q1["a"] + (1 - FORK_P_A) * q1["b"]
    return q1, v0


def _rollouts(tokenizer, policy) -> Rollouts:
    return Rollouts(ScriptedSampler(policy, tokenizer), ChatTemplate(tokenizer), SamplingParams(max_tokens=4))


def _choices(ep):
    return ep.turns[0].action_text.strip(), ep.turns[1].action_text.strip()


def test_hand_enumeration_of_the_fork_policy():
    q1, v0 = _exact()  # Q(a) = 0.7, Q(b) = 1.5, V0 = 0.6·0.7 + 0.4·1.5 = 1.02
    assert q1 == pytest.approx({"a": 0.7, "b": 1.5}) and v0 == pytest.approx(1.02)


def test_monte_carlo_recovers_the_enumerated_advantage_within_its_standard_error(tokenizer):
    rollouts = _rollouts(tokenizer, fork_policy(1))
    tasks, audited = sample_episodes(ForkEnv.default_tasks("train"), 16, rollouts)
    truth = ground_truth(tasks, audited, rollouts, m=200)
    q1, v0 = _exact()
    exact = []
    for ep in audited:
        c1, c2 = _choices(ep)
        exact += [q1[c1] - v0, FORK_REWARD[(c1, c2)] - q1[c1]]
    z = (truth.a_star - np.array(exact)) / truth.se
    assert truth.se.min() > 0 and truth.se.max() < 0.3
    assert np.all(np.abs(z) < 4), z
    assert np.mean(np.abs(z) < 2) >= 0.75, z
    assert truth.replay_exact_frac == 1.0  # scripted replies re-render to the recorded tokens
    # the second turn's Q is the episode's own reward (the episode ended there): no Monte-Carlo error
    assert truth.q[truth.turn == 1] == pytest.approx([FORK_REWARD[_choices(e)] for e in audited])


def test_estimators_match_their_closed_forms(tokenizer):
    """Audited episode (c1, c2) with reward R among L = 4 leaves, scale none, the others fresh from π.

    group_mean: Â_t = R − mean of the 4 → E = (3/4)(R − V0) on both turns (turn 1 inherits turn 2's luck).
    branched 2×2: leaf (0,0) = the audited one, (0,1) continues it after c1, (1,·) a fresh subtree:
    E[Â_1] = E[V1_0 − V0] = ½((R + Q(c1))/2 − V0), E[Â_2] = E[R − V1_0] = ½(R − Q(c1)). Averaged over
    c2 ~ π(·|c1), E[Â_1 | c1] = ½ A*_1(c1): branched's first-turn advantage is unbiased up to (G1−1)/G1.
    """
    q1, v0 = _exact()
    combos = [("a", "x"), ("a", "y"), ("b", "x"), ("b", "y")]
    audited, tasks = [], []
    for c1, c2 in combos:
        t, (ep,) = sample_episodes(ForkEnv.default_tasks("train"), 1, _rollouts(tokenizer, fork_fixed_policy(c1, c2)))
        tasks += t
        audited.append(ep)
    arms = [
        EstimatorArm("gm", "group_mean", {"scale": "none"}),
        EstimatorArm("br", "branched", {"scale": "none"}, (2, 2)),
    ]
    reps = 400
    ahat = estimator_runs(tasks, audited, _rollouts(tokenizer, fork_policy(2)), arms, leaves=4, repeats=reps)
    expect_gm, expect_br = [], []
    for c1, c2 in combos:
        r = FORK_REWARD[(c1, c2)]
        expect_gm += [0.75 * (r - v0)] * 2
        expect_br += [0.5 * ((r + q1[c1]) / 2 - v0), 0.5 * (r - q1[c1])]
    for label, expect in (("gm", expect_gm), ("br", expect_br)):
        mean, se = ahat[label].mean(axis=0), ahat[label].std(axis=0, ddof=1) / np.sqrt(reps)
        assert np.all(np.abs(mean - np.array(expect)) < 4 * se + 1e-9), (label, mean, expect, se)
    # group_mean's first-turn advantage of (b, x) has the wrong sign: A*_1(b) = 0.48 > 0, E[Â_1] = −0.765
    assert expect_gm[4] < 0 < q1["b"] - v0
    br = ahat["br"].mean(axis=0)
    for j, c1 in ((0, "a"), (4, "b")):  # mix (c1, x) and (c1, y) by π(x | c1)
        mixed = FORK_P_X[c1] * br[j] + (1 - FORK_P_X[c1]) * br[j + 2]
        assert mixed == pytest.approx(0.5 * (q1[c1] - v0), abs=0.05)


def test_turn_metrics_by_hand():
    a_star = np.array([1.0, -1.0, 0.0])
    se = np.array([0.1, 0.1, 0.1])
    ahat = np.array([[2.0, -2.0, 0.0], [1.0, 1.0, -1.0]])
    m = turn_metrics(ahat, a_star, se)
    # repeat 0: corr 1; repeat 1: x = (1, 1, −1), corr with (1, −1, 0) = 0 (x·(y − ȳ) = 0)
    assert m["corr"] == pytest.approx(0.5)
    assert m["mse"] == pytest.approx((1 + 1 + 0 + 0 + 4 + 1) / 6)
    assert m["sign"] == pytest.approx(3 / 4) and m["sign_n"] == 2  # the A* = 0 turn is not resolved
    # u = (1, −1, 0)/√2: projections 4/√2 and 0 → SNR = mean/std = (2/√2)/(4/√2/√2) = 1/√2
    assert m["projection_mean"] == pytest.approx(2 / np.sqrt(2))
    assert m["snr"] == pytest.approx(1 / np.sqrt(2))
    assert m["var"] == pytest.approx(np.mean([0.5, 4.5, 0.5]))


def test_replay_rebuilds_the_state_and_keeps_the_horizon(tokenizer):
    task = Task("ng", "number_guess", {"target": 12})
    rollouts = _rollouts(tokenizer, lambda m: "<answer>3</answer>")
    (ep,) = rollouts([task], [1], "x")  # six wrong guesses
    env = make_env(replay_task(task, ep, 2, horizon=4))
    messages = asyncio.run(env.initial_messages())
    assert env.state_key() == (4, 20) and messages[-1]["content"] == "<feedback>higher</feedback>"
    first = asyncio.run(env.step("<answer>5</answer>"))
    second = asyncio.run(env.step("<answer>6</answer>"))
    assert not first.done and second.truncated and second.stop_reason == "collector_limit"
    with pytest.raises(ValueError, match="1..6"):
        replay_task(task, ep, 7, None)


def test_replay_passes_the_environment_options_to_the_inner_environment(tokenizer):
    """The run's ``env.options`` (here the main job's ``few_shot``) belong to the replayed
    environment: the replay wrapper takes them without rejecting them, and the inner environment
    opens with its worked example as the recorded episode did."""
    task = Task("ng", "number_guess", {"target": 12})
    rollouts = _rollouts(tokenizer, lambda m: "<answer>3</answer>")
    rollouts.settings = RolloutSettings(env_options=MappingProxyType({"few_shot": True}))
    (ep,) = rollouts([task], [1], "x")
    plain = make_env(task).initial_messages()
    shown = make_env(task, few_shot=True).initial_messages()
    replayed = asyncio.run(make_env(replay_task(task, ep, 1, horizon=None), few_shot=True).initial_messages())
    assert len(shown) > len(plain)
    assert replayed[: len(shown)] == shown
    assert replayed[-1]["content"] == "<feedback>higher</feedback>"
    (cont,) = rollouts([replay_task(task, ep, 1, rollouts.settings.max_turns)], [1], "r", replayed=True)
    assert cont.num_turns == ep.num_turns - 1


def test_default_shapes_and_arms():
    assert default_shapes(24) == [(2, 12), (4, 6)]
    assert default_shapes(8) == [(2, 4)]
    assert default_shapes(3) == []
    labels = [a.label for a in default_arms(8)]
    assert {"group_mean/group", "group_mean/none", "loo_similarity", "stepwise", "gigpo", "branched/2x4"} <= set(labels)
    with pytest.raises(ValueError, match="3x3"):
        default_arms(8, [(3, 3)])
    assert parse_shapes("2x4,4x2") == [(2, 4), (4, 2)]
    with pytest.raises(ValueError, match="G1xG2"):
        parse_shapes("2x1")


def test_cli_credit_audit_on_the_toy_env(tmp_path):
    from turnrl.cli import app

    cfg = tmp_path / "fork.yaml"
    cfg.write_text("model: {name: tiny}\nenv: {name: fork}\nsampler: {max_tokens: 4}\n")
    out = tmp_path / "audit"
    args = ["credit-audit", str(cfg), "--scripted", "random", "--episodes", "4", "--continuations", "16"]
    result = CliRunner().invoke(app, [*args, "--leaves", "4", "--repeats", "3", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "credit_audit.json").read_text())
    assert (out / "credit_audit.png").stat().st_size > 0
    assert len(report["ground_truth"]["turns"]) == 8
    assert set(report["estimators"]["branched/2x2"]) == {"1", "2", "all"}
    est = report["cost"]["estimators"]
    # per repeat: flat 4 × 3 fresh; tree 4 × 1 continuation + 4 × (1 × 2) fresh leaves
    assert est["episodes"] == 3 * (4 * 3 + 4 * 1 + 4 * 2)
    assert "credit audit" in result.output
    bad = CliRunner().invoke(app, ["credit-audit", str(cfg), "--scripted", "random", "--leaves", "1"])
    assert bad.exit_code == 2 and "--leaves" in bad.output


# ---- the correlation's ± covers the sampling of the audited games (issue 31 §4)


def _audited_set(rng, games: int, turns: int, repeats: int):
    """``games`` audited games drawn from a population whose games differ in how well the estimator tracks
    A* there (ρ_g uniform in [-0.2, 1]), the estimator's noise per repeat small: most of a set's error is
    which games it holds, which the repeats cannot see."""
    rho = rng.uniform(-0.2, 1.0, games)
    a_star = rng.normal(size=(games, turns))
    signal = rho[:, None] * a_star + np.sqrt(1 - rho[:, None] ** 2) * rng.normal(size=(games, turns))
    ahat = signal.reshape(1, -1) + 0.1 * rng.normal(size=(repeats, games * turns))
    return ahat, a_star.reshape(-1), np.repeat(np.arange(games), turns)


def test_the_games_bootstrap_covers_the_spread_of_fresh_audited_sets():
    from turnrl.audit.metrics import audit_metrics

    rng = np.random.default_rng(7)
    corrs, repeat_se, games_se, total_se = [], [], [], []
    for _ in range(150):
        ahat, a_star, episode = _audited_set(rng, games=6, turns=3, repeats=4)
        m = audit_metrics(ahat, a_star, np.zeros_like(a_star), np.zeros(a_star.size, dtype=int), episode)["all"]
        corrs.append(m["corr"])
        repeat_se.append(m["corr_se"])
        games_se.append(m["corr_se_games"])
        total_se.append(m["corr_se_total"])
    spread = float(np.std(corrs, ddof=1))  # how far one set of 6 audited games lands from another
    assert np.median(repeat_se) < spread / 4  # the old ± (repeats alone) misses most of it
    assert 0.6 < np.median(games_se) / spread < 1.3  # the bootstrap over games finds most of it (0.76 here:
    # a bootstrap of 6 games runs low, as sqrt(5/6) and the correlation's skew predict)
    assert np.allclose(total_se, np.sqrt(np.square(repeat_se) + np.square(games_se)))
    one = audit_metrics(ahat[:, :3], a_star[:3], np.zeros(3), np.zeros(3, dtype=int), np.zeros(3, dtype=int))["all"]
    assert np.isnan(one["corr_se_games"])  # one game: nothing to resample
