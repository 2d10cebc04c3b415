"""The run object: every side effect of one training run, and the settings every stage is given.

:class:`RunSettings` resolves the config once into each stage's own frozen settings
(:class:`~turnrl.rollout.collect.RolloutSettings`, :class:`~turnrl.sampling.SamplerSettings`,
:class:`~turnrl.credit.CreditSettings`, :class:`~turnrl.train.step.StepSettings` with its
:class:`~turnrl.losses.LossPlan`, :class:`~turnrl.eval.EvalSettings`,
:class:`~turnrl.train.policy.PolicySettings`); below this module no function takes the config.

:class:`Run` owns what a run does to the outside world: the run directory and its lock,
the checks before anything is written (:meth:`Run.prepare`), the typed
:class:`~turnrl.train.checkpoint.Checkpoint`, the tracking sinks, the summary, the saved
rollouts, the sync to ``paths.sync_to``, and the tasks of each split. With several
processes only rank 0 writes: every writing method is behind the one guard :func:`rank0_only`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from turnrl.config import RunConfig, dump_config
from turnrl.credit import CreditSettings
from turnrl.envs import make_env
from turnrl.envs.splits import TaskSource
from turnrl.eval import EvalSettings, comparison_table
from turnrl.rollout.collect import RolloutSettings
from turnrl.rundir import RunDir, atomic_write_text, pull_run, push_run, write_jsonl
from turnrl.sampling import SamplerSettings, get_sampler
from turnrl.tracking import MultiSink, make_plots, make_sinks, write_report
from turnrl.train import distributed
from turnrl.train.checkpoint import (
    Checkpoint,
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
from turnrl.train.policy import PolicySettings
from turnrl.train.step import StepSettings
from turnrl.types import Episode, Task

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class RunSettings:
    """Every stage's settings, resolved once from the run config, plus the loop's own."""

    seed: int
    rollout: RolloutSettings
    sampler: SamplerSettings
    credit: CreditSettings
    step: StepSettings
    eval: EvalSettings
    policy: PolicySettings
    iterations: int = 1
    steps_per_iteration: int = 1
    max_seconds: float | None = None
    checkpoint_every: int = 1
    mask_truncated_completions: bool = False
    per_turn_rows: bool = False
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    exclude_think: bool = False
    shard_collection: bool = False
    """Each process collects its share of a step's tasks (:func:`distributed.shards_collection`)."""

    @classmethod
    def from_config(cls, cfg: RunConfig) -> RunSettings:
        shard = distributed.shards_collection(get_sampler(cfg.sampler.backend).shares_weights)
        rollout = RolloutSettings.from_config(cfg)
        if cfg.rollout.task_seeds is None:  # sharded collection needs them; one process keeps per-call seeds
            rollout = dataclasses.replace(rollout, task_seeds=shard)
        return cls(
            seed=cfg.seed,
            rollout=rollout,
            sampler=SamplerSettings.from_config(cfg.sampler),
            credit=CreditSettings.from_config(cfg.credit),
            step=StepSettings.from_config(cfg),
            eval=EvalSettings.from_config(cfg),
            policy=PolicySettings.from_config(cfg),
            iterations=cfg.loop.iterations,
            steps_per_iteration=cfg.loop.steps_per_iteration or cfg.train.steps,
            max_seconds=cfg.train.max_seconds,
            checkpoint_every=cfg.train.checkpoint_every,
            mask_truncated_completions=cfg.train.mask_truncated_completions,
            per_turn_rows=cfg.per_turn_rows,
            chat_template_kwargs=dict(cfg.model.chat_template_kwargs),
            exclude_think=cfg.credit.exclude_think,
            shard_collection=shard,
        )

    def out_of_time(self, state: RunState) -> bool:
        """``train.max_seconds`` is spent."""
        return self.max_seconds is not None and state.train_seconds >= self.max_seconds

    def last_step(self, state: RunState) -> bool:
        """The iteration's steps are done (or the time is spent): its end saves and evaluates anyway."""
        return state.iteration_step >= self.steps_per_iteration or self.out_of_time(state)

    def eval_due(self, state: RunState) -> bool:
        return bool(self.eval.every) and state.step % self.eval.every == 0 and not self.last_step(state)

    def checkpoint_due(self, state: RunState) -> bool:
        return state.step % self.checkpoint_every == 0 and not self.last_step(state)


@dataclass
class Start:
    """Where a run starts: fresh, resumed from a checkpoint, or restarted at an iteration."""

    state: RunState = field(default_factory=RunState)
    summary: dict[str, Any] = field(default_factory=dict)
    checkpoint: Checkpoint | None = None
    """The checkpoint resumed from (its trainer and sampler state are loaded mid-iteration)."""
    start_iter: int | None = None
    continued: bool = False
    """Resumed or restarted: the sinks continue their files."""


def rank0_only(method: F) -> F:
    """The one rank-0 guard: with several processes, the decorated method writes on rank 0 and is a
    no-op (returning None) elsewhere; every rank holds the same state, so rank 0's copy is the run's."""

    @functools.wraps(method)
    def guarded(self: Run, *args: Any, **kwargs: Any) -> Any:
        return method(self, *args, **kwargs) if self.writer else None

    return guarded  # type: ignore[return-value]


class Run:
    """One training run's side effects (see the module docstring)."""

    def __init__(self, cfg: RunConfig, console: Console | None = None) -> None:
        self.cfg = cfg
        self.settings = RunSettings.from_config(cfg)
        self.dir = self.dir_for(cfg)
        self.writer = distributed.is_main()
        """This process writes the run directory (rank 0, or the only process)."""
        self.console = (console or Console()) if self.writer else Console(quiet=True)
        self.sink = MultiSink([])
        self._tasks = TaskSource.from_config(cfg)
        self.train_tasks: list[Task] = []
        self.eval_tasks: list[Task] = []

    @staticmethod
    def dir_for(cfg: RunConfig) -> RunDir:
        """The run directory a config trains into (``paths.output_dir/run_name``)."""
        return RunDir(Path(cfg.paths.output_dir) / cfg.run_name)

    # ---- before anything is written ----------------------------------------------------

    def prepare(self, resume: bool, start_iter: int | None, allow_config_change: bool) -> Start:
        """Check that the run can start (rank 0 decides, every rank gets its answer), load the tasks
        (bad task input and bad environment options fail here), and say where the run starts."""
        if start_iter is not None and start_iter < 0:
            raise ResumeError(f"--start-iter must be >= 0 (got {start_iter})")
        ckpt = distributed.on_main(_prepare, self.cfg, self.dir, resume, start_iter, allow_config_change, self.console)
        self.train_tasks, self.eval_tasks = self.tasks("train"), self.tasks("eval")
        make_env(self.train_tasks[0], **self.settings.rollout.env_options)
        continued = resume or start_iter is not None
        if start_iter is not None:  # restart at iteration N on the saved adapters 0..N-1
            steps = start_iter * self.settings.steps_per_iteration
            state = RunState(step=steps, iteration=start_iter, cursor=steps * self.settings.rollout.tasks_per_step)
            return Start(state, self._summary_before(start_iter), None, start_iter, continued)
        if ckpt is not None:
            return Start(ckpt.state, dict(ckpt.summary), ckpt, None, continued)
        return Start(continued=continued)

    def tasks(self, split: str) -> list[Task]:
        return self._tasks.tasks(split)

    def _summary_before(self, start_iter: int) -> dict[str, Any]:
        path = self.dir.summary
        return json.loads(path.read_text()) if path.exists() and start_iter > 0 else {}

    @contextlib.contextmanager
    def opened(self, start: Start) -> Iterator[Run]:
        """Hold the run directory for the run: lock it, cut its files back to the starting point,
        write the config, open the sinks; close them at the end. A fresh start that fails before
        any resumable state was written leaves nothing behind."""
        fresh = not self.dir.root.exists()
        try:
            with RunLock(self.dir) if self.writer else contextlib.nullcontext():
                self._cut_back(start)
                self._write_config()
                distributed.barrier()
                if start.checkpoint is not None:
                    restore_rng(start.checkpoint.rng)
                self._open_sinks(start)
                try:
                    yield self
                finally:
                    self.sink.close()
        except BaseException:
            if self.writer and fresh and not self.dir.checkpoint.exists():
                shutil.rmtree(self.dir.root, ignore_errors=True)
            raise

    @rank0_only
    def _cut_back(self, start: Start) -> None:
        if start.continued and start.start_iter is None:  # resume: to the checkpoint's rows, or a clean start
            cut_back(self.dir, start.checkpoint)
        elif start.start_iter is not None and self.dir.config.exists():
            truncate_to(self.dir, rows_before_iteration(self.dir, start.start_iter))
        if start.start_iter is not None:  # the restarted iterations' rollouts are written again
            for path in self.dir.train_rollout_files():
                if int(path.stem.split("_")[1]) >= start.start_iter:
                    path.unlink()

    @rank0_only
    def _write_config(self) -> None:
        atomic_write_text(self.dir.config, dump_config(self.cfg))

    @rank0_only
    def _open_sinks(self, start: Start) -> None:
        self.sink = MultiSink(
            make_sinks(
                self.cfg.tracking,
                self.dir.root,
                self.cfg.run_name,
                self.cfg.model_dump(mode="json"),
                resume_step=start.state.step if start.continued else None,
                console=self.console,
            )
        )

    # ---- during the run ------------------------------------------------------------------

    def save(self, trainer: Any, sampler: Any, state: RunState, summary: dict[str, Any]) -> None:
        """The checkpoint (rank 0 writes it: :func:`save_checkpoint` has the same guard)."""
        save_checkpoint(self.dir, trainer, sampler, state, summary)

    @rank0_only
    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write_text(self.dir.summary, json.dumps(summary, indent=2))

    def log_step(self, state: RunState, episodes: list[Episode], metrics: dict[str, float]) -> None:
        for ep in episodes:
            ep.metrics["step"] = float(state.step)
        if self.cfg.tracking.save_rollouts:
            self._append_rollouts(self.dir.train_rollouts(state.iteration), episodes)
        self.sink.log_step(state.step, {"iteration": float(state.iteration), **metrics})

    def log_eval(self, state: RunState, episodes: list[Episode], label: str, metrics: dict[str, float]) -> None:
        for ep in episodes:
            ep.metrics["step"] = float(state.step)
        self._write_rollouts(self.dir.eval_rollouts(state.step), episodes)
        self.sink.log_eval(state.step, {"iteration": float(state.iteration), "label": label, **metrics})

    def log_iteration(self, state: RunState, metrics: dict[str, float]) -> None:
        self.sink.log_iteration(state.iteration, {"step": float(state.step), **metrics})

    @rank0_only
    def _append_rollouts(self, path: Path, episodes: list[Episode]) -> None:
        write_jsonl(path, episodes, append=True)

    @rank0_only
    def _write_rollouts(self, path: Path, episodes: list[Episode]) -> None:
        write_jsonl(path, episodes)

    @rank0_only
    def sync(self, iteration: int) -> None:
        """The end of ``iteration``: remember the files' rows (for ``--start-iter``), copy to ``paths.sync_to``."""
        record_iteration_rows(self.dir, iteration)
        push_run(self.cfg.paths.sync_to, self.dir)

    @contextlib.contextmanager
    def progress(self, state: RunState) -> Iterator[Callable[[dict[str, float]], None]]:
        """A progress bar over the iteration's steps; yields ``advance(metrics)``."""
        s = self.settings
        with Progress(
            TextColumn(f"iter {state.iteration + 1}/{s.iterations}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        ) as bar:
            task = bar.add_task("train", total=s.steps_per_iteration, completed=state.iteration_step, info="")

            def advance(metrics: dict[str, float]) -> None:
                bar.update(task, advance=1, info=f"reward {metrics.get('reward', 0):.3f}")

            yield advance

    # ---- after the run --------------------------------------------------------------------

    def finish(self, summary: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
        """Close the sinks, then the comparison table, plots and report (rank 0); returns the summary."""
        sink, self.sink = self.sink, MultiSink([])
        sink.close()
        self._report(summary, tokenizer)
        return summary

    @rank0_only
    def _report(self, summary: dict[str, Any], tokenizer: Any) -> None:
        if "base" in summary and "final" in summary:
            rows = {"base": summary["base"], "trained": summary["final"]}
            self.console.print(comparison_table(rows, "held-out: base vs trained"))
        if self.cfg.tracking.plots:
            make_plots(self.dir.root)
        if self.cfg.tracking.report:
            write_report(self.dir.root, tokenizer=tokenizer)
        self.console.print(f"run directory: {self.dir.root}")


def _prepare(
    cfg: RunConfig, run: RunDir, resume: bool, start_iter: int | None, allow_config_change: bool, console
) -> Checkpoint | None:
    """Checks before anything is written; returns the checkpoint to resume from (or None)."""
    out = run.root.parent
    if out.exists() and not out.is_dir():
        raise ResumeError(f"paths.output_dir {out} is a file, not a directory; set paths.output_dir to a directory")
    if run.root.exists() and not run.root.is_dir():
        raise ResumeError(f"{run.root} exists and is not a directory; choose another --run-name or paths.output_dir")
    if resume:
        if pull_run(cfg.paths.sync_to, run):  # runs on rank 0 only (distributed.on_main)
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
