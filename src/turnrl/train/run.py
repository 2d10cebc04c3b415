"""The run object: every side effect of one training run.

Its settings are :class:`~turnrl.train.settings.RunSettings`, resolved once from the config.

:class:`Run` owns what a run does to the outside world: the run directory and its lock,
the checks before anything is written (:meth:`Run.prepare`), the typed
:class:`~turnrl.train.checkpoint.Checkpoint`, the tracking sinks, the summary, the saved
rollouts, the sync to ``paths.sync_to``, and the tasks of each split. With several
processes only rank 0 writes: every writing method is behind the one guard :func:`rank0_only`.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from turnrl.config import RunConfig, dump_config, resume_conflicts
from turnrl.envs import make_env
from turnrl.eval import comparison_table
from turnrl.rundir import RunDir, atomic_write_text, pull_run, push_run, write_jsonl
from turnrl.terminal import make_console
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
    read_saved_config,
    record_iteration_rows,
    restore_rng,
    rows_before_iteration,
    save_checkpoint,
    truncate_to,
)
from turnrl.train.settings import RunSettings
from turnrl.train.summary import Summary, SummaryError, new_run_id, read_summary
from turnrl.types import Episode, Task

F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class Start:
    """Where a run starts: fresh, resumed from a checkpoint, or restarted at an iteration."""

    state: RunState = field(default_factory=RunState)
    summary: Summary = field(default_factory=Summary)
    """The run record to continue (a fresh start: a new identity, no evaluation yet)."""
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
        self.console = (console or make_console()) if self.writer else make_console(quiet=True)
        self.sink = MultiSink([])
        self.train_tasks: list[Task] = []
        self.eval_tasks: list[Task] = []

    @staticmethod
    def dir_for(cfg: RunConfig) -> RunDir:
        """The run directory a config trains into (``paths.output_dir/run_name``)."""
        return RunDir(Path(cfg.paths.output_dir) / cfg.run_name)

    # ---- before anything is written ----------------------------------------------------

    def prepare(self, resume: bool, start_iter: int | None, allow_config_change: bool) -> Start:
        """Say where the run starts (rank 0 decides, under the lock, and every rank gets its answer), and
        load the tasks (bad task input and bad environment options fail here)."""
        if start_iter is not None and start_iter < 0:
            raise ResumeError(f"--start-iter must be >= 0 (got {start_iter})")
        args = (self.cfg, self.settings, self.dir, resume, start_iter, allow_config_change, self.console)
        start: Start = distributed.on_main(_prepare, *args)
        self.train_tasks, self.eval_tasks = self.tasks("train"), self.tasks("eval")
        make_env(self.train_tasks[0], **self.settings.rollout.env_options)
        return start

    def tasks(self, split: str) -> list[Task]:
        return self.settings.tasks.tasks(split)

    @contextlib.contextmanager
    def opened(self, resume: bool, start_iter: int | None, allow_config_change: bool) -> Iterator[Start]:
        """Hold the run directory for the run, and yield where it starts. Lock it first, then inspect it:
        decide the start (:meth:`prepare`), cut the files back to it, write the config and the run record,
        open the sinks; close them at the end. A fresh start that fails before any resumable state was
        written removes the directory only if this process created it (a trainer the lock refuses
        removes nothing: the directory is the lock holder's)."""
        _check_paths(self.dir)
        with RunLock(self.dir) if self.writer else contextlib.nullcontext() as lock:
            try:
                start = self.prepare(resume, start_iter, allow_config_change)
                self._cut_back(start)
                self._write_config()
                self.write_summary(start.summary)
                distributed.barrier()
                if start.checkpoint is not None:
                    restore_rng(start.checkpoint.rng)
                    self.settings.credit.load_state_dict(start.checkpoint.credit)  # a learned critic
                self._open_sinks(start)
                try:
                    yield start
                finally:
                    self.sink.close()
            except BaseException:
                if lock is not None and lock.created and not self.dir.checkpoint.exists():
                    shutil.rmtree(self.dir.root, ignore_errors=True)  # ours alone: created, and locked since
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

    def save(self, trainer: Any, sampler: Any, state: RunState, summary: Summary) -> None:
        """The checkpoint with the credit estimator's state (rank 0 writes it: :func:`save_checkpoint` has the
        same guard)."""
        save_checkpoint(self.dir, trainer, sampler, state, summary, self.settings.credit.state_dict())

    @rank0_only
    def write_summary(self, summary: Summary) -> None:
        summary.write(self.dir)

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

    def finish(self, summary: Summary, tokenizer: Any) -> Summary:
        """Write the (complete) run record, close the sinks, then the comparison table, plots and report
        (rank 0); returns the record."""
        summary.complete = True
        self.write_summary(summary)
        sink, self.sink = self.sink, MultiSink([])
        sink.close()
        self._report(summary, tokenizer)
        return summary

    @rank0_only
    def _report(self, summary: Summary, tokenizer: Any) -> None:
        if summary.base is not None and summary.final is not None:
            rows = {"base": summary.base, "trained": summary.final}
            self.console.print(comparison_table(rows, "held-out: base vs trained"))
        if self.cfg.tracking.plots:
            make_plots(self.dir.root)
        if self.cfg.tracking.report:
            write_report(self.dir.root, tokenizer=tokenizer)
        self.console.print(f"run directory: {self.dir.root}")


def _check_paths(run: RunDir) -> None:
    """Refuse an output directory or run directory that is a file (before anything is created)."""
    out = run.root.parent
    if out.exists() and not out.is_dir():
        raise ResumeError(f"paths.output_dir {out} is a file, not a directory; set paths.output_dir to a directory")
    if run.root.exists() and not run.root.is_dir():
        raise ResumeError(f"{run.root} exists and is not a directory; choose another --run-name or paths.output_dir")


def _prepare(
    cfg: RunConfig,
    settings: RunSettings,
    run: RunDir,
    resume: bool,
    start_iter: int | None,
    allow_config_change: bool,
    console: Console,
) -> Start:
    """The checks before anything is written (the run lock is held): where the run starts."""
    if resume:
        if pull_run(cfg.paths.sync_to, run):  # runs on rank 0 only (distributed.on_main)
            console.print(f"pulled {run.root} from {cfg.paths.sync_to}")
        if not run.config.exists():
            raise ResumeError(f"nothing to resume: {run.config} does not exist")
        check_resume_config(run, cfg, allow_config_change)
        ckpt = load_checkpoint(run)
        if ckpt is None:  # killed before its first checkpoint: a clean start, under the run's own identity
            return Start(summary=Summary(_run_id(run) or new_run_id()), continued=True)
        check_same_run(run, ckpt)
        _check_request(run, cfg, settings, ckpt.state)
        ckpt.summary.complete = ckpt.state.iteration >= settings.iterations
        return Start(ckpt.state, ckpt.summary, ckpt, None, continued=True)
    if start_iter is not None and run.config.exists():
        check_resume_config(run, cfg, allow_config_change)
    elif run.checkpoint.exists():
        raise ResumeError(f"{run.root} already holds a run; pass --resume to continue it or choose another --run-name")
    if start_iter is not None:  # restart at iteration N on the saved adapters 0..N-1
        steps = start_iter * settings.steps_per_iteration
        state = RunState(step=steps, iteration=start_iter, cursor=steps * settings.rollout.tasks_per_step)
        record = _saved_summary(run) or Summary(new_run_id())
        return Start(state, record.before(start_iter), None, start_iter, continued=True)
    return Start(summary=Summary(new_run_id()))


def _saved_summary(run: RunDir) -> Summary | None:
    """The run's record, or None when it has none or it is damaged (the starting point rewrites it)."""
    try:
        return read_summary(run)
    except SummaryError:
        return None


def _run_id(run: RunDir) -> str:
    saved = _saved_summary(run)
    return saved.run_id if saved else ""


def check_same_run(run: RunDir, ckpt: Checkpoint) -> None:
    """A checkpoint copied in from another run is refused: its identity must be this run's (the one
    ``progress/summary.json`` holds since the run directory was created)."""
    mine, theirs = _run_id(run), ckpt.summary.run_id
    if mine and theirs and mine != theirs:
        raise ResumeError(
            f"{run.checkpoint} belongs to run {theirs}, not to this run ({mine}, {run.summary}): it was copied"
            " from another run directory. Restore this run's own checkpoint, or resume the run it came from"
        )


def _check_request(run: RunDir, cfg: RunConfig, settings: RunSettings, state: RunState) -> None:
    """A resumed config (changed under ``--allow-config-change``) that the run cannot follow is refused in
    one line rather than dropped: steps taken cannot be taken back, and an iteration that has ended (its
    adapter, evaluation and learning-rate schedule written) takes no more steps."""
    if state.iteration_step > settings.steps_per_iteration:
        raise ResumeError(
            f"{run.checkpoint} is at step {state.iteration_step} of iteration {state.iteration}, past the"
            f" {settings.steps_per_iteration} steps per iteration the config asks for; steps taken cannot be"
            f" taken back: restart the iteration (--start-iter {state.iteration}) or start a new run (--run-name)"
        )
    if state.iteration_step == 0 and state.iteration >= settings.iterations:  # no step left to train
        changed = resume_conflicts(read_saved_config(run), cfg)
        if changed:
            raise ResumeError(
                f"{run.root} has finished its {state.iteration} iteration(s) ({state.step} steps): a changed"
                f" {', '.join(changed)} would apply to no step. To train on top of it, add an iteration"
                f" (--set loop.iterations={state.iteration + 1}); otherwise start a new run (another --run-name)"
            )
