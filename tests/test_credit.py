"""Credit estimators against hand-computed values (ALGORITHMS.md §1)."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest

from factories import advantages_of
from turnrl import credit
from turnrl.config import CreditConfig
from turnrl.credit import (
    ESTIMATORS,
    batch_mean,
    branched_advantages,
    filter_zero_variance,
    group_mean,
    groups_by_id,
    loo_similarity,
    node_values,
    raw_advantages,
    stepwise_advantages,
    stepwise_returns,
    tfidf_vectors,
    tokenize,
)
from turnrl.types import Episode, Turn

S = math.sqrt


def assign_credit(episodes, cfg) -> SimpleNamespace:
    """turnrl's assign_credit (which writes Turn.advantage), with the advantages read back."""
    metrics = credit.assign_credit(episodes, credit.CreditSettings.from_config(cfg))
    return SimpleNamespace(advantages=advantages_of(episodes), metrics=metrics)


def ep(eid, reward, group="g", branch=(), turns=1, turn_rewards=None, prompt=""):
    rewards = turn_rewards or [None] * turns
    return Episode(
        episode_id=eid,
        task_id=group,
        turns=[
            Turn(
                index=k,
                prompt_ids=[1],
                action_ids=[2],
                action_logprobs=[-0.1],
                action_text="a",
                reward=r,
            )
            for k, r in enumerate(rewards)
        ],
        reward=reward,
        terminated=True,
        truncated=False,
        group_id=group,
        branch=list(branch),
        prompt=prompt,
    )


# ---- group_mean / batch_mean / loo_similarity -------------------------------------------


def test_group_mean_group_scale():
    # mean 0.5; unbiased std = sqrt((4 · 0.25) / 3) = sqrt(1/3)
    a = group_mean([1, 0, 0, 1], ["g"] * 4, "group")
    s = S(1 / 3) + 1e-4
    np.testing.assert_allclose(a, [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s])


def test_group_mean_none_scale_is_dr_grpo():
    np.testing.assert_allclose(group_mean([1, 0, 0, 1], ["g"] * 4, "none"), [0.5, -0.5, -0.5, 0.5])


def test_group_mean_batch_scale_and_zero_variance_group():
    # batch [1, 0, 1, 1]: mean 0.75, unbiased var = (3 · 0.0625 + 0.5625) / 3 = 0.25 → std 0.5
    a = group_mean([1, 0, 1, 1], ["a", "a", "b", "b"], "batch")
    np.testing.assert_allclose(a, [0.5 / 0.5001, -0.5 / 0.5001, 0.0, 0.0])


def test_group_mean_zero_variance_is_exactly_zero():
    a = group_mean([0.3, 0.3, 0.3, 7.0], ["a", "a", "a", "single"], "group")
    assert a.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_batch_mean_leave_one_out():
    # A_0 = 1 − (2 − 1)/3 = 2/3; A_1 = 0 − 2/3
    np.testing.assert_allclose(batch_mean([1, 0, 0, 1]), [2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert batch_mean([5.0]).tolist() == [0.0]


def test_tokenize_and_tfidf():
    assert tokenize("Hello, World! hello_there 42") == ["hello", "world", "hello_there", "42"]
    # vocab a, b, c; df(a)=2, df(b)=df(c)=1; n=2: idf(a)=log(3/3)+1=1, idf(b)=log(3/2)+1
    v = tfidf_vectors(["a b", "A c"])
    ib = math.log(1.5) + 1
    np.testing.assert_allclose(v, [[0.5, 0.5 * ib, 0.0], [0.5, 0.0, 0.5 * ib]])


def test_loo_similarity_hand_computed():
    # cos(x, x) = 1 → w = 1; cos(x, y) = 0 → w = e^{-1/τ} = e^{-10}
    e = math.exp(-10)
    a = loo_similarity([1, 0, 1], ["x", "x", "y"], tau=0.1)
    np.testing.assert_allclose(a, [1 - e / (1 + e), 0 - (1 + e) / (1 + e), 1 - e / (2 * e)])


def test_loo_similarity_falls_back_to_uniform_when_weights_underflow():
    # τ = 1e-3 and disjoint texts: w = e^{-1000} = 0 → uniform leave-one-out
    a = loo_similarity([1, 0, 0], ["x", "y", "z"], tau=1e-3)
    np.testing.assert_allclose(a, [1.0, -0.5, -0.5])
    np.testing.assert_allclose(a, batch_mean([1, 0, 0]))


# ---- branched ---------------------------------------------------------------------------

TREE = {(0, 0): 1.0, (0, 1): 0.0, (1, 0): 0.0, (1, 1): 0.0}  # V0 = 1/4, V1 = [1/2, 0]


def test_node_values():
    assert node_values(TREE) == {(): 0.25, (0,): 0.5, (1,): 0.0, **TREE}


def test_branched_none_scale_hand_computed():
    (adv,), m = branched_advantages([TREE], "none")
    assert adv == {(0,): 0.25, (1,): -0.25, (0, 0): 0.5, (0, 1): -0.5, (1, 0): 0.0, (1, 1): 0.0}
    assert m["branched/V0"] == 0.25
    # Var_i(V1) = var([.5, 0]) = 1/16; Var(R) = var([1, 0, 0, 0]) = 3/16
    assert m["branched/v1_signal_ratio"] == pytest.approx(1 / 3)
    assert m["branched/frac_zero_var_prefixes"] == 0.5


def test_branched_group_scale():
    (adv,), _ = branched_advantages([TREE], "group")
    s1 = S(0.125) + 1e-4  # unbiased std of V1 = [0.5, 0]
    s2 = S(0.5) + 1e-4  # unbiased std of R_0j = [1, 0]
    assert adv[(0,)] == pytest.approx(0.25 / s1)
    assert adv[(1,)] == pytest.approx(-0.25 / s1)
    assert adv[(0, 0)] == pytest.approx(0.5 / s2)
    assert adv[(0, 1)] == pytest.approx(-0.5 / s2)
    assert adv[(1, 0)] == 0.0 and adv[(1, 1)] == 0.0  # zero-variance prefix


def test_branched_batch_scale_per_depth():
    other = {(0, 0): 1.0, (0, 1): 1.0, (1, 0): 1.0, (1, 1): 0.0}  # V0 = .75, V1 = [1, .5]
    (a, b), m = branched_advantages([TREE, other], "batch")
    # depth 1 raw: [.25, -.25, .25, -.25] → unbiased std sqrt(.25/3)
    s1 = S(0.25 / 3) + 1e-4
    # depth 2 raw: [.5, -.5, 0, 0, 0, 0, .5, -.5] → unbiased std sqrt(1/7)
    s2 = S(1 / 7) + 1e-4
    assert a[(0,)] == pytest.approx(0.25 / s1) and b[(1,)] == pytest.approx(-0.25 / s1)
    assert a[(0, 1)] == pytest.approx(-0.5 / s2) and b[(1, 1)] == pytest.approx(-0.5 / s2)
    assert b[(0, 0)] == 0.0
    assert m["branched/V0"] == pytest.approx(0.5)
    # other: var(V1) = 1/16, var(R) = 3/16 → 1/3 as well
    assert m["branched/v1_signal_ratio"] == pytest.approx(1 / 3)


def test_branched_telescoping_identity_any_depth():
    rng = np.random.default_rng(0)
    for shape in [(3, 4), (2, 3, 2)]:
        leaves = {p: float(rng.normal()) for p in itertools.product(*map(range, shape))}
        raw = raw_advantages(leaves)
        v0 = node_values(leaves)[()]
        for path, r in leaves.items():
            total = sum(raw[path[: d + 1]] for d in range(len(path)))
            assert total == pytest.approx(r - v0)  # A1 + A2 (+ A3) = R − V0


def test_branched_v1_signal_ratio_edge_cases():
    flat = {(0, 0): 1.0, (0, 1): 1.0, (1, 0): 1.0, (1, 1): 1.0}
    _, m = branched_advantages([flat], "group")
    assert m["branched/v1_signal_ratio"] == 0.0  # no tree with Var(R) > 0
    assert m["branched/frac_zero_var_prefixes"] == 1.0
    # all variance between first-turn variants → ratio 1
    between = {(0, 0): 1.0, (0, 1): 1.0, (1, 0): 0.0, (1, 1): 0.0}
    _, m = branched_advantages([between, flat], "group")
    assert m["branched/v1_signal_ratio"] == 1.0  # the flat tree is left out of the mean


def test_branched_rejects_leaf_that_is_a_prefix():
    with pytest.raises(ValueError, match="prefix"):
        node_values({(0,): 1.0, (0, 1): 0.0})


def _adv(result, eid):
    return result.advantages[eid]


def test_branched_credit_trains_shared_prefix_once_2x2():
    cfg = CreditConfig(estimator="branched", scale="none")
    rewards = {(0, 0): 1.0, (0, 1): 0.0, (1, 0): 0.0, (1, 1): 0.0}
    eps = [ep(f"e{i}{j}", r, branch=(i, j), turns=2) for (i, j), r in reversed(rewards.items())]
    res = assign_credit(eps, cfg)
    assert _adv(res, "e00") == [0.25, 0.5]
    assert _adv(res, "e01") == [None, -0.5]
    assert _adv(res, "e10") == [-0.25, 0.0]
    assert _adv(res, "e11") == [None, 0.0]
    assert res.metrics["branched/V0"] == 0.25
    assert res.metrics["reward"] == 0.25


def test_branched_credit_three_levels():
    cfg = CreditConfig(estimator="branched", scale="none")
    r = {p: 0.0 for p in itertools.product(range(2), range(2), range(2))}
    r.update({(0, 0, 0): 1.0, (0, 0, 1): 1.0, (0, 1, 1): 1.0, (1, 1, 1): 1.0})
    # V0 = .5; V(0) = .75, V(1) = .25; V(0,0) = 1, V(0,1) = .5, V(1,0) = 0, V(1,1) = .5
    res = assign_credit([ep("".join(map(str, p)), v, branch=p, turns=3) for p, v in r.items()], cfg)
    assert _adv(res, "000") == [0.25, 0.25, 0.0]
    assert _adv(res, "001") == [None, None, 0.0]
    assert _adv(res, "010") == [None, -0.25, -0.5]
    assert _adv(res, "011") == [None, None, 0.5]
    assert _adv(res, "100") == [-0.25, -0.25, 0.0]
    assert _adv(res, "110") == [None, 0.25, -0.5]
    assert _adv(res, "111") == [None, None, 0.5]
    trained = [sum(a[k] is not None for a in res.advantages.values()) for k in range(3)]
    assert trained == [2, 4, 8]  # each node's turn once


def test_branched_credit_leaves_longer_and_shorter_than_the_tree():
    cfg = CreditConfig(estimator="branched", scale="none")
    eps = [
        ep("e00", 1.0, branch=(0, 0), turns=4),  # 6-turn-style game on a 2-level tree
        ep("e01", 0.0, branch=(0, 1), turns=3),
        ep("e10", 0.0, branch=(1, 0), turns=1),  # ended in turn 1, replicated G2 times
        ep("e11", 0.0, branch=(1, 1), turns=1),
    ]
    res = assign_credit(eps, cfg)
    assert _adv(res, "e00") == [0.25, 0.5, 0.5, 0.5]
    assert _adv(res, "e01") == [None, -0.5, -0.5]
    assert _adv(res, "e10") == [-0.25]
    assert _adv(res, "e11") == [None]


def test_branched_credit_separate_trees_and_errors():
    cfg = CreditConfig(estimator="branched", scale="none")
    eps = [
        ep("a0", 1.0, "A", (0, 0), 2),
        ep("a1", 0.0, "A", (0, 1), 2),
        ep("b0", 1.0, "B", (0, 0), 2),
    ]
    res = assign_credit(eps, cfg)
    assert _adv(res, "a0") == [0.0, 0.5] and _adv(res, "b0") == [0.0, 0.0]
    with pytest.raises(ValueError, match="branch"):
        assign_credit([ep("x", 1.0)], cfg)
    with pytest.raises(ValueError, match="share the leaf path"):
        assign_credit([ep("x", 1.0, branch=(0, 0)), ep("y", 1.0, branch=(0, 0))], cfg)


# ---- stepwise ---------------------------------------------------------------------------


def test_stepwise_returns_sum_and_max():
    # sum, γ = .4: R2 = 1, R1 = .5 + .4 = .9, R0 = 0 + .36
    np.testing.assert_allclose(stepwise_returns([0, 0.5, 1], 0.4, "sum"), [0.36, 0.9, 1.0])
    # max: R2 = 1, R1 = max(.5, .4) = .5, R0 = max(0, .2) = .2
    np.testing.assert_allclose(stepwise_returns([0, 0.5, 1], 0.4, "max"), [0.2, 0.5, 1.0])
    np.testing.assert_allclose(stepwise_returns([0.1, 1], 0.4, "max"), [0.4, 1.0])
    np.testing.assert_allclose(stepwise_returns([-1.0], 0.4, "max"), [-1.0])


def test_stepwise_pooled_zscore():
    # pool [1, 3, 2]: mean 2, population std sqrt(2/3)
    a, b = stepwise_advantages([[1, 3], [2]], "pooled")
    s = S(2 / 3) + 1e-8
    np.testing.assert_allclose(a, [-1 / s, 1 / s])
    np.testing.assert_allclose(b, [0.0])


def test_stepwise_per_turn_index():
    # t = 0: [1, 2] → mean 1.5, std .5 → [-1, 1]; t = 1: only one sample → 0
    a, b = stepwise_advantages([[1, 3], [2]], "per_turn_index")
    np.testing.assert_allclose(a, [-1.0, 0.0], atol=1e-7)
    np.testing.assert_allclose(b, [1.0], atol=1e-7)


def test_stepwise_credit_end_to_end():
    cfg = CreditConfig(estimator="stepwise", gamma=0.5, aggregation="sum")
    # returns: e1 scores [0, 1] → [0.5, 1]; e2 scores [None→0, None→0] → [0, 0]; pool [.5, 1, 0, 0]
    eps = [ep("e1", 1.0, turn_rewards=[0.0, 1.0]), ep("e2", 0.0, turn_rewards=[None, None])]
    res = assign_credit(eps, cfg)
    pool = np.array([0.5, 1, 0, 0])
    z = (pool - pool.mean()) / (pool.std() + 1e-8)
    np.testing.assert_allclose(res.advantages["e1"] + res.advantages["e2"], z)
    assert res.metrics["stepwise/return_mean"] == pytest.approx(0.375)


def test_strip_think():
    from turnrl.chat import strip_think

    assert strip_think("<think>plan</think>\n\nAnswer: 4") == "Answer: 4"
    assert strip_think("<think>a</think>b</think>c") == "c"
    assert strip_think("no reasoning here") == "no reasoning here"
    assert strip_think("x</think>") == ""


# ---- episode level: flat estimators, metrics, dynamic sampling --------------------------


def test_assign_credit_group_mean_and_trl_metrics():
    eps = [
        ep("a", 1.0, "A", turns=2),
        ep("b", 0.0, "A", turns=3),
        ep("c", 1.0, "B"),
        ep("d", 1.0, "B"),
    ]
    res = assign_credit(eps, CreditConfig(estimator="group_mean", scale="none"))
    assert res.advantages == {"a": [0.5, 0.5], "b": [-0.5, -0.5, -0.5], "c": [0.0], "d": [0.0]}
    assert res.metrics["reward"] == 0.75
    assert res.metrics["reward_std"] == pytest.approx(0.5)  # TRL: the batch's std of [1, 0, 1, 1]
    assert res.metrics["reward_std/group"] == pytest.approx(S(0.5) / 2)  # mean of [.707, .707, 0, 0]
    assert res.metrics["frac_reward_zero_std"] == 0.5


def test_assign_credit_batch_mean_and_similarity():
    eps = [ep("a", 1.0, prompt="x"), ep("b", 0.0, prompt="x"), ep("c", 1.0, prompt="y")]
    res = assign_credit(eps, CreditConfig(estimator="batch_mean"))
    assert res.advantages["a"] == pytest.approx([0.5])  # 1 − (0 + 1)/2
    res = assign_credit(eps, CreditConfig(estimator="loo_similarity", tau=0.1))
    e = math.exp(-10)
    assert res.advantages["a"] == pytest.approx([1 - e / (1 + e)])
    assert "loo_similarity/effective_neighbors" in res.metrics


def test_registry_and_input_checks():
    assert set(ESTIMATORS) == {"group_mean", "batch_mean", "loo_similarity", "branched", "stepwise", "gigpo", "critic"}
    assert assign_credit([], CreditConfig()).advantages == {}
    with pytest.raises(ValueError, match="appears twice"):
        assign_credit([ep("a", 1.0), ep("a", 0.0)], CreditConfig())


def test_filter_zero_variance():
    eps = [
        ep("a", 1.0, "A"),
        ep("b", 0.0, "A"),
        ep("c", 1.0, "B"),
        ep("d", 1.0, "B"),
        ep("e", 0.0, "C"),
    ]
    kept, dropped = filter_zero_variance(groups_by_id(eps))
    assert [[e.episode_id for e in g] for g in kept] == [["a", "b"]]
    assert dropped == 2
    kept, dropped = filter_zero_variance([[1.0, 1.0], [0.0, 1.0]], reward=float)
    assert kept == [[0.0, 1.0]] and dropped == 1
