"""The environment vocabulary every task family shares.

An environment is built from one :class:`Task`, gives the first chat messages,
then takes one assistant message at a time and answers with a
:class:`StepResult`: the next messages (empty when the episode ends), the
turn's reward, and whether the episode terminated or was truncated, with a
named stop reason. Parsing failures belong to the environment: a malformed
reply gets the environment's failure reward and a clear observation, never an
exception that ends training.

Environments must be deterministic given their task and the actions they
receive, and deep-copyable: branched rollouts copy an environment after turn 1
so every continuation sees byte-identical replies.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar

Message = dict[str, str]
"""A chat message: ``{"role": "system"|"user"|"assistant"|"tool", "content": str}``."""


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

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated


class Env(ABC):
    """A multi-turn environment for one task.

    Subclasses set ``name`` (the registry key) and ``max_turns``, and implement
    :meth:`initial_messages` and :meth:`step`. Tasks for an environment come
    from :meth:`default_tasks` (generated) or from a JSONL task file.
    """

    name: ClassVar[str] = ""
    max_turns: int = 1

    def __init__(self, task: Task, **options: Any) -> None:
        self.task = task
        self.options = options

    @abstractmethod
    def initial_messages(self) -> list[Message]:
        """The chat messages that open the episode (system/user, few-shot examples)."""

    @abstractmethod
    def step(self, action_text: str) -> StepResult:
        """Consume one assistant message; return the reply, reward and end state."""

    @classmethod
    def default_tasks(cls, split: str, **options: Any) -> list[Task]:
        """Tasks this environment ships for a split; environments without a generator raise."""
        raise ValueError(
            f"environment {cls.name!r} has no built-in tasks; set data.train_file / data.eval_file"
        )

    def observation_text(self, messages: list[Message]) -> str:
        """The text of the environment's reply, for records and reports."""
        return "\n".join(m["content"] for m in messages)


def check_options(env_name: str, options: dict[str, Any], allowed: frozenset[str]) -> None:
    """Refuse environment options the environment does not know, naming the allowed ones."""
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for environment {env_name!r}; "
            f"allowed: {', '.join(sorted(allowed))}"
        )


def check_split(split: str) -> str:
    """A built-in split name (train/eval), or a clear error."""
    valid = [str(s) for s in SplitName]
    if str(split) not in valid:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(valid)}")
    return str(split)


class TaskFileError(ValueError):
    """A task file has a bad line; the message names the file, line and field."""


def read_json_lines(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``("file:line", object)`` for every non-blank line of a JSONL file.

    A line that is not a JSON object raises :class:`TaskFileError` naming the file and line.
    """
    with Path(path).open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskFileError(f"{where}: not valid JSON ({exc.msg}); each line must be one JSON object") from exc
            if not isinstance(obj, dict):
                raise TaskFileError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            yield where, obj


def load_task_file(
    path: str | Path, split: str | None = None, validate: Callable[[Task, str], None] | None = None
) -> list[Task]:
    """Read tasks from JSONL: one object per line with ``task_id`` and ``env``.

    Every other key goes into ``params`` (a ``params`` object is merged in as is).
    ``validate(task, "file:line")`` may check each task further (environment-specific fields).
    Raises :class:`TaskFileError` naming the file, line and field on bad input.
    """
    path = Path(path)
    if not path.exists():
        raise TaskFileError(f"task file {path} does not exist; check data.train_file/data.eval_file")
    tasks: list[Task] = []
    for where, obj in read_json_lines(path):
        for key in ("task_id", "env"):
            if not isinstance(obj.get(key), str) or not obj.get(key):
                raise TaskFileError(f"{where}: missing or empty field {key!r} (a string)")
        params = dict(obj.pop("params", {}) or {})
        task_id, env = obj.pop("task_id"), obj.pop("env")
        task_split = obj.pop("split", split or SplitName.TRAIN)
        params.update(obj)
        task = Task(task_id=task_id, env=env, params=params, split=task_split)
        if validate is not None:
            validate(task, where)
        tasks.append(task)
    if not tasks:
        raise TaskFileError(f"{path}: no tasks found (the file is empty)")
    return tasks
