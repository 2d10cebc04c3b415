"""Toy environments for pipeline tests: deterministic, with reward variance for a random model."""

from __future__ import annotations

from turnrl.envs import Env, StepResult, StopReason, Task


class CountEnv(Env):
    """Three turns; replies are ``obs k``; the final reward depends on the last reply's length."""

    name = "count"
    max_turns = 3

    def __init__(self, task: Task, **options) -> None:
        super().__init__(task, **options)
        self.turn = 0
        self.progress = 0.0

    @classmethod
    def default_tasks(cls, split: str, **options) -> list[Task]:
        return [Task(f"count-{split}-{k}", "count", {"k": k}, split) for k in range(4)]

    def initial_messages(self):
        return [
            {"role": "system", "content": "Say anything."},
            {"role": "user", "content": f"Task {self.task.params['k']}"},
        ]

    def potential(self) -> float:
        return self.progress

    def step(self, action_text: str) -> StepResult:
        self.turn += 1
        self.progress = self.turn / 3
        if self.turn < 3:
            return StepResult([{"role": "user", "content": f"obs {self.turn}"}], reward=0.0)
        reward = float(len(action_text) % 3)
        reason = StopReason.SUCCESS if reward == 2 else StopReason.FAILURE
        return StepResult([], reward=reward, terminated=True, stop_reason=reason, metrics={"len": len(action_text)})


class EarlyEndEnv(CountEnv):
    """Ends after the first turn when the reply is short (to exercise replicated tree leaves)."""

    name = "early"

    def step(self, action_text: str) -> StepResult:
        if self.turn == 0 and len(action_text) % 2 == 0:
            self.turn = 3
            return StepResult([], reward=1.0, terminated=True, stop_reason=StopReason.SUCCESS)
        return super().step(action_text)


class ForkEnv(Env):
    """Two turns with an enumerable true advantage: pick ``a``/``b``, then ``x``/``y``; reward at the end.

    R(a, x) = 1, R(a, y) = 0, R(b, x) = 0, R(b, y) = 3 (:data:`FORK_REWARD`). A reply other than
    the offered letters counts as the second letter. ``state_key`` is the first choice (after turn 1).
    """

    name = "fork"
    max_turns = 2

    def __init__(self, task: Task, **options) -> None:
        super().__init__(task, **options)
        self.first: str | None = None

    @classmethod
    def default_tasks(cls, split: str, **options) -> list[Task]:
        return [Task(f"fork-{split}-0", "fork", {}, split)]

    @classmethod
    def scripted_policies(cls):
        return {"random": fork_policy(0)}

    def initial_messages(self):
        return [{"role": "system", "content": "Choose."}, {"role": "user", "content": "Pick a or b."}]

    def state_key(self):
        return self.first or "start"

    def step(self, action_text: str) -> StepResult:
        choice = action_text.strip()
        if self.first is None:
            self.first = "a" if choice == "a" else "b"
            return StepResult([{"role": "user", "content": f"You picked {self.first}. Pick x or y."}], reward=0.0)
        second = "x" if choice == "x" else "y"
        reward = FORK_REWARD[(self.first, second)]
        return StepResult([], reward=reward, terminated=True, stop_reason=StopReason.SUCCESS)


FORK_REWARD = {("a", "x"): 1.0, ("a", "y"): 0.0, ("b", "x"): 0.0, ("b", "y"): 3.0}
FORK_P_A = 0.6
"""π(a) at the first turn."""
FORK_P_X = {"a": 0.7, "b": 0.5}
"""π(x | first choice) at the second turn."""


def fork_policy(seed: int):
    """The stochastic scripted policy of :class:`ForkEnv` (π above), seeded."""
    import random

    rng = random.Random(seed)

    def policy(messages) -> str:
        last = str(messages[-1]["content"])
        if last.startswith("Pick a or b"):
            return "a" if rng.random() < FORK_P_A else "b"
        first = "a" if "picked a" in last else "b"
        return "x" if rng.random() < FORK_P_X[first] else "y"

    return policy


def fork_fixed_policy(first: str, second: str):
    """A deterministic policy of :class:`ForkEnv` that always plays ``first`` then ``second``."""

    def policy(messages) -> str:
        return first if str(messages[-1]["content"]).startswith("Pick a or b") else second

    return policy
