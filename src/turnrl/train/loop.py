"""The training loop: iterations of (collect → credit → update) steps, evaluation, checkpoints.

Outer iteration n trains a fresh LoRA adapter on the base model with adapters
0..n−1 merged in, then evaluates on held-out tasks and saves
``adapters/iter_NNN``. Checkpoints (every ``train.checkpoint_every`` steps) make a killed run
resume where it stopped; sampling seeds derive from (seed, step), so a resumed
CPU run reproduces the uninterrupted one. One step, read aloud:

    episodes = collect(tasks, sampler)        # the policy acts; environments reply and score
                                              # (N processes: each its share of tasks, then gathered)
    metrics  = assign_credit(episodes)        # one advantage per turn (Turn.advantage)
    rows     = build_rows(episodes)           # token rows with loss masks
    metrics |= update(trainer, rows)          # forward/backward, optimizer step (num_iterations passes,
                                              # fewer when approx-KL passes train.target_kl)
    metrics |= rollout_metrics(episodes)      # lengths, turns, stop/<reason>, episode/<metric>
    sampler.refresh(trainer.policy_weights()) # every sampler.refresh_every steps

With ``sampler.max_staleness: 1`` the step's batch was collected while the last step trained
(:mod:`turnrl.train.overlap`), and the refresh comes before the next batch starts.

The run's record (:class:`~turnrl.train.summary.Summary`) gains each iteration's held-out
evaluation and is complete when the last one has ended; ``train()`` returns it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

from rich.console import Console

from turnrl.chat import ChatTemplate
from turnrl.config import RunConfig
from turnrl.credit import assign_credit, filter_zero_variance
from turnrl.eval import evaluate
from turnrl.rollout.collect import collect
from turnrl.rundir import RunDir
from turnrl.sampling import Sampler, make_sampler
from turnrl.tasks import TaskStream
from turnrl.train import distributed
from turnrl.train.base_eval import BaseEvaluations
from turnrl.train.batch import build_rows, mask_truncated_turns
from turnrl.train.checkpoint import Checkpoint, ResumeError, RunState
from turnrl.train.diagnostics import rollout_metrics
from turnrl.train.overlap import Collector, check_overlap
from turnrl.train.policy import build_policy, step_seed
from turnrl.train.run import Run, Start
from turnrl.train.settings import RunSettings
from turnrl.train.step import Trainer, idle_metrics, update
from turnrl.train.summary import Summary
from turnrl.types import Episode, Task

__all__ = ["ResumeError", "collect_batch", "train", "train_step"]


def run_dir_for(cfg: RunConfig) -> RunDir:
    """The run directory a config trains into (``paths.output_dir/run_name``)."""
    return Run.dir_for(cfg)


def collect_batch(
    settings: RunSettings, train_tasks: list[Task], state: RunState, sampler: Sampler, chat: ChatTemplate
) -> tuple[list[Episode], dict[str, float]]:
    """Episodes for one step; with dynamic sampling, zero-variance groups are dropped (and refilled).

    With several processes each collects its share of the tasks and every process gets all the episodes.
    """
    r = settings.rollout
    seed = step_seed(settings.seed, state.step)
    kept: list[Episode] = []
    dropped = 0
    needed = r.tasks_per_step
    for round_ in range(4 if r.refill else 1):
        tasks = TaskStream(train_tasks, settings.seed).take(state.cursor, needed)
        state.cursor += needed
        params = settings.sampler.sampling(seed + round_)
        mine = _share(settings, len(tasks))  # this process's tasks (all of them on one process)
        prefix = f"s{state.step + 1}r{round_}-"
        episodes = collect(
            [tasks[i] for i in mine], sampler, chat, params, r.shape, r, id_prefix=prefix, first_task=mine.start
        )
        if settings.shard_collection:
            episodes = distributed.gather_episodes(episodes)  # every rank's, in task order
        if not r.dynamic_sampling:
            return episodes, {}
        groups: dict[str, list[Episode]] = {}
        for ep in episodes:
            groups.setdefault(ep.group_id, []).append(ep)
        good, n_dropped = filter_zero_variance(list(groups.values()))
        kept += [ep for g in good for ep in g]
        dropped += n_dropped
        needed = n_dropped
        if needed == 0:
            break
    return kept, {"dynamic_sampling/dropped_groups": float(dropped)}


def _share(settings: RunSettings, n: int) -> range:
    if not settings.shard_collection:
        return range(n)
    return distributed.task_share(n, distributed.rank(), distributed.launched_world_size())


def train_step(
    settings: RunSettings,
    trainer: Trainer,
    sampler: Sampler,
    chat: ChatTemplate,
    train_tasks: list[Task],
    state: RunState,
    collector: Collector | None = None,
) -> tuple[list[Episode], dict[str, float]]:
    t0 = time.perf_counter()
    if collector is None:  # synchronous: collect with the weights of the last refresh, then train
        episodes, metrics = collect_batch(settings, train_tasks, state, sampler, chat)
    else:  # overlapped: the batch collected while the last step trained; the next one starts now
        episodes, metrics = collector.next_batch(state)
    t1 = time.perf_counter()
    metrics.update(assign_credit(episodes, settings.credit))
    if settings.mask_truncated_completions:
        metrics.update(mask_truncated_turns(episodes))
    rows = build_rows(episodes, per_turn=settings.per_turn_rows)
    if rows:
        metrics.update(update(trainer, rows, settings.step, seed=step_seed(settings.seed, state.step, salt=17)))
    else:  # every group dropped or every turn masked: nothing to learn; the same columns, at 0
        metrics.update(idle_metrics(settings.step))
    t2 = time.perf_counter()
    metrics.update(rollout_metrics(episodes))  # lengths, turns, success, stop/<reason>, episode/<metric>
    metrics.update(
        {
            "policy_version": float(sampler.policy_version),
            "lr": metrics.get("lr", settings.step.lr),
            "time/collect_s": t1 - t0,
            "time/train_s": t2 - t1,
        }
    )
    state.step += 1
    state.iteration_step += 1
    state.train_seconds += t2 - t0
    if collector is None and state.step % settings.sampler.refresh_every == 0:
        sampler.refresh(trainer.policy_weights())
    state.sampler_version = sampler.policy_version
    return episodes, metrics


@dataclass
class Policy:
    """An outer iteration's policy: its trainer, the training sampler, the (fresh) evaluation sampler, the chat."""

    trainer: Trainer
    sampler: Sampler
    eval_sampler: Sampler
    chat: ChatTemplate


def build_iteration(run: Run, state: RunState, ckpt: Checkpoint | None) -> Policy:
    """Base + adapters 0..n−1 merged and a fresh LoRA; its trainer and samplers (mid-iteration: restored)."""
    s = run.settings
    model, tokenizer = build_policy(s.policy, run.dir, state.iteration)
    trainer = distributed.make_trainer(model, s.step, pad_id=tokenizer.pad_token_id)
    sampler = make_sampler(s.sampler, model, tokenizer)
    if s.sampler.max_staleness:
        check_overlap(s, sampler)  # before anything is evaluated or saved
    sampler.policy_version = state.sampler_version
    if ckpt is not None and state.iteration_step > 0:  # mid-iteration resume: adapter, optimizer, stale snapshot
        trainer.load_state_dict(ckpt.trainer)
        sampler.load_state_dict(ckpt.sampler)
    eval_sampler = make_sampler(s.sampler, model, tokenizer, stale=False)
    chat = s.chat.template(tokenizer)
    return Policy(trainer, sampler, eval_sampler, chat)


@contextlib.contextmanager
def overlapped_collector(run: Run, policy: Policy) -> Iterator[Collector | None]:
    """The iteration's collector one batch ahead (``sampler.max_staleness: 1``), or None (synchronous)."""
    if not run.settings.sampler.max_staleness:
        yield None
        return
    trainer, sampler = policy.trainer, policy.sampler
    refresh = lambda: sampler.refresh(trainer.policy_weights())  # noqa: E731
    collector = Collector(run.settings, run.train_tasks, sampler, policy.chat, refresh, collect_batch)
    try:
        yield collector
    finally:
        collector.close()  # a batch still in flight (the time ran out) is waited for and dropped


def evaluate_and_log(
    run: Run, policy: Policy, state: RunState, label: str, shared: BaseEvaluations | None = None
) -> dict[str, float]:
    """Evaluate on held-out tasks; save the episodes and log one eval row. ``shared`` (the base evaluation
    only): taken from a run that computed the same one, or computed and kept for the next."""
    key = run.settings.base_eval if shared is not None else None
    result = shared.get(key) if shared is not None and key is not None else None
    if result is None:
        seed = step_seed(run.settings.seed, state.step, salt=99)
        result = evaluate(run.eval_tasks, policy.eval_sampler, policy.chat, run.settings.eval, seed=seed)
        if shared is not None and key is not None:
            shared.put(key, result)
    run.log_eval(state, result.episodes, label, result.metrics)
    return result.metrics


def train(
    cfg: RunConfig,
    *,
    resume: bool = False,
    start_iter: int | None = None,
    allow_config_change: bool = False,
    console: Console | None = None,
    base_evaluations: BaseEvaluations | None = None,
) -> Summary:
    """Run (or resume) training; returns the run record (the base and each iteration's evaluation).
    ``base_evaluations``: base evaluations shared with other runs of this process (``turnrl experiment``)."""
    distributed.setup()  # several processes: join the launcher's process group; rank 0 checks and writes
    run = Run(cfg, console)
    with run.opened(resume, start_iter, allow_config_change) as start:  # the lock first, then where to start
        return _run(run, start, base_evaluations)


def _run(run: Run, start: Start, shared: BaseEvaluations | None = None) -> Summary:
    s = run.settings
    state, summary, ckpt = start.state, start.summary, start.checkpoint
    chat = None
    while state.iteration < s.iterations:
        # the iteration's policy: the base with earlier iterations' adapters merged, a fresh LoRA
        policy = build_iteration(run, state, ckpt)
        chat, ckpt = policy.chat, None

        # the base model's held-out evaluation, once, before any training
        if state.step == 0 and s.eval.before and summary.base is None:
            summary.base = evaluate_and_log(run, policy, state, "base", shared)
            run.write_summary(summary)
            run.save(policy.trainer, policy.sampler, state, summary)

        # the iteration's steps: collect, credit, update; log; evaluate and checkpoint when due
        # (sampler.max_staleness 1: a collector gathers the next batch while each step trains)
        with run.progress(state) as advance, overlapped_collector(run, policy) as collector:
            while not s.last_step(state):
                episodes, metrics = train_step(
                    s, policy.trainer, policy.sampler, policy.chat, run.train_tasks, state, collector
                )
                state.train_seconds = distributed.broadcast_object(state.train_seconds)  # one stop decision
                run.log_step(state, episodes, metrics)
                advance(metrics)
                if s.eval_due(state):
                    evaluate_and_log(run, policy, state, "step")
                if s.checkpoint_due(state):
                    run.save(policy.trainer, policy.sampler, state, summary)

        # end of iteration: the adapter, the evaluation, the checkpoint that moves to the next iteration
        policy.trainer.save_adapter(run.dir.adapter(state.iteration))
        last = state.iteration == s.iterations - 1
        held_out = evaluate_and_log(run, policy, state, "final" if last else "iter")
        summary.end_iteration(state.iteration, held_out, last)  # complete once the last one has ended
        run.log_iteration(state, held_out)
        run.write_summary(summary)
        state.iteration += 1
        state.iteration_step = 0
        run.save(policy.trainer, policy.sampler, state, summary)
        run.sync(state.iteration - 1)
        distributed.barrier()  # the next iteration's policy reads the adapter rank 0 wrote

    return run.finish(summary, chat.tokenizer if chat else None)
