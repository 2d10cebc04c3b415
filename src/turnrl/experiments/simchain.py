"""A simulated chain where the answer is known: what the audit's effective-samples figure predicts, measured.

An episode is K independent two-option decisions; turn t answers right with probability p_t, and a
right answer is worth 1 (paid on its turn, or all at the end with ``terminal``). The policy is a
tabular softmax per turn over 2V replies, V phrasings of each option ("right" is replies 0..V−1),
uniform within an option, so a reply's score ∇log π = e_reply − π has a part along the reward
(which option) and a larger reward-free part (which phrasing), as a language model's reply does.
Exact here (γ = 1):

    A*_t = 1{right_t} − p_t                    (the decisions are independent: Q − V of turn t alone)
    G_t  = ∇_θt J = π ⊙ A*(option)             (componentwise, the true gradient of turn t's logits)

Arms at equal leaves L per task (ALGORITHMS.md §1, unscaled): ``flat`` Â = R − mean_L R (group_mean,
scale none); ``pool`` leave-one-out over a pool of P returns, the task's L among them (batch_mean);
``stepwise`` G_t = Σ_{u≥t} γ^{u−t} r_u z-scored per turn index over the L leaves; ``tree`` (k1, k2):
V1_i = mean of its k2 leaves, V0 = mean of all, turn 1 of variant i gets V1_i − V0 (trained once),
turns ≥ 2 of leaf ij get R_ij − V1_i.

Measured (:func:`measure`): per turn, the gradient g = Σ_i Â_i (e_{a_i} − π) over the distinct samples
of one task, over many independent batches; SNR² = ⟨E g, Ĝ⟩² / tr Cov(g), divided by the SNR² of one
perfectly credited sample (Â = A*, exact by enumeration) = the number of perfect samples worth the
arm's gradient. :func:`audit_advantages` draws what the credit audit sees (N audited episodes fixed,
each repeat a fresh group around each, as ``turnrl.audit.core.estimator_runs`` builds them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Z_EPS = 1e-8


@dataclass(frozen=True)
class Chain:
    p: tuple[float, ...]
    """P(right) at each turn."""
    terminal: bool = False
    """Pay the sum of the right answers at the last turn instead of each on its turn."""
    phrasings: int = 50
    """V: replies per option."""

    @property
    def turns(self) -> int:
        return len(self.p)

    def rewards(self, right: np.ndarray) -> np.ndarray:
        """Per-turn rewards r_t of episodes ``right[..., K]``."""
        r = right.astype(float)
        if not self.terminal:
            return r
        out = np.zeros_like(r)
        out[..., -1] = r.sum(axis=-1)
        return out

    def a_star(self, right: np.ndarray) -> np.ndarray:
        return right.astype(float) - np.asarray(self.p)

    def policy(self, t: int) -> np.ndarray:
        """π over the 2V replies of turn t."""
        v = self.phrasings
        return np.r_[np.full(v, self.p[t] / v), np.full(v, (1 - self.p[t]) / v)]

    def reply_a_star(self, t: int) -> np.ndarray:
        """A* of each of the 2V replies of turn t."""
        v = self.phrasings
        return np.r_[np.full(v, 1 - self.p[t]), np.full(v, -self.p[t])]


@dataclass(frozen=True)
class Arm:
    name: str
    kind: str
    """``flat``, ``pool``, ``stepwise`` or ``tree``."""
    gamma: float = 0.0
    """stepwise: the discount."""
    pool: int = 0
    """pool: P returns behind the leave-one-out baseline (P ≥ leaves)."""
    shape: tuple[int, int] = (0, 0)
    """tree: (k1, k2), k1·k2 = leaves."""


def _returns(rewards: np.ndarray, gamma: float) -> np.ndarray:
    out = np.zeros_like(rewards)
    acc = np.zeros(rewards.shape[:-1])
    for t in range(rewards.shape[-1] - 1, -1, -1):
        acc = rewards[..., t] + gamma * acc
        out[..., t] = acc
    return out


def _zscore(x: np.ndarray) -> np.ndarray:
    """Over axis 1 (the leaves), population std, 0 where all equal (turnrl.credit.stepwise)."""
    sd = x.std(axis=1, keepdims=True)
    return np.where(sd > 0, (x - x.mean(axis=1, keepdims=True)) / (sd + Z_EPS), 0.0)


def group(
    arm: Arm, chain: Chain, leaves: int, batches: int, rng: np.random.Generator, first: np.ndarray | None = None
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``batches`` independent tasks' groups: per turn t, (right[b, i], Â[b, i]) over the distinct samples
    the arm trains at t. ``first[b, K]`` fixes the episode of sample 0 (the audited one; in a tree, leaf
    (0, 0): sample 0 at turn 1 is its first reply)."""
    k, p = chain.turns, np.asarray(chain.p)
    if arm.kind == "tree":
        k1, k2 = arm.shape
        if k1 * k2 != leaves:
            raise ValueError(f"tree {k1}x{k2} has {k1 * k2} leaves, not {leaves}")
        right = rng.random((batches, k1, k2, k)) < p
        right[:, :, :, 0] = right[:, :, :1, 0]  # the k2 leaves of a variant share its first reply
        if first is not None:
            right[:, 0, :, 0] = first[:, None, 0]
            right[:, 0, 0] = first
        ret = chain.rewards(right).sum(axis=-1)
        v1 = ret.mean(axis=2)
        a1 = v1 - v1.mean(axis=1, keepdims=True)
        a2 = (ret - v1[:, :, None]).reshape(batches, leaves)
        flat_right = right.reshape(batches, leaves, k)
        return [(right[:, :, 0, 0], a1)] + [(flat_right[..., t], a2) for t in range(1, k)]
    right = rng.random((batches, max(leaves, arm.pool), k)) < p
    if first is not None:
        right[:, 0] = first
    rewards = chain.rewards(right)
    if arm.kind == "stepwise":
        adv = _zscore(_returns(rewards[:, :leaves], arm.gamma))
        return [(right[:, :leaves, t], adv[..., t]) for t in range(k)]
    ret = rewards.sum(axis=-1)
    if arm.kind == "flat":
        a = ret[:, :leaves] - ret[:, :leaves].mean(axis=1, keepdims=True)
    elif arm.kind == "pool":
        if arm.pool < leaves:
            raise ValueError(f"pool {arm.pool} < leaves {leaves}")
        a = ret[:, :leaves] - (ret.sum(axis=1, keepdims=True) - ret[:, :leaves]) / (arm.pool - 1)
    else:
        raise ValueError(f"unknown arm kind {arm.kind!r}")
    return [(right[:, :leaves, t], a) for t in range(k)]


def perfect_snr2(chain: Chain, t: int) -> float:
    """SNR² of one sample credited with A* at turn t, by enumeration: |G|² / (E|A* s|² − |G|²)."""
    pi, a = chain.policy(t), chain.reply_a_star(t)
    g2 = float(np.sum((pi * a) ** 2))
    s2 = 1 - 2 * pi + np.sum(pi**2)  # |e_j − π|²
    return g2 / (float(np.sum(pi * a**2 * s2)) - g2)


def measure(arm: Arm, chain: Chain, leaves: int, batches: int, seed: int = 0) -> list[dict[str, float]]:
    """Per turn: the gradient's SNR² over ``batches`` tasks (one group each; 0 where every advantage is 0)
    and ``n_eff`` = SNR² / the SNR² of one perfectly credited sample, ± ``n_eff_se`` (its Monte-Carlo SE,
    delta method on the projection's mean)."""
    rng = np.random.default_rng(seed)
    v = chain.phrasings
    out = []
    for t, (right, adv) in enumerate(group(arm, chain, leaves, batches, rng)):
        pi = chain.policy(t)
        reply = np.where(right, 0, v) + rng.integers(0, v, right.shape)
        idx = (np.arange(batches)[:, None] * 2 * v + reply).ravel()
        g = np.bincount(idx, adv.ravel(), minlength=batches * 2 * v).reshape(batches, 2 * v)
        g -= adv.sum(axis=1, keepdims=True) * pi
        u = pi * chain.reply_a_star(t) / np.linalg.norm(pi * chain.reply_a_star(t))  # Ĝ
        proj = g @ u
        mean, var_mean = float(proj.mean()), float(proj.var(ddof=1)) / batches
        noise = float(g.var(axis=0, ddof=1).sum())
        snr2, se = ((mean**2 - var_mean) / noise, 2 * abs(mean) * np.sqrt(var_mean) / noise) if noise else (0.0, 0.0)
        one = perfect_snr2(chain, t)
        out.append({"samples": float(right.shape[1]), "snr2": snr2, "n_eff": snr2 / one, "n_eff_se": se / one})
    return out


def audit_advantages(
    arm: Arm, chain: Chain, leaves: int, episodes: int, repeats: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What the credit audit sees: ``(ahat[r, j], a_star[j], turn[j], episode[j])`` over the turns j of
    ``episodes`` audited episodes (held fixed), each repeat a fresh group of ``leaves`` around each."""
    rng = np.random.default_rng(seed)
    audited = rng.random((episodes, chain.turns)) < np.asarray(chain.p)
    ahat = np.stack(
        [
            np.stack([adv[:, 0] for _, adv in group(arm, chain, leaves, episodes, rng, first=audited)], axis=1).ravel()
            for _ in range(repeats)
        ]
    )
    turn = np.tile(np.arange(chain.turns), episodes)
    episode = np.repeat(np.arange(episodes), chain.turns)
    return ahat, chain.a_star(audited).ravel(), turn, episode
