"""The training loop: iterations of (collect → credit → update) steps, evaluation, checkpoints.

Outer iteration n trains a fresh LoRA adapter on the base model with adapters
0..n−1 merged in, then evaluates on held-out tasks and saves
``adapters/iter_NNN``. Checkpoints (``train.checkpoint``) make a killed run
resume where it stopped; sampling seeds derive from (seed, step), so a resumed
CPU run reproduces the uninterrupted one. One step, read aloud:

    episodes = collect(tasks, sampler)        # the policy acts; environments reply and score
    metrics  = assign_credit(episodes)        # one advantage per turn (Turn.advantage)
    rows     = build_rows(episodes)           # token rows with loss masks
    metrics |= update(trainer, rows)          # forward/backward, optimizer step
    sampler.refresh(trainer.policy_weights()) # every sampler.refresh_every steps
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from turnrl.chat import ChatTemplate
from turnrl.config import RunConfig, dump_config
from turnrl.credit import assign_credit, filter_zero_variance
from turnrl.envs import make_env
from turnrl.eval import comparison_table, evaluate, load_tasks
from turnrl.rollout.collect import collect, mask_truncated_turns
from turnrl.rundir import RunDir, atomic_write_text, pull_run, push_run, write_jsonl
from turnrl.sampling import Sampler, make_sampler
from turnrl.tasks import TaskStream
from turnrl.tracking import MultiSink, make_plots, make_sinks, write_report
from turnrl.train import distributed
from turnrl.train.batch import build_rows
from turnrl.train.checkpoint import (
    ResumeError,
    RunLock,
    RunState,
    check_resume_config,
    cut_back,
    load_checkpoint,
    record_iteration_rows,
    restore_rng,
    rows_before_iteration,
    save_checkpoint,
    truncate_to,
)
from turnrl.train.policy import build_policy, step_seed
from turnrl.train.step import Trainer, update
from turnrl.types import Episode, SamplingParams, Task

__all__ = ["ResumeError", "collect_batch", "train", "train_step"]


def run_dir_for(cfg: RunConfig) -> RunDir:
    return RunDir(Path(cfg.paths.output_dir) / cfg.run_name)


def collect_batch(
    cfg: RunConfig, train_tasks: list[Task], state: RunState, sampler: Sampler, chat: ChatTemplate
) -> tuple[list[Episode], dict[str, float]]:
    """Episodes for one step; with dynamic sampling, zero-variance groups are dropped (and refilled)."""
    shape = cfg.rollout.branching or [cfg.rollout.group_size]
    s = cfg.sampler
    seed = step_seed(cfg.seed, state.step)
    kept: list[Episode] = []
    dropped = 0
    needed = cfg.rollout.tasks_per_step
    for round_ in range(4 if cfg.rollout.refill else 1):
        tasks = TaskStream(train_tasks, cfg.seed).take(state.cursor, needed)
        state.cursor += needed
        params = SamplingParams(s.temperature, s.top_p, s.max_tokens, s.top_k_logprobs, seed + round_)
        episodes = collect(
            tasks,
            sampler,
            chat,
            params,
            shape,
            env_options=cfg.env.options,
            max_turns=cfg.rollout.max_turns,
            shaping_gamma=cfg.credit.shaping_gamma if cfg.credit.shaping else None,
            id_prefix=f"s{state.step + 1}r{round_}-",
            max_context_tokens=cfg.rollout.max_context_tokens,
            truncated_reward=cfg.train.truncated_completion_reward,
            env_workers=cfg.rollout.env_workers,
        )
        if not cfg.rollout.dynamic_sampling:
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


def _out_of_time(cfg: RunConfig, state: RunState) -> bool:
    return cfg.train.max_seconds is not None and state.train_seconds >= cfg.train.max_seconds


def _rollout_metrics(episodes: list[Episode]) -> dict[str, float]:
    turns = [t for ep in episodes for t in ep.turns]
    if not episodes:
        return {"num_episodes": 0.0}
    return {
        "completions/mean_length": float(np.mean([len(t.action_ids) for t in turns])) if turns else 0.0,
        "completions/clipped_ratio": float(np.mean([t.finish_reason == "length" for t in turns])) if turns else 0.0,
        "num_turns/mean": float(np.mean([ep.num_turns for ep in episodes])),
        "success_rate": float(np.mean([ep.success for ep in episodes])),
        "num_episodes": float(len(episodes)),
    }


def train_step(
    cfg: RunConfig, trainer: Trainer, sampler: Sampler, chat: ChatTemplate, train_tasks: list[Task], state: RunState
) -> tuple[list[Episode], dict[str, float]]:
    t0 = time.perf_counter()
    episodes, metrics = collect_batch(cfg, train_tasks, state, sampler, chat)
    t1 = time.perf_counter()
    metrics.update(assign_credit(episodes, cfg.credit))
    if cfg.train.mask_truncated_completions:
        metrics.update(mask_truncated_turns(episodes))
    rows = build_rows(episodes, per_turn=cfg.per_turn_rows)
    if rows:
        metrics.update(update(trainer, rows, cfg, seed=step_seed(cfg.seed, state.step, salt=17)))
    else:  # every group had zero variance: nothing to learn from this batch
        metrics.update({"loss": 0.0, "grad_norm": 0.0, "num_tokens": 0.0})
    t2 = time.perf_counter()
    metrics.update(_rollout_metrics(episodes))
    metrics.update(
        {
            "policy_version": float(sampler.policy_version),
            "lr": metrics.get("lr", cfg.train.lr),
            "time/collect_s": t1 - t0,
            "time/train_s": t2 - t1,
        }
    )
    state.step += 1
    state.iteration_step += 1
    state.train_seconds += t2 - t0
    if state.step % cfg.sampler.refresh_every == 0:
        sampler.refresh(trainer.policy_weights())
    state.sampler_version = sampler.policy_version
    return episodes, metrics


def evaluate_and_log(
    cfg: RunConfig,
    tasks: list[Task],
    sampler: Sampler,
    chat: ChatTemplate,
    state: RunState,
    run: RunDir,
    sink: MultiSink,
    label: str,
) -> dict[str, float]:
    """Evaluate on held-out tasks; save the episodes and log one eval row."""
    result = evaluate(tasks, sampler, chat, cfg, seed=step_seed(cfg.seed, state.step, salt=99))
    for ep in result.episodes:
        ep.metrics["step"] = float(state.step)
    if distributed.is_main():  # several processes: rank 0 writes
        write_jsonl(run.eval_rollouts(state.step), result.episodes)
    sink.log_eval(state.step, {"iteration": float(state.iteration), "label": label, **result.metrics})
    return result.metrics


def _prepare(cfg: RunConfig, run: RunDir, resume: bool, start_iter: int | None, allow_config_change: bool, console):
    """Checks before anything is written; returns the checkpoint to resume from (or None)."""
    out = run.root.parent
    if out.exists() and not out.is_dir():
        raise ResumeError(f"paths.output_dir {out} is a file, not a directory; set paths.output_dir to a directory")
    if run.root.exists() and not run.root.is_dir():
        raise ResumeError(f"{run.root} exists and is not a directory; choose another --run-name or paths.output_dir")
    if resume:
        if distributed.is_main() and pull_run(cfg.paths.sync_to, run):  # several processes: rank 0 writes
            console.print(f"pulled {run.root} from {cfg.paths.sync_to}")
        if not run.config.exists():
            raise ResumeError(f"nothing to resume: {run.config} does not exist")
        check_resume_config(run, cfg, allow_config_change)
        return load_checkpoint(run)
    if start_iter is not None and run.config.exists():
        check_resume_config(run, cfg, allow_config_change)
    elif run.checkpoint.exists():
        raise ResumeError(f"{run.root} already holds a run; pass --resume to continue it or choose another --run-name")
    return None


def train(
    cfg: RunConfig,
    *,
    resume: bool = False,
    start_iter: int | None = None,
    allow_config_change: bool = False,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run (or resume) training; returns the base and final evaluation metrics."""
    distributed.setup()  # several processes: join the launcher's process group; rank 0 checks and writes
    main = distributed.is_main()
    console = (console or Console()) if main else Console(quiet=True)
    run = run_dir_for(cfg)
    if start_iter is not None and start_iter < 0:
        raise ResumeError(f"--start-iter must be >= 0 (got {start_iter})")
    ckpt = distributed.on_main(_prepare, cfg, run, resume, start_iter, allow_config_change, console)
    train_tasks, eval_tasks = load_tasks(cfg, "train"), load_tasks(cfg, "eval")  # bad task input fails here
    make_env(train_tasks[0], **cfg.env.options)  # ... and bad environment options (or a missing sandbox layer)
    fresh = not run.root.exists()
    try:
        with RunLock(run) if main else contextlib.nullcontext():
            if main and resume:  # back to the checkpoint's rows; with no checkpoint, back to a clean start
                cut_back(run, ckpt)
            elif main and start_iter is not None and run.config.exists():
                truncate_to(run, rows_before_iteration(run, start_iter))
            if main:
                atomic_write_text(run.config, dump_config(cfg))
            distributed.barrier()
            return _run(cfg, run, ckpt, start_iter, train_tasks, eval_tasks, resume, console)
    except BaseException:
        if (
            main and fresh and not run.checkpoint.exists()
        ):  # a start that failed before any resumable state leaves nothing
            shutil.rmtree(run.root, ignore_errors=True)
        raise


def _run(cfg, run: RunDir, ckpt, start_iter, train_tasks, eval_tasks, resume, console) -> dict[str, Any]:
    steps_per_iter = cfg.loop.steps_per_iteration or cfg.train.steps
    state = RunState(**ckpt["state"]) if ckpt else RunState()
    summary: dict[str, Any] = dict(ckpt["summary"]) if ckpt else {}
    if start_iter is not None:  # restart at iteration N on the saved adapters 0..N-1
        state = RunState(
            step=start_iter * steps_per_iter,
            iteration=start_iter,
            cursor=start_iter * steps_per_iter * cfg.rollout.tasks_per_step,
        )
        for path in run.train_rollout_files() if distributed.is_main() else []:
            if int(path.stem.split("_")[1]) >= start_iter:
                path.unlink()
        summary = json.loads(run.summary.read_text()) if run.summary.exists() and start_iter > 0 else {}
        ckpt = None
    if ckpt:
        restore_rng(ckpt["rng"])
    main = distributed.is_main()  # several processes: only rank 0 logs and writes
    sink = MultiSink(
        make_sinks(
            cfg.tracking,
            run.root,
            cfg.run_name,
            cfg.model_dump(mode="json"),
            resume_step=state.step if (resume or start_iter is not None) else None,
            console=console,
        )
        if main
        else []
    )
    chat = None
    try:
        while state.iteration < cfg.loop.iterations:
            model, tokenizer = build_policy(cfg, run, state.iteration)
            trainer = distributed.make_trainer(model, cfg, pad_id=tokenizer.pad_token_id)
            sampler = make_sampler(cfg.sampler, model, tokenizer)
            sampler.policy_version = state.sampler_version
            if ckpt and state.iteration_step > 0:  # mid-iteration resume: adapter, optimizer, stale snapshot
                trainer.load_state_dict(ckpt["trainer"])
                sampler.load_state_dict(ckpt["sampler"])
            ckpt = None
            eval_sampler = make_sampler(cfg.sampler, model, tokenizer, stale=False)
            chat = ChatTemplate(tokenizer, cfg.model.chat_template_kwargs, exclude_think=cfg.credit.exclude_think)

            def run_eval(label: str) -> dict[str, float]:
                return evaluate_and_log(cfg, eval_tasks, eval_sampler, chat, state, run, sink, label)  # noqa: B023

            if state.step == 0 and cfg.eval.before and "base" not in summary:
                summary["base"] = run_eval("base")
                if main:
                    atomic_write_text(run.summary, json.dumps(summary, indent=2))
                save_checkpoint(run, trainer, sampler, state, summary)

            with Progress(
                TextColumn(f"iter {state.iteration + 1}/{cfg.loop.iterations}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                console=console,
                transient=False,
            ) as progress:
                bar = progress.add_task("train", total=steps_per_iter, completed=state.iteration_step, info="")
                while state.iteration_step < steps_per_iter and not _out_of_time(cfg, state):
                    episodes, metrics = train_step(cfg, trainer, sampler, chat, train_tasks, state)
                    state.train_seconds = distributed.broadcast_object(state.train_seconds)  # one stop decision
                    for ep in episodes:
                        ep.metrics["step"] = float(state.step)
                    if cfg.tracking.save_rollouts and main:
                        write_jsonl(run.train_rollouts(state.iteration), episodes, append=True)
                    sink.log_step(state.step, {"iteration": float(state.iteration), **metrics})
                    progress.update(bar, advance=1, info=f"reward {metrics.get('reward', 0):.3f}")
                    last = state.iteration_step == steps_per_iter or _out_of_time(cfg, state)
                    if cfg.eval.every and state.step % cfg.eval.every == 0 and not last:
                        run_eval("step")
                    if state.step % cfg.train.checkpoint_every == 0 and not last:
                        save_checkpoint(run, trainer, sampler, state, summary)

            # end of iteration: adapter, evaluation, then the checkpoint that moves to the next iteration
            trainer.save_adapter(run.adapter(state.iteration))
            final = state.iteration == cfg.loop.iterations - 1
            metrics = run_eval("final" if final else "iter")
            sink.log_iteration(state.iteration, {"step": float(state.step), **metrics})
            summary["final"] = metrics
            if main:
                atomic_write_text(run.summary, json.dumps(summary, indent=2))
            state.iteration += 1
            state.iteration_step = 0
            save_checkpoint(run, trainer, sampler, state, summary)
            if main:
                record_iteration_rows(run, state.iteration - 1)
                push_run(cfg.paths.sync_to, run)
            distributed.barrier()  # the next iteration's policy reads the adapter rank 0 wrote
    finally:
        sink.close()

    if not main:
        return summary
    if "base" in summary and "final" in summary:
        console.print(
            comparison_table({"base": summary["base"], "trained": summary["final"]}, "held-out: base vs trained")
        )
    if cfg.tracking.plots:
        make_plots(run.root)
    if cfg.tracking.report:
        write_report(run.root, tokenizer=chat.tokenizer if chat else None)
    console.print(f"run directory: {run.root}")
    return summary
