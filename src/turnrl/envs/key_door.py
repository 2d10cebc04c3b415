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

Two front ends share one state machine, :class:`KeyDoorGame`:

- :class:`KeyDoorEnv` (registry name ``key_door``), the chat environment. It
  parses one action per reply: a JSON tool call such as
  ``{"name": "pickup", "arguments": {"color": "red"}}`` (optionally inside
  ``<tool_call>...</tool_call>``) or a bare action word such as ``pickup_red``.
  JSON tool calls take precedence over bare words; among several, the last
  counts. An unparseable reply is an *invalid action*: the agent is told the
  valid actions and the episode continues (the turn still counts), unless the
  option ``end_on_invalid=True`` ends it with reward 0 and ``MALFORMED``.
- :class:`KeyDoorToolEnv`, the same task as a tool environment for TRL's
  ``GRPOTrainer(environment_factory=KeyDoorToolEnv)``: ``reset(**row)`` starts an
  episode from a dataset row, the public methods ``inspect``, ``pickup``,
  ``open_door`` and ``finish`` are the tools, and ``get_reward()`` returns the
  episode's reward.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from turnrl.envs.base import (
    Env,
    Message,
    SplitName,
    StepResult,
    StopReason,
    Task,
    check_options,
    check_split,
)

PALETTE: tuple[str, ...] = ("red", "blue", "green", "yellow", "purple", "orange")
DEFAULT_NUM_COLORS = 3
DEFAULT_HORIZON = 8
EVAL_FRACTION = 0.25
SUCCESS_REWARD = 1.0

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
            raise ValueError(
                f"key_door needs at least two distinct colours, got {list(self.colors)}"
            )
        if self.target not in self.colors:
            raise ValueError(
                f"key_door target {self.target!r} is not one of the colours {list(self.colors)}"
            )
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
            return Outcome(
                f"You read the note: the exit is the {self.target} door. The note crumbles to dust."
            )
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
            return Outcome(f"There is no {color} {thing} here. Colours: {', '.join(self.colors)}.")
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


# ------------------------------------------------------------------ parsing

_TOOL_NAMES = {
    "inspect": "inspect",
    "pickup": "pickup",
    "pick_up": "pickup",
    "open": "open",
    "open_door": "open",
    "finish": "finish",
}
_BARE_RE = re.compile(
    r"\b(?:(?P<inspect>inspect)|(?P<finish>finish)"
    r"|(?:pickup|pick_up)_(?P<pickup>[a-z]+)|open_(?:door_)?(?P<open>[a-z]+))\b",
    re.IGNORECASE,
)
_DECODER = json.JSONDecoder()


def parse_action(text: str) -> Action | None:
    """The action in a reply, or ``None`` when there is none.

    JSON tool calls (``{"name": ..., "arguments": {"color": ...}}``; ``arguments``
    may also be a JSON string, ``parameters`` is accepted as its alias) take
    precedence over bare action words (``inspect``, ``pickup_red``,
    ``open_red``, ``finish``); among several of the same kind, the last counts.
    Colours are lower-cased; whether a colour exists is the game's business.
    """
    if not isinstance(text, str):
        return None
    calls = [a for a in (_action_from_json(obj) for obj in _json_objects(text)) if a is not None]
    if calls:
        return calls[-1]
    bare = list(_BARE_RE.finditer(text))
    if not bare:
        return None
    m = bare[-1]
    if m.group("inspect"):
        return Action("inspect")
    if m.group("finish"):
        return Action("finish")
    if m.group("pickup"):
        return Action("pickup", m.group("pickup").lower())
    color = m.group("open").lower()
    return Action("open", None if color == "door" else color)  # bare "open_door": no colour


_JSON_START_RE = re.compile(r'\{\s*"')
_MAX_JSON_ATTEMPTS = 256


def _json_objects(text: str) -> list[Any]:
    """The JSON objects embedded in ``text``, left to right.

    Only ``{`` followed by a quoted key can start one, and at most
    ``_MAX_JSON_ATTEMPTS`` starts are tried, so pathological replies stay cheap.
    """
    found: list[Any] = []
    pos, attempts = 0, 0
    while attempts < _MAX_JSON_ATTEMPTS:
        m = _JSON_START_RE.search(text, pos)
        if m is None:
            break
        attempts += 1
        try:
            obj, end = _DECODER.raw_decode(text, m.start())
        except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
            pos = m.start() + 1
            continue
        found.append(obj)
        pos = end
    return found


def _action_from_json(obj: Any) -> Action | None:
    if not isinstance(obj, dict):
        return None
    # OpenAI style: {"type": "function", "function": {"name": ..., "arguments": "..."}}
    if isinstance(obj.get("function"), dict):
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    name = name.strip().lower()
    color = args.get("color", args.get("colour"))
    if name not in _TOOL_NAMES:
        # "pickup_red" / "open_red" as a tool name with no arguments
        m = _BARE_RE.fullmatch(name)
        if m is None:
            return None
        return parse_action(name)
    verb = _TOOL_NAMES[name]
    if verb in ("inspect", "finish"):
        return Action(verb)
    if not isinstance(color, str) or not color.strip():
        return Action(verb, None)
    return Action(verb, color.strip().lower())


# -------------------------------------------------------------------- tasks


def make_game(params: dict[str, Any], horizon: int | None = None) -> KeyDoorGame:
    """A fresh game from task params (``colors``, ``target``; or just ``seed``)."""
    if "colors" not in params or "target" not in params:
        params = {**task_params_from_seed(int(params.get("seed", 0))), **params}
    colors = params["colors"]
    if isinstance(colors, str) or not isinstance(colors, list | tuple):
        raise ValueError(f"key_door params.colors must be a list of colour names, got {colors!r}")
    h = horizon if horizon is not None else params.get("horizon", DEFAULT_HORIZON)
    return KeyDoorGame(
        colors=tuple(str(c) for c in colors), target=str(params["target"]), horizon=h
    )


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
    if (
        isinstance(num_colors, bool)
        or not isinstance(num_colors, int)
        or not 2 <= num_colors <= len(PALETTE)
    ):
        raise ValueError(
            f"key_door option num_colors must be an integer in [2, {len(PALETTE)}], got {num_colors!r}"
        )
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
                env=KeyDoorEnv.name,
                params={"colors": colors, "target": target, "seed": seed},
                split=split,
            )
        )
    return tasks


# ------------------------------------------------------------ chat environment


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

    name: ClassVar[str] = "key_door"
    OPTIONS: ClassVar[frozenset[str]] = frozenset({"horizon", "end_on_invalid", "num_colors"})

    def __init__(self, task: Task, **options: Any) -> None:
        super().__init__(task, **options)
        check_options(self.name, options, self.OPTIONS)
        try:
            self.game = make_game(task.params, horizon=options.get("horizon"))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"task {task.task_id!r}: {exc}") from exc
        self.max_turns = self.game.horizon
        self.end_on_invalid = bool(options.get("end_on_invalid", False))

    def potential(self) -> float:
        """Φ of the current state (see :meth:`KeyDoorGame.potential`)."""
        return self.game.potential()

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
        check_options(cls.name, options, cls.OPTIONS)
        return generate_tasks(split, options.get("num_colors", DEFAULT_NUM_COLORS))


# ------------------------------------------------------------ tool environment


class KeyDoorToolEnv:
    """Key and door as a tool environment for TRL's ``GRPOTrainer(environment_factory=...)``.

    TRL's convention: the factory is called with no arguments, once per rollout
    slot; ``reset(**row)`` gets every column of the dataset row and returns the
    text appended to the prompt; every other public method is a tool, described
    to the model from its signature and docstring; ``get_reward()`` (reserved,
    not a tool) is read once per finished rollout. Tool calls on a finished
    episode raise ``ValueError``, which TRL feeds back as the tool's reply.

    The episode state is the same :class:`KeyDoorGame` that :class:`KeyDoorEnv`
    drives, stored in the attribute ``game`` (not a method, so not a tool).
    """

    def __init__(self, horizon: int | None = None) -> None:
        self._horizon = horizon
        self.game: KeyDoorGame = make_game({"seed": 0}, horizon=horizon)

    def reset(self, **kwargs: Any) -> str:
        """Start an episode from a dataset row (``colors``, ``target``, optional ``seed``/``horizon``).

        Unknown keys (``prompt``, ``task_id``, ...) are ignored; a row with only a
        ``seed`` gets a room generated from it. Returns the room description.
        """
        params = {k: kwargs[k] for k in ("colors", "target", "seed", "horizon") if k in kwargs}
        if isinstance(kwargs.get("params"), dict):  # a Task.to_dict() row
            params = {**kwargs["params"], **params}
        self.game = make_game(params, horizon=self._horizon)
        return self.game.describe() + " Use the tools to act, one call at a time."

    def inspect(self) -> str:
        """
        Read the note that names the exit door. The note can be read only once.

        Returns:
            What the note says, or that it is gone.
        """
        return self._act(Action("inspect"))

    def pickup(self, color: str) -> str:
        """
        Pick up the key of the given colour, putting down the key you hold.

        Args:
            color: Colour of the key to pick up, e.g. "red".

        Returns:
            What happened.
        """
        return self._act(Action("pickup", str(color).strip().lower()))

    def open_door(self, color: str) -> str:
        """
        Open the door of the given colour. You must hold the key of that colour. Opening a door that is not the exit ends the game.

        Args:
            color: Colour of the door to open, e.g. "red".

        Returns:
            What happened.
        """
        return self._act(Action("open", str(color).strip().lower()))

    def finish(self) -> str:
        """
        Leave the room. You win only if the exit door is open.

        Returns:
            Whether you escaped.
        """
        return self._act(Action("finish"))

    def get_reward(self) -> float:
        """The episode's reward: 1.0 if it finished with the exit open, else 0.0."""
        return float(self.game.reward)

    def _act(self, action: Action) -> str:
        if self.game.done:
            raise ValueError("Game over: the episode has ended; stop calling tools.")
        return self.game.act(action).observation


def key_door_reward(environments: list[KeyDoorToolEnv], **kwargs: Any) -> list[float]:
    """A TRL ``reward_funcs`` entry reading each environment's reward.

    For TRL versions without environment-owned rewards (``get_reward``);
    newer versions call ``get_reward()`` themselves, so do not pass both.
    """
    return [env.get_reward() for env in environments]


def key_door_tool_dataset(split: str, num_colors: int = DEFAULT_NUM_COLORS) -> list[dict[str, Any]]:
    """Rows for a TRL dataset (``datasets.Dataset.from_list``) with the same tasks as ``default_tasks``.

    Each row has a conversational ``prompt`` plus the task params that
    ``KeyDoorToolEnv.reset`` receives.
    """
    instruction = (
        "Escape the room: find out which door is the exit, pick up its key, open it, then finish. "
        "Call one tool at a time."
    )
    return [
        {"prompt": [{"role": "user", "content": instruction}], "task_id": t.task_id, **t.params}
        for t in generate_tasks(split, num_colors)
    ]


def _join(items: tuple[str, ...]) -> str:
    return ", ".join(items[:-1]) + f" and {items[-1]}" if len(items) > 1 else items[0]
