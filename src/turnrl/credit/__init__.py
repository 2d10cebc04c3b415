"""Credit assignment: rewards in, one advantage per turn out.

The trainer calls :func:`assign_credit` with the step's episodes and the
``credit`` config section; it writes ``Turn.advantage`` (the one home of an
advantage). Each estimator is one module and one :data:`ESTIMATORS` entry (an
:class:`EstimatorSpec`: function, own pydantic parameters, needs); the math
underneath is pure numpy and knows nothing of models or training
(ALGORITHMS.md §1). ``register_estimator`` adds one from user code. A stateful estimator (the
``critic``, which learns across steps) names its state in ``EstimatorSpec.state``: the run's
:class:`CreditSettings` holds one, and the checkpoint saves it (``state_dict``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel

from turnrl.credit.branched import (
    BRANCHED,
    branched_advantages,
    node_values,
    raw_advantages,
)
from turnrl.credit.critic import CRITIC, CriticState, critic_advantages
from turnrl.credit.dynamic import filter_zero_variance, groups_by_id
from turnrl.credit.gigpo import GIGPO, gigpo_advantages
from turnrl.credit.group import (
    BATCH_MEAN,
    GROUP_MEAN,
    LOO_SIMILARITY,
    batch_mean,
    group_mean,
    loo_similarity,
    similarity_weights,
    tfidf_vectors,
    tokenize,
)
from turnrl.credit.result import CreditResult, EstimatorParams, EstimatorSpec, EstimatorState, reward_metrics
from turnrl.credit.returns import (
    collector_target,
    discounted_return,
    gae,
    informative_group_probability,
    semi_markov_return,
    td_residuals,
)
from turnrl.credit.shaping import shaped_rewards
from turnrl.credit.stepwise import (
    STEPWISE,
    stepwise_advantages,
    stepwise_returns,
)
from turnrl.types import Episode

ESTIMATORS: dict[str, EstimatorSpec[Any]] = {
    "group_mean": GROUP_MEAN,
    "batch_mean": BATCH_MEAN,
    "loo_similarity": LOO_SIMILARITY,
    "branched": BRANCHED,
    "stepwise": STEPWISE,
    "gigpo": GIGPO,
    "critic": CRITIC,
}


def register_estimator(name: str, spec: EstimatorSpec[Any]) -> None:
    """Add an estimator under ``name`` (then ``credit.estimator: name`` works in configs)."""
    ESTIMATORS[name] = spec


def get_estimator(name: str) -> EstimatorSpec[Any]:
    if name not in ESTIMATORS:
        raise ValueError(f"unknown credit.estimator {name!r}; choose one of {', '.join(sorted(ESTIMATORS))}")
    return ESTIMATORS[name]


class CreditSection(Protocol):
    """The keys of the ``credit`` config section that :class:`CreditSettings` reads (this package
    may not import the config: the section is passed in, and this Protocol says what it must have)."""

    @property
    def estimator(self) -> str: ...
    @property
    def params(self) -> BaseModel: ...


@dataclass(frozen=True)
class CreditSettings:
    """The estimator of a run, resolved once: its registry name and its own validated parameters."""

    estimator: str
    params: BaseModel
    state: EstimatorState | None = field(default=None, compare=False, repr=False)
    """A stateful estimator's state for the run (made here when its spec has one; it learns across steps)."""

    def __post_init__(self) -> None:
        spec = ESTIMATORS.get(self.estimator)
        if self.state is None and spec is not None and spec.state is not None:
            object.__setattr__(self, "state", spec.state(self.params))

    def state_dict(self) -> dict[str, Any]:
        """The estimator's state for the checkpoint (empty for a stateless estimator)."""
        return self.state.state_dict() if self.state is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore it from a checkpoint; an empty one (a stateless run, or an older checkpoint) keeps it fresh."""
        if self.state is not None and state:
            self.state.load_state_dict(state)

    @property
    def spec(self) -> EstimatorSpec[Any]:
        return get_estimator(self.estimator)

    @classmethod
    def from_config(cls, section: CreditSection) -> CreditSettings:
        get_estimator(section.estimator)
        return cls(section.estimator, section.params)


def assign_credit(episodes: list[Episode], settings: CreditSettings) -> dict[str, float]:
    """Set ``Turn.advantage`` on every turn of every episode with the estimator ``settings.estimator``.

    ``None`` = the turn is not trained in this episode (a shared tree prefix trained in
    a sibling). Returns metrics: TRL's ``reward``, ``reward_std`` and
    ``frac_reward_zero_std`` (see :func:`reward_metrics`) plus the estimator's own.
    """
    spec = settings.spec
    ids = [e.episode_id for e in episodes]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"episode_id {dup!r} appears twice; credit is keyed by episode id")
    if not episodes:
        return {}
    if settings.state is not None:  # a stateful estimator: credit from what it learned, then learn this batch
        result = settings.state.credit(episodes, settings.params)
    else:
        result = spec.fn(episodes, settings.params)
    for ep in episodes:
        for turn, adv in zip(ep.turns, result.advantages[ep.episode_id], strict=True):
            turn.advantage = adv
    return {**reward_metrics(episodes, getattr(settings.params, "scale", "group")), **result.metrics}


__all__ = [
    "ESTIMATORS",
    "CreditResult",
    "CreditSection",
    "CreditSettings",
    "CriticState",
    "EstimatorParams",
    "EstimatorSpec",
    "EstimatorState",
    "assign_credit",
    "get_estimator",
    "register_estimator",
    "batch_mean",
    "branched_advantages",
    "collector_target",
    "critic_advantages",
    "discounted_return",
    "filter_zero_variance",
    "gae",
    "gigpo_advantages",
    "group_mean",
    "groups_by_id",
    "informative_group_probability",
    "loo_similarity",
    "node_values",
    "raw_advantages",
    "reward_metrics",
    "semi_markov_return",
    "shaped_rewards",
    "similarity_weights",
    "stepwise_advantages",
    "stepwise_returns",
    "td_residuals",
    "tfidf_vectors",
    "tokenize",
]
