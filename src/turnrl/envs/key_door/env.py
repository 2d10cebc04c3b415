"""Key and door as a chat environment (registry name ``key_door``).

It parses one action per reply (:func:`~turnrl.envs.key_door.parser.parse_action`)
and drives the shared :class:`~turnrl.envs.key_door.game.KeyDoorGame`. An
unparseable reply is an *invalid action*: the agent is told the valid actions
and the episode continues (the turn still counts), unless the option
``end_on_invalid=True`` ends it with reward 0 and ``MALFORMED``.

:class:`KeyDoorToolsEnv` is the same game as a tool environment (structured tool calls).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

from pydantic import Field

from turnrl.envs.base import Env, EnvOptions, Message, StepResult, StopReason, Task
from turnrl.envs.key_door.game import (
    DEFAULT_NUM_COLORS,
    ENV_NAME,
    PALETTE,
    Action,
    generate_tasks,
    make_game,
)
from turnrl.envs.key_door.parser import parse_action
from turnrl.envs.tools import ToolEnv


class KeyDoorToolsOptions(EnvOptions):
    horizon: int | None = Field(None, ge=1, le=1000)
    """Actions before truncation (unset: the task's ``horizon``, or 8)."""
    num_colors: int = Field(DEFAULT_NUM_COLORS, ge=2, le=len(PALETTE))
    """Colours per room, for :meth:`default_tasks`."""


class KeyDoorOptions(KeyDoorToolsOptions):
    end_on_invalid: bool = False
    """End the episode (reward 0, ``MALFORMED``) on an unparseable reply."""


def _game_for(task: Task, options: KeyDoorToolsOptions):
    """The task's game (``horizon`` option applied); a bad task is one clear error naming it."""
    try:
        return make_game(task.params, horizon=options.horizon)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"task {task.task_id!r}: {exc}") from exc


class KeyDoorEnv(Env):
    """Key and door as a chat environment (one action per assistant reply).

    Task params: ``colors`` (list of colour names), ``target`` (one of them),
    optionally ``seed`` and ``horizon``.

    Options:
        horizon (int, default: task's ``horizon`` or 8): actions before truncation.
        end_on_invalid (bool, default False): end the episode (reward 0,
            ``MALFORMED``) on an unparseable reply instead of continuing.
        num_colors (int, default 3): colours per room, for :meth:`default_tasks`.
    """

    name: ClassVar[str] = ENV_NAME
    Options = KeyDoorOptions
    options: KeyDoorOptions

    def __init__(self, task: Task, **options: Any) -> None:
        super().__init__(task, **options)
        self.game = _game_for(task, self.options)
        self.max_turns = self.game.horizon
        self.end_on_invalid = self.options.end_on_invalid

    def potential(self) -> float:
        """Φ of the current state (see :meth:`KeyDoorGame.potential`)."""
        return self.game.potential()

    def state_key(self) -> tuple[bool, str | None, str | None]:
        """A hashable key of the state the next turn acts from: ``(inspected, held, opened)``.

        Equal keys on the same task mean the same game state apart from the
        turns left (see :meth:`KeyDoorGame.visible_state`); meant for
        anchor-state grouping of turns across a group's episodes (GiGPO).
        """
        return self.game.visible_state()

    def system_prompt(self) -> str:
        c = self.game.colors[0]
        return (
            "You are an agent in a text game. Each turn, reply with exactly one action.\n"
            "Actions:\n"
            "- inspect: read the note that names the exit door (it can be read only once)\n"
            "- pickup_<colour>: pick up the key of that colour (you hold one key at a time)\n"
            "- open_<colour>: open the door of that colour (you must hold its key)\n"
            "- finish: leave through the open exit\n"
            f"Write the action as a single word, e.g. pickup_{c}, or as a JSON tool call, e.g. "
            f'{{"name": "pickup", "arguments": {{"color": "{c}"}}}}. '
            "Tool names: inspect, pickup, open_door, finish.\n"
            "You win only if you finish after opening the exit door."
        )

    def initial_messages(self) -> list[Message]:
        return [
            {"role": "system", "content": self.system_prompt()},
            {"role": "user", "content": self.game.describe() + " What do you do?"},
        ]

    def step(self, action_text: str) -> StepResult:
        outcome = self.game.act(parse_action(action_text), end_on_invalid=self.end_on_invalid)
        return StepResult(
            messages=[] if outcome.done else [{"role": "user", "content": outcome.observation}],
            reward=outcome.reward,
            terminated=outcome.terminated,
            truncated=outcome.truncated,
            stop_reason=outcome.stop_reason,
            metrics={
                "success": float(outcome.stop_reason == StopReason.SUCCESS),
                "invalid": float(outcome.invalid),
                "inspected": float(self.game.inspected),
                "turns": float(self.game.turns),
            },
        )

    @classmethod
    def default_tasks(cls, split: str, **options: Any) -> list[Task]:
        """Generated rooms (see :func:`generate_tasks`); option ``num_colors`` (default 3)."""
        return generate_tasks(split, cls.parse_options(options).num_colors)


class KeyDoorToolsEnv(ToolEnv):
    """Key and door with structured tool calls (registry name ``key_door_tools``).

    The same :class:`KeyDoorGame` as :class:`KeyDoorEnv`, played through the tools
    ``inspect``, ``pickup(color)``, ``open_door(color)`` and ``finish`` (the methods of
    :class:`turnrl.integrations.trl_key_door.KeyDoorToolEnv`, TRL's form), called as
    ``<tool_call>{"name": "pickup", "arguments": {"color": "red"}}</tool_call>``. A reply
    without a tool call ends the episode (``FAILURE`` unless the game was won); a malformed
    call ends it with reward 0, ``MALFORMED``. Options: ``horizon``, ``num_colors``.
    """

    name: ClassVar[str] = "key_door_tools"
    Options = KeyDoorToolsOptions
    options: KeyDoorToolsOptions

    def __init__(self, task: Task, **options: Any) -> None:
        super().__init__(task, **options)
        self.game = _game_for(task, self.options)
        self.max_turns = self.game.horizon

    def reset(self, **params: Any) -> str:
        return self.game.describe() + " Use the tools to act, one call at a time."

    def inspect(self) -> str:
        """
        Read the note that names the exit door. The note can be read only once.

        Returns:
            What the note says, or that it is gone.
        """
        return self.game.act(Action("inspect")).observation

    def pickup(self, color: str) -> str:
        """
        Pick up the key of the given colour, putting down the key you hold.

        Args:
            color: Colour of the key to pick up, e.g. "red".

        Returns:
            What happened.
        """
        return self.game.act(Action("pickup", str(color).strip().lower())).observation

    def open_door(self, color: str) -> str:
        """
        Open the door of the given colour. You must hold its key. Opening a door that is not the exit ends the game.

        Args:
            color: Colour of the door to open, e.g. "red".

        Returns:
            What happened.
        """
        return self.game.act(Action("open", str(color).strip().lower())).observation

    def finish(self) -> str:
        """
        Leave the room. You win only if the exit door is open.

        Returns:
            Whether you escaped.
        """
        return self.game.act(Action("finish")).observation

    def is_done(self) -> bool:
        return self.game.done

    def get_reward(self) -> float:
        return float(self.game.reward)

    def episode_end(self) -> tuple[float, StopReason, bool]:
        if not self.game.done:  # the model stopped calling tools before the game ended
            return float(self.game.reward), StopReason.FAILURE, False
        return float(self.game.reward), self.game.stop_reason or StopReason.FAILURE, self.game.truncated

    def potential(self) -> float:
        return self.game.potential()

    def state_key(self) -> tuple[bool, str | None, str | None]:
        """``(inspected, held, opened)``, as :meth:`KeyDoorEnv.state_key`."""
        return self.game.visible_state()

    @classmethod
    def default_tasks(cls, split: str, **options: Any) -> list[Task]:
        """The rooms of :meth:`KeyDoorEnv.default_tasks`, for this environment."""
        num_colors = cls.parse_options(options).num_colors
        return [replace(t, env=cls.name) for t in generate_tasks(split, num_colors)]
