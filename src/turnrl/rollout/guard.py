"""The guarded calls of collection: environment code run on what a model wrote.

Nothing a model writes can stop a run. :func:`guarded_step` wraps ``env.step(reply)`` (plain or
``async``); an ``Exception`` it raises ends that episode with the environment's ``failure_reward``,
stop reason ``MALFORMED``, episode metric ``env_error`` and the exception as the turn's observation,
logged once per environment class and exception type. :func:`guarded_group_rewards` wraps the
group-level hook ``Env.group_rewards(episodes)``: if it raises, that group gets no group reward
(each episode keeps its own) and metric ``group_reward_error``. ``BaseException``
(KeyboardInterrupt, SystemExit) passes, and errors anywhere else in the collector still raise.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from turnrl.envs import Env
from turnrl.types import StepResult, StopReason

_ERROR_CHARS = 500
_log = logging.getLogger(__name__)
_warned: set[tuple[str, str]] = set()


def _describe(exc: Exception) -> str:
    try:
        return str(exc)[:_ERROR_CHARS]
    except Exception:  # noqa: BLE001 - an exception whose message itself fails
        return "(no message)"


def _warn_once(env_cls: type, exc: Exception, what: str, then: str) -> None:
    if (env_cls.__name__, type(exc).__name__) not in _warned:
        _warned.add((env_cls.__name__, type(exc).__name__))
        _log.warning(
            "environment %s raised %s on %s (%s); %s. Environments should turn such output into a"
            " malformed result themselves",
            env_cls.__name__,
            type(exc).__name__,
            what,
            _describe(exc),
            then,
        )


def guarded_group_rewards(env_cls: type[Env], episodes: list[Any]) -> list[float] | None:
    """``env_cls.group_rewards(episodes)``; on an ``Exception``, None (no group reward for this group)
    and metric ``group_reward_error`` = 1 on each episode."""
    try:
        return env_cls.group_rewards(episodes)
    except Exception as exc:  # noqa: BLE001 - the model's replies must not stop the run
        _warn_once(env_cls, exc, "a group of episodes", "the group gets no group reward")
        for ep in episodes:
            ep.metrics["group_reward_error"] = 1.0
        return None


def step_failure(env: Env, exc: Exception) -> StepResult:
    """The result of a step that raised on the model's reply: the episode ends with the environment's
    ``failure_reward`` (stop reason ``MALFORMED``, metric ``env_error``), the exception recorded."""
    kind, detail = type(exc).__name__, _describe(exc)
    _warn_once(type(env), exc, "a model reply", f"the episode ends with its failure reward {env.failure_reward}")
    return StepResult(
        [],
        reward=float(env.failure_reward),
        terminated=True,
        stop_reason=StopReason.MALFORMED,
        metrics={"env_error": 1.0},
        error=f"{kind}: {detail}",
    )


def guarded_step(env: Env, text: str) -> Callable[[], Any]:
    """The call that steps ``env`` on the reply ``text``, for :func:`run_concurrently`.

    Any ``Exception`` from the step (or from awaiting an ``async`` one) becomes :func:`step_failure`;
    ``BaseException`` (KeyboardInterrupt, SystemExit) passes.
    """
    step = env.step

    async def guard_awaitable(awaitable: Any) -> Any:
        try:
            return await awaitable
        except Exception as exc:  # noqa: BLE001 - the model's reply must not stop the run
            return step_failure(env, exc)

    if inspect.iscoroutinefunction(step):

        async def run_async() -> Any:
            return await guard_awaitable(step(text))

        return run_async

    def run() -> Any:
        try:
            out = step(text)
        except Exception as exc:  # noqa: BLE001 - the model's reply must not stop the run
            return step_failure(env, exc)
        return guard_awaitable(out) if inspect.isawaitable(out) else out

    return run
