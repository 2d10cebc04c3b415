"""The environment vocabulary every task family shares.

An environment is built from one :class:`Task`, gives the first chat messages,
then takes one assistant message at a time and answers with a
:class:`StepResult`: the next messages (empty when the episode ends), the
turn's reward, and whether the episode terminated or was truncated, with a
named stop reason. Parsing failures belong to the environment: a malformed
reply gets the environment's failure reward (:attr:`Env.failure_reward`) and a
clear observation, never an exception that ends training. The collector holds
every environment to this: a ``step`` that raises on a reply ends that episode
with ``failure_reward``, stop reason ``MALFORMED`` and the episode metric
``env_error`` (the exception is logged and recorded as the turn's observation).

Options (``env.options`` in a config) are one typed model per environment: a subclass of
:class:`EnvOptions` set as ``Options``. :meth:`Env.parse_options` validates them under the strict
rules of :mod:`turnrl.sections` (unknown keys refused, ``true``/``false`` only for booleans,
finite floats, ranges) whenever an environment is built or its tasks are listed — a new
environment gets this by declaring its fields; one without options refuses any.

Environments must be deterministic given their task and the actions they
receive, and deep-copyable: branched rollouts copy an environment after turn 1
so every continuation sees byte-identical replies.

Concurrency: the collector steps every live episode's environment at once.
``step`` (and ``initial_messages``) may be ``async def`` (awaited together with
``asyncio.gather``: an environment that calls a service or a sandbox awaits it);
a plain ``step`` runs in a thread pool of ``rollout.env_workers`` threads, so a
step that waits on a subprocess or the network does not hold up the others.
Each episode has its own environment object, so a step needs no locking unless
environments share state on purpose.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, ClassVar

from pydantic import ValidationError

from turnrl.sections import Section, error_lines, strict_validate
from turnrl.tasks import load_task_file
from turnrl.types import Message, SplitName, StepResult, StopReason, Task

__all__ = ["ECHO_CHARS", "Env", "EnvOptions", "Message", "StepResult", "StopReason", "Task", "check_split", "echo"]

ECHO_CHARS = 200
"""The most characters of the model's own text an observation repeats back (:func:`echo`)."""


def echo(text: object, limit: int = ECHO_CHARS) -> str:
    """Model-written text as an observation (or an error recorded with one) may quote it: the first
    ``limit`` characters and how many more were cut. Every environment quoting a reply goes through
    this, so a 500 kB action name costs the next prompt ``limit`` characters, not 500 kB."""
    text = text if isinstance(text, str) else str(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit:,} more characters]"


class EnvOptions(Section):
    """Base of an environment's options model (``env.options``): no fields, so no option is accepted."""


class Env(ABC):
    """A multi-turn environment for one task.

    Subclasses set ``name`` (the registry key) and ``max_turns``, and implement
    :meth:`initial_messages` and :meth:`step`. Tasks for an environment come
    from :meth:`default_tasks` (generated) or from a JSONL task file.
    """

    name: ClassVar[str] = ""
    max_turns: int = 1
    Options: ClassVar[type[EnvOptions]] = EnvOptions
    """The environment's options model (fields with types, defaults and ranges)."""
    failure_reward: ClassVar[float] = 0.0
    """The reward of a reply that cannot be parsed or executed: what the environment gives a
    malformed reply, and what the collector gives when ``step`` raises on one (the lowest reward
    the task gives, typically)."""

    def __init__(self, task: Task, **options: Any) -> None:
        self.task = task
        self.options = self.parse_options(options)

    @classmethod
    def parse_options(cls, options: dict[str, Any] | None = None) -> Any:
        """``options`` validated by :attr:`Options` (strictly), or one ``ValueError`` naming the key,
        the value and what is allowed."""
        options = dict(options or {})
        model = cls.Options
        allowed = sorted(f.alias or n for n, f in model.model_fields.items())
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ValueError(
                f"unknown option(s) {', '.join(map(repr, unknown))} for environment {cls.name!r}; "
                f"allowed: {', '.join(allowed) or '(none: this environment takes no options)'}"
            )
        try:
            return strict_validate(model, options)
        except ValidationError as exc:
            raise ValueError(f"environment {cls.name!r}: " + "; ".join(error_lines(exc, "env.options"))) from None

    @abstractmethod
    def initial_messages(self) -> list[Message]:
        """The chat messages that open the episode (system/user, few-shot examples)."""

    @abstractmethod
    def step(self, action_text: str) -> StepResult:
        """Consume one assistant message; return the reply, reward and end state."""

    # ------------------------------------------------------------------ optional hooks (defaults)

    @classmethod
    def default_tasks(cls, split: str, **options: Any) -> list[Task]:
        """Tasks this environment ships for a split; environments without a generator raise."""
        raise ValueError(f"environment {cls.name!r} has no built-in tasks; set data.train_file / data.eval_file")

    @classmethod
    def load_tasks(cls, path: str | Path, split: str | None = None) -> list[Task]:
        """Tasks from a JSONL task file; override to validate environment-specific fields."""
        return load_task_file(path, split)

    @classmethod
    def scripted_policies(cls) -> dict[str, Callable[[list[Message]], str]]:
        """Named scripted policies (messages → reply text) for ceilings and floors of the task."""
        return {}

    def potential(self) -> float | None:
        """Φ(s) of the current state for potential-based shaping; None = no potential defined."""
        return None

    def observation_text(self, messages: list[Message]) -> str:
        """The text of the environment's reply, for records and reports."""
        return "\n".join(str(m.get("content", "")) for m in messages)

    def state_key(self) -> Hashable | None:
        """A key of the state the next turn acts from; None = no key (the default).

        Turns of one group whose keys are equal are taken to act from the same
        state (anchor states, estimator ``gigpo``). The key must be JSON-serialisable
        (numbers, strings, booleans, None, lists/tuples, dicts with string keys); the
        collector records it on ``Turn.state_key`` as canonical JSON.
        """
        return None

    def context_summary(self) -> str | None:
        """Text that stands for the turns a context window leaves out (``rollout.context: summary``): the
        state so far in a few lines (e.g. "room 3; holding the red key; doors tried: 1, 4"). None = this
        environment gives no summary (the default; such a run uses ``rollout.context: window``)."""
        return None

    def action_choices(self) -> list[str] | None:
        """The replies the next turn can give, when that set is finite and small (answers from a
        fixed menu); None = open-ended (the default). A reply outside the set is one this
        environment treats as malformed, with a deterministic outcome, so the exact credit audit
        (``turnrl credit-audit --exact``) can enumerate a policy's turns: each choice scored by the
        policy, every other reply lumped into one malformed branch."""
        return None

    def tools(self) -> list[dict[str, Any]] | None:
        """JSON schemas of the tools this environment offers, passed to the chat template as
        ``tools=`` (None = no tools, the default). See :class:`turnrl.envs.tools.ToolEnv`."""
        return None

    @classmethod
    def group_rewards(cls, episodes: list[Any]) -> list[float] | None:
        """Optional group-level reward: given every finished episode of one group (same task, one
        step), return one extra reward per episode (added to its last turn), or None (the default).
        Logged as the episode metric ``reward/group``. See :class:`turnrl.envs.rubric.Rubric`."""
        return None


def check_split(split: str) -> str:
    """A built-in split name (train/eval), or a clear error."""
    valid = [str(s) for s in SplitName]
    if str(split) not in valid:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(valid)}")
    return str(split)
