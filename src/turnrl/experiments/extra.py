"""More held-out games for finished runs (``evaluation.extra_games``): evaluated once, saved, reused, pooled.

At 100 games an evaluation's own binomial noise can be most of the seed-to-seed spread of a
comparison; more games per final policy shrink it without retraining (docs/results.md §14 did this
by hand). For each finished run, its final policy (the base with the run's adapters through the
last iteration merged, as ``turnrl eval --run-dir R --iteration N``) plays ⌈extra_games / tasks⌉
more sampled games on each of the run's held-out tasks, at the evaluation's sampling temperature
(``eval.sample_temperature``), from the fresh seed

    EXTRA_SEED + 1009·k     (run seed k; the same in every arm, so arms stay paired)

— a run-time evaluation draws from ``step_seed(k, step, 99)`` instead. The episodes go to
``rollouts/extra_eval.jsonl`` and their summary to ``extra_eval.json`` in the run directory; a rerun
reuses them while the request (games, seed, final step) is the same, as finished runs are reused.
The games are pooled with the run's last evaluation by :func:`turnrl.experiments.verdict.pool_points`
(one evaluation of n₀ + n₁ games), and the verdict's rule applies to the pooled values unchanged.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from turnrl.config import RunConfig
from turnrl.experiments.plan import PlannedRun
from turnrl.experiments.results import RunResult
from turnrl.experiments.verdict import sample_variance
from turnrl.rundir import RunDir, atomic_write_text, write_jsonl
from turnrl.types import Episode, StopReason

EXTRA_SEED = 1_000_000
EXTRA_RECORD = "extra_eval.json"
EXTRA_EPISODES = "extra_eval.jsonl"

Evaluator = Callable[[RunConfig, Path, int, int], list[Episode]]
"""``evaluator(cfg, run_dir, games, seed)``: the extra held-out episodes of a finished run's final policy."""

VALUES: dict[str, Callable[[Episode], float]] = {
    "success_rate": lambda e: float(e.stop_reason == StopReason.SUCCESS),
    "mean_reward": lambda e: float(e.reward),
    "mean_turns": lambda e: float(e.num_turns),
    "malformed_rate": lambda e: float(e.stop_reason == StopReason.MALFORMED),
}
"""Per-game values of the eval metrics that are means over games (the ones that pool)."""


def extra_seed(seed: int) -> int:
    return EXTRA_SEED + 1009 * seed


def evaluate_final(cfg: RunConfig, run_dir: Path, games: int, seed: int) -> list[Episode]:
    """The default evaluator: the merged final policy, ⌈games / tasks⌉ sampled games per held-out task."""
    from dataclasses import replace

    from turnrl.eval import evaluate
    from turnrl.train.settings import RunSettings
    from turnrl.train.standalone import policy_sampler

    run = RunSettings.from_config(cfg)  # the one resolution point: training's chat, limits and sampling
    tasks = run.tasks.tasks("eval")
    per_task = max(1, math.ceil(games / len(tasks)))
    settings = run.eval
    t = settings.sample_temperature if settings.samples_per_task else settings.temperature
    settings = replace(settings, temperature=t, sample_temperature=t, samples_per_task=per_task - 1)
    sampler, tokenizer, _ = policy_sampler(run, run_dir=run_dir, iteration=cfg.loop.iterations - 1)
    chat = run.chat.template(tokenizer)
    return evaluate(tasks, sampler, chat, settings, seed=seed).episodes


def summarize_games(episodes: Sequence[Episode]) -> dict[str, Any]:
    """``{"n", "mean": {metric: x̄}, "sample_var": {metric: s²}}`` of the pooling metrics."""
    out: dict[str, Any] = {"n": len(episodes), "mean": {}, "sample_var": {}}
    for metric, value in VALUES.items():
        xs = [value(e) for e in episodes]
        if xs:
            out["mean"][metric] = sum(xs) / len(xs)
        var = sample_variance(xs)
        if var is not None:
            out["sample_var"][metric] = var
    return out


def ensure_extra(run: PlannedRun, result: RunResult, games: int, evaluator: Evaluator, console: Console) -> None:
    """Attach the run's extra games to ``result`` (``result.extra``): reused from its record, or played now."""
    steps = [int(r["step"]) for r in result.eval_rows if "step" in r]
    if not steps:
        console.print(f"{result.run_dir}: no evaluation to pool extra games with; none played")
        return
    rd = RunDir(result.run_dir)
    request = {"games": games, "seed": extra_seed(run.seed), "step": max(steps)}
    path = rd.root / EXTRA_RECORD
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        record = {}
    if record.get("request") == request:
        console.print(f"reusing the {record['n']} extra held-out games in {path}")
    else:
        console.print(f"{result.arm} seed {run.seed}: {games} more held-out games (seed {request['seed']})")
        episodes = evaluator(run.config, rd.root, games, request["seed"])
        write_jsonl(rd.rollouts / EXTRA_EPISODES, episodes)
        record = {"request": request, **summarize_games(episodes)}
        atomic_write_text(path, json.dumps(record, indent=2))
    result.extra = record


def add_extra_games(
    plan: Sequence[PlannedRun],
    results: Sequence[RunResult],
    games: int,
    evaluator: Evaluator | None,
    console: Console,
) -> None:
    """Every run's extra held-out games (``evaluation.extra_games``), in plan order."""
    for run, result in zip(plan, results, strict=True):
        ensure_extra(run, result, games, evaluator or evaluate_final, console)
