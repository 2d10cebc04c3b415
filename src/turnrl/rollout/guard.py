"""The one guarded call of collection: an environment stepping on a model's reply.

Nothing a model writes can stop a run. :func:`guarded_step` wraps ``env.step(reply)`` (plain or
``async``); an ``Exception`` it raises ends that episode with the environment's ``failure_reward``,
stop reason ``MALFORMED``, episode metric ``env_error`` and the exception as the turn's observation,
logged once per environment class and exception type. ``BaseException`` (KeyboardInterrupt,
SystemExit) passes, and errors anywhere else in the collector still raise.
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


def step_failure(env: Env, exc: Exception) -> StepResult:
    """The result of a step that raised on the model's reply: the episode ends with the environment's
    ``failure_reward`` (stop reason ``MALFORMED``, metric ``env_error``), the exception recorded."""
    kind = type(exc).__name__
    try:
        detail = str(exc)[:_ERROR_CHARS]
    except Exception:  # noqa: BLE001 - an exception whose message itself fails
        detail = "(no message)"
    if (type(env).__name__, kind) not in _warned:
        _warned.add((type(env).__name__, kind))
        _log.warning(
            "environment %s raised %s on a model reply (%s); the episode ends with its failure reward %s."
            " Environments should turn such replies into a malformed result themselves",
            type(env).__name__,
            kind,
            detail,
            env.failure_reward,
        )
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
