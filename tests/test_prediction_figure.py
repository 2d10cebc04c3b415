"""The audit's effective-samples figure n·c² (:mod:`turnrl.experiments.prediction`) against the gradient it
predicts, on a simulated chain where the answer is known (:mod:`turnrl.experiments.simchain`): K independent
two-option decisions, exact A*, the gradient's SNR² measured over many batches in perfectly credited samples."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

from turnrl.audit.core import EstimatorArm
from turnrl.audit.metrics import audit_metrics
from turnrl.experiments.prediction import arm_samples, compare_ordering, predict
from turnrl.experiments.simchain import Arm, Chain, audit_advantages, measure

FOUR = Chain((0.5, 0.5, 0.5, 0.5))  # four decisions of equal weight, each paid on its turn
L = 8
FLAT, STEP, TREE = Arm("flat", "flat"), Arm("stepwise", "stepwise", gamma=0.0), Arm("tree", "tree", shape=(2, 4))
ARMS = (FLAT, STEP, TREE)
TOL = 0.08  # the figure's relative error allowed: the audit's c² over 20,000 games (±2-3 %) and κ ≈ 1/(2V) = 1 %


def _audit(arms, chain, leaves=L, episodes=20_000, repeats=4, seed=1):
    """The audit's per-turn metrics of each arm, as ``turnrl.audit.run`` reports them (exact A*, se 0)."""
    out = {}
    for arm in arms:
        ahat, a_star, turn, _ = audit_advantages(arm, chain, leaves, episodes, repeats, seed)
        out[arm.name] = audit_metrics(ahat, a_star, np.zeros_like(a_star), turn)
    return out


@functools.cache
def _figure(arms, chain, leaves=L, **kw):
    estimators = _audit(arms, chain, leaves, **kw)
    audit_arms = [EstimatorArm(a.name, a.kind, {}, a.shape if a.kind == "tree" else None) for a in arms]
    return predict(estimators, arms[0].name, arm_samples(audit_arms, leaves, estimators))


@functools.cache
def _measured(arms, chain, leaves=L, batches=20_000):
    return {a.name: measure(a, chain, leaves, batches, seed=2) for a in arms}


def _close(figure: float, measured: dict[str, float]) -> bool:
    return abs(figure - measured["n_eff"]) <= TOL * measured["n_eff"] + 3 * measured["n_eff_se"]


def test_n_c2_by_hand_on_two_tiny_cases():
    # K = 2 decisions at p = ½ paid per turn, a flat group of L = 2: Â_1 = R_1 − (R_1 + R_2)/2 = (R_1 − R_2)/2
    # and A*_1 = r_11 − ½. Cov(Â_1, A*_1) = Var(r_11)/2 = 1/8, Var Â_1 = 2·Var R/4 = 2·(2·¼)/4 = ¼, Var A* = ¼,
    # so c = (1/8)/√(¼·¼) = ½ and n·c² = 2·¼ = ½: the group's gradient is worth half a perfectly credited sample.
    two = Chain((0.5, 0.5))
    fig = _figure((FLAT,), two, leaves=2)["arms"]["flat"]
    got = _measured((FLAT,), two, leaves=2, batches=50_000)["flat"]
    for t in ("1", "2"):
        assert fig[t]["corr"] == pytest.approx(0.5, abs=0.02)
        assert fig[t]["samples"] == 2 and fig[t]["n_eff"] == pytest.approx(0.5, rel=TOL)
        assert got[int(t) - 1]["n_eff"] == pytest.approx(0.5, rel=0.05)
    # A (2, 4) tree on FOUR: V1_i = Q_i + the mean of its 4 leaves' later rewards (variance 3·¼/4 = 3/16), so
    # Â_1 = V1_1 − V0 = (V1_1 − V1_2)/2 has Cov with A*_1 = ¼/2 = 1/8 and Var = 2·(¼ + 3/16)/4 = 7/32:
    # c² = (1/8)²/(7/32 · ¼) = 2/7 and n·c² = 2 · 2/7 = 4/7 ≈ 0.571. A flat group of 8: Â = R − R̄,
    # c² = (7/8)·¼/(4·¼) = 7/32 < 2/7 but n·c² = 8 · 7/32 = 7/4.
    fig = _figure(ARMS, FOUR)["arms"]
    assert fig["tree"]["1"]["corr"] ** 2 == pytest.approx(2 / 7, rel=TOL)
    assert fig["tree"]["1"]["n_eff"] == pytest.approx(4 / 7, rel=TOL)
    assert fig["flat"]["1"]["corr"] ** 2 == pytest.approx(7 / 32, rel=TOL)
    assert fig["flat"]["1"]["n_eff"] == pytest.approx(7 / 4, rel=TOL)


@pytest.mark.parametrize("chain", [FOUR, Chain((0.2, 0.5, 0.8, 0.9))], ids=["equal", "unequal"])
def test_the_figure_is_the_gradients_worth_in_perfect_samples_per_arm_and_turn(chain):
    arms = ARMS
    fig, got = _figure(arms, chain), _measured(arms, chain)
    for arm in arms:
        for t in range(chain.turns):
            row = fig["arms"][arm.name][str(t + 1)]
            assert row["samples"] == got[arm.name][t]["samples"]  # n from the shape: 8, or 2 then 8 for the tree
            assert _close(row["n_eff"], got[arm.name][t]), (arm.name, t, row, got[arm.name][t])
        for t in range(chain.turns):  # every clear ordering of two arms at a turn, the figure's too
            for a in arms:
                for b in arms:
                    if got[a.name][t]["n_eff"] > 1.15 * got[b.name][t]["n_eff"]:
                        assert fig["arms"][a.name][str(t + 1)]["n_eff"] > fig["arms"][b.name][str(t + 1)]["n_eff"]


def test_correlation_alone_favours_the_tree_at_turn_one_the_figure_and_the_gradient_do_not():
    fig, got = _figure(ARMS, FOUR), _measured(ARMS, FOUR)
    flat, tree = fig["arms"]["flat"]["1"], fig["arms"]["tree"]["1"]
    assert tree["corr"] > flat["corr"] + 0.04  # 0.53 vs 0.47: the old ρ = c_flat²/c_tree² < 1 says the tree
    assert tree["variance_ratio"] < 0.85
    measured_ratio = got["flat"][0]["n_eff"] / got["tree"][0]["n_eff"]  # the tree's gradient noise vs flat's
    assert measured_ratio > 2.5  # 3.06 = (7/4)/(4/7): the tree's two first replies are worth a third of eight
    assert tree["n_eff_ratio"] == pytest.approx(measured_ratio, rel=2 * TOL)
    for t in ("2", "3", "4"):  # later turns: the tree removes turn 1's reward, 8 leaves, 2.0 vs 1.75
        assert (
            fig["arms"]["tree"][t]["n_eff_ratio"] < 1
            and got["tree"][int(t) - 1]["n_eff"] > got["flat"][int(t) - 1]["n_eff"]
        )
    # over the turns, Σ n·c² ≈ 6.57 (tree) vs 7 (flat) vs 28 (stepwise): at equal leaves the tree's later turns
    # about buy back its first; both sums agree with the measured ones
    total = {a: sum(m["n_eff"] for m in got[a]) for a in got}
    assert fig["arms"]["stepwise"]["all"]["n_eff"] == pytest.approx(total["stepwise"], rel=TOL)
    assert fig["arms"]["tree"]["all"]["n_eff"] == pytest.approx(total["tree"], rel=TOL)
    assert fig["arms"]["flat"]["all"]["n_eff"] == pytest.approx(total["flat"], rel=TOL)


def test_the_old_snr_grows_with_the_baselines_pool_and_the_audits_size_the_gradient_does_not():
    # batch_mean-style leave-one-out over a pool of P returns, the task's 8 leaves among them: the baseline's
    # noise shrinks like 1/(P − 1) but the 8 samples and their own noise stay, so the gradient barely moves
    # (n·c² = 8·((P − 1)/P)·¼: 1.75 → 1.98), while the audit's SNR, which holds the audited turns fixed and
    # varies only the rest of the group, grows like √(P − 1): 7 → 127, ×4.3
    small, big = Arm("pool8", "pool", pool=8), Arm("pool128", "pool", pool=128)
    old = _audit([small, big], FOUR, episodes=64, repeats=100)
    old_growth = old["pool128"]["all"]["snr"] / old["pool8"]["all"]["snr"]
    got = _measured((small, big), FOUR)
    fig = _figure((small, big), FOUR)["arms"]
    true_growth = got["pool128"][0]["n_eff"] / got["pool8"][0]["n_eff"]
    assert old_growth > 3 and true_growth < 1.2
    assert fig["pool128"]["all"]["n_eff"] / fig["pool8"]["all"]["n_eff"] == pytest.approx(true_growth, rel=TOL)
    # and with the number of audited episodes N (an audit setting, ≈ √N), where the figure stays put
    few, many = _audit([FLAT], FOUR, episodes=32, repeats=100), _audit([FLAT], FOUR, episodes=2048, repeats=100)
    assert many["flat"]["1"]["snr"] / few["flat"]["1"]["snr"] > 3  # √64 = 8 (a few games' own noise moves it)
    fig_many = _figure((FLAT,), FOUR, episodes=1024, repeats=100)["arms"]["flat"]
    assert fig_many["all"]["n_eff"] == pytest.approx(7.0, rel=0.15)


def test_more_leaves_buy_more_samples_in_the_figure_as_in_the_gradient():
    # with correlation flat near 0.5 (√(¼) on four equal turns) the gradient's worth grows with the leaves:
    # n·c² = (L − 1)/4 = 0.75, 3.75, 15.75 at L = 4, 16, 64 (the audit's SNR grows too, ≈ √(N·n·c²): rightly here)
    for leaves in (4, 16, 64):
        fig = _figure((FLAT,), FOUR, leaves=leaves, episodes=5_000)["arms"]["flat"]["1"]
        got = _measured((FLAT,), FOUR, leaves=leaves, batches=4_000)["flat"][0]
        assert got["n_eff"] == pytest.approx((leaves - 1) / 4, rel=0.06)
        assert fig["n_eff"] == pytest.approx(got["n_eff"], rel=0.12)


def test_an_arm_that_gives_a_turn_nothing_is_worth_nothing_there():
    # terminal reward: stepwise with γ = 0 hands turns 1-3 a return of 0 (Â = 0, no correlation), so n_eff 0
    # there while flat credit carries the end reward back; the last turn is flat's (z-scored: within TOL)
    terminal = Chain((0.5, 0.5, 0.5, 0.5), terminal=True)
    fig = _figure((FLAT, STEP), terminal)
    got = _measured((FLAT, STEP), terminal)
    assert fig["turns"] == ["1", "2", "3", "4"]
    for t in range(3):
        assert math.isnan(fig["arms"]["stepwise"][str(t + 1)]["corr"])
        assert fig["arms"]["stepwise"][str(t + 1)]["n_eff"] == 0 == got["stepwise"][t]["n_eff"]
        assert math.isnan(fig["arms"]["stepwise"][str(t + 1)]["n_eff_ratio"])
    assert _close(fig["arms"]["stepwise"]["4"]["n_eff"], got["stepwise"][3])
    measured = {a: sum(m["n_eff"] for m in got[a]) for a in got}
    ordering = compare_ordering(fig, measured)
    assert ordering["predicted_n_eff"][0] > 3 * ordering["predicted_n_eff"][1]  # flat ≈ 7 vs stepwise ≈ 1.7
    assert measured["flat"] > 3 * measured["stepwise"]


def test_predict_by_hand_samples_signs_and_the_sum_over_turns():
    est = {
        "flat": {"1": {"corr": 0.5, "n_turns": 10}, "2": {"corr": 0.5, "n_turns": 5}, "all": {"corr": 0.5}},
        "tree": {"1": {"corr": 0.6, "n_turns": 10}, "2": {"corr": -0.5, "n_turns": 5}, "all": {"corr": 0.2}},
    }
    arms = [EstimatorArm("flat", "group_mean"), EstimatorArm("tree", "branched", {}, (2, 4))]
    samples = arm_samples(arms, 8, est)
    assert samples == {"flat": {"1": 8.0, "2": 4.0}, "tree": {"1": 2.0, "2": 4.0}}  # half the games reach turn 2
    p = predict(est, "flat", samples)
    flat, tree = p["arms"]["flat"], p["arms"]["tree"]
    assert flat["1"]["n_eff"] == pytest.approx(2.0) and flat["2"]["n_eff"] == pytest.approx(1.0)
    assert tree["1"]["n_eff"] == pytest.approx(0.72) and tree["1"]["n_eff_ratio"] == pytest.approx(2.0 / 0.72)
    assert tree["1"]["variance_ratio"] == pytest.approx(0.25 / 0.36)  # correlation alone: the tree looks better
    assert tree["2"]["n_eff"] == pytest.approx(-1.0) and math.isnan(tree["2"]["n_eff_ratio"])  # the wrong way
    assert flat["all"]["n_eff"] == pytest.approx(3.0) and tree["all"]["n_eff"] == pytest.approx(-0.28)
    assert flat["all"]["samples"] == 12 and flat["all"]["corr"] == 0.5  # the pooled correlation stays
