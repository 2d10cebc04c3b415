"""Multi-turn collection: flat groups and branched trees, token-in/token-out.

All live episodes advance together, one turn at a time: their contexts go to
the sampler in one call, then every environment steps at once (``async``
environments awaited together with ``asyncio.gather``, plain ones in a thread
pool), and each environment's messages are appended to the context as the chat
template's token difference (rendered with and without them), never by
re-tokenizing model text. Model tokens are exactly the sampled ids.

A rollout shape is a list of branch factors, one per turn: ``[G]`` is a flat
group of G episodes per task; ``[G1, G2]`` gives G1 first-turn variants, each
continued G2 times from a deep copy of its environment (byte-identical
replies). A variant whose episode ended before a branch point is replicated,
so every tree stays balanced (G1 × G2 leaves).

No reply can stop a run: the environment's step on a reply is the one guarded
call (:func:`guarded_step`). An exception it raises ends that episode with the
environment's ``failure_reward``, stop reason ``MALFORMED``, episode metric
``env_error`` and the exception as the turn's observation (logged once per
environment class and exception type). Errors anywhere else still raise.

Seeds: by default a call's draws come from one seed per turn (and the sampler's batch chunk).
With ``task_seeds`` each draw is seeded from (seed, task index, branch, turn) (:func:`row_seed`),
so a task's episodes are the same whichever other tasks share the call; ``first_task`` numbers a
share of a step's tasks as in the whole step (several processes each collect a share).

Every turn records the state key the environment gave before it acted
(``Turn.state_key``) and the provenance of its context tokens
(``Turn.prompt_sources``). Every finished episode is checked against the record
contract (:meth:`Episode.validate`); a violation stops collection with the
episode id (:class:`RolloutContractError`).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import inspect
import json
import math
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Protocol

from turnrl.chat import ChatTemplate
from turnrl.credit.shaping import shaped_rewards
from turnrl.envs import Env, make_env
from turnrl.rollout.guard import guarded_step
from turnrl.sampling.base import Sampler
from turnrl.types import (
    Episode,
    Message,
    Sample,
    SamplingParams,
    StepResult,
    StopReason,
    Task,
    Turn,
)

DEFAULT_ENV_WORKERS = 8


class RolloutSection(Protocol):
    """The keys of the ``rollout`` config section that :class:`RolloutSettings` reads."""

    tasks_per_step: int
    group_size: int
    branching: list[int] | None
    max_turns: int | None
    dynamic_sampling: bool
    refill: bool
    max_context_tokens: int | None
    env_workers: int
    shaping: bool
    shaping_gamma: float
    truncated_completion_reward: float | None
    task_seeds: bool | None


class EnvSection(Protocol):
    options: dict[str, Any]


class RolloutSource(Protocol):
    """What :meth:`RolloutSettings.from_config` reads of a run config: its ``rollout`` and ``env``
    sections (this package may not import the config; this Protocol says what it must have)."""

    rollout: RolloutSection
    env: EnvSection


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
        )

    def for_evaluation(self) -> RolloutSettings:
        """The same limits and environment options without the training-only reward changes."""
        return replace(self, shaping_gamma=None, truncated_reward=None)


class RolloutContractError(RuntimeError):
    """A collected episode violates the record contract (:meth:`Episode.validate`)."""


@dataclass
class _Live:
    """An episode being collected."""

    env: Env
    task: Task
    group_id: str
    branch: list[int]
    messages: list[Message]
    context: list[int]
    sources: list[list[Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    turns: list[Turn] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    done: bool = False
    terminated: bool = False
    truncated: bool = False
    stop_reason: StopReason | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    potentials: list[float] | None = None
    """Φ(s_0), Φ(s_1), ... of the states the turns acted from (shaping only)."""
    prompt: str = ""
    index: int = 0
    """The task's index in the step (``first_task`` + its place in this call)."""

    def fork(self, j: int) -> _Live:
        child = copy.deepcopy(self)
        child.branch = self.branch + [j]
        return child


def run_concurrently(calls: list[Callable[[], Any]], pool: ThreadPoolExecutor | None) -> list[Any]:
    """Call every function at once; results in input order.

    A coroutine function's coroutine (or any awaitable a call returns) is awaited with the
    others in one ``asyncio.gather``; a plain call runs in ``pool`` (inline without one, or when
    there is a single call). The first exception is raised after every call has finished.
    """
    results: list[Any] = [None] * len(calls)
    awaitables: dict[int, Any] = {}
    futures = {}
    for i, fn in enumerate(calls):
        if inspect.iscoroutinefunction(fn) or pool is None or len(calls) == 1:
            results[i] = fn()
        else:
            futures[i] = pool.submit(fn)
    errors = []
    for i, fut in futures.items():
        try:
            results[i] = fut.result()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the others finished
            errors.append(exc)
    for i, r in enumerate(results):
        if inspect.isawaitable(r):
            awaitables[i] = r
    if awaitables:
        for i, r in zip(awaitables, _gather(list(awaitables.values())), strict=True):
            if isinstance(r, BaseException):
                errors.append(r)
            results[i] = r
    if errors:
        raise errors[0]
    return results


def _gather(awaitables: list[Any]) -> list[Any]:
    async def main() -> list[Any]:
        return await asyncio.gather(*awaitables, return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(main())
    out: list[Any] = []  # called from inside an event loop (a notebook): run ours in a thread
    worker = threading.Thread(target=lambda: out.extend(asyncio.run(main())))
    worker.start()
    worker.join()
    return out


def _key_json(env: Env) -> str | None:
    key = env.state_key()
    if key is None:
        return None
    try:
        return json.dumps(key, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"environment {type(env).__name__}: state_key() must be JSON-serialisable (got {key!r}: {exc})"
        ) from None


def collect(
    tasks: list[Task],
    sampler: Sampler,
    chat: ChatTemplate,
    params: SamplingParams,
    shape: list[int] | tuple[int, ...],
    settings: RolloutSettings = RolloutSettings(),
    *,
    id_prefix: str = "",
    first_task: int = 0,
) -> list[Episode]:
    """Run episodes for ``tasks`` with rollout ``shape`` (``[G]`` flat, ``[G1, G2, ...]`` tree).

    ``settings.shaping_gamma`` turns on potential-based shaping for environments whose
    ``potential()`` is defined: turn rewards become r + γΦ(s') − Φ(s), Φ(terminal) = 0
    (:func:`turnrl.credit.shaping.shaped_rewards`, applied when the episode ends).

    ``max_context_tokens`` bounds an episode's sequence (context + action): a sampled
    action that would cross it is cut at the limit (``finish_reason`` ``length``, not sent
    to the environment, reward 0) and a reply that fills it ends the episode; either way
    the episode is truncated with stop reason ``context_limit``. ``truncated_reward``
    replaces the reward of every episode with a length-cut turn (on its last turn).
    ``env_workers`` threads step plain (non-async) environments. (Each of these is a field of ``settings``.)

    ``first_task``: the index of ``tasks[0]`` among the step's tasks, when this call collects a share of
    them (one process's): group ``g{i}`` and episode ``e{k}`` are then numbered as in one call for every
    task, and with ``settings.task_seeds`` the draws are those of that call.
    """
    env_options, max_turns, max_context_tokens = (
        dict(settings.env_options),
        settings.max_turns,
        settings.max_context_tokens,
    )
    shaping_gamma, truncated_reward, env_workers = (
        settings.shaping_gamma,
        settings.truncated_reward,
        settings.env_workers,
    )
    with ThreadPoolExecutor(max_workers=max(1, env_workers), thread_name_prefix="env") as pool:
        envs = [make_env(task, **env_options) for task in tasks]
        openings = run_concurrently([env.initial_messages for env in envs], pool)
        live: list[_Live] = []
        for t, (task, env, messages) in enumerate(zip(tasks, envs, openings, strict=True)):
            tools = env.tools()
            context, sources = chat.initial_with_sources(messages, tools)
            if max_context_tokens is not None and len(context) >= max_context_tokens:
                raise ValueError(
                    f"task {task.task_id!r}: the opening context is {len(context)} tokens, at or over"
                    f" rollout.max_context_tokens = {max_context_tokens}; raise rollout.max_context_tokens"
                )
            task_text = next((str(m["content"]) for m in reversed(messages) if m["role"] == "user"), "")
            i = first_task + t
            root = _Live(
                env, task, f"{id_prefix}g{i}", [], messages, context, sources, tools, prompt=task_text, index=i
            )
            if shaping_gamma is not None:
                phi = env.potential()
                root.potentials = None if phi is None else [float(phi)]
            live += [root.fork(i) for i in range(shape[0])]

        turn = 0
        while True:
            active = [e for e in live if not e.done]
            if not active:
                break
            keys = [_key_json(e.env) for e in active]
            call = replace(params, seed=params.seed * 1009 + turn)
            if settings.task_seeds:
                call = replace(call, row_seeds=tuple(row_seed(params.seed, e.index, e.branch, turn) for e in active))
            samples = sampler.sample([e.context for e in active], call, [e.messages for e in active])
            fitted = [_fit(e, s, max_context_tokens) for e, s in zip(active, samples, strict=True)]
            samples = [s for s, _ in fitted]
            texts = [s.text if s.text is not None else chat.decode(s.ids) for s in samples]
            stepping = [k for k, (_, cut) in enumerate(fitted) if not cut]
            results: list[StepResult | None] = [None] * len(active)
            stepped = run_concurrently([guarded_step(active[k].env, texts[k]) for k in stepping], pool)
            for k, result in zip(stepping, stepped, strict=True):
                results[k] = result
            for e, sample, text, key, result in zip(active, samples, texts, keys, results, strict=True):
                _advance(e, sample, text, key, result, chat, sampler.policy_version, max_turns, max_context_tokens)
            turn += 1
            if turn < len(shape):  # branch point: every node (ended or not) gets shape[turn] children
                live = [e.fork(j) for e in live for j in range(shape[turn])]
        for factor in shape[turn + 1 :]:  # every episode ended before these branch points: trees stay whole
            live = [e.fork(j) for e in live for j in range(factor)]
    leaves = math.prod(shape)
    episodes = [_finish(e, first_task * leaves + k, shaping_gamma, truncated_reward) for k, e in enumerate(live)]
    _group_rewards(episodes, live)
    for ep in episodes:
        errors = ep.validate()
        if errors:
            raise RolloutContractError(f"episode {ep.episode_id}: {'; '.join(errors)}")
    return episodes


def row_seed(seed: int, task: int, branch: list[int], turn: int) -> int:
    """The seed of one draw: the episode node (task index, branch path) at ``turn`` of a call seeded ``seed``."""
    key = f"{seed}:{task}:{'.'.join(map(str, branch))}:{turn}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % 2**31


def _fit(e: _Live, sample: Sample, limit: int | None) -> tuple[Sample, bool]:
    """The sample, cut at the context limit, and whether it was cut (then the environment does not see it)."""
    if limit is None or len(e.context) + len(sample.ids) <= limit:
        return sample, False
    keep = limit - len(e.context)  # >= 1: a context at the limit ended the episode before
    cut = replace(
        sample,
        ids=sample.ids[:keep],
        logprobs=sample.logprobs[:keep],
        finish_reason="length",
        topk_ids=sample.topk_ids[:keep] if sample.topk_ids is not None else None,
        topk_logprobs=sample.topk_logprobs[:keep] if sample.topk_logprobs is not None else None,
        text=None,
    )
    return cut, True


def _advance(
    episode: _Live,
    sample: Sample,
    text: str,
    key: str | None,
    result: StepResult | None,
    chat: ChatTemplate,
    policy_version: int,
    max_turns: int | None,
    max_context_tokens: int | None,
) -> None:
    reward = result.reward if result is not None else 0.0
    if episode.potentials is not None and result is not None and not result.terminated:
        episode.potentials.append(float(episode.env.potential()))  # Φ(terminal) = 0 is not recorded
    observation = episode.env.observation_text(result.messages) if result is not None and result.messages else None
    if result is not None and result.error is not None:
        observation = f"[the environment raised on this reply: {result.error}]"
    episode.turns.append(
        Turn(
            index=len(episode.turns),
            prompt_ids=list(episode.context),
            action_ids=list(sample.ids),
            action_logprobs=list(sample.logprobs),
            action_text=text,
            observation=observation,
            reward=reward,
            policy_version=policy_version,
            finish_reason=sample.finish_reason,
            topk_ids=sample.topk_ids,
            topk_logprobs=sample.topk_logprobs,
            state_key=key,
            prompt_sources=episode.sources,
        )
    )
    episode.rewards.append(reward)
    assistant = (result.assistant_message if result is not None else None) or {"role": "assistant", "content": text}
    history = episode.messages + [assistant]
    if result is None:  # the action was cut at the context limit
        _end(episode, history, truncated=True, reason=StopReason.CONTEXT_LIMIT)
        return
    for k, value in result.metrics.items():
        episode.metrics[k] = float(value)
    if result.done:
        _end(episode, history, truncated=result.truncated, reason=result.stop_reason, terminated=result.terminated)
        return
    if max_turns is not None and len(episode.turns) >= max_turns:
        _end(episode, history, truncated=True, reason=StopReason.COLLECTOR_LIMIT)
        return
    episode.context, episode.sources = chat.extend_with_sources(
        episode.context, episode.sources, sample.ids, history, result.messages, episode.tools
    )
    episode.messages = history + result.messages
    if max_context_tokens is not None and len(episode.context) >= max_context_tokens:
        _end(episode, episode.messages, truncated=True, reason=StopReason.CONTEXT_LIMIT)


def _end(episode: _Live, messages: list[Message], *, truncated: bool, reason: Any, terminated: bool = False) -> None:
    episode.done, episode.terminated, episode.truncated = True, terminated, truncated
    episode.stop_reason = _stop_reason(episode.env, reason)
    episode.messages = messages


def _stop_reason(env: Env, reason: Any) -> StopReason | None:
    """The environment's stop reason as a :class:`StopReason` (the one type, collected or reloaded)."""
    if not reason:
        return None
    try:
        return StopReason(reason)
    except ValueError:
        raise ValueError(
            f"environment {type(env).__name__}: stop_reason {reason!r} is not a StopReason;"
            f" use one of {', '.join(r.value for r in StopReason)}"
        ) from None


def _finish(e: _Live, k: int, shaping_gamma: float | None, truncated_reward: float | None) -> Episode:
    if truncated_reward is not None and any(t.finish_reason == "length" for t in e.turns):
        e.rewards = [0.0] * (len(e.rewards) - 1) + [float(truncated_reward)]
        for turn, r in zip(e.turns, e.rewards, strict=True):
            turn.reward = r
        e.metrics["truncated_reward"] = 1.0
    if e.potentials is not None:  # r'_k = r_k + γΦ(s_{k+1}) − Φ(s_k); a truncated end keeps Φ(s_K)
        shaped = shaped_rewards(e.rewards, e.potentials, shaping_gamma)
        e.rewards = [float(r) for r in shaped]
        for turn, r in zip(e.turns, e.rewards, strict=True):
            turn.reward = r
    return Episode(
        episode_id=f"{e.group_id}-e{k}-" + ".".join(map(str, e.branch)),
        task_id=e.task.task_id,
        turns=e.turns,
        reward=float(sum(e.rewards)),
        terminated=e.terminated,
        truncated=e.truncated,
        stop_reason=e.stop_reason,
        metrics={**e.metrics, "num_turns": float(len(e.turns))},
        group_id=e.group_id,
        branch=e.branch if len(e.branch) > 1 else [],
        prompt=e.prompt,
    )


def _group_rewards(episodes: list[Episode], live: list[_Live]) -> None:
    """Apply each environment class's group-level reward hook (``Env.group_rewards``) per group."""
    groups: dict[str, list[int]] = {}
    for i, ep in enumerate(episodes):
        groups.setdefault(ep.group_id, []).append(i)
    for gid, idx in groups.items():
        extra = type(live[idx[0]].env).group_rewards([episodes[i] for i in idx])
        if extra is None:
            continue
        if len(extra) != len(idx):
            raise ValueError(
                f"{type(live[idx[0]].env).__name__}.group_rewards returned {len(extra)} rewards"
                f" for the {len(idx)} episodes of group {gid!r}"
            )
        for i, bonus in zip(idx, extra, strict=True):
            ep = episodes[i]
            ep.turns[-1].reward = (ep.turns[-1].reward or 0.0) + float(bonus)
            ep.reward += float(bonus)
            ep.metrics["reward/group"] = float(bonus)


def mask_truncated_turns(episodes: list[Episode]) -> dict[str, float]:
    """``train.mask_truncated_completions``: a length-cut turn is not trained (advantage None).

    Call after credit. Returns ``completions/masked_truncated``: the fraction of turns masked.
    """
    turns = [t for ep in episodes for t in ep.turns]
    masked = 0
    for t in turns:
        if t.finish_reason == "length" and t.advantage is not None:
            t.advantage = None
            masked += 1
    return {"completions/masked_truncated": masked / len(turns) if turns else 0.0}
