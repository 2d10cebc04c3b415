"""turnrl's multi-turn rollouts and credit inside TRL's ``GRPOTrainer`` (TRL 1.16), through its own seams.

    from trl import GRPOConfig
    from turnrl.integrations.trl import TurnrlGRPOTrainer, TurnrlRollout, task_dataset

    rollout = TurnrlRollout(estimator="branched", branching=[2, 4], max_turns=6)   # 2 x 4 = num_generations
    trainer = TurnrlGRPOTrainer(model=model, args=GRPOConfig(num_generations=8, loss_type="dapo", ...),
                                train_dataset=task_dataset(tasks), processing_class=tokenizer, turnrl=rollout)
    trainer.train()

How (the fewest overrides): TRL's ``rollout_func`` is :class:`TurnrlRollout`. For each group of
``num_generations`` dataset rows of one task it runs turnrl's collector (:func:`turnrl.rollout.collect.
collect`: flat groups or ``branching`` trees, token-in/token-out, any turnrl sampler; by default
transformers generation on the trainer's own model), assigns credit with any registered estimator
(:func:`turnrl.credit.assign_credit`), and hands each episode to TRL as one sample: ``prompt_ids`` = the
first turn's context, ``completion_ids`` = everything after it (actions and environment replies),
``env_mask`` = 1 on the action tokens of trained turns (TRL's loss mask; environment tokens, and a
tree's shared prefix in every leaf but the one that trains it, are 0), ``logprobs`` = the sampler's.
:class:`TurnrlGRPOTrainer` overrides one method, ``_generate_and_score_completions``: TRL's own, then its
``advantages`` replaced by turnrl's per-token advantages ``[B, T]`` (TRL's loss takes ``(B, T)``
advantages as it is). Everything after that is TRL's: ``loss_type``, clipping, β/KL with its reference,
``num_iterations``, ``steps_per_generation``, gradient accumulation, accelerate, logging.

What is exact. Each token's advantage is its turn's, so the loss decomposes over turns: with a token-sum
normaliser (``loss_type`` ``dapo``, ``cispo``, ``bnpo``) TRL's loss and gradient over whole episodes equal
turnrl's over per-turn rows (``tests/test_integration_trl.py`` checks the gradients), and a tree's
shared turn is trained once. With flat credit (``group_mean``, the scale taken from TRL's
``scale_rewards``) the advantages equal TRL's own and so does the loss. ``grpo``/``dr_grpo`` normalise per
whole episode (TRL's rule, not turnrl's per-turn rows). Rewards are the environment's:
``reward_funcs`` is :func:`episode_reward` (reward terms belong in the environment, e.g. a rubric).
Groups must be whole on each process (``per_device_train_batch_size × steps_per_generation`` a multiple
of ``num_generations``); ``batch`` scaling is over one process's groups. docs/integrations.md.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from turnrl.chat import ChatSettings
from turnrl.credit import CreditSettings, assign_credit, get_estimator
from turnrl.envs import make_env
from turnrl.integrations.credit import settings_from_mapping
from turnrl.records import append_records
from turnrl.rollout.collect import RolloutSettings, collect
from turnrl.types import Episode, SamplingParams, Task, new_prompt_lengths

try:  # TRL is an optional dependency: pip install 'turnrl[trl]'
    from trl import GRPOTrainer
except ImportError:  # pragma: no cover - the message below says what to install
    GRPOTrainer = None  # type: ignore[assignment,misc]


def task_dataset(tasks: list[Task], env_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Rows for ``datasets.Dataset.from_list``: ``prompt`` (the task's opening user text, for TRL's logs),
    ``task_id`` and ``task`` (the task as JSON, which :class:`TurnrlRollout` reads back)."""
    rows = []
    for task in tasks:
        messages = make_env(task, **(env_options or {})).initial_messages()
        if inspect.isawaitable(messages):
            messages = asyncio.run(messages)  # type: ignore[arg-type]
        prompt = next((str(m["content"]) for m in reversed(messages) if m["role"] == "user"), task.task_id)
        rows.append({"prompt": prompt, "task_id": task.task_id, "task": json.dumps(task.to_dict())})
    return rows


def episode_reward(prompts, completions, turnrl_reward, **kwargs) -> list[float]:
    """TRL's ``reward_funcs`` entry: each episode's reward, as the environment gave it."""
    return list(turnrl_reward)


@dataclass
class Sample:
    """One episode as one TRL sample (see the module doc)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    env_mask: list[int]
    logprobs: list[float]
    advantages: list[float]


def as_sample(episode: Episode) -> Sample:
    """The episode as TRL sees it; needs every turn's context to extend the previous turn's sequence."""
    new = new_prompt_lengths(episode)
    ids: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    adv: list[float] = []
    for k, turn in enumerate(episode.turns):
        if k:  # the environment's reply and the template between two actions: not trained
            env = turn.prompt_ids[len(turn.prompt_ids) - new[k] :]
            ids, mask, lps, adv = ids + env, mask + [0] * len(env), lps + [0.0] * len(env), adv + [0.0] * len(env)
        n = len(turn.action_ids)
        ids += turn.action_ids
        mask += [int(turn.advantage is not None)] * n
        lps += list(turn.action_logprobs)
        adv += [0.0 if turn.advantage is None else float(turn.advantage)] * n
    first = episode.turns[0]
    return Sample(list(first.prompt_ids), ids, mask, lps, adv)


@dataclass
class TurnrlRollout:
    """TRL's ``rollout_func``: turnrl's collector and credit for each group of ``num_generations`` rows.

    ``estimator`` and ``params``: a registered credit estimator and its own parameters (``credit.*``
    keys; a ``scale`` not given is TRL's ``scale_rewards``). ``branching``: a tree shape whose product is
    ``num_generations`` (None: flat groups). ``max_tokens`` per turn (None: TRL's
    ``max_completion_length``). ``sampler``: any turnrl sampler (None: transformers generation on the
    trainer's model, the current policy). ``records``: a record file each generation's episodes are
    appended to (with their advantages; ``turnrl credit-audit --records`` audits them).
    """

    estimator: str = "group_mean"
    params: dict[str, Any] = field(default_factory=dict)
    branching: list[int] | None = None
    max_turns: int | None = None
    max_context_tokens: int | None = None
    max_tokens: int | None = None
    env_options: dict[str, Any] = field(default_factory=dict)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    sampler: Any = None
    records: str | Path | None = None
    last_episodes: list[Episode] = field(default_factory=list, repr=False)
    """The episodes of the last call, in TRL's sample order, with their advantages."""
    last_samples: list[Sample] = field(default_factory=list, repr=False)
    _calls: int = field(default=0, repr=False)
    _credit: dict[str, CreditSettings] = field(default_factory=dict, repr=False)

    def credit(self, scale_rewards: str | bool, *, fresh: bool = False) -> CreditSettings:
        """The training run's credit settings, made once (per TRL ``scale_rewards``) and kept across generations,
        so a stateful estimator (the ``critic``) learns across steps as in turnrl's own loop; ``fresh``: new
        settings whose state learns nothing the run keeps (evaluation rollouts)."""
        key = str(scale_rewards)
        if fresh or key not in self._credit:
            params = dict(self.params)
            spec = get_estimator(self.estimator)
            if "scale" in spec.params.model_fields and "scale" not in params:
                params["scale"] = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)  # type: ignore[arg-type]
            settings = settings_from_mapping({"estimator": self.estimator, **params})
            if fresh:
                return settings
            self._credit[key] = settings
        return self._credit[key]

    def _groups(self, rows: list[dict[str, Any]], size: int) -> list[Task]:
        if len(rows) % size:
            raise ValueError(
                f"TurnrlGRPOTrainer: {len(rows)} rows on this process are not whole groups of num_generations"
                f" = {size}; make per_device_train_batch_size x steps_per_generation a multiple of it"
            )
        tasks = []
        for g in range(0, len(rows), size):
            ids = {r.get("task_id") for r in rows[g : g + size]}
            if len(ids) != 1 or "task" not in rows[g]:
                raise ValueError(
                    "TurnrlGRPOTrainer: a group of num_generations rows must be one task with a 'task' column"
                    f" (rows from turnrl.integrations.trl.task_dataset); got task ids {sorted(map(str, ids))}"
                )
            tasks.append(Task(**json.loads(rows[g]["task"])))
        return tasks

    def _sampler(self, trainer):
        if self.sampler is not None:
            return self.sampler
        from turnrl.sampling.hf import HFSampler

        return HFSampler(trainer.accelerator.unwrap_model(trainer.model), trainer.processing_class)

    def __call__(self, prompts: list[Any], trainer) -> dict[str, Any]:
        training = trainer.model.training
        size = trainer.num_generations if training else trainer.num_generations_eval
        tasks = self._groups(trainer._turnrl_rows, size)
        shape = list(self.branching) if self.branching and training else [size]
        if training and self.branching and int(torch.tensor(shape).prod()) != size:
            raise ValueError(f"TurnrlRollout.branching {shape} has {int(torch.tensor(shape).prod())} leaves;"
                             f" num_generations is {size}")  # fmt: skip
        args = trainer.args
        sampler = self._sampler(trainer)
        sampler.policy_version = int(trainer.state.global_step)
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            max_tokens=self.max_tokens or args.max_completion_length,
            seed=int(args.seed) * 7919 + self._calls,
        )
        self._calls += 1
        settings = RolloutSettings(
            shape=tuple(shape),
            env_options=MappingProxyType(dict(self.env_options)),
            max_turns=self.max_turns,
            max_context_tokens=self.max_context_tokens,
        )
        chat = ChatSettings(MappingProxyType(dict(self.chat_template_kwargs))).template(trainer.processing_class)
        prefix = f"{'train' if training else 'eval'}{trainer.state.global_step}-c{self._calls}-"
        episodes = collect(tasks, sampler, chat, params, shape, settings, id_prefix=prefix)
        by_group: dict[str, list[Episode]] = {}
        for ep in episodes:
            by_group.setdefault(ep.group_id, []).append(ep)
        episodes = [ep for group in by_group.values() for ep in group]  # group after group, as TRL's rows
        assign_credit(episodes, self.credit(trainer.scale_rewards, fresh=not training))
        samples = [as_sample(ep) for ep in episodes]
        self.last_episodes, self.last_samples = episodes, samples
        if self.records is not None and trainer.accelerator.is_main_process:
            append_records(self.records, episodes, source="trl")
        return {
            "prompt_ids": [s.prompt_ids for s in samples],
            "completion_ids": [s.completion_ids for s in samples],
            "logprobs": [s.logprobs for s in samples],
            "env_mask": [s.env_mask for s in samples],
            "turnrl_reward": [float(ep.reward) for ep in episodes],
        }

    def advantages(self, width: int, device: torch.device) -> torch.Tensor:
        """The last call's per-token advantages, ``[B, width]`` (right-padded with 0, as TRL pads completions)."""
        out = torch.zeros(len(self.last_samples), width, device=device)
        for i, s in enumerate(self.last_samples):
            out[i, : len(s.advantages)] = torch.tensor(s.advantages, device=device)
        return out


def _require_trl() -> None:
    if GRPOTrainer is None:
        raise ImportError("turnrl.integrations.trl needs TRL: pip install 'turnrl[trl]' (trl>=1.16)")


if GRPOTrainer is not None:

    class TurnrlGRPOTrainer(GRPOTrainer):
        """``GRPOTrainer`` with turnrl's rollouts and credit (:class:`TurnrlRollout`); one override.

        Every other argument is TRL's. ``reward_funcs`` defaults to :func:`episode_reward` (and may only
        be that: credit is assigned on the environment's rewards); ``rollout_func`` is the rollout.
        """

        def __init__(self, model, reward_funcs=None, *, turnrl: TurnrlRollout | None = None, **kwargs) -> None:
            if kwargs.get("rollout_func") is not None or kwargs.get("environment_factory") is not None:
                raise ValueError("TurnrlGRPOTrainer brings its own rollout_func (TurnrlRollout); do not pass one")
            funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs] if reward_funcs else []
            if any(f is not episode_reward for f in funcs):
                raise ValueError(
                    "TurnrlGRPOTrainer assigns credit on the environment's rewards: reward_funcs may only be"
                    " episode_reward; put other reward terms in the environment (a rubric)"
                )
            self.turnrl = turnrl or TurnrlRollout()
            self._turnrl_rows: list[dict[str, Any]] = []
            super().__init__(model, [episode_reward], rollout_func=self.turnrl, **kwargs)

        def _generate_and_score_completions(self, inputs):
            self._turnrl_rows = inputs  # the rows behind the prompts TRL hands the rollout
            output = super()._generate_and_score_completions(inputs)
            width = output["completion_ids"].shape[1]
            output["advantages"] = self.turnrl.advantages(width, output["completion_ids"].device)
            return output

else:  # pragma: no cover

    class TurnrlGRPOTrainer:  # type: ignore[no-redef]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            _require_trl()
