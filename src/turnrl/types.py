"""The vocabulary every part of turnrl shares: messages, tasks, steps, turns, episodes, samples.

Token-in/token-out: a turn's ``action_ids`` are exactly the ids the sampler
drew, and ``prompt_ids`` are every token the model saw before them (system
prompt, earlier turns, environment replies), none of which is trained. When a
turn's context extends the previous turn's sequence (the usual case), the whole
episode is the last turn's ``prompt_ids + action_ids``.

Trees: an episode of a branched rollout carries ``branch``, its path in the
tree (``[i, j]`` = first-turn variant i, continuation j). Leaves with the same
``group_id`` and the same ``branch[:k]`` share their first k turns token for
token.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from functools import cache
from typing import Any

from pydantic import TypeAdapter, ValidationError

TokenIds = list[int]
Logprobs = list[float]

Message = dict[str, Any]
"""A chat message: ``{"role": "system"|"user"|"assistant"|"tool", "content": str}``.

Structured tool calling adds keys the chat template understands: an assistant
message may carry ``"tool_calls": [{"type": "function", "function": {"name": str,
"arguments": dict}}]`` (see :func:`tool_call_message`), and a tool result is
``{"role": "tool", "name": str, "content": str}``.
"""

SOURCES: tuple[str, ...] = ("system", "user", "assistant", "tool")
"""Token provenance: which kind of message a context token belongs to (index = its code)."""


def tool_call_message(content: str, calls: list[tuple[str, dict[str, Any]]]) -> Message:
    """An assistant message with structured ``tool_calls`` (name, arguments) besides its text."""
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls],
    }


class StopReason(StrEnum):
    """Why an episode ended."""

    SUCCESS = "success"
    """The task was solved."""
    FAILURE = "failure"
    """The episode ended without success (wrong final answer, spill, low score)."""
    MALFORMED = "malformed"
    """The reply could not be parsed; the environment's failure reward was given."""
    MAX_TURNS = "max_turns"
    """The task's own turn horizon ran out (truncation)."""
    COLLECTOR_LIMIT = "collector_limit"
    """The collector stopped the episode before the task ended (truncation)."""
    ERROR = "error"
    """Model-written code raised, timed out or was killed."""
    CONTEXT_LIMIT = "context_limit"
    """The episode's context reached ``rollout.max_context_tokens`` (truncation)."""


class SplitName(StrEnum):
    TRAIN = "train"
    EVAL = "eval"


@dataclass(frozen=True)
class Task:
    """One problem instance: which environment, with which parameters."""

    task_id: str
    env: str
    params: dict[str, Any] = field(default_factory=dict)
    split: str = SplitName.TRAIN
    origin: str = field(default="", compare=False, repr=False)
    """Where the task was read (``file:line`` of a task file; empty for generated tasks), for errors."""

    def to_dict(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "env": self.env, "params": self.params, "split": str(self.split)}


@dataclass
class StepResult:
    """The environment's answer to one assistant message."""

    messages: list[Message]
    """Messages to append before the next assistant turn; empty when the episode is over."""
    reward: float = 0.0
    """This turn's reward. An episode's reward is the sum over its turns."""
    terminated: bool = False
    """The task reached a natural end (solved, failed, malformed)."""
    truncated: bool = False
    """The episode was cut by a horizon, not ended by the task."""
    stop_reason: StopReason | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    assistant_message: Message | None = None
    """How the action enters the conversation (e.g. with structured ``tool_calls``); None = the
    reply text as a plain assistant message."""
    error: str | None = None
    """Set by the collector when ``step`` raised on the reply (the exception's type and message);
    the episode then ended with the environment's failure reward."""

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    max_tokens: int = 64
    """Maximum new tokens for this turn."""
    top_k_logprobs: int = 0
    """Also return the top-k log-probs per sampled position (0 = off)."""
    seed: int = 0
    row_seeds: tuple[int, ...] | None = None
    """One seed per context of the call (None: every draw of the call comes from ``seed``). When set,
    context i's draws come from ``row_seeds[i]`` alone, whatever else is in the call: the collector
    sets them when several processes share a step's tasks (``rollout.task_seeds``)."""

    def row_seed(self, i: int) -> int:
        """The seed of context i of the call: ``row_seeds[i]``, else ``seed * 100_003 + i``."""
        return self.row_seeds[i] if self.row_seeds is not None else self.seed * 100_003 + i


@dataclass
class Sample:
    """One completion of one context."""

    ids: list[int]
    """Sampled token ids, including the end-of-turn token when one was sampled."""
    logprobs: list[float]
    """Log-prob of each sampled id under the sampling distribution (after temperature)."""
    finish_reason: str
    """``stop`` (end-of-turn sampled) or ``length``."""
    topk_ids: list[list[int]] | None = None
    topk_logprobs: list[list[float]] | None = None
    text: str | None = None
    """Set by samplers that produce text directly (scripted policies); else decoded by the collector."""


@dataclass
class Turn:
    """One assistant turn and the environment's reply to it."""

    index: int
    prompt_ids: list[int]
    """Every token before this action, as the model saw it (not trained)."""
    action_ids: list[int]
    """The sampled token ids (trained)."""
    action_logprobs: list[float]
    """Behavior (sampler) log-prob of each action token, ≤ 0."""
    action_text: str
    observation: str | None = None
    """The environment's reply text after this turn, if any."""
    reward: float | None = None
    """Per-turn reward (or per-turn score) when the environment gives one."""
    policy_version: int | None = None
    """Sampler weight version that produced the action."""
    finish_reason: str = "stop"
    """``stop`` (end-of-turn token sampled) or ``length`` (max tokens reached)."""
    advantage: float | None = None
    """The advantage this turn was trained with (filled in after credit; None = not trained)."""
    topk_ids: list[list[int]] | None = None
    """Optional: the sampler's top-k token ids per action position."""
    topk_logprobs: list[list[float]] | None = None
    """Optional: the sampler's log-probs of ``topk_ids``."""
    state_key: str | None = None
    """The environment's key of the state this turn acted from (``Env.state_key()`` as canonical
    JSON), or None when the environment defines none. Equal keys within a group = same state (GiGPO)."""
    prompt_sources: list[list[Any]] | None = None
    """Provenance of ``prompt_ids``, run-length encoded: ``[[source, count], ...]`` with source in
    :data:`SOURCES` (the action tokens are ``assistant``); None when not recorded."""

    @property
    def sequence_ids(self) -> list[int]:
        return self.prompt_ids + self.action_ids


@dataclass
class Episode:
    """One rollout of one task."""

    episode_id: str
    task_id: str
    turns: list[Turn]
    reward: float
    terminated: bool
    truncated: bool
    stop_reason: StopReason | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    group_id: str = ""
    """All episodes sampled for one task in one step share a group id."""
    branch: list[int] = field(default_factory=list)
    """Path in a branched tree (empty for flat groups)."""
    prompt: str = ""
    """The task's opening user text (for similarity baselines and reports)."""

    @property
    def parent(self) -> str | None:
        """The tree node this leaf descends from (``"i"`` for first-turn variant i)."""
        return "/".join(map(str, self.branch[:-1])) if len(self.branch) > 1 else None

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def success(self) -> bool:
        return self.stop_reason == "success"

    def validate(self) -> list[str]:
        """Every violation of the record contract, as messages (empty = valid)."""
        errors: list[str] = []
        if not self.episode_id:
            errors.append("episode_id is empty")
        if self.terminated and self.truncated:
            errors.append("episode is both terminated and truncated")
        if not math.isfinite(self.reward):
            errors.append(f"reward {self.reward!r} is not finite")
        for k, turn in enumerate(self.turns):
            where = f"turn {k}"
            if turn.index != k:
                errors.append(f"{where}: index {turn.index} breaks contiguity (expected {k})")
            if len(turn.action_logprobs) != len(turn.action_ids):
                errors.append(f"{where}: {len(turn.action_ids)} action ids but {len(turn.action_logprobs)} log-probs")
            bad = [lp for lp in turn.action_logprobs if not math.isfinite(lp) or lp > 0]
            if bad:
                errors.append(f"{where}: {len(bad)} log-probs not finite or > 0 (first {bad[0]!r})")
            if not turn.action_ids:
                errors.append(f"{where}: no action tokens")
            if turn.policy_version is None:
                errors.append(f"{where}: policy_version missing")
            if turn.finish_reason not in ("stop", "length"):
                errors.append(f"{where}: finish_reason {turn.finish_reason!r} not in stop/length")
            if turn.topk_ids is not None and len(turn.topk_ids) != len(turn.action_ids):
                errors.append(f"{where}: top-k rows do not match action tokens")
            if turn.prompt_sources is not None:
                n = sum(c for _, c in turn.prompt_sources)
                if n != len(turn.prompt_ids) or any(src not in SOURCES for src, _ in turn.prompt_sources):
                    errors.append(
                        f"{where}: prompt_sources cover {n} tokens of {len(turn.prompt_ids)}"
                        f" or name a source outside {'/'.join(SOURCES)}"
                    )
        return errors

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, obj: Any) -> Episode:
        """An episode from :meth:`to_dict`'s shape, every field checked against its annotation first
        (pydantic; numbers lax, so ``1`` reads as ``1.0``, but ``"<img …>"`` is no turn index, and a
        prompt source is one of :data:`SOURCES`): what a run directory holds is typed before anything
        renders, plots or trains on it. ``ValueError`` naming the field (``turns.0.index: …``)."""
        try:
            episode = _episode_adapter().validate_python(obj)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            raise ValueError(f"{'.'.join(map(str, first['loc'])) or 'record'}: {first['msg']}") from None
        for k, turn in enumerate(episode.turns):
            runs = turn.prompt_sources or []
            if any(len(run) != 2 or run[0] not in SOURCES or type(run[1]) is not int for run in runs):
                raise ValueError(f"turns.{k}.prompt_sources: each run is [source, count] with source in {SOURCES}")
        return episode


def run_lengths(sources: list[str]) -> list[list[Any]]:
    """``["user", "user", "tool"]`` → ``[["user", 2], ["tool", 1]]``."""
    runs: list[list[Any]] = []
    for src in sources:
        if runs and runs[-1][0] == src:
            runs[-1][1] += 1
        else:
            runs.append([src, 1])
    return runs


def token_sources(turn: Turn) -> list[str] | None:
    """The source of every token of ``turn.sequence_ids`` (prompt from ``prompt_sources``, action =
    ``assistant``), or None when the turn has no provenance."""
    if turn.prompt_sources is None:
        return None
    out = [src for src, count in turn.prompt_sources for _ in range(count)]
    return out + ["assistant"] * len(turn.action_ids)


def provenance_mask(turn: Turn, source: str) -> list[int]:
    """1 on the tokens of ``turn.sequence_ids`` that came from ``source`` (system/user/assistant/tool)."""
    if source not in SOURCES:
        raise ValueError(f"unknown token source {source!r}; expected one of {', '.join(SOURCES)}")
    sources = token_sources(turn)
    if sources is None:
        raise ValueError(f"turn {turn.index} has no prompt_sources (collected without provenance)")
    return [int(s == source) for s in sources]


def new_prompt_lengths(episode: Episode) -> list[int]:
    """For each turn, how many of its context tokens are new (after the previous turn's action).

    Requires every turn's context to extend the previous turn's sequence, so the whole
    episode is one sequence: ``turns[-1].prompt_ids + turns[-1].action_ids``.
    """
    lengths: list[int] = []
    before: list[int] = []  # the sequence up to the end of the previous turn's action
    for turn in episode.turns:
        if turn.prompt_ids[: len(before)] != before:
            raise ValueError(
                f"episode {episode.episode_id}: turn {turn.index}'s context does not extend the previous"
                " turn (e.g. exclude_think); it must be trained as per-turn rows"
            )
        lengths.append(len(turn.prompt_ids) - len(before))
        before = turn.sequence_ids
    return lengths


def loss_mask(episode: Episode) -> tuple[list[int], list[int]]:
    """The whole episode as one sequence and its loss mask (1 on model tokens only)."""
    mask: list[int] = []
    for turn, n_new in zip(episode.turns, new_prompt_lengths(episode), strict=True):
        mask += [0] * n_new + [1] * len(turn.action_ids)
    last = episode.turns[-1]
    return last.prompt_ids + last.action_ids, mask


@cache
def _episode_adapter() -> TypeAdapter[Episode]:
    return TypeAdapter(Episode)
