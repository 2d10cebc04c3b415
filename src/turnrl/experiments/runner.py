"""Running an experiment: every planned run trained (or reused), then the report and the verdict.

Every arm × seed is one ordinary training run (:func:`turnrl.train.loop.train`)
in ``<output root>/<name>/<arm>/seed<k>``. Running a spec again reuses every
finished run whose saved config ``train --resume`` would accept
(:func:`turnrl.config.resume_conflicts`, the one "same run?" rule; a run with a
checkpoint resumes from it) and refuses a run directory trained with a
different config; ``fresh`` deletes the runs first. Each seed's base evaluation is
computed once for all its arms, here and in later processes (``base_eval/``,
:mod:`turnrl.train.base_eval`).
"""

from __future__ import annotations

import functools
import json
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console

from turnrl.config import RunConfig, read_config_data, resume_conflicts, upgrade_saved
from turnrl.envs.splits import TaskSource
from turnrl.experiments.extra import Evaluator, add_extra_games
from turnrl.experiments.plan import PlannedRun, plan_runs
from turnrl.experiments.prediction import compare_ordering, prediction_lines, run_prediction
from turnrl.experiments.report import (
    VERDICT_RULE,
    compute_tables,
    criterion_lines,
    describe_plan,
    json_safe,
    plot_experiment,
    primary_line,
    result_line,
    results_table,
    rich_table,
    summary_markdown,
)
from turnrl.experiments.results import (
    RUN_RECORD,
    RunResult,
    arm_summary,
    evaluate_on_runs,
    is_complete,
    read_run,
)
from turnrl.experiments.spec import ExperimentError, ExperimentSpec, load_spec
from turnrl.experiments.verdict import RATE_METRICS, CriterionResult, Verdict
from turnrl.rundir import RunDir, atomic_write_text, contained
from turnrl.terminal import make_console, styled
from turnrl.train.base_eval import BaseEvaluations
from turnrl.train.settings import RunSettings
from turnrl.train.summary import Summary

BASE_EVAL_DIR = "base_eval"
"""Under the experiment's directory: the base evaluations its runs share (:mod:`turnrl.train.base_eval`)."""

Runner = Callable[..., Any]
"""``runner(cfg: RunConfig, console=Console) -> Any``: trains one run into ``paths.output_dir/run_name``."""


def train_run(
    cfg: RunConfig, console: Console | None = None, base_evaluations: BaseEvaluations | None = None
) -> Summary:
    """The default runner: :func:`turnrl.train.loop.train`, resuming a run directory that has a checkpoint;
    ``base_evaluations``: the experiment's base evaluations, shared by its runs that would compute the same one
    (the arms of a seed, in this process and later ones; :mod:`turnrl.train.base_eval`)."""
    from turnrl.train.loop import run_dir_for, train

    resume = run_dir_for(cfg).checkpoint.exists()
    return train(cfg, resume=resume, console=console, base_evaluations=base_evaluations)


def config_conflicts(run_dir: Path, cfg: RunConfig) -> list[str]:
    """Keys in which ``cfg`` differs from the run directory's saved config as ``train --resume`` sees it."""
    return resume_conflicts(upgrade_saved(read_config_data(RunDir(run_dir).config)), cfg)


def resolve_runs(plan: Sequence[PlannedRun]) -> list[RunSettings]:
    """Every planned run resolved through the one resolution point (:meth:`RunSettings.from_config`, as
    ``turnrl train`` resolves it), and each distinct task source read, before the first run trains: an
    arm whose tasks cannot be read fails now, not after the arms before it have trained."""
    settings = [RunSettings.from_config(run.config) for run in plan]
    sources: list[TaskSource] = []
    for s in settings:
        if s.tasks not in sources:
            sources.append(s.tasks)
            s.tasks.tasks("train")
            s.tasks.tasks("eval")
    return settings


@dataclass
class ExperimentResult:
    name: str
    directory: Path
    arms: dict[str, dict[str, Any]]
    verdict: Verdict | None
    criterion: CriterionResult | None
    runs: list[RunResult]
    plot: Path | None
    result_line: str
    primary: CriterionResult | None = None


def run_experiment(
    spec: ExperimentSpec,
    runner: Runner | None = None,
    *,
    output_root: str | Path = "runs",
    overrides: Sequence[str] = (),
    console: Console | None = None,
    fresh: bool = False,
    out: TextIO | None = None,
    evaluator: Evaluator | None = None,
) -> ExperimentResult:
    """Run every arm × seed with ``runner`` (default :func:`train_run`), then compare and judge.

    A run directory that already holds a finished run with the same config (by
    :func:`turnrl.config.resume_conflicts`) is reused, not retrained; one with a different
    config is an error unless ``fresh`` (which deletes the experiment's run directories
    and its shared base evaluations first). Prints the table and the final ``RESULT`` line
    to ``out`` (default stdout) and writes ``experiment.json``, ``summary.md`` and
    ``experiment.png`` into ``<output_root>/<name>/``.
    """
    console = console or make_console()
    out = out or sys.stdout
    name = spec.experiment_name()
    plan = plan_runs(spec, output_root, overrides)
    resolve_runs(plan)
    exp_dir = Path(output_root) / name
    exp_dir.mkdir(parents=True, exist_ok=True)
    shared_base = exp_dir / BASE_EVAL_DIR  # each seed's base evaluation, once for the experiment's processes
    if fresh and shared_base.exists():
        shutil.rmtree(contained(shared_base, output_root, "--fresh would delete"))
    runner = runner or functools.partial(train_run, base_evaluations=BaseEvaluations(shared_base))
    prediction = None
    if spec.audit is not None:  # stated before any arm trains
        baseline = spec.primary.baseline if spec.primary is not None else plan[0].arm
        prediction = run_prediction(plan, baseline, spec.audit, exp_dir, console)
    started = time.perf_counter()
    spread = any(m not in RATE_METRICS for m in spec.metrics())  # SE from the eval episodes
    results: list[RunResult] = []
    for i, run in enumerate(plan, start=1):
        rd = RunDir(run.run_dir)
        if fresh and rd.root.exists():  # only what lies under the output directory, links resolved
            shutil.rmtree(contained(rd.root, output_root, "--fresh would delete"))
        console.rule(f"[{i}/{len(plan)}] {name}: arm {run.arm}, seed {run.seed} → {rd.root}")
        if rd.config.exists():
            changed = config_conflicts(rd.root, run.config)
            if changed:
                raise ExperimentError(
                    f"{rd.root} holds a run with a different config (in {', '.join(changed)});"
                    " pass --fresh to delete this experiment's runs and start over, or use another"
                    " --output-dir"
                )
        record = rd.root / RUN_RECORD
        if rd.config.exists() and is_complete(rd.root):
            console.print(f"reusing the finished run in {rd.root}")
            info = json.loads(record.read_text()) if record.exists() else {}
            info["reused"] = True
        else:
            t0 = time.perf_counter()
            runner(run.config, console=console)
            info = {"wall_s": time.perf_counter() - t0, "reused": False}
        rd.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(record, json.dumps(info, indent=2))
        results.append(read_run(run.arm, run.seed, rd.root, spread))
    if spec.evaluation.extra_games:
        add_extra_games(plan, results, spec.evaluation.extra_games, evaluator, console)
    ran = sum(not r.reused for r in results)
    console.print(f"ran {ran} of {len(results)} runs in {time.perf_counter() - started:.0f} s")
    wall_s = sum(r.wall_s or 0.0 for r in results)
    return report_experiment(
        spec, plan, results, exp_dir, console=console, out=out, wall_s=wall_s, prediction=prediction
    )


def report_experiment(
    spec: ExperimentSpec,
    plan: Sequence[PlannedRun],
    results: Sequence[RunResult],
    exp_dir: Path,
    *,
    console: Console,
    out: TextIO,
    wall_s: float,
    prediction: dict[str, Any] | None = None,
) -> ExperimentResult:
    """Table, plot, ``experiment.json``, ``summary.md`` and the ``RESULT`` line from finished runs
    (``prediction``: the audit's, :mod:`turnrl.experiments.prediction`, compared with the outcome)."""
    name = spec.experiment_name()
    metric = spec.evaluation.metric
    arms = {arm.name: arm_summary([r for r in results if r.arm == arm.name], metric) for arm in spec.all_arms()}
    for p in plan:
        arms[p.arm]["leaves_per_step"] = p.config.rollout.tasks_per_step * p.config.episodes_per_task
    primary = evaluate_on_runs(margin, results) if (margin := spec.primary_margin()) else None
    criterion = evaluate_on_runs(spec.criterion, results) if spec.criterion is not None else None
    verdict = criterion.verdict if criterion else None

    if primary is not None:
        console.print(styled((primary_line(primary), "bold")), highlight=False)
    console.print(results_table(arms, metric, f"{spec.title} · held-out {metric}"))
    for title, header, rows in compute_tables(arms):
        console.print(rich_table(header, rows, title))
    if criterion is not None:
        for line in criterion_lines(criterion):
            console.print(line.replace("**", ""), highlight=False)
        console.print(styled((f"verdict: {verdict}", "bold")))
    ordering = None
    if prediction is not None:
        ordering = compare_ordering(prediction, {a: s["after"] for a, s in arms.items() if s["after"] is not None})
        for line in prediction_lines(prediction, ordering):
            console.print(line, highlight=False)
    plot = None
    if any(r.eval_rows or r.train_rows for r in results):
        plot = plot_experiment(results, metric, exp_dir / "experiment.png", spec.title)
        console.print(f"plot: {plot}")
    payload = {
        "name": name,
        "title": spec.title,
        "hypothesis": spec.hypothesis,
        "spec": spec.model_dump(mode="json"),
        "spec_path": str(spec.source) if spec.source else None,
        "metric": metric,
        "primary": primary.to_dict() if primary else None,
        "arms": arms,
        "verdict": verdict,
        "criterion": criterion.to_dict() if criterion else None,
        "verdict_rule": VERDICT_RULE,
        "prediction": prediction,
        "ordering": ordering,
        "wall_s": wall_s,
        "runs": [
            {
                "arm": r.arm,
                "seed": r.seed,
                "run_dir": str(r.run_dir),
                "wall_s": r.wall_s,
                "reused": r.reused,
                "eval": r.eval_rows,
                "eval_spread": r.eval_spread,
                "extra_games": r.extra,
                "train_reward": r.rewards(),
            }
            for r in results
        ],
        "configs": {f"{p.arm}/seed{p.seed}": p.config.model_dump(mode="json") for p in plan},
    }
    text = json.dumps(json_safe(payload), indent=2, allow_nan=False)
    atomic_write_text(exp_dir / "experiment.json", text)
    summary = summary_markdown(spec, name, plan, arms, metric, criterion, plot, wall_s, primary)
    if prediction is not None:
        summary = summary.rstrip("\n") + "\n\n" + "\n".join(prediction_lines(prediction, ordering)) + "\n"
    atomic_write_text(exp_dir / "summary.md", summary)
    console.print(f"experiment directory: {exp_dir}")
    line = result_line(name, metric, arms, verdict, criterion, primary)
    print(line, file=out, flush=True)
    return ExperimentResult(name, exp_dir, arms, verdict, criterion, list(results), plot, line, primary)


def main(
    spec_path: str | Path,
    *,
    output_root: str | Path = "runs",
    overrides: Sequence[str] = (),
    fresh: bool = False,
    dry_run: bool = False,
    console: Console | None = None,
) -> ExperimentResult | None:
    """The ``turnrl experiment`` command."""
    console = console or make_console()
    spec = load_spec(spec_path)
    if dry_run:
        describe_plan(spec, plan_runs(spec, output_root, overrides), console)
        return None
    return run_experiment(spec, output_root=output_root, overrides=overrides, console=console, fresh=fresh)
