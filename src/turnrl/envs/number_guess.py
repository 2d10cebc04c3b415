"""Number guessing: a multi-turn task where each turn's feedback shapes the next guess.

The environment hides an integer in [1, 20]. Every assistant reply must contain
``<answer>N</answer>``; when it holds several, the last one counts. A wrong guess
gets ``<feedback>higher</feedback>`` or ``<feedback>lower</feedback>`` as the next
user message. Rewards are per turn, 0.0 on intermediate turns, so an episode's
reward (the sum) is:

- correct guess on turn k: ``2.0 - 0.1 * (k - 1)``; terminated, ``SUCCESS``;
- malformed reply (no ``<answer>N</answer>``, N not an integer, or N outside
  [1, 20]) on any turn: ``-2.0``; terminated, ``MALFORMED``;
- ``max_turns`` (default 6) wrong guesses: ``-1.0``; terminated, ``FAILURE``.

Running out of guesses is *termination*, not truncation: the game's own rules end
it, and no future reward was cut off (a value function should not bootstrap
past it). Truncation is reserved for limits imposed from outside the task (the
collector's limit).

Train targets are odd (1, 3, ..., 19), eval targets even (2, 4, ..., 20).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from pydantic import Field

from turnrl.envs.base import (
    Env,
    EnvOptions,
    Message,
    SplitName,
    StepResult,
    StopReason,
    Task,
    check_split,
)

LOW, HIGH = 1, 20
DEFAULT_MAX_TURNS = 6

SUCCESS_REWARD = 2.0
"""Reward for a correct first guess; each extra turn costs ``TURN_PENALTY``."""
TURN_PENALTY = 0.1
MALFORMED_REWARD = -2.0
FAILURE_REWARD = -1.0

# The content may not contain "<", so in "<answer> um <answer>7</answer>" the inner tag matches.
_ANSWER_RE = re.compile(r"<answer>([^<]*)</answer>", re.IGNORECASE)
_INT_RE = re.compile(r"[+-]?\d{1,9}")  # longer is out of range anyway; int() of huge strings raises

# The worked example shown with ``few_shot=True``: binary search to 13 in three guesses.
_EXAMPLE_GAME: tuple[tuple[int, str], ...] = ((10, "higher"), (15, "lower"), (13, "correct"))


def parse_guess(text: str) -> int | None:
    """The guess in a reply: the integer inside the last ``<answer>...</answer>``.

    Returns ``None`` when there is no answer tag or its content is not a plain
    integer (surrounding whitespace is allowed). Range checking is the caller's.
    """
    matches = _ANSWER_RE.findall(text)
    if not matches:
        return None
    content = matches[-1].strip()
    if not _INT_RE.fullmatch(content):
        return None
    return int(content)


def success_reward(turn: int) -> float:
    """``2.0 - 0.1 * (turn - 1)`` for a correct guess on 1-based ``turn``, rounded to 1e-9."""
    return round(SUCCESS_REWARD - TURN_PENALTY * (turn - 1), 9)


def feedback_text(direction: str) -> str:
    """The user message after a wrong guess: ``<feedback>higher</feedback>`` or ``...lower...``."""
    return f"<feedback>{direction}</feedback>"


class NumberGuessOptions(EnvOptions):
    few_shot: bool = False
    """Open with one worked example game."""
    max_turns: int = Field(DEFAULT_MAX_TURNS, ge=1, le=1000)
    """Guesses allowed before the game is lost."""


class NumberGuessEnv(Env):
    """Guess a hidden integer in [1, 20] from higher/lower feedback.

    Task params: ``{"target": N}`` with N in [1, 20].

    Options:
        few_shot (bool, default False): open with one worked example game as
            earlier user/assistant turns, so a small chat model sees the exact
            reply format before its own first turn.
        max_turns (int, default 6): guesses allowed before the game is lost.
    """

    name: ClassVar[str] = "number_guess"
    Options = NumberGuessOptions
    options: NumberGuessOptions
    failure_reward: ClassVar[float] = MALFORMED_REWARD

    def __init__(self, task: Task, **options: Any) -> None:
        super().__init__(task, **options)
        target = task.params.get("target")
        if isinstance(target, bool) or not isinstance(target, int) or not LOW <= target <= HIGH:
            raise ValueError(
                f"task {task.task_id!r}: params.target must be an integer in [{LOW}, {HIGH}], got {target!r}"
            )
        self.target: int = target
        self.max_turns = self.options.max_turns
        self.few_shot: bool = self.options.few_shot
        self.turns = 0
        self.done = False
        self.low, self.high = LOW, HIGH
        """The interval the feedback so far implies for the secret number."""

    def state_key(self) -> tuple[int, int]:
        """``(low, high)``: the interval the feedback so far implies (anchor state for ``gigpo``).

        Two turns of one task acting from the same interval act from the same
        information state, whatever guesses led there: 10 "higher", 15 "lower" gives (11, 14),
        and so does 5 "higher", 15 "lower", 10 "higher".
        """
        return (self.low, self.high)

    # ------------------------------------------------------------------ prompts

    def system_prompt(self) -> str:
        return (
            "You are playing a number guessing game. I have picked a secret whole number "
            f"from {LOW} to {HIGH}. You have {self.max_turns} guesses to find it.\n"
            "After each wrong guess I reply <feedback>higher</feedback> if the secret number "
            "is higher than your guess, or <feedback>lower</feedback> if it is lower.\n"
            "Reply with your guess in exactly this format: <answer>N</answer>, for example "
            "<answer>10</answer>. If you write several, only the last <answer> counts.\n"
            f"A reply without <answer>N</answer>, or with N outside {LOW} to {HIGH}, loses the game."
        )

    def _opening(self) -> str:
        return f"I have picked a secret number from {LOW} to {HIGH}. What is your first guess?"

    def initial_messages(self) -> list[Message]:
        messages: list[Message] = [{"role": "system", "content": self.system_prompt()}]
        if not self.few_shot:
            messages.append({"role": "user", "content": self._opening()})
            return messages
        messages.append({"role": "user", "content": "Example game. " + self._opening()})
        for i, (guess, result) in enumerate(_EXAMPLE_GAME):
            messages.append({"role": "assistant", "content": f"<answer>{guess}</answer>"})
            if result != "correct":
                messages.append({"role": "user", "content": feedback_text(result)})
            else:
                messages.append(
                    {
                        "role": "user",
                        "content": (
                            f"<feedback>correct</feedback> You won the example game in {i + 1} guesses.\n"
                            "Now a new game. I have picked a new secret number from "
                            f"{LOW} to {HIGH}. What is your first guess?"
                        ),
                    }
                )
        return messages

    # --------------------------------------------------------------------- step

    def step(self, action_text: str) -> StepResult:
        if self.done:
            raise RuntimeError(f"number_guess episode {self.task.task_id!r} is over; build a new env")
        self.turns += 1
        guess = parse_guess(action_text if isinstance(action_text, str) else "")
        if guess is None or not LOW <= guess <= HIGH:
            return self._end(self.failure_reward, StopReason.MALFORMED, success=False, malformed=True)
        if guess == self.target:
            return self._end(success_reward(self.turns), StopReason.SUCCESS, success=True, malformed=False)
        if self.turns >= self.max_turns:
            return self._end(FAILURE_REWARD, StopReason.FAILURE, success=False, malformed=False)
        direction = "higher" if self.target > guess else "lower"
        if direction == "higher":
            self.low = max(self.low, guess + 1)
        else:
            self.high = min(self.high, guess - 1)
        return StepResult(
            messages=[{"role": "user", "content": feedback_text(direction)}],
            reward=0.0,
            metrics=self._metrics(success=False, malformed=False),
        )

    def _end(self, reward: float, reason: StopReason, *, success: bool, malformed: bool) -> StepResult:
        self.done = True
        return StepResult(
            messages=[],
            reward=reward,
            terminated=True,
            truncated=False,
            stop_reason=reason,
            metrics=self._metrics(success=success, malformed=malformed),
        )

    def _metrics(self, *, success: bool, malformed: bool) -> dict[str, float]:
        return {
            "success": float(success),
            "malformed": float(malformed),
            "turns": float(self.turns),
        }

    # -------------------------------------------------------------------- tasks

    @classmethod
    def default_tasks(cls, split: str, **options: Any) -> list[Task]:
        """Train: odd targets 1..19; eval: even targets 2..20 (10 tasks each)."""
        cls.parse_options(options)
        split = check_split(split)
        start = 1 if split == SplitName.TRAIN else 2
        return [
            Task(
                task_id=f"number_guess-{split}-{n:02d}",
                env=cls.name,
                params={"target": n},
                split=split,
            )
            for n in range(start, HIGH + 1, 2)
        ]
