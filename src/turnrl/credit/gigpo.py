"""Anchor-state credit (GiGPO, Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training").

Two levels of groups. The episode level is GRPO's: A^E(τ_i) from the group's
episode rewards (``group_mean`` with ``scale``; on trees, the ``branched``
per-node advantage). The step level groups the *turns* of one task's group
that act from the same environment state: the anchor state ``s`` is
``Turn.state_key`` (``Env.state_key()``), and

    G(g, s)   = {(i, t) : episode i in group g, turn t acts from state s}
    R_t^i     = Σ_{k ≥ t} γ^{k−t} r_k^i                  (discounted return from that turn)
    A^S_{i,t} = (R_t^i − mean_{G(g,s)} R) / F,            F = 1 (``mean``) or std_{G(g,s)}(R) + 1e-4 (``mean_std``)
    A_{i,t}   = A^E(τ_i) + ω · A^S_{i,t}

``episode_stats`` says what the episode level's mean and std run over. ``per_trajectory`` (the
paper's Eq. 3, the default): each episode once, ``group_mean``. ``per_step`` (verl-agent's
shipped default, ``compute_mean_std_cross_all_data=True``): every *turn row* carries its
episode's R, and the group's mean and unbiased std run over the rows, so an episode of T turns
counts T times:

    μ = Σ_i T_i R_i / Σ_i T_i,   σ = sqrt(Σ_i T_i (R_i − μ)² / (Σ_i T_i − 1)),   A^E_i = (R_i − μ) / (σ + ε)

(``scale: none``: A^E_i = R_i − μ); a group of a single row keeps verl-agent's μ = 0, σ = 1.
``std_eps`` is ε of the step level and of ``per_step``'s episode level (1e-4 here, verl-agent
1e-6); ``per_trajectory``'s episode level is ``group_mean``'s (ε = 1e-4).

A turn without a key, or alone in its anchor group, or in a group whose returns
are all equal, gets A^S = 0. On trees a shared prefix turn is one member of its
anchor group (its return: the mean over the leaves below it) and is trained
once, in the leaf that ``branched`` picks. Every turn is its own training row.

ALGORITHMS.md §1 "gigpo"; docs/algorithms.md has a worked example.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from turnrl.credit.branched import branched_credit
from turnrl.credit.group import GroupMeanParams, group_mean
from turnrl.credit.result import STD_EPS, CreditResult, EstimatorSpec, all_equal, group_indices, sample_std
from turnrl.credit.returns import discounted_return
from turnrl.types import Episode

StepNorm = Literal["mean", "mean_std"]
EpisodeStats = Literal["per_trajectory", "per_step"]


def anchor_advantages(
    returns: Sequence[float], anchors: Sequence[Hashable | None], norm: StepNorm = "mean_std", eps: float = STD_EPS
) -> np.ndarray:
    """A^S_j = (R_j − mean_{G(j)} R) / F with G(j) = {k : anchors[k] == anchors[j]} (None = no anchor → 0).

    ``norm``: ``mean`` F = 1; ``mean_std`` F = std_G(R) (unbiased) + ``eps``. A group of one,
    or one whose returns are all equal, gives exactly 0.
    """
    r = np.asarray(returns, dtype=float)
    if len(anchors) != r.size:
        raise ValueError(f"{r.size} returns but {len(anchors)} anchors")
    if norm not in ("mean", "mean_std"):
        raise ValueError(f"step_norm must be mean or mean_std (got {norm!r})")
    groups: dict[Hashable, list[int]] = {}
    for j, a in enumerate(anchors):
        if a is not None:
            groups.setdefault(a, []).append(j)
    out = np.zeros_like(r)
    for idx in groups.values():
        x = r[idx]
        if len(idx) < 2 or all_equal(x):
            continue
        f = sample_std(x) + eps if norm == "mean_std" else 1.0
        out[idx] = (x - x.mean()) / f
    return out


class GigpoParams(GroupMeanParams):
    """``scale`` (episode level, as ``group_mean``) plus the step level's own parameters."""

    omega: float = Field(1.0, ge=0)
    """Weight ω of the step-level (anchor-state) advantage."""
    step_norm: StepNorm = "mean_std"
    """Step-level normalisation: ``mean`` (R − mean) or ``mean_std`` ((R − mean) / std)."""
    gamma: float = Field(0.95, ge=0, le=1)
    """Discount γ of the return from a turn."""
    episode_stats: EpisodeStats = "per_trajectory"
    """Episode-level mean/std over episodes (``per_trajectory``, the paper) or over turn rows
    (``per_step``, verl-agent's default); flat groups only."""
    std_eps: float = Field(STD_EPS, gt=0)
    """ε added to a std before dividing: step level, and episode level with ``per_step`` (verl-agent: 1e-6)."""

    @model_validator(mode="after")
    def _per_step_scale(self) -> GigpoParams:
        if self.episode_stats == "per_step" and self.scale == "batch":
            raise ValueError("episode_stats: per_step takes scale group or none (verl-agent has no batch scale)")
        return self


def per_step_episode_advantages(
    rewards: Sequence[float], turns: Sequence[int], group_ids: Sequence[str], scale: str, eps: float
) -> np.ndarray:
    """verl-agent's episode level with statistics over step rows (see the module doc).

    Episode i of ``turns[i]`` rows contributes R_i ``turns[i]`` times to its group's mean and
    unbiased std; a group of a single row has μ = 0, σ = 1. ``scale``: ``group`` divides by
    σ + ε, ``none`` does not.
    """
    if scale not in ("group", "none"):
        raise ValueError(f"gigpo episode_stats per_step supports scale group or none (got {scale!r})")
    r = np.asarray(rewards, dtype=float)
    adv = np.zeros_like(r)
    for idx in group_indices(list(group_ids)).values():
        rows = np.repeat(r[idx], [turns[i] for i in idx])
        mu, sigma = (0.0, 1.0) if rows.size <= 1 else (float(rows.mean()), sample_std(rows))
        adv[idx] = (r[idx] - mu) / (sigma + eps) if scale == "group" else r[idx] - mu
    return adv


def _units(episodes: list[Episode], gamma: float):
    """Deduplicated turns: (unit id → (anchor, [returns of its copies])), and each turn's unit id."""
    units: dict[tuple, tuple[Hashable | None, list[float]]] = {}
    of_turn: dict[str, list[tuple]] = {}
    for e in episodes:
        returns = discounted_return([t.reward or 0.0 for t in e.turns], gamma)
        ids = []
        for k, turn in enumerate(e.turns):
            shared = k < len(e.branch) - 1  # a tree's prefix turn: the same turn in every leaf below it
            uid = ("node", e.group_id, tuple(e.branch[: k + 1])) if shared else ("turn", e.episode_id, k)
            anchor = (e.group_id, turn.state_key) if turn.state_key is not None else None
            units.setdefault(uid, (anchor, []))[1].append(float(returns[k]))
            ids.append(uid)
        of_turn[e.episode_id] = ids
    return units, of_turn


SIZE_BINS = {"1": (1, 1), "2_3": (2, 3), "4_7": (4, 7), "8_15": (8, 15), "16up": (16, math.inf)}
"""Anchor-group sizes (inclusive bounds) binned for the histogram metrics ``gigpo/anchor_size_<name>``
(a size-1 group is a turn no other turn shares)."""


def gigpo_advantages(episodes: list[Episode], cfg: GigpoParams) -> CreditResult:
    """A = A^E + ω A^S per turn (see the module doc). Metrics: ``gigpo/anchor_frac`` (fraction of
    turns, shared tree turns counted once, whose anchor group has ≥ 2 members),
    ``gigpo/anchor_group_size`` (mean size of the anchor group a keyed turn is in), its histogram
    ``gigpo/anchor_size_<bin>`` (the fraction of keyed turns whose anchor group's size falls in each of
    :data:`SIZE_BINS`) and ``gigpo/step_adv_abs`` (mean |A^S| over turns)."""
    tree = any(e.branch for e in episodes)
    if tree and cfg.episode_stats == "per_step":
        raise ValueError("gigpo episode_stats: per_step applies to flat groups; trees use the branched node values")
    if cfg.episode_stats == "per_step":
        adv = per_step_episode_advantages(
            [e.reward for e in episodes],
            [e.num_turns for e in episodes],
            [e.group_id for e in episodes],
            cfg.scale,
            cfg.std_eps,
        )
        episode_level: dict[str, list[float | None]] = {
            e.episode_id: [float(a)] * e.num_turns for e, a in zip(episodes, adv, strict=True)
        }
        metrics = {}
    elif tree:
        base = branched_credit(episodes, cfg)
        episode_level, metrics = base.advantages, dict(base.metrics)
    else:
        adv = group_mean([e.reward for e in episodes], [e.group_id for e in episodes], cfg.scale)
        episode_level = {e.episode_id: [float(a)] * e.num_turns for e, a in zip(episodes, adv, strict=True)}
        metrics = {}

    units, of_turn = _units(episodes, cfg.gamma)
    keys = list(units)
    anchors = [units[u][0] for u in keys]
    step = anchor_advantages([float(np.mean(units[u][1])) for u in keys], anchors, cfg.step_norm, cfg.std_eps)
    step_of = dict(zip(keys, step, strict=True))

    advantages: dict[str, list[float | None]] = {}
    for e in episodes:
        row: list[float | None] = []
        for a_e, uid in zip(episode_level[e.episode_id], of_turn[e.episode_id], strict=True):
            row.append(None if a_e is None else float(a_e + cfg.omega * step_of[uid]))
        advantages[e.episode_id] = row

    sizes: dict[Hashable, int] = {}
    for a in anchors:
        if a is not None:
            sizes[a] = sizes.get(a, 0) + 1
    n = len(keys)
    keyed = [sizes[a] for a in anchors if a is not None]
    metrics.update(
        {
            "gigpo/anchor_frac": sum(s >= 2 for s in keyed) / n if n else 0.0,
            "gigpo/anchor_group_size": float(np.mean(keyed)) if keyed else 0.0,
            "gigpo/step_adv_abs": float(np.mean(np.abs(step))) if n else 0.0,
        }
    )
    for name, (lo, hi) in SIZE_BINS.items():
        metrics[f"gigpo/anchor_size_{name}"] = sum(lo <= s <= hi for s in keyed) / len(keyed) if keyed else 0.0
    return CreditResult(advantages, metrics)


GIGPO = EstimatorSpec(gigpo_advantages, GigpoParams, per_turn_rows=True, supports_tree=True)
