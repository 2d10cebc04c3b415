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

import copy
import hashlib
import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from turnrl.chat import ChatTemplate
from turnrl.credit.shaping import shaped_rewards
from turnrl.envs import Env, make_env
from turnrl.rollout.concurrent import run_concurrently
from turnrl.rollout.context import windowed
from turnrl.rollout.guard import guarded_group_rewards, guarded_step
from turnrl.rollout.settings import RolloutSettings
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

DEFAULT_ROLLOUT = RolloutSettings()


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
    opening: int = 0
    """How many messages the environment opened with (the task, which a context window always keeps)."""
    shown: list[Message] | None = None
    """The messages the current context renders when a window left turns out (None: all of ``messages``)."""

    def fork(self, j: int) -> _Live:
        child = copy.deepcopy(self)
        child.branch = self.branch + [j]
        return child


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
    settings: RolloutSettings = DEFAULT_ROLLOUT,
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
    ``env_workers`` threads step plain (non-async) environments. Each of these is a field of ``settings``, the
    run's :class:`RolloutSettings`, which the helpers below read as well (no limit is passed on its own).

    ``first_task``: the index of ``tasks[0]`` among the step's tasks, when this call collects a share of
    them (one process's): group ``g{i}`` and episode ``e{k}`` are then numbered as in one call for every
    task, and with ``settings.task_seeds`` the draws are those of that call.
    """
    with ThreadPoolExecutor(max_workers=max(1, settings.env_workers), thread_name_prefix="env") as pool:
        envs = [make_env(task, **settings.env_options) for task in tasks]
        openings = run_concurrently([env.initial_messages for env in envs], pool)
        live: list[_Live] = []
        for t, (task, env, messages) in enumerate(zip(tasks, envs, openings, strict=True)):
            root = _open(task, env, messages, chat, settings, f"{id_prefix}g{first_task + t}", first_task + t)
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
            samples = sampler.sample([e.context for e in active], call, [_shown(e) for e in active])
            fitted = [_fit(e, s, settings.max_context_tokens) for e, s in zip(active, samples, strict=True)]
            samples = [s for s, _ in fitted]
            texts = [s.text if s.text is not None else chat.decode(s.ids) for s in samples]
            stepping = [k for k, (_, cut) in enumerate(fitted) if not cut]
            results: list[StepResult | None] = [None] * len(active)
            stepped = run_concurrently([guarded_step(active[k].env, texts[k]) for k in stepping], pool)
            for k, result in zip(stepping, stepped, strict=True):
                results[k] = result
            for e, sample, text, key, result in zip(active, samples, texts, keys, results, strict=True):
                _advance(e, sample, text, key, result, chat, sampler.policy_version, settings)
            turn += 1
            if turn < len(shape):  # branch point: every node (ended or not) gets shape[turn] children
                live = [e.fork(j) for e in live for j in range(shape[turn])]
        for factor in shape[turn + 1 :]:  # every episode ended before these branch points: trees stay whole
            live = [e.fork(j) for e in live for j in range(factor)]
    leaves = math.prod(shape)
    episodes = [_finish(e, first_task * leaves + k, settings) for k, e in enumerate(live)]
    _group_rewards(episodes, live)
    for ep in episodes:
        errors = ep.validate()
        if errors:
            raise RolloutContractError(f"episode {ep.episode_id}: {'; '.join(errors)}")
    return episodes


def _open(
    task: Task, env: Env, messages: list[Message], chat: ChatTemplate, settings: RolloutSettings, group: str, index: int
) -> _Live:
    """The root of a task's episodes: its opening context (within ``max_context_tokens``) and, with shaping,
    Φ(s_0)."""
    tools = env.tools()
    context, sources = chat.initial_with_sources(messages, tools)
    limit = settings.max_context_tokens
    if limit is not None and len(context) >= limit:
        raise ValueError(
            f"task {task.task_id!r}: the opening context is {len(context)} tokens, at or over"
            f" rollout.max_context_tokens = {limit}; raise rollout.max_context_tokens"
        )
    task_text = next((str(m["content"]) for m in reversed(messages) if m["role"] == "user"), "")
    root = _Live(env, task, group, [], messages, context, sources, tools, prompt=task_text, index=index)
    root.opening = len(messages)
    if settings.shaping_gamma is not None:
        phi = env.potential()
        root.potentials = None if phi is None else [float(phi)]
    return root


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
    settings: RolloutSettings,
) -> None:
    reward = result.reward if result is not None else 0.0
    if episode.potentials is not None and result is not None and not result.terminated:
        episode.potentials.append(_potential(episode.env))  # Φ(terminal) = 0 is not recorded
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
    if settings.max_turns is not None and len(episode.turns) >= settings.max_turns:
        _end(episode, history, truncated=True, reason=StopReason.COLLECTOR_LIMIT)
        return
    messages = history + result.messages
    summary = episode.env.context_summary() if settings.context == "summary" else None
    episode.shown = windowed(messages, episode.opening, settings.context_turns, settings.context, summary)
    if episode.shown is None:  # the whole history: the previous context, extended
        episode.context, episode.sources = chat.extend_with_sources(
            episode.context, episode.sources, sample.ids, history, result.messages, episode.tools
        )
    else:  # turns left out: rendered whole from the messages it shows (rollout.context)
        episode.context, sources = chat.initial_with_sources(episode.shown, episode.tools)
        episode.sources = sources if episode.sources is not None else None
    episode.messages = messages
    if settings.max_context_tokens is not None and len(episode.context) >= settings.max_context_tokens:
        _end(episode, episode.messages, truncated=True, reason=StopReason.CONTEXT_LIMIT)


def _shown(episode: _Live) -> list[Message]:
    """The messages of the episode's current context (what a chat-message sampler backend is sent)."""
    return episode.shown if episode.shown is not None else episode.messages


def _potential(env: Env) -> float:
    """Φ(s) of a state after the first (whose Φ was a number): a number too."""
    phi = env.potential()
    if phi is None:
        raise ValueError(
            f"environment {type(env).__name__}: potential() returned None after its first state returned a number;"
            " return a number for every state (or None for every state: no shaping)"
        )
    return float(phi)


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


def _finish(e: _Live, k: int, settings: RolloutSettings) -> Episode:
    truncated_reward, shaping_gamma = settings.truncated_reward, settings.shaping_gamma
    if truncated_reward is not None and any(t.finish_reason == "length" for t in e.turns):
        e.rewards = [0.0] * (len(e.rewards) - 1) + [float(truncated_reward)]
        for turn, r in zip(e.turns, e.rewards, strict=True):
            turn.reward = r
        e.metrics["truncated_reward"] = 1.0
    if (
        e.potentials is not None and shaping_gamma is not None
    ):  # r'_k = r_k + γΦ(s_{k+1}) − Φ(s_k); a truncated end keeps Φ(s_K)
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
        extra = guarded_group_rewards(type(live[idx[0]].env), [episodes[i] for i in idx])
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
