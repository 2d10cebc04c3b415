"""Calling environments together: plain calls in a thread pool, ``async`` ones in one ``asyncio.gather``."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def run_concurrently(calls: list[Callable[[], Any]], pool: ThreadPoolExecutor | None) -> list[Any]:
    """Call every function at once; results in input order.

    A coroutine function's coroutine (or any awaitable a call returns) is awaited with the
    others in one ``asyncio.gather``; a plain call runs in ``pool`` (inline without one, or when
    there is a single call). The first exception is raised after every call has finished.
    """
    results: list[Any] = [None] * len(calls)
    awaitables: dict[int, Any] = {}
    futures = {}
    for i, fn in enumerate(calls):
        if inspect.iscoroutinefunction(fn) or pool is None or len(calls) == 1:
            results[i] = fn()
        else:
            futures[i] = pool.submit(fn)
    errors = []
    for i, fut in futures.items():
        try:
            results[i] = fut.result()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the others finished
            errors.append(exc)
    for i, r in enumerate(results):
        if inspect.isawaitable(r):
            awaitables[i] = r
    if awaitables:
        for i, r in zip(awaitables, _gather(list(awaitables.values())), strict=True):
            if isinstance(r, BaseException):
                errors.append(r)
            results[i] = r
    if errors:
        raise errors[0]
    return results


def _gather(awaitables: list[Any]) -> list[Any]:
    async def main() -> list[Any]:
        return await asyncio.gather(*awaitables, return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(main())
    out: list[Any] = []  # called from inside an event loop (a notebook): run ours in a thread
    worker = threading.Thread(target=lambda: out.extend(asyncio.run(main())))
    worker.start()
    worker.join()
    return out
