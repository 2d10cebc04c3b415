"""turnrl's estimators with verl's advantage-estimator signature (turnrl.integrations.verl).

Against verl 0.9.1's ``compute_grpo_outcome_advantage`` and verl-agent's ``compute_gigpo_outcome_advantage``
on random inputs: their outputs recorded in tests/golden/verl_golden.json (tests/golden/make_verl_golden.py,
run in a venv with verl: the test venv cannot import verl, whose top level imports Ray), and live where
they import. Stepwise (which verl lacks) against the formula by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from golden.verl_inputs import gigpo_inputs, grpo_inputs
from turnrl.integrations.verl import gigpo_step_advantage, register_verl, turn_spans, verl_estimator

GOLDEN = json.loads((Path(__file__).parent / "golden" / "verl_golden.json").read_text())


def test_turns_are_the_runs_of_the_response_mask():
    runs, rewards = turn_spans([1, 1, 0, 0, 1, 0, 1, 1, 1, 0])
    assert runs == [(0, 2), (4, 5), (6, 9)]
    assert rewards == [(0, 4), (4, 6), (6, 10)]  # a reward on an environment token is its turn's
    assert turn_spans([0, 0]) == ([], [])


def test_group_mean_equals_verls_grpo_on_random_rows():
    rewards, mask, index = grpo_inputs()
    assert rewards.tolist() == GOLDEN["grpo_rewards"]  # the inputs verl saw
    single = index == "d"
    for norm, scale in ((True, "group"), (False, "none")):
        ours, returns = verl_estimator("group_mean", scale=scale)(
            token_level_rewards=rewards, response_mask=mask, config=None, index=index
        )
        verl = torch.tensor(GOLDEN["grpo"][str(norm)])
        assert torch.equal(ours, returns) and ours.shape == rewards.shape
        assert torch.allclose(ours[~single], verl[~single], atol=1e-5, rtol=1e-5)
        # by design: turnrl gives a group of one 0, verl R / (1 + ε) (mean 0, std 1)
        assert ours[single].abs().max() == 0
        r = float(rewards[single].sum())
        on = verl[single][mask[single] > 0]
        assert on.tolist() == pytest.approx([r / (1 + 1e-4) if norm else r] * len(on), abs=1e-6)
    assert (ours[mask == 0] == 0).all()


@pytest.mark.parametrize("mode", ["mean_norm", "mean_std_norm"])
def test_gigpo_step_rows_equal_verl_agents(mode):
    ours, _ = gigpo_step_advantage(*gigpo_inputs(), epsilon=1e-6, step_advantage_w=0.7, mode=mode)
    verl_agent = torch.tensor(GOLDEN["gigpo"][mode])
    assert ours.abs().max() > 0.1
    assert torch.allclose(ours, verl_agent, atol=1e-5, rtol=1e-5)


def test_gigpo_step_rows_by_hand():
    """One group of three rows: two from anchor s (returns 1, 3), one alone (return 5); scores 1, 0, 1."""
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    mask = torch.ones(3, 2)
    args = (rewards, torch.tensor([1.0, 3.0, 5.0]), mask, np.array(["s", "s", "t"]), np.array(["g"] * 3))
    adv, _ = gigpo_step_advantage(*args, np.array(["e0", "e1", "e2"]), step_advantage_w=0.5, mode="mean_norm")
    mu = 2 / 3  # episode level: R − mean over the group's rows
    assert adv[:, 0].tolist() == pytest.approx([1 - mu + 0.5 * -1, 0 - mu + 0.5 * 1, 1 - mu + 0.0])
    adv, _ = gigpo_step_advantage(*args, np.array(["e0", "e1", "e2"]), epsilon=1e-6, mode="mean_std_norm")
    sd, sd_s = float(np.std([1, 0, 1], ddof=1)), float(np.std([1, 3], ddof=1))
    expected = [
        (1 - mu) / (sd + 1e-6) - 1 / (sd_s + 1e-6),
        -mu / (sd + 1e-6) + 1 / (sd_s + 1e-6),
        (1 - mu) / (sd + 1e-6),
    ]
    assert adv[:, 1].tolist() == pytest.approx(expected, rel=1e-5)


def test_stepwise_over_trajectory_rows_by_hand():
    """Two episodes of one group, two turns each; per-turn rewards from the tokens up to the next turn."""
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 0, 0, 1, 1]], dtype=torch.float32)
    rewards = torch.tensor([[0, 0, 0.5, 0, 1.0], [0, 0, 0, 0, 0.0]])
    adv, _ = verl_estimator("stepwise", gamma=0.5)(rewards, mask, np.array(["g", "g"]))
    # returns: episode 0: turn 1 = 1, turn 0 = 0.5 + 0.5 · 1 = 1; episode 1: 0, 0; pooled z-score (ddof 0)
    pooled = np.array([1.0, 1.0, 0.0, 0.0])
    z = (pooled - pooled.mean()) / (pooled.std() + 1e-8)
    assert adv[0].tolist() == pytest.approx([z[0], z[0], 0, z[1], 0])
    assert adv[1].tolist() == pytest.approx([z[2], 0, 0, z[3], z[3]])


def test_register_verl_registers_every_estimator_without_trees():
    registry = {}

    def register(name):
        def deco(fn):
            registry[name] = fn
            return fn

        return deco

    names = register_verl({"stepwise": {"gamma": 0.9}}, register=register)
    assert names == sorted(registry) and "turnrl_branched" not in registry
    assert {"turnrl_group_mean", "turnrl_stepwise", "turnrl_gigpo", "turnrl_batch_mean"} <= set(registry)
    rewards, mask, index = grpo_inputs()
    adv, _ = registry["turnrl_batch_mean"](token_level_rewards=rewards, response_mask=mask, config=None, index=index)
    r = rewards.sum(-1).double()
    loo = r - (r.sum() - r) / (len(r) - 1)
    first = mask.argmax(dim=-1)  # each row's first masked token
    assert adv[torch.arange(len(r)), first].double().numpy() == pytest.approx(loo.numpy(), abs=1e-5)
    with pytest.raises(ValueError, match="needs tree rollouts"):
        verl_estimator("branched")
    with pytest.raises(ValueError, match=r"credit\.gamma: Input should be less than or equal to 1"):
        verl_estimator("stepwise", gamma=3)


def test_live_against_verl_where_it_imports():
    core = pytest.importorskip(
        "verl.trainer.ppo.core_algos",
        reason="verl is not importable here (it needs Ray); compared with recorded outputs",
    )
    rewards, mask, index = grpo_inputs()
    verl, _ = core.compute_grpo_outcome_advantage(rewards, mask, index, epsilon=1e-4)
    register_verl()
    fn = core.get_adv_estimator_fn("turnrl_group_mean")
    ours, _ = fn(token_level_rewards=rewards, response_mask=mask, config=None, index=index)
    keep = index != "d"
    assert torch.allclose(ours[keep], verl[keep], atol=1e-5)


def test_live_against_verl_agent_where_it_imports():
    gigpo = pytest.importorskip(
        "gigpo.core_gigpo", reason="verl-agent is not importable here (not a package); compared with recorded outputs"
    )
    for mode in ("mean_norm", "mean_std_norm"):
        theirs, _ = gigpo.compute_gigpo_outcome_advantage(*gigpo_inputs(), step_advantage_w=0.7, mode=mode)
        ours, _ = gigpo_step_advantage(*gigpo_inputs(), step_advantage_w=0.7, mode=mode)
        assert torch.allclose(ours, theirs, atol=1e-5)
