"""The random inputs of the verl comparisons (tests/test_integration_verl.py), made the same way in the test
venv and in a venv with verl (``make_verl_golden.py`` records verl's outputs on them)."""

from __future__ import annotations

import numpy as np
import torch


def grpo_inputs(seed: int = 0):
    """12 trajectory rows of up to 10 tokens: groups a, b (4 rows, one with binary rewards), c (3 rows), d (1 row).

    Each row's response has one to three runs of mask 1 (turns) separated by 0s (environment tokens);
    its reward sits on its last masked token (verl's convention), continuous except in group b."""
    g = np.random.default_rng(seed)
    index = np.array(["a"] * 4 + ["b"] * 4 + ["c"] * 3 + ["d"], dtype=object)
    mask = np.zeros((12, 10), dtype=np.int64)
    rewards = np.zeros((12, 10), dtype=np.float32)
    for i in range(12):
        pos, turns = 0, int(g.integers(1, 4))
        for _ in range(turns):
            n = int(g.integers(1, 3))
            mask[i, pos : pos + n] = 1
            pos += n + int(g.integers(1, 2))
        last = int(np.nonzero(mask[i])[0][-1])
        rewards[i, last] = float(g.integers(0, 2)) if index[i] == "b" else float(np.round(g.normal(), 3))
    return torch.tensor(rewards), torch.tensor(mask, dtype=torch.float32), index


def gigpo_inputs(seed: int = 1):
    """16 step rows of verl-agent's layout: 2 groups × 4 trajectories × 2 steps; binary episode rewards on
    every step row of the trajectory; anchors from a small set (shared within groups); distinct returns."""
    g = np.random.default_rng(seed)
    index, traj, anchors, scores, returns = [], [], [], [], []
    for group in ("g0", "g1"):
        for t in range(4):
            reward = float(g.integers(0, 2))
            for step in range(2):
                index.append(group)
                traj.append(f"{group}-t{t}")
                anchors.append("start" if step == 0 else f"s{int(g.integers(0, 2))}")
                scores.append(reward)
                returns.append(float(np.round(g.normal(), 3)))
    mask = torch.ones(16, 4)
    mask[::3, 3] = 0
    rewards = torch.zeros(16, 4)
    rewards[:, 2] = torch.tensor(scores)
    return (
        rewards,
        torch.tensor(returns, dtype=torch.float32),
        mask,
        np.array(anchors, dtype=object),
        np.array(index, dtype=object),
        np.array(traj, dtype=object),
    )
