"""Collection overlapped with training (``sampler.max_staleness: 1``): each step's batch is collected while the
previous step trains, one version of the weights behind.

Step n, read aloud (W_n: the trainer's weights after n steps):

    batch_n = the batch collected during step n−1 with W_{n−1}   # or, at an iteration's first step (and
                                                                 # after a resume), collected now
    sampler.refresh(W_n)                                         # when due; nothing is in flight
    start collecting batch_{n+1} with W_n                        # a thread: sampling, environments
    update(trainer, batch_n)                                     # → W_{n+1}, while batch_{n+1} is collected

The synchronous loop (``max_staleness: 0``) collects batch_n with W_n instead and does not come here. The
sampler must hold its own copy of the weights between refreshes (``Sampler.detached``), so the update never
changes what is being sampled; the loss's ``mismatch`` correction weighs the one-step-stale turns (each turn
records the ``policy_version`` that sampled it). A batch is collected whole, so group and tree estimators
receive complete groups only.

Nothing is lost to a kill: the batch in flight is not in the checkpoint, and its tasks are not consumed
(``RunState.cursor`` moves when the batch is taken); the checkpoint holds the sampler's snapshot of W_n, so a
resumed run collects the same batch again (seeds derive from the step) and continues as the uninterrupted run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

from turnrl.chat import ChatTemplate
from turnrl.sampling import Sampler
from turnrl.train import distributed
from turnrl.train.checkpoint import RunState
from turnrl.train.settings import RunSettings
from turnrl.types import Episode, Task

Batch = tuple[list[Episode], dict[str, float]]
CollectFn = Callable[[RunSettings, list[Task], RunState, Sampler, ChatTemplate], Batch]


def check_overlap(settings: RunSettings, sampler: Sampler) -> None:
    """``max_staleness: 1`` needs one process and a sampler with its own copy of the weights (one line otherwise)."""
    if distributed.launched_world_size() > 1:
        raise ValueError(
            "sampler.max_staleness: 1 runs on one process (several processes collect their shares in step);"
            " set sampler.max_staleness: 0 or train on one process"
        )
    if not getattr(sampler, "detached", False):
        why = getattr(sampler, "fast_decode_unsupported", None)
        raise ValueError(
            f"sampler.max_staleness: 1 needs a sampler with its own copy of the weights; backend"
            f" {settings.sampler.backend!r} here generates with the trainer's module"
            + (f" (the packed decoder is off: {why})" if why else " (only LoRA adapters may train)")
            + ": use the packed decoder with LoRA, sampler.backend vllm or openai, or sampler.max_staleness: 0"
        )


class Collector:
    """One batch collected ahead, in one thread (see the module docstring)."""

    def __init__(
        self,
        settings: RunSettings,
        tasks: list[Task],
        sampler: Sampler,
        chat: ChatTemplate,
        refresh: Callable[[], None],
        collect: CollectFn,
    ) -> None:
        check_overlap(settings, sampler)
        self.settings, self.tasks, self.sampler, self.chat = settings, tasks, sampler, chat
        self._refresh, self._collect = refresh, collect
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="turnrl-collect")
        self._ahead: Future[tuple[Batch, int, float]] | None = None
        self._ahead_step = -1

    def _run(self, state: RunState) -> tuple[Batch, int, float]:
        t0 = time.perf_counter()
        batch = self._collect(self.settings, self.tasks, state, self.sampler, self.chat)
        return batch, state.cursor, time.perf_counter() - t0

    def next_batch(self, state: RunState) -> Batch:
        """Step ``state.step``'s batch; then the refresh when due, and the next step's batch started."""
        ahead = self._ahead is not None and self._ahead_step == state.step
        if ahead:
            assert self._ahead is not None
            (episodes, metrics), state.cursor, seconds = self._ahead.result()
            self._ahead = None
            metrics = {**metrics, "collect/ahead": 1.0, "time/collect_ahead_s": seconds}
        else:
            self.discard()
            episodes, metrics = self._collect(self.settings, self.tasks, state, self.sampler, self.chat)
            metrics = {**metrics, "collect/ahead": 0.0}
        if state.iteration_step > 0 and state.step % self.settings.sampler.refresh_every == 0:
            self._refresh()  # the synchronous loop refreshed after the last update; here nothing is in flight
        if state.iteration_step + 1 < self.settings.steps_per_iteration:
            self._ahead_step = state.step + 1
            self._ahead = self._pool.submit(self._run, replace(state, step=state.step + 1))
        return episodes, metrics

    def discard(self) -> None:
        """Wait for a batch in flight and drop it (its tasks were not consumed)."""
        if self._ahead is not None:
            self._ahead.exception()  # wait; an error in a batch nobody takes is not raised
            self._ahead = None

    def close(self) -> None:
        self.discard()
        self._pool.shutdown(wait=True)
