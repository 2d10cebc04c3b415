"""The one resolution point: :class:`RunSettings`, a run config resolved once into every stage's settings.

:meth:`RunSettings.from_config` is the only place a run config becomes settings
(:class:`~turnrl.rollout.settings.RolloutSettings`, :class:`~turnrl.sampling.SamplerSettings`,
:class:`~turnrl.credit.CreditSettings`, :class:`~turnrl.train.step.StepSettings` with its
:class:`~turnrl.losses.LossPlan`, :class:`~turnrl.eval.EvalSettings`,
:class:`~turnrl.train.policy.PolicySettings`, :class:`~turnrl.envs.splits.TaskSource`,
:class:`~turnrl.chat.ChatSettings`); below it no function takes the config. Every command resolves
its run here: ``turnrl train`` (the run object), ``turnrl eval`` and ``turnrl credit-audit``
(:mod:`turnrl.train.standalone`) and the experiment runner, so one config means one run
whichever command builds it (``tests/test_architecture.py`` checks that no other code resolves one).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType

from turnrl.chat import ChatSettings
from turnrl.config import RunConfig
from turnrl.credit import CreditSettings
from turnrl.envs.splits import TaskSource
from turnrl.eval import EvalSettings
from turnrl.rollout.settings import RolloutSettings
from turnrl.sampling import SamplerSettings, get_sampler
from turnrl.train import distributed
from turnrl.train.base_eval import BaseEvalKey
from turnrl.train.checkpoint import RunState
from turnrl.train.policy import PolicySettings
from turnrl.train.step import StepSettings


@dataclass(frozen=True)
class RunSettings:
    """Every stage's settings, resolved once from the run config, plus the loop's own."""

    seed: int
    rollout: RolloutSettings
    sampler: SamplerSettings
    credit: CreditSettings
    step: StepSettings
    eval: EvalSettings
    policy: PolicySettings
    tasks: TaskSource
    """Where the train and eval tasks come from (``data`` and ``env``)."""
    chat: ChatSettings = field(default_factory=ChatSettings)
    """How every chat of the run is rendered: training, evaluation, ``turnrl eval``, the credit audit."""
    iterations: int = 1
    steps_per_iteration: int = 1
    max_seconds: float | None = None
    checkpoint_every: int = 1
    mask_truncated_completions: bool = False
    per_turn_rows: bool = False
    shard_collection: bool = False
    """Each process collects its share of a step's tasks (:func:`distributed.shards_collection`)."""
    base_eval: BaseEvalKey | None = None
    """What the base model's held-out evaluation depends on (:mod:`turnrl.train.base_eval`: runs with equal keys
    may share it)."""

    @classmethod
    def from_config(cls, cfg: RunConfig) -> RunSettings:
        shard = distributed.shards_collection(get_sampler(cfg.sampler.backend).shares_weights)
        rollout = RolloutSettings.from_config(cfg)
        if cfg.rollout.task_seeds is None:  # sharded collection needs them; one process keeps per-call seeds
            rollout = dataclasses.replace(rollout, task_seeds=shard)
        return cls(
            seed=cfg.seed,
            rollout=rollout,
            sampler=SamplerSettings.from_config(cfg.sampler),
            credit=CreditSettings.from_config(cfg.credit),
            step=StepSettings.from_config(cfg),
            eval=EvalSettings.from_config(cfg),
            policy=PolicySettings.from_config(cfg),
            tasks=TaskSource.from_config(cfg),
            chat=ChatSettings(MappingProxyType(dict(cfg.model.chat_template_kwargs)), cfg.model.exclude_think),
            iterations=cfg.loop.iterations,
            steps_per_iteration=cfg.loop.steps_per_iteration or cfg.train.steps,
            max_seconds=cfg.train.max_seconds,
            checkpoint_every=cfg.train.checkpoint_every,
            mask_truncated_completions=cfg.train.mask_truncated_completions,
            per_turn_rows=cfg.per_turn_rows,
            shard_collection=shard,
            base_eval=BaseEvalKey.from_config(cfg),
        )

    def out_of_time(self, state: RunState) -> bool:
        """``train.max_seconds`` is spent."""
        return self.max_seconds is not None and state.train_seconds >= self.max_seconds

    def last_step(self, state: RunState) -> bool:
        """The iteration's steps are done (or the time is spent): its end saves and evaluates anyway."""
        return state.iteration_step >= self.steps_per_iteration or self.out_of_time(state)

    def eval_due(self, state: RunState) -> bool:
        return bool(self.eval.every) and state.step % self.eval.every == 0 and not self.last_step(state)

    def checkpoint_due(self, state: RunState) -> bool:
        return state.step % self.checkpoint_every == 0 and not self.last_step(state)
