"""Decisions: D independent quiz decisions per episode, with the knobs credit theory names.

Each *decision* is one question with two options (``choices: 3``: three) and one right answer,
a reply of a letter and a word (``B) grape``; three worked examples open the chat)::

    Question 2 of 4: Which one is a fruit? A) hammer B) grape

Decision k of every task asks about its own category (k = 1..8: animal, fruit, colour, tool,
vehicle, body part, drink, weather), so no two decisions of an episode share a rule
(docs/decisions.md says how far that holds for a language model). With ``show_rule: false`` the
category is not named ("Question 2 of 4: Pick one.") and decision k's rule must be learnt from
reward alone. ``rule: position`` drops the categories: decision k's right letter is fixed by k
(:data:`POSITION_KEYS`, "Question 2 of 4: Guess."), a rule a small model learns from reward
quickly, and still one per decision — but every decision answers through the same two letters, so
what one decision learns moves the others (docs/results.md §17). ``rule: word`` gives each decision
a reply of its own: decision k offers its own fixed words (:data:`WORD_RULE`, "Question 2 of 4: Say
one word: north or south.", their order set by the task), the right one is the first of them, and
every menu and reply is a bare word (no letters). Train and held-out tasks draw their words from
disjoint pools (the word rule's words are the same in both; the orders differ).

Layout of an episode (``mode: chain``, the default): ``noise_turns`` lottery turns first (the
noisy prefix), then for each of the ``decisions`` decisions ``fillers`` free turns and the
decision itself. Rewards (``reward: per_turn``):

- decision correct: ``1/D``, wrong or malformed: 0 (so the return is the fraction correct);
- free turn: 0, whatever the reply (entropy, no reward effect);
- lottery turn: ``−noise`` or ``+noise`` by the option chosen (three options: ``−noise, 0,
  +noise``; a permutation fixed per task and turn, unrelated to anything the model can see), 0
  for a malformed reply.

``reward: terminal`` pays the same total at the last turn and 0 before it. An episode is a
``success`` when every decision is right. ``mode: corridor`` (recurring states): the decisions
are rooms 1..D of a corridor walked from room 1; a right answer opens the door to the next room,
a wrong or malformed one sends the walker back to room 1, for ``horizon`` turns (default 2·D) or
until the exit; each room first reached pays ``1/D`` (per turn, or the total at the end);
success = the exit. ``state_key()`` is the position in the layout (chain) or the room
(corridor: rooms recur within and across episodes, gigpo's anchor groups).

Parsing is lenient (the format is not the point): a reply that is one letter, starts with one
(``B) grape``), says ``answer is B``, or names an option's word counts as that option;
``strict: true`` accepts only the menu replies :meth:`DecisionsEnv.action_choices` lists, so
that every other reply is malformed (the exact credit audit's contract). A malformed reply on a
decision counts as wrong (``failure_reward`` 0) and the next message says so; it never ends
the episode. Tasks ship as files (``turnrl/data/decisions_{train,eval}.jsonl``, rebuilt by
:func:`build_tasks`).
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from turnrl.envs.base import Env, EnvOptions
from turnrl.tasks import load_task_file, shipped_task_file, write_task_files
from turnrl.types import Message, StepResult, StopReason, Task

LETTERS = ("A", "B", "C")
MAX_DECISIONS = 8
CATEGORIES: tuple[tuple[str, str, tuple[str, ...], tuple[str, ...]], ...] = (
    # (category, "a/an + category" in a question, train words, held-out words)
    ("animal", "an animal", ("dog", "horse", "rabbit", "tiger", "sheep", "mouse", "eagle", "frog", "bear", "goat"),
     ("lion", "zebra", "camel", "wolf", "duck", "deer")),
    ("fruit", "a fruit", ("apple", "banana", "grape", "cherry", "lemon", "peach", "plum", "mango", "pear", "melon"),
     ("kiwi", "orange", "lime", "papaya", "apricot", "fig")),
    ("colour", "a colour", ("red", "blue", "green", "yellow", "purple", "pink", "brown", "black", "white", "gray"),
     ("violet", "crimson", "teal", "beige", "maroon", "indigo")),
    ("tool", "a tool", ("hammer", "saw", "drill", "wrench", "shovel", "axe", "pliers", "chisel", "rake", "spade"),
     ("screwdriver", "spanner", "trowel", "mallet", "sickle", "crowbar")),
    ("vehicle", "a vehicle", ("car", "truck", "bus", "train", "bicycle", "boat", "plane", "tractor", "van", "scooter"),
     ("taxi", "ship", "jeep", "tram", "motorbike", "helicopter")),
    ("body part", "a body part",
     ("hand", "foot", "knee", "elbow", "nose", "ear", "finger", "shoulder", "chin", "ankle"),
     ("wrist", "thumb", "neck", "toe", "hip", "cheek")),
    ("drink", "a drink", ("tea", "coffee", "milk", "juice", "water", "soda", "cocoa", "lemonade", "wine", "beer"),
     ("cider", "smoothie", "latte", "espresso", "cola", "milkshake")),
    ("weather", "a kind of weather", ("rain", "snow", "wind", "fog", "storm", "hail", "thunder", "frost", "sleet",
     "drizzle"), ("blizzard", "mist", "breeze", "lightning", "tornado", "sunshine")),
)  # fmt: skip
WORD_CATEGORY = {w: c for c, _, train, held in CATEGORIES for w in (*train, *held)}
FILE_NAMES = {"train": "decisions_train.jsonl", "eval": "decisions_eval.jsonl"}
TASKS_PER_SPLIT = {"train": 48, "eval": 30}
EXAMPLES = (
    ("Which one is a piece of furniture?", ("cloud", "chair", "rice"), "B"),
    ("Which one is a musical instrument?", ("violin", "sock", "desert"), "A"),
    ("Which one is a metal?", ("pillow", "poem", "iron"), "C"),
)
"""The worked examples opening the chat (``few_shot``; their words are in no pool)."""
POSITION_KEYS = {2: "BAABABBA", 3: "CABBCAAC"}
"""``rule: position``: the right letter of decision k is ``POSITION_KEYS[choices][k]``."""
WORD_RULE = (
    ("north", "south", "center"), ("early", "late", "never"), ("up", "down", "sideways"), ("rock", "sand", "clay"),
    ("sweet", "sour", "bitter"), ("soft", "hard", "rough"), ("east", "west", "inland"), ("yes", "no", "maybe"),
)  # fmt: skip
"""``rule: word``: decision k's words; the first is right (no category, pool, menu or example word).
Chosen by the base model's first-token preference on question 1 and 3, both orders (docs/decisions.md):
the right word's share 0.39–0.57 of the pair's, nearly the same in either order, so no decision is
settled by the menu's position (pairs like ``sun / moon``, 0.23 first and 0.72 second, were left out)."""
TURN_MENUS = {2: ("left", "right"), 3: ("left", "middle", "right")}
"""The options of free and lottery turns."""
FREE_TEXT = "Free turn (any option is fine, it does not count):"
LOTTERY_TEXT = "Lottery turn (each option pays a hidden random amount):"


def menu(words: list[str] | tuple[str, ...]) -> str:
    """``A) w1 B) w2 C) w3`` (or ``A) w1 B) w2``)."""
    return " ".join(choices(words))


def word_menu(words: list[str] | tuple[str, ...]) -> str:
    """``w1 or w2`` (``w1, w2 or w3``): a menu without letters (``rule: word``)."""
    return f"{', '.join(words[:-1])} or {words[-1]}"


def choices(words: list[str] | tuple[str, ...]) -> list[str]:
    """The canonical replies to a menu: ``["A) w1", "B) w2", "C) w3"]``."""
    return [f"{letter}) {word}" for letter, word in zip(LETTERS, words, strict=False)]


def shrink(options: list[str] | tuple[str, ...], answer: str, n: int) -> tuple[list[str], str]:
    """A decision's menu of ``n`` options (2 or 3) and its answer letter. Two options keep the right
    word and the next one after it (cyclically); the right word comes first when its letter among
    three was A, second when B, and for C first or second as the word's length is even or odd."""
    if n == 3:
        return list(options), answer
    a = LETTERS.index(answer)
    right, other = options[a], options[(a + 1) % 3]
    first = a == 0 or (a == 2 and len(right) % 2 == 0)
    return ([right, other], "A") if first else ([other, right], "B")


class DecisionsOptions(EnvOptions):
    decisions: int = Field(4, ge=1, le=MAX_DECISIONS)
    """D: decisions per episode (decision k asks about category k)."""
    fillers: int = Field(0, ge=0, le=4)
    """Free turns before each decision (no reward effect); chain mode only."""
    reward: Literal["per_turn", "terminal"] = "per_turn"
    """``per_turn``: each turn's reward on its turn; ``terminal``: the same total at the last turn."""
    noise_turns: int = Field(0, ge=0, le=8)
    """Lottery turns before the first decision (the noisy prefix); chain mode only."""
    noise: float = Field(0.5, ge=0.0, le=10.0)
    """A lottery turn pays −noise, 0 or +noise by the option chosen (two options: −noise or +noise)."""
    choices: int = Field(2, ge=2, le=3)
    """Options per question: 2 (A, B; the default, the base model's rate nearest 50 %) or 3 (A, B, C)."""
    mode: Literal["chain", "corridor"] = "chain"
    """``corridor``: a wrong answer sends the walker back to room 1 (recurring states)."""
    horizon: int | None = Field(None, ge=1, le=64)
    """Corridor mode: turns before the walk ends (default 2·decisions)."""
    rule: Literal["category", "position", "word"] = "category"
    """``category``: decision k's right word is of category k; ``position``: its right letter is fixed by k;
    ``word``: its right word is fixed by k (:data:`WORD_RULE`; bare-word menus and replies)."""
    show_rule: bool = True
    """Name each question's category (False: "pick one", the rule learnt from reward alone)."""
    strict: bool = False
    """Accept only the canonical replies (``B) grape``: :meth:`DecisionsEnv.action_choices`); others are malformed."""
    few_shot: bool = True
    """Open with three worked example questions (user/assistant turns): the reply format."""

    @model_validator(mode="after")
    def _mode_knobs(self) -> DecisionsOptions:
        if self.mode == "corridor" and (self.fillers or self.noise_turns):
            raise ValueError(
                "env.options.fillers / noise_turns: corridor mode has neither (set them to 0, or mode: chain)"
            )
        if self.mode == "chain" and self.horizon is not None:
            raise ValueError("env.options.horizon: only corridor mode has a horizon (drop it, or mode: corridor)")
        return self


def parse_choice(text: str, options: list[str], strict: bool = False, words_only: bool = False) -> str | None:
    """The letter a reply chooses, or None (malformed).

    ``words_only`` (``rule: word``, letterless menus): strict, the reply stripped is exactly one
    option word; lenient, the option word named first (whole word, any case); letters mean nothing.

    ``strict``: the reply stripped is exactly one of :func:`choices` (``B) grape``). Lenient: a lone
    letter (any case, with punctuation: ``(b).``), a leading letter (``B) grape``, ``C. tea``,
    ``A) crowbar`` whatever the word), ``answer is B`` / ``answer: B``, else the option word named
    first (whole word, any case)."""
    text = text if isinstance(text, str) else ""
    if words_only and strict:
        return LETTERS[options.index(text.strip())] if text.strip() in options else None
    if strict:
        canon = choices(options)
        return LETTERS[canon.index(text.strip())] if text.strip() in canon else None
    head, letters = text[:2000], "".join(LETTERS[: len(options)])
    if words_only:
        return _first_word(head, options)
    if (m := re.fullmatch(r"\W*([A-Za-z])\W*", head)) and m.group(1).upper() in letters:
        return m.group(1).upper()
    if (m := re.match(r"\s*\(?([A-Z])(?:[).:,]|\s|$)", head)) and m.group(1) in letters:
        return m.group(1)
    if (m := re.search(r"(?i:answer)\s*(?:is|:)?\s*\(?([A-Z])\b", head)) and m.group(1) in letters:
        return m.group(1)
    return _first_word(head, options)


def _first_word(text: str, options: list[str]) -> str | None:
    """The letter of the option word named first in ``text`` (whole word, any case), or None."""
    hits = [(m.start(), i) for i, w in enumerate(options) if (m := re.search(rf"\b{re.escape(w)}\b", text, re.I))]
    return LETTERS[min(hits)[1]] if hits else None


def lottery_payoffs(task_id: str, turn: int, noise: float, n: int = 3) -> dict[str, float]:
    """Letter → payoff of lottery turn ``turn``: a permutation of (−noise, 0, +noise) (two options:
    of (−noise, +noise)), fixed by task and turn; mean 0 over the options."""
    values = [-noise, 0.0, noise] if n == 3 else [-noise, noise]
    random.Random(f"decisions-lottery-{task_id}-{turn}").shuffle(values)
    return dict(zip(LETTERS, values, strict=False))


def _question(k: int, d: int, words: list[str], rule: str, show_rule: bool, room: bool) -> str:
    where = f"Room {k + 1} of {d}" if room else f"Question {k + 1} of {d}"
    if rule == "word":
        return f"{where}: {WORD_ASK} {word_menu(words)}."
    ask = "Guess." if rule == "position" else f"Which one is {CATEGORIES[k][1]}?" if show_rule else "Pick one."
    return f"{where}: {ask} {menu(words)}"


WORD_ASK = "Say one word:"
"""``rule: word``'s question (then the letterless menu)."""


class DecisionsEnv(Env):
    """D independent quiz decisions, with filler turns, a noisy prefix, reward timing and a
    corridor mode (module doc). Task params: ``decisions``, a list of 8 ``{"options": [three words],
    "answer": "A"|"B"|"C"}`` (decision k's right word is of category k); the first D are played."""

    name: ClassVar[str] = "decisions"
    Options = DecisionsOptions
    options: DecisionsOptions
    failure_reward: ClassVar[float] = 0.0

    def __init__(self, task: Task, **options: Any) -> None:
        super().__init__(task, **options)
        _validate(task, f"task {task.task_id!r}")
        o = self.options
        self.d = o.decisions
        self.n = o.choices
        self.items = [shrink(x["options"], x["answer"], self.n) for x in task.params["decisions"][: self.d]]
        """Per decision: (its menu of words, the right letter)."""
        if o.rule == "position":
            self.items = [(words, POSITION_KEYS[self.n][k]) for k, (words, _) in enumerate(self.items)]
        elif o.rule == "word":  # decision k's own words, the right one (the first) at the task's letter
            self.items = [_word_item(WORD_RULE[k][: self.n], letter) for k, (_, letter) in enumerate(self.items)]
        self.words = o.rule == "word"
        self.corridor = o.mode == "corridor"
        if self.corridor:
            self.layout = ["decision"] * (o.horizon or 2 * self.d)  # kinds of turns; the room is state
        else:
            self.layout = ["lottery"] * o.noise_turns + (["free"] * o.fillers + ["decision"]) * self.d
        self.max_turns = len(self.layout)
        self.turn = 0
        self.room = 0  # corridor: the room the walker is in; chain: the next decision's index
        self.best = 0  # corridor: rooms opened (furthest progress)
        self.correct = 0
        self.malformed = 0
        self.total = 0.0  # the return so far (paid at the end under reward: terminal)

    # ------------------------------------------------------------------ prompts

    def _system(self) -> str:
        o = self.options
        if self.words:
            shows = "two words" if self.n == 2 else "three words"
            reply = "Reply with the word of your choice only, for example: chair"
        else:
            shows = "two options A and B" if self.n == 2 else "three options A, B and C"
            reply = "Reply with the letter and the word of your choice only, for example: B) chair"
        lines = [f"You are answering a quiz. Each question shows {shows}.", reply]
        if self.corridor:
            lines.append(
                f"You walk a corridor of {self.d} rooms. A right answer opens the door to the next room;"
                " a wrong answer sends you back to room 1."
            )
        if o.fillers:
            lines.append("Some turns are free turns: any option is fine there, it does not count.")
        if o.noise_turns:
            lines.append("Some turns are lottery turns: each option pays a hidden random amount.")
        if not o.show_rule or o.rule != "category":
            lines.append("Each question has its own hidden rule for which option is right.")
        return "\n".join(lines)

    def _prompt(self) -> str:
        """The message asking for the next turn."""
        kind = self.layout[self.turn]
        if kind in ("lottery", "free"):
            text, words = LOTTERY_TEXT if kind == "lottery" else FREE_TEXT, TURN_MENUS[self.n]
            return f"{text} {word_menu(words)}." if self.words else f"{text} {menu(words)}"
        o = self.options
        return _question(self.room, self.d, self.items[self.room][0], o.rule, o.show_rule, self.corridor)

    def initial_messages(self) -> list[Message]:
        messages: list[Message] = [{"role": "system", "content": self._system()}]
        o = self.options
        if o.few_shot:
            for question, three, letter in EXAMPLES:
                words, answer = shrink(three, letter, self.n)
                if self.words:
                    ask, reply = f"{WORD_ASK} {word_menu(words)}.", words[LETTERS.index(answer)]
                else:
                    ask = "Guess." if o.rule == "position" else question if o.show_rule else "Pick one."
                    ask, reply = f"{ask} {menu(words)}", choices(words)[LETTERS.index(answer)]
                messages.append({"role": "user", "content": f"Example. {ask}"})
                messages.append({"role": "assistant", "content": reply})
        return [*messages, {"role": "user", "content": "Now the quiz. " * self.options.few_shot + self._prompt()}]

    # ------------------------------------------------------------------ hooks

    def state_key(self) -> tuple[str, int]:
        """Chain: ``("turn", t)``, the position in the layout (what earlier answers were changes
        nothing ahead); corridor: ``("room", r)`` (rooms recur: gigpo's anchor states)."""
        return ("room", self.room) if self.corridor else ("turn", self.turn)

    def action_choices(self) -> list[str] | None:
        """With ``strict: true``, the canonical replies to the next turn's menu, ``["A) lion", "B) mist",
        "C) indigo"]`` (free and lottery turns: ``A) left`` ...), every other reply malformed (a
        decision: wrong; a lottery: 0; a free turn: nothing) — the hook's contract. Lenient parsing
        (the default) also reads ``B``, ``B) anything`` or ``mist`` as B, so there off-menu replies are
        not one outcome and the set is not declared (None: an exact audit refuses the run)."""
        if not self.options.strict:
            return None
        menu_words = self.items[self.room][0] if self.layout[self.turn :][:1] == ["decision"] else TURN_MENUS[self.n]
        return list(menu_words) if self.words else choices(menu_words)

    @classmethod
    def scripted_policies(cls):
        return {"oracle": oracle_policy, "random": random_policy(0), "always_a": lambda messages: "A"}

    # ------------------------------------------------------------------ step

    def step(self, action_text: str) -> StepResult:
        if self.turn >= len(self.layout):
            raise RuntimeError(f"decisions episode {self.task.task_id!r} is over; build a new env")
        kind = self.layout[self.turn]
        options = self.items[self.room][0] if kind == "decision" else list(TURN_MENUS[self.n])
        choice = parse_choice(action_text, options, self.options.strict, words_only=self.words)
        reward, note = 0.0, ""
        if choice is None and kind != "free":
            self.malformed += 1
            then = "it counts as wrong" if kind == "decision" else "it pays nothing"
            note = f"(Your reply names no option of the menu: {then}.) "
        if kind == "lottery" and choice is not None:
            reward = lottery_payoffs(self.task.task_id, self.turn, self.options.noise, self.n)[choice]
        elif kind == "decision":
            right = choice == self.items[self.room][1]
            self.correct += right
            reward, note = self._move(right, note)
        self.turn += 1
        self.total = round(self.total + reward, 9)
        done = self.turn >= len(self.layout) or (self.corridor and self.best == self.d)
        if not done:
            pay = reward if self.options.reward == "per_turn" else 0.0
            return StepResult([{"role": "user", "content": note + self._prompt()}], pay, metrics=self._metrics())
        pay = reward if self.options.reward == "per_turn" else self.total
        won = (self.best if self.corridor else self.correct) == self.d
        reason = StopReason.SUCCESS if won else StopReason.MALFORMED if self.malformed else StopReason.FAILURE
        return StepResult([], pay, terminated=True, stop_reason=reason, metrics=self._metrics())

    def _move(self, right: bool, note: str) -> tuple[float, str]:
        """A decision's reward and the note before the next message; advance to the next decision/room."""
        if not self.corridor:
            self.room += 1
            return (1.0 / self.d if right else 0.0), note
        if not right:
            self.room = 0
            return 0.0, note + ("Wrong door: back to room 1. " if not note else "Back to room 1. ")
        self.room += 1
        reward = 0.0
        if self.room > self.best:  # a room reached for the first time pays 1/D
            self.best, reward = self.room, 1.0 / self.d
        return reward, ("Right door. " if self.room < self.d else "")

    def _metrics(self) -> dict[str, float]:
        answered = sum(1 for k in self.layout[: self.turn] if k == "decision")
        m = {
            "success": float((self.best if self.corridor else self.correct) == self.d),
            "decision_accuracy": self.correct / max(answered, 1),
            "malformed": float(self.malformed),
        }
        if self.corridor:
            m["progress"] = self.best / self.d
        return m

    # ------------------------------------------------------------------ tasks

    @classmethod
    def default_tasks(cls, split: str, **options: Any) -> list[Task]:
        """The shipped tasks: ``train`` (48, train word pools) or ``eval`` (30, held-out words)."""
        cls.parse_options(options)
        return cls.load_tasks(shipped_task_file(cls.name, FILE_NAMES, split), split)

    @classmethod
    def load_tasks(cls, path: str | Path, split: str | None = None) -> list[Task]:
        return load_task_file(path, split, validate=_validate)


def _word_item(words: tuple[str, ...], letter: str) -> tuple[list[str], str]:
    """``rule: word``: the menu with the right word (``words[0]``) at ``letter``, the others in order."""
    at, others = LETTERS.index(letter), list(words[1:])
    return [*others[:at], words[0], *others[at:]], letter


def _validate(task: Task, where: str) -> None:
    items = task.params.get("decisions")
    if not isinstance(items, list) or len(items) != MAX_DECISIONS:
        raise ValueError(f"{where}: params.decisions must be a list of {MAX_DECISIONS} decisions")
    for k, item in enumerate(items):
        at = f"{where}: params.decisions[{k}]"
        if not isinstance(item, dict) or set(item) != {"options", "answer"}:
            raise ValueError(f"{at} must be {{'options': [three words], 'answer': 'A'|'B'|'C'}}")
        opts, answer = item["options"], item["answer"]
        if not (isinstance(opts, list) and len(opts) == 3 and all(isinstance(w, str) and w.isalpha() for w in opts)):
            raise ValueError(f"{at}.options must be three distinct words (letters only)")
        if len(set(opts)) != 3:
            raise ValueError(f"{at}.options must be three distinct words (letters only)")
        if answer not in LETTERS:
            raise ValueError(f"{at}.answer must be one of A, B, C, got {answer!r}")


# --------------------------------------------------------------------------- scripted policies

_QUESTION_RE = re.compile(r"(?:Question|Room) (\d+) of \d+: ")
_OPTION_RE = re.compile(r"\b([A-C])\) (\w+)")
_WORD_MENU_RE = re.compile(r": (\w+(?:, \w+)*) or (\w+)\.$")


def _word_options(text: str) -> list[str]:
    """The words of a letterless menu (``rule: word``) ending ``text``, or []."""
    m = _WORD_MENU_RE.search(text)
    return [*m.group(1).split(", "), m.group(2)] if m else []


def oracle_policy(messages: list[Message]) -> str:
    """The option of decision k's category (the pools hold every word), of its letter under
    ``rule: position``, or its first :data:`WORD_RULE` word under ``rule: word``; ``left`` on other turns."""
    last = str(messages[-1]["content"])
    m, options = _QUESTION_RE.search(last), _OPTION_RE.findall(last)
    if f": {WORD_ASK} " in last:  # rule: word
        return WORD_RULE[int(m.group(1)) - 1][0] if m else "left"
    if _word_options(last):  # rule: word, a free or lottery turn
        return "left"
    if m and ": Guess." in last:  # rule: position
        letter = POSITION_KEYS[len(options)][int(m.group(1)) - 1]
        return next(f"{x}) {w}" for x, w in options if x == letter)
    category = CATEGORIES[int(m.group(1)) - 1][0] if m else None
    return next((f"{letter}) {w}" for letter, w in options if WORD_CATEGORY.get(w) == category), "A) left")


def random_policy(seed: int):
    """A uniformly random option of the menu shown, every turn (right one time in two, or three)."""
    rng = random.Random(seed)

    def policy(messages: list[Message]) -> str:
        last = str(messages[-1]["content"])
        if words := _word_options(last):
            return rng.choice(words)
        options = _OPTION_RE.findall(last) or [("A", "left")]
        return "{}) {}".format(*rng.choice(options))

    return policy


# --------------------------------------------------------------------------- the task files


def make_tasks(split: str, seed: int = 0) -> list[Task]:
    """A split's tasks: decision k's right word from category k's pool for the split (cycling
    through it), two distractors from two other categories (the split's pools), the right answer's
    letter cycling A, B, C across tasks and offset by k, the distractors' order random."""
    rng = random.Random(f"decisions-{split}-{seed}")
    col = 2 if split == "train" else 3  # the column of CATEGORIES holding the split's words
    out = []
    for i in range(TASKS_PER_SPLIT[split]):
        items = []
        for k in range(len(CATEGORIES)):
            words = CATEGORIES[k][col]
            right = words[(i + k) % len(words)]
            others = rng.sample([j for j in range(len(CATEGORIES)) if j != k], 2)
            distractors = [rng.choice(CATEGORIES[j][col]) for j in others]
            pos = (i + k) % 3
            options = distractors[:pos] + [right] + distractors[pos:]
            items.append({"options": options, "answer": LETTERS[pos]})
        out.append(Task(f"decisions-{split}-{i:02d}", DecisionsEnv.name, {"decisions": items}, split))
    return out


def build_tasks(out_dir: str | Path) -> list[Path]:
    """Write ``decisions_train.jsonl`` and ``decisions_eval.jsonl`` (the shipped files)."""
    return write_task_files(out_dir, FILE_NAMES, make_tasks)
