"""Returns toolkit: discounted returns, TD residuals, GAE, semi-Markov returns,
collector targets, and the chance a binary group is informative.

An episode of K turns visits states s_0 .. s_K: turn k acts in s_k, gets r_k and
moves to s_{k+1}; s_K is the state after the last turn. ``values`` are
V(s_0) .. V(s_K) (K + 1 numbers). ``terminated`` means s_K is terminal (its
value is 0 by definition, so V(s_K) is never used); ``truncated`` means the
episode was cut (by a horizon or the collector) and s_K still has a future.

ALGORITHMS.md §1 "returns toolkit".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def discounted_return(rewards: Sequence[float] | np.ndarray, gamma: float, bootstrap: float = 0.0) -> np.ndarray:
    """Return-to-go of every turn; ``G[0]`` is the episode's discounted return.

        G_k = r_k + γ G_{k+1},   G_K = bootstrap (0 by default)

    i.e. G_k = Σ_{j≥k} γ^{j−k} r_j + γ^{K−k} · bootstrap.
    """
    r = np.asarray(rewards, dtype=float)
    g = np.zeros_like(r)
    running = float(bootstrap)
    for k in range(r.size - 1, -1, -1):
        running = r[k] + gamma * running
        g[k] = running
    return g


def _terminal_flags(terminated: bool | Sequence[bool], k: int) -> np.ndarray:
    """Per-turn flags: a bool means "the last turn ended in a terminal state"."""
    if isinstance(terminated, bool | np.bool_):
        flags = np.zeros(k, dtype=bool)
        if k:
            flags[-1] = bool(terminated)
        return flags
    flags = np.asarray(terminated, dtype=bool)
    if flags.shape != (k,):
        raise ValueError(f"terminated has {flags.size} flags for {k} rewards")
    return flags


def td_residuals(
    rewards: Sequence[float] | np.ndarray,
    values: Sequence[float] | np.ndarray,
    gamma: float,
    terminated: bool | Sequence[bool],
) -> np.ndarray:
    """One-step TD errors.

        δ_k = r_k + γ V(s_{k+1}) (1 − terminated_k) − V(s_k)

    ``values`` has K + 1 entries V(s_0..s_K). ``terminated`` is one flag per
    turn, or a bool for the whole episode (applies to the last turn only).
    """
    r = np.asarray(rewards, dtype=float)
    v = np.asarray(values, dtype=float)
    if v.size != r.size + 1:
        raise ValueError(f"values needs K + 1 = {r.size + 1} entries (V(s_0..s_K)), got {v.size}")
    done = _terminal_flags(terminated, r.size)
    return r + gamma * v[1:] * (1.0 - done) - v[:-1]


def gae(
    rewards: Sequence[float] | np.ndarray,
    values: Sequence[float] | np.ndarray,
    gamma: float,
    lam: float,
    terminated: bool | Sequence[bool],
) -> np.ndarray:
    """Generalised advantage estimation.

        A_k = Σ_j (γλ)^j δ_{k+j},   computed as A_k = δ_k + γλ (1 − terminated_k) A_{k+1}

    (the (1 − terminated_k) factor only matters when several episodes are
    concatenated). λ = 1 telescopes to G_k − V(s_k) with G_k the return
    bootstrapped by V(s_K) unless terminated; λ = 0 gives δ_k.
    """
    delta = td_residuals(rewards, values, gamma, terminated)
    done = _terminal_flags(terminated, delta.size)
    adv = np.zeros_like(delta)
    running = 0.0
    for k in range(delta.size - 1, -1, -1):
        running = delta[k] + gamma * lam * (1.0 - done[k]) * running
        adv[k] = running
    return adv


def semi_markov_return(rewards: Sequence[float], durations: Sequence[float], gamma: float) -> np.ndarray:
    """Return when turn k lasts τ_k time units (e.g. tokens or environment steps).

    G_k = R_k + γ^{τ_k} G_{k+1},   G_K = 0
    """
    r = np.asarray(rewards, dtype=float)
    tau = np.asarray(durations, dtype=float)
    if tau.shape != r.shape:
        raise ValueError(f"{r.size} rewards but {tau.size} durations")
    g = np.zeros_like(r)
    running = 0.0
    for k in range(r.size - 1, -1, -1):
        running = r[k] + gamma ** tau[k] * running
        g[k] = running
    return g


def collector_target(
    rewards: Sequence[float], value_last: float, gamma: float, terminated: bool, truncated: bool
) -> np.ndarray:
    """Value target of every turn of an episode the collector ended.

        target_k = Σ_{j=k}^{K−1} γ^{j−k} r_j + [truncated] γ^{K−k} V(s_K)

    Bootstraps with V(s_K) only when the episode was truncated (cut by a
    horizon or the collector), never when it terminated. An episode that is
    neither is not bootstrapped; one that is both is an error.
    """
    if terminated and truncated:
        raise ValueError("an episode cannot be both terminated and truncated")
    return discounted_return(rewards, gamma, bootstrap=value_last if truncated else 0.0)


def informative_group_probability(p: float | np.ndarray, group_size: int) -> float | np.ndarray:
    """Chance that a group of G binary rewards with success rate p has both outcomes.

        P = 1 − p^G − (1 − p)^G

    That is the chance a GRPO group gives any gradient (DAPO's dynamic sampling
    drops the others).
    """
    if group_size < 1:
        raise ValueError(f"group size must be ≥ 1 (got {group_size})")
    q = np.asarray(p, dtype=float)
    if np.any((q < 0) | (q > 1)):
        raise ValueError(f"p must lie in [0, 1] (got {p})")
    out = 1.0 - q**group_size - (1.0 - q) ** group_size
    return float(out) if out.ndim == 0 else out
