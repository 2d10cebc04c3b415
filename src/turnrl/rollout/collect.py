"""Multi-turn collection: flat groups and branched trees, token-in/token-out.

All live episodes advance together, one turn at a time: their contexts go to
the sampler in one call, each reply goes to its environment, and the
environment's messages are appended to the context as the chat template's
token difference (rendered with and without them), never by re-tokenizing
model text. Model tokens are exactly the sampled ids.

A rollout shape is a list of branch factors, one per turn: ``[G]`` is a flat
group of G episodes per task; ``[G1, G2]`` gives G1 first-turn variants, each
continued G2 times from a deep copy of its environment (byte-identical
replies). A variant whose episode ended before a branch point is replicated,
so every tree stays balanced (G1 × G2 leaves).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from turnrl.envs import Env, Message, StopReason, Task, make_env
from turnrl.rollout.records import Episode, Turn
from turnrl.sampling.base import Sampler, SamplingParams

ThinkStripper = Callable[[str], str]


def render_ids(tokenizer, messages: list[Message], add_generation_prompt: bool, **template_kwargs: Any) -> list[int]:
    """Token ids of the chat template applied to ``messages``."""
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    return tokenizer(text, add_special_tokens=False).input_ids


@dataclass
class ChatTokens:
    """How to turn chat messages into tokens for one tokenizer."""

    tokenizer: Any
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    exclude_think: ThinkStripper | None = None
    """When set, earlier assistant messages are re-rendered through this function (e.g. strip
    ``<think>`` blocks), so later contexts are re-rendered rather than extended."""

    def __post_init__(self) -> None:
        from turnrl.sampling.hf import end_of_turn_ids

        self.eot_ids = end_of_turn_ids(self.tokenizer)

    def initial(self, messages: list[Message]) -> list[int]:
        return render_ids(self.tokenizer, messages, True, **self.template_kwargs)

    def extend(self, context: list[int], action_ids: list[int], history: list[Message], reply: list[Message]) -> list[int]:
        """The next turn's context: ``context + action + environment tokens``.

        ``history`` ends with the assistant message just sampled; ``reply`` are the
        environment's messages. The environment tokens are the template's rendering
        of ``history + reply`` (with a generation prompt) minus its rendering of
        ``history``, preceded by whatever the template puts after the end-of-turn token
        (e.g. a newline), and by the end-of-turn token itself when the action was cut
        by the token limit.
        """
        if self.exclude_think is not None:
            stripped = [
                {**m, "content": self.exclude_think(m["content"])} if m["role"] == "assistant" else m
                for m in history + reply
            ]
            return render_ids(self.tokenizer, stripped, True, **self.template_kwargs)
        before = render_ids(self.tokenizer, history, False, **self.template_kwargs)
        after = render_ids(self.tokenizer, history + reply, True, **self.template_kwargs)
        if after[: len(before)] != before:
            raise ValueError(
                "the chat template does not render the conversation as a prefix of its continuation;"
                " token-in/token-out collection needs a prefix-stable template"
            )
        last_eot = max((k for k, t in enumerate(before) if t in self.eot_ids), default=None)
        if last_eot is None:
            raise ValueError("the chat template rendered an assistant message without an end-of-turn token")
        bridge = before[last_eot + 1 :]
        if not action_ids or action_ids[-1] not in self.eot_ids:  # cut by max_tokens: close the turn
            bridge = [before[last_eot]] + bridge
        return context + action_ids + bridge + after[len(before) :]


@dataclass
class _Live:
    """An episode being collected."""

    env: Env
    task: Task
    group_id: str
    branch: list[int]
    messages: list[Message]
    context: list[int]
    turns: list[Turn] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    done: bool = False
    terminated: bool = False
    truncated: bool = False
    stop_reason: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    potential: float | None = None
    prompt: str = ""

    def fork(self, j: int) -> _Live:
        child = copy.deepcopy(self)
        child.branch = self.branch + [j]
        return child


def collect(
    tasks: list[Task],
    sampler: Sampler,
    chat: ChatTokens,
    params: SamplingParams,
    shape: list[int],
    *,
    env_options: dict[str, Any] | None = None,
    max_turns: int | None = None,
    shaping_gamma: float | None = None,
    id_prefix: str = "",
) -> list[Episode]:
    """Run episodes for ``tasks`` with rollout ``shape`` (``[G]`` flat, ``[G1, G2, ...]`` tree).

    ``shaping_gamma`` turns on potential-based shaping for environments with a
    ``potential()`` method: turn rewards become r + γΦ(s') − Φ(s), Φ(terminal) = 0.
    """
    env_options = env_options or {}
    live: list[_Live] = []
    for t, task in enumerate(tasks):
        env = make_env(task, **env_options)
        messages = env.initial_messages()
        task_text = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        root = _Live(env, task, f"{id_prefix}g{t}", [], messages, chat.initial(messages), prompt=task_text)
        if shaping_gamma is not None and hasattr(env, "potential"):
            root.potential = float(env.potential())
        live += [root.fork(i) for i in range(shape[0])]

    turn = 0
    while True:
        active = [e for e in live if not e.done]
        if not active:
            break
        samples = sampler.sample(
            [e.context for e in active],
            SamplingParams(**{**params.__dict__, "seed": params.seed * 1009 + turn}),
            [e.messages for e in active],
        )
        for episode, sample in zip(active, samples, strict=True):
            _advance(episode, sample, chat, sampler.policy_version, max_turns, shaping_gamma)
        turn += 1
        if turn < len(shape):  # branch point: every node (ended or not) gets shape[turn] children
            live = [e.fork(j) for e in live for j in range(shape[turn])]
    return [_finish(e, k) for k, e in enumerate(live)]


def _advance(
    episode: _Live, sample, chat: ChatTokens, policy_version: int, max_turns: int | None, shaping_gamma: float | None
) -> None:
    text = sample.text if sample.text is not None else chat.tokenizer.decode(sample.ids, skip_special_tokens=True)
    result = episode.env.step(text)
    reward = result.reward
    if episode.potential is not None:
        # Φ(terminal) = 0; a truncated episode's last state is not terminal and keeps its Φ
        after = 0.0 if result.terminated else float(episode.env.potential())
        reward = reward + shaping_gamma * after - episode.potential
        episode.potential = after
    observation = episode.env.observation_text(result.messages) if result.messages else None
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
        )
    )
    episode.rewards.append(reward)
    for key, value in result.metrics.items():
        episode.metrics[key] = float(value)
    history = episode.messages + [{"role": "assistant", "content": text}]
    if result.done:
        episode.done, episode.terminated, episode.truncated = True, result.terminated, result.truncated
        episode.stop_reason = str(result.stop_reason) if result.stop_reason else None
        episode.messages = history
        return
    if max_turns is not None and len(episode.turns) >= max_turns:
        episode.done, episode.truncated = True, True
        episode.stop_reason = StopReason.COLLECTOR_LIMIT
        episode.messages = history
        return
    episode.context = chat.extend(episode.context, sample.ids, history, result.messages)
    episode.messages = history + result.messages


def _finish(e: _Live, k: int) -> Episode:
    return Episode(
        episode_id=f"{e.group_id}-e{k}-" + ".".join(map(str, e.branch)),
        task_id=e.task.task_id,
        turns=e.turns,
        reward=float(sum(e.rewards)),
        terminated=e.terminated,
        truncated=e.truncated,
        stop_reason=str(e.stop_reason) if e.stop_reason else None,
        metrics={**e.metrics, "num_turns": float(len(e.turns))},
        group_id=e.group_id,
        branch=e.branch if len(e.branch) > 1 else [],
        prompt=e.prompt,
    )
