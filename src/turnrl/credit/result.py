"""What every estimator returns, and the reward statistics every estimator reports."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict

from turnrl.types import Episode

Scale = Literal["group", "batch", "none"]

STD_EPS = 1e-4
"""Added to a reward std before dividing (GRPO's scale), so tiny stds do not explode."""


@dataclass
class CreditResult:
    """One advantage per turn of every episode, plus diagnostics.

    ``advantages[episode_id][k]`` is turn k's advantage; ``None`` means turn k
    is not trained in this episode (a shared tree prefix trained in a sibling).
    """

    advantages: dict[str, list[float | None]]
    metrics: dict[str, float] = field(default_factory=dict)


class EstimatorParams(BaseModel):
    """Base of an estimator's own parameters (``credit.<name>`` keys of the config)."""

    model_config = ConfigDict(extra="forbid")


P = TypeVar("P", bound=BaseModel)
"""An estimator's own parameter model."""


class EstimatorState(Protocol):
    """What a stateful estimator (a learned critic) keeps across a run's steps: it credits a batch with its
    own parameters and learns from it, and its state is saved with the run's checkpoint (plain values)."""

    def credit(self, episodes: list[Episode], params: Any) -> CreditResult: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class EstimatorSpec(Generic[P]):
    """A credit estimator as a registry entry, generic in its parameter model ``P``: its function, its
    parameters, what it needs.

    ``fn(episodes, params)`` returns one advantage per turn of every episode (``params`` an instance of ``P``).
    """

    fn: Callable[[list[Episode], P], CreditResult]
    params: type[P] = EstimatorParams  # type: ignore[assignment]  # an estimator without parameters of its own
    per_turn_rows: bool = False
    """Train each turn as its own row (credit differs between turns of one episode)."""
    needs_tree: bool = False
    """Needs ``rollout.branching`` (episodes are leaves of trees)."""
    supports_tree: bool = False
    """Works with or without ``rollout.branching`` (trees are optional)."""
    state: Callable[[P], EstimatorState] | None = None
    """A stateful estimator's state, made from its parameters: a run keeps one (:class:`CreditSettings`), which
    learns across steps and is checkpointed; ``fn`` alone starts from a fresh one each call."""


def sample_std(x: Sequence[float] | np.ndarray) -> float:
    """Unbiased (N − 1) standard deviation; 0.0 for fewer than two values."""
    x = np.asarray(x, dtype=float)
    return float(np.std(x, ddof=1)) if x.size > 1 else 0.0


def all_equal(x: Sequence[float] | np.ndarray) -> bool:
    """True when every value is exactly the same (a zero-variance group; singletons too)."""
    x = np.asarray(x, dtype=float)
    return bool(np.all(x == x[0])) if x.size else True


def group_indices(group_ids: Sequence[str]) -> dict[str, list[int]]:
    """Positions of each group id, groups in order of first appearance."""
    out: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        out.setdefault(g, []).append(i)
    return out


ZERO_STD = 1e-8
"""A std below this counts as zero (TRL's ``is_std_zero = std.abs() < 1e-8``)."""


def reward_metrics(episodes: Sequence[Episode], scale: Scale = "group") -> dict[str, float]:
    """TRL's reward statistics over the batch, groups by ``Episode.group_id``; ``scale`` = the one in use.

    * ``reward``: mean episode reward.
    * ``reward_std``: the unbiased (N − 1) std of the batch's episode rewards (TRL's ``rewards.std()``).
    * ``frac_reward_zero_std``: the fraction of episodes whose std *at the scale in use* is zero
      (TRL's ``is_std_zero.float().mean()``): ``group``/``none`` = the episode's group std,
      ``batch`` = the batch std (so 0 or 1). A group of one counts as zero std.
    * per group, under their own names: ``reward_std/group`` (the group's std averaged over
      episodes, TRL ≥ 0.20's ``reward_std`` with per-group scaling) and ``frac_groups_zero_std``
      (the fraction of groups with zero std; groups, not episodes).
    * ``reward/<name>``: the mean of every episode metric ``reward/<name>`` (rubric components,
      the group-level reward), over the episodes that report it.
    """
    if not episodes:
        return {}
    rewards = np.array([e.reward for e in episodes], dtype=float)
    groups = group_indices([e.group_id for e in episodes]).values()
    group_std = np.zeros_like(rewards)
    for idx in groups:
        group_std[idx] = sample_std(rewards[idx])
    batch_std = sample_std(rewards)
    if scale == "batch":
        zero = np.full_like(rewards, float(batch_std < ZERO_STD))
    else:
        zero = (group_std < ZERO_STD).astype(float)
    out = {
        "reward": float(rewards.mean()),
        "reward_std": batch_std,
        "frac_reward_zero_std": float(zero.mean()),
        "reward_std/group": float(group_std.mean()),
        "frac_groups_zero_std": float(np.mean([sample_std(rewards[idx]) < ZERO_STD for idx in groups])),
    }
    names = sorted({k for e in episodes for k in e.metrics if k.startswith("reward/")})
    for name in names:
        out[name] = float(np.mean([e.metrics[name] for e in episodes if name in e.metrics]))
    return out
