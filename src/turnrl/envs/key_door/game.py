"""Key and door: a small partially observed task with turn-level progress.

A room has N locked doors and one key per door, each of a colour; one door (the
*target*) is the exit. The agent sees the colours but not the target. Actions:

- ``inspect``: read the note naming the target door. The clue is shown **once**;
  later inspects say the note is gone, so the agent must remember it.
- ``pickup <colour>``: take that key (putting down the one held, if any).
- ``open <colour>``: unlock that door; needs its key in hand. Opening the exit
  opens it; opening any other door sets off an alarm and ends the episode
  (failure, reward 0) -- otherwise opening every door would beat the clue.
- ``finish``: leave. Reward 1 if the exit door is open, else 0; either way the
  episode ends.

Every action, including an invalid one, costs one turn. After ``horizon`` turns
without an ending the episode is **truncated** (``StopReason.MAX_TURNS``): the
horizon is a time limit, not a rule of the game.

Rewards: base reward 1.0 only for ``finish`` with the exit open (``SUCCESS``),
0.0 otherwise. The potential Φ (:meth:`KeyDoorGame.potential`) measures
progress: 1/3 for having inspected, 1/3 for holding the exit key (or having
opened the exit), 1/3 for the exit being open; Φ of a terminated state is 0
(Ng, Harada & Russell, 1999), so shaped rewards r + γΦ(s') − Φ(s) leave the
optimal policies unchanged. A truncated state keeps its Φ (it is not terminal).

This module is the pure game: :class:`KeyDoorGame` (the state machine),
:class:`Action`, the task generator, the potential, and a discrete interface
(:meth:`KeyDoorGame.action_space`, :meth:`KeyDoorGame.observe`,
:meth:`KeyDoorGame.visible_state`) for agents that act on action indices
rather than text (the course lab, ``turnrl lab keydoor``). It knows nothing of
chat or parsing: :mod:`turnrl.envs.key_door.parser` turns text into an
:class:`Action`, :mod:`turnrl.envs.key_door.env` is the chat environment, and
:mod:`turnrl.integrations.trl_key_door` the TRL tool environment.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Any

from turnrl.envs.base import SplitName, StopReason, Task, check_split, echo

ENV_NAME = "key_door"
"""The registry name of the chat environment (tasks carry it)."""
PALETTE: tuple[str, ...] = ("red", "blue", "green", "yellow", "purple", "orange")
DEFAULT_NUM_COLORS = 3
DEFAULT_HORIZON = 8
EVAL_FRACTION = 0.25
SUCCESS_REWARD = 1.0
COLOR_ECHO = 40
"""The most characters of an unknown colour the observation quotes back (colour names are short)."""

VERBS = ("inspect", "pickup", "open", "finish")


@dataclass(frozen=True)
class Action:
    """One parsed action: ``verb`` in :data:`VERBS` and, for pickup/open, a colour."""

    verb: str
    color: str | None = None

    def __str__(self) -> str:
        return self.verb if self.color is None else f"{self.verb}_{self.color}"


@dataclass(frozen=True)
class Outcome:
    """What one action did: the observation text, reward and end state."""

    observation: str
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    stop_reason: StopReason | None = None
    invalid: bool = False

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated


@dataclass(frozen=True)
class Observation:
    """What the agent can see before a turn, as small integers (the discrete interface).

    Colours are *slots*: indices into :attr:`KeyDoorGame.colors`, the order in
    which the room lists them. ``clue`` is the exit's slot only on the turn
    right after the note was read (the note crumbles: later observations show
    ``-1`` again), so an agent must remember it. Everything else is what the
    chat agent can also read off its history: the key it holds, whether the
    exit is open, whether it read the note, and how many actions are left.
    """

    clue: int
    """Slot of the exit door if the last action read the note, else -1."""
    held: int
    """Slot of the key in hand, or -1."""
    exit_open: bool
    inspected: bool
    turns_left: int


@dataclass
class KeyDoorGame:
    """The state machine both front ends share. Deterministic; plain data, so deep-copyable."""

    colors: tuple[str, ...]
    target: str
    horizon: int = DEFAULT_HORIZON
    inspected: bool = False
    held: str | None = None
    opened: str | None = None
    turns: int = 0
    reward: float = 0.0
    """Total base reward so far (0 or 1)."""
    terminated: bool = False
    truncated: bool = False
    stop_reason: StopReason | None = None
    invalid_actions: int = 0
    history: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.colors = tuple(self.colors)
        if len(self.colors) < 2 or len(set(self.colors)) != len(self.colors):
            raise ValueError(f"key_door needs at least two distinct colours, got {list(self.colors)}")
        if self.target not in self.colors:
            raise ValueError(f"key_door target {self.target!r} is not one of the colours {list(self.colors)}")
        if isinstance(self.horizon, bool) or not isinstance(self.horizon, int) or self.horizon < 1:
            raise ValueError(f"key_door horizon must be an integer >= 1, got {self.horizon!r}")

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated

    def potential(self) -> float:
        """Φ(s) in [0, 1]: thirds for inspected, exit key held (or exit open), exit open; 0 when terminated."""
        if self.terminated:
            return 0.0
        exit_open = self.opened == self.target
        progress = int(self.inspected) + int(self.held == self.target or exit_open) + int(exit_open)
        return progress / 3.0

    # ------------------------------------------------ discrete interface

    def action_space(self) -> tuple[Action, ...]:
        """Every distinct action, in a fixed order: inspect, pickup per slot, open per slot, finish.

        ``2 + 2 * len(colors)`` actions; index ``i`` of this tuple is action ``i``
        of a discrete agent (:meth:`act_index`).
        """
        return (
            Action("inspect"),
            *(Action("pickup", c) for c in self.colors),
            *(Action("open", c) for c in self.colors),
            Action("finish"),
        )

    def act_index(self, index: int) -> Outcome:
        """Apply action ``index`` of :meth:`action_space` (the same state machine as :meth:`act`)."""
        space = self.action_space()
        if isinstance(index, bool) or not 0 <= int(index) < len(space):
            raise ValueError(f"key_door action index must be in [0, {len(space)}), got {index!r}")
        return self.act(space[int(index)])

    def observe(self) -> Observation:
        """The agent's view of the current state (see :class:`Observation`)."""
        read_now = bool(self.history) and self.history[-1] == "inspect" and self.history.count("inspect") == 1
        return Observation(
            clue=self.colors.index(self.target) if read_now else -1,
            held=-1 if self.held is None else self.colors.index(self.held),
            exit_open=self.opened == self.target,
            inspected=self.inspected,
            turns_left=self.horizon - self.turns,
        )

    def visible_state(self) -> tuple[bool, str | None, str | None]:
        """A hashable key of the game state a turn acts from: ``(inspected, held, opened)``.

        Two turns of episodes on the same task with equal keys act from the same
        state as far as the game's future is concerned, apart from the turns
        left (the turn counter is deliberately not part of the key, as in
        GiGPO's anchor states). The target is fixed by the task, so it is
        not repeated here.
        """
        return (self.inspected, self.held, self.opened)

    def describe(self) -> str:
        """The room as the agent first sees it (no hint of the target)."""
        colors = _join(self.colors)
        return (
            f"You are in a room with {len(self.colors)} locked doors: {colors}. "
            f"On the floor lies one key for each door, of the same colour ({colors}). "
            "Exactly one door is the exit. A note on the table says which one, but it "
            "crumbles after one reading. Opening a door that is not the exit ends the game. "
            f"You have {self.horizon} actions."
        )

    def act(self, action: Action | None, *, end_on_invalid: bool = False) -> Outcome:
        """Apply one action and return what happened.

        ``None`` is an unparseable reply: an invalid-action observation, and the
        episode goes on unless ``end_on_invalid`` (then reward 0, ``MALFORMED``).
        """
        if self.done:
            raise RuntimeError("the key_door episode is over")
        self.turns += 1
        self.history.append("invalid" if action is None else str(action))
        if action is None and end_on_invalid:
            outcome = Outcome(
                "Invalid action. " + self.action_help(),
                terminated=True,
                stop_reason=StopReason.MALFORMED,
                invalid=True,
            )
        else:
            outcome = self._apply(action)
        if outcome.terminated:
            self.terminated = True
            self.stop_reason = outcome.stop_reason
            self.reward += outcome.reward
        elif self.turns >= self.horizon:
            self.truncated = True
            self.stop_reason = StopReason.MAX_TURNS
            outcome = Outcome(
                observation=outcome.observation + " You are out of actions.",
                truncated=True,
                stop_reason=StopReason.MAX_TURNS,
                invalid=outcome.invalid,
            )
        if outcome.invalid:
            self.invalid_actions += 1
        return outcome

    def action_help(self) -> str:
        c = self.colors[0]
        return (
            "Reply with exactly one action: inspect, pickup_<colour>, open_<colour> or finish "
            f"(colours: {', '.join(self.colors)}), e.g. pickup_{c}, or as a tool call "
            f'{{"name": "pickup", "arguments": {{"color": "{c}"}}}}.'
        )

    def _apply(self, action: Action | None) -> Outcome:
        if action is None:
            return Outcome("Invalid action. " + self.action_help(), invalid=True)
        verb, color = action.verb, action.color
        if verb == "inspect":
            if self.inspected:
                return Outcome("The note has crumbled to dust; there is nothing left to read.")
            self.inspected = True
            return Outcome(f"You read the note: the exit is the {self.target} door. The note crumbles to dust.")
        if verb == "finish":
            if self.opened == self.target:
                return Outcome(
                    "You walk through the open exit. You escaped!",
                    reward=SUCCESS_REWARD,
                    terminated=True,
                    stop_reason=StopReason.SUCCESS,
                )
            return Outcome(
                "You stop without opening the exit. Game over.",
                terminated=True,
                stop_reason=StopReason.FAILURE,
            )
        if not color:
            return Outcome(f"Which colour? {self.action_help()}", invalid=True)
        if color not in self.colors:
            thing = "key" if verb == "pickup" else "door"
            return Outcome(f"There is no {echo(color, COLOR_ECHO)} {thing} here. Colours: {', '.join(self.colors)}.")
        if verb == "pickup":
            if self.held == color:
                return Outcome(f"You already hold the {color} key.")
            before, self.held = self.held, color
            if before is None:
                return Outcome(f"You pick up the {color} key.")
            return Outcome(f"You put down the {before} key and pick up the {color} key.")
        # verb == "open"
        if self.opened == color:
            return Outcome(f"The {color} door is already open.")
        if self.held != color:
            return Outcome(f"The {color} door is locked. You need the {color} key.")
        if color != self.target:
            return Outcome(
                f"You unlock the {color} door. It is not the exit: an alarm sounds. Game over.",
                terminated=True,
                stop_reason=StopReason.FAILURE,
            )
        self.opened = color
        return Outcome(f"You unlock the {color} door. It opens: this is the exit. Now finish.")


# -------------------------------------------------------------------- tasks


def make_game(params: dict[str, Any], horizon: int | None = None) -> KeyDoorGame:
    """A fresh game from task params (``colors``, ``target``; or just ``seed``)."""
    if "colors" not in params or "target" not in params:
        params = {**task_params_from_seed(int(params.get("seed", 0))), **params}
    colors = params["colors"]
    if isinstance(colors, str) or not isinstance(colors, list | tuple):
        raise ValueError(f"key_door params.colors must be a list of colour names, got {colors!r}")
    h = horizon if horizon is not None else params.get("horizon", DEFAULT_HORIZON)
    return KeyDoorGame(colors=tuple(str(c) for c in colors), target=str(params["target"]), horizon=h)


def task_params_from_seed(seed: int, num_colors: int = DEFAULT_NUM_COLORS) -> dict[str, Any]:
    """Deterministic task params for a seed (used when a reset gives only a seed)."""
    rng = random.Random(seed)
    colors = rng.sample(PALETTE, num_colors)
    return {"colors": colors, "target": rng.choice(colors), "seed": seed}


def generate_tasks(split: str, num_colors: int = DEFAULT_NUM_COLORS) -> list[Task]:
    """Every (colour set, target) pair, split disjointly: a fixed 25% for eval, the rest for train.

    The pairs are enumerated in a fixed order, shuffled with a fixed seed, and the
    first quarter goes to eval. Each task's ``seed`` (its index in that shuffled
    list) fixes the order in which the colours are listed.
    """
    split = check_split(split)
    if isinstance(num_colors, bool) or not isinstance(num_colors, int) or not 2 <= num_colors <= len(PALETTE):
        raise ValueError(f"key_door option num_colors must be an integer in [2, {len(PALETTE)}], got {num_colors!r}")
    pairs = [(combo, t) for combo in itertools.combinations(PALETTE, num_colors) for t in combo]
    random.Random(1000 + num_colors).shuffle(pairs)
    n_eval = max(1, round(len(pairs) * EVAL_FRACTION))
    chosen = range(n_eval) if split == SplitName.EVAL else range(n_eval, len(pairs))
    tasks = []
    for seed in chosen:
        combo, target = pairs[seed]
        colors = list(combo)
        random.Random(seed).shuffle(colors)
        tasks.append(
            Task(
                task_id=f"key_door-{split}-{seed:03d}",
                env=ENV_NAME,
                params={"colors": colors, "target": target, "seed": seed},
                split=split,
            )
        )
    return tasks


def _join(items: tuple[str, ...]) -> str:
    return ", ".join(items[:-1]) + f" and {items[-1]}" if len(items) > 1 else items[0]
