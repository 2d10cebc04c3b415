"""An environment that replays a recorded prefix of actions, then lets the policy continue.

The credit audit needs rollouts that start mid-episode: "the state after the first k turns
of this recorded episode". Environments are deterministic given their task and the actions
they receive, so the state is rebuilt by stepping a fresh environment through the recorded
action texts; the conversation so far becomes the opening messages of a new episode, and the
collector (with any sampler backend, and its deep-copy branching) continues from there.

The replayed turns' rewards are not part of the new episode (its return is the return-to-go
from turn k). ``params.horizon`` is the number of turns left under the original collector
limit: the continuation is truncated there, as the collector would have cut the original.

Token-exactness: the opening context is the chat template's rendering of the replayed
messages, not the sampled token ids of the recorded turns; when the policy sampled a
non-canonical tokenisation the two differ (the audit reports how often, ``replay_exact_frac``).
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable
from typing import Any, ClassVar

from turnrl.envs import Env, make_env
from turnrl.types import Episode, Message, StepResult, StopReason, Task

REPLAY_ENV = "turnrl.audit.replay:ReplayEnv"


def replay_task(task: Task, episode: Episode, k: int, horizon: int | None) -> Task:
    """A task whose episode starts after the first ``k`` turns of ``episode`` (a run of ``task``)."""
    if not 0 < k <= episode.num_turns:
        raise ValueError(f"replay prefix k = {k} must lie in 1..{episode.num_turns} (the episode's turns)")
    params = {
        "task": task.to_dict(),
        "actions": [t.action_text for t in episode.turns[:k]],
        "horizon": None if horizon is None else horizon - k,
    }
    return Task(f"{task.task_id}@{episode.episode_id}:{k}", REPLAY_ENV, params, task.split)


async def _resolve(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class ReplayEnv(Env):
    """Wraps the environment of ``params.task``; its opening is that task's conversation after
    the recorded ``params.actions``. Everything else is the inner environment's."""

    name: ClassVar[str] = "replay"

    def __init__(self, task: Task, **options: Any) -> None:
        super().__init__(task)  # the options are the inner environment's, validated there
        inner = dict(task.params["task"])
        self.inner = make_env(Task(inner["task_id"], inner["env"], inner.get("params", {}), inner["split"]), **options)
        self.actions: list[str] = list(task.params["actions"])
        self.horizon: int | None = task.params.get("horizon")
        self.max_turns = max(1, getattr(self.inner, "max_turns", 1) - len(self.actions))
        self.turns = 0

    async def initial_messages(self) -> list[Message]:
        messages = list(await _resolve(self.inner.initial_messages()))
        for k, text in enumerate(self.actions):
            result: StepResult = await _resolve(self.inner.step(text))
            if result.done:
                raise ValueError(
                    f"replay of {self.task.task_id!r}: the recorded episode ended at turn {k + 1} of the prefix;"
                    " the environment is not deterministic in its task and actions"
                )
            messages += [result.assistant_message or {"role": "assistant", "content": text}, *result.messages]
        return messages

    async def step(self, action_text: str) -> StepResult:
        result: StepResult = await _resolve(self.inner.step(action_text))
        self.turns += 1
        if not result.done and self.horizon is not None and self.turns >= self.horizon:
            return StepResult(
                [], result.reward, truncated=True, stop_reason=StopReason.COLLECTOR_LIMIT, metrics=result.metrics
            )
        return result

    def potential(self) -> float | None:
        return self.inner.potential()

    def observation_text(self, messages: list[Message]) -> str:
        return self.inner.observation_text(messages)

    def state_key(self) -> Hashable | None:
        return self.inner.state_key()

    def tools(self) -> list[dict[str, Any]] | None:
        return self.inner.tools()
