"""How a run collects episodes, resolved once: :class:`RolloutSettings`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Protocol

from turnrl.rollout.context import ContextMode

DEFAULT_ENV_WORKERS = 8


class RolloutSection(Protocol):
    """The keys of the ``rollout`` config section that :class:`RolloutSettings` reads."""

    @property
    def tasks_per_step(self) -> int: ...
    @property
    def group_size(self) -> int: ...
    @property
    def branching(self) -> list[int] | None: ...
    @property
    def max_turns(self) -> int | None: ...
    @property
    def dynamic_sampling(self) -> bool: ...
    @property
    def refill(self) -> bool: ...
    @property
    def max_context_tokens(self) -> int | None: ...
    @property
    def env_workers(self) -> int: ...
    @property
    def shaping(self) -> bool: ...
    @property
    def shaping_gamma(self) -> float: ...
    @property
    def truncated_completion_reward(self) -> float | None: ...
    @property
    def task_seeds(self) -> bool | None: ...
    @property
    def context(self) -> ContextMode: ...
    @property
    def context_turns(self) -> int: ...


class EnvSection(Protocol):
    @property
    def options(self) -> dict[str, Any]: ...


class RolloutSource(Protocol):
    """What :meth:`RolloutSettings.from_config` reads of a run config: its ``rollout`` and ``env``
    sections (this package may not import the config; this Protocol says what it must have)."""

    @property
    def rollout(self) -> RolloutSection: ...
    @property
    def env(self) -> EnvSection: ...


@dataclass(frozen=True)
class RolloutSettings:
    """How a run collects episodes, resolved once (the ``rollout`` section and the environment options).

    ``shape`` is the training rollouts' shape (``[G]`` flat, ``[G1, G2, ...]`` tree);
    ``shaping_gamma`` is None when shaping is off.
    """

    shape: tuple[int, ...] = (1,)
    tasks_per_step: int = 1
    dynamic_sampling: bool = False
    refill: bool = False
    env_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    max_turns: int | None = None
    max_context_tokens: int | None = None
    env_workers: int = DEFAULT_ENV_WORKERS
    shaping_gamma: float | None = None
    truncated_reward: float | None = None
    task_seeds: bool = False
    """Seed every draw from (the call's seed, task index, branch, turn) instead of from its place in the
    sampler call, so a task's episodes do not depend on which other tasks are collected with it (or by
    which process): :func:`row_seed`."""
    context: ContextMode = "full"
    """What each turn's context holds (:mod:`turnrl.rollout.context`): the whole history, or the task and
    the last ``context_turns`` turns (``window``; ``summary``: with the environment's summary between)."""
    context_turns: int = 4

    @classmethod
    def from_config(cls, cfg: RolloutSource) -> RolloutSettings:
        r = cfg.rollout
        return cls(
            shape=tuple(r.branching or [r.group_size]),
            tasks_per_step=r.tasks_per_step,
            dynamic_sampling=r.dynamic_sampling,
            refill=r.refill,
            env_options=MappingProxyType(dict(cfg.env.options)),
            max_turns=r.max_turns,
            max_context_tokens=r.max_context_tokens,
            env_workers=r.env_workers,
            shaping_gamma=r.shaping_gamma if r.shaping else None,
            truncated_reward=r.truncated_completion_reward,
            task_seeds=bool(r.task_seeds),
            context=r.context,
            context_turns=r.context_turns,
        )

    def for_evaluation(self) -> RolloutSettings:
        """The same limits and environment options without the training-only reward changes."""
        return replace(self, shaping_gamma=None, truncated_reward=None)
