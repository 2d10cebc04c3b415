"""Reading finished runs: eval and train progress, evaluation episodes, per-arm numbers.

A run directory (:class:`turnrl.rundir.RunDir`) holds ``progress/eval.csv``
(one row per evaluation: the means of :func:`turnrl.eval.summarize` and
``num_tasks``), ``progress/train.csv`` and the evaluation episodes
``rollouts/eval_step_NNNNN.jsonl``. The episodes give the per-example values
behind a mean, whose sample variance is the SE of any metric that is not a rate
(:mod:`turnrl.experiments.verdict`).

Compute and credit scale per run (:func:`rollout_stats`, :func:`compute_of`), for equal-leaves and
equal-compute comparisons side by side:

- **tokens generated**: the sampled action tokens of the distinct turns in ``rollouts/iter_*.jsonl``
  — a branched tree's shared turns once (turn t of the leaf with branch path b was sampled at
  node b[:t + 1]), every turn of a flat group's episodes;
- **tokens trained**: Σ over steps of ``num_tokens`` (``progress/train.csv``: the batch's trained
  tokens, one pass; ``train.num_iterations`` passes train each that many times);
- **train seconds**: Σ over steps of ``time/collect_s`` + ``time/train_s`` (evaluations left out);
- **advantage scale per turn**: mean |A_t| over the trained turns (advantage not None) of each
  turn index t, and their number: a change of the effective learning rate per turn, not of credit,
  when it differs between arms.

Groups dropped by ``rollout.dynamic_sampling`` are not saved, so their tokens are not counted.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnrl.experiments.verdict import (
    CriterionResult,
    Curve,
    EvalPoint,
    as_curve,
    combine,
    eval_var,
    evaluate,
    mean_curve,
    pool_points,
    sample_variance,
)
from turnrl.rundir import RunDir, iter_episodes
from turnrl.tracking.sinks import read_csv
from turnrl.train.summary import SummaryError, read_summary
from turnrl.types import Episode

RUN_RECORD = "experiment_run.json"
"""Written into each run directory by the runner: wall time of the run."""

EPISODE_VALUES: dict[str, Callable[[Episode], float]] = {
    "mean_reward": lambda e: float(e.reward),
    "mean_turns": lambda e: float(e.num_turns),
}
"""Per-episode values of the eval metrics that are not rates (a rate's SE is binomial)."""


@dataclass
class RunResult:
    arm: str
    seed: int
    run_dir: Path
    eval_rows: list[dict[str, Any]]
    train_rows: list[dict[str, Any]]
    wall_s: float | None = None
    reused: bool = False
    eval_spread: dict[int, dict[str, Any]] = field(default_factory=dict)
    """step → ``{"n": episodes, <metric>: sample variance}`` from the saved evaluation episodes."""
    extra: dict[str, Any] | None = None
    """The extra held-out games of the final policy (:mod:`turnrl.experiments.extra`), pooled into ``curve``."""
    rollouts: dict[str, Any] = field(default_factory=dict)
    """:func:`rollout_stats` of the saved training rollouts (empty when not read)."""

    def curve(self, metric: str) -> Curve:
        """The eval curve of ``metric``; a point carries the sample variance of its examples when known.

        With extra games, the point of their step is the pooled evaluation (:func:`pool_points`)."""
        points = []
        for row in self.eval_rows:
            if metric in row and "step" in row:
                step, n = int(row["step"]), int(row.get("num_tasks", 0) or 0)
                spread = self.eval_spread.get(step, {})
                var = spread.get(metric) if spread.get("n") == n else None  # episodes of this very row
                points.append(EvalPoint(step, float(row[metric]), n, var))
        curve = as_curve(points)
        x = self.extra
        if x and x.get("n") and metric in x["mean"]:
            extra = EvalPoint(x["request"]["step"], x["mean"][metric], x["n"], x["sample_var"].get(metric))
            curve = [pool_points(p, extra) if p.step == extra.step else p for p in curve]
        return curve

    def rewards(self) -> list[tuple[int, float]]:
        return [(int(r["step"]), float(r["reward"])) for r in self.train_rows if "reward" in r]

    def column_mean(self, key: str) -> float | None:
        return _mean([float(r[key]) for r in self.train_rows if key in r])

    def column_sum(self, *keys: str) -> float | None:
        """Σ over steps of the given train.csv columns; None when no row has any of them."""
        values = [float(r[k]) for r in self.train_rows for k in keys if r.get(k) not in (None, "")]
        return sum(values) if values else None


def _turn_key(ep: Episode, t: int) -> tuple[Any, ...]:
    """The node a turn was sampled at: a tree's turn t of the leaf on path b at b[:t + 1]; a flat episode's own."""
    return (ep.group_id, tuple(ep.branch[: t + 1]), t) if ep.branch else (ep.episode_id, t)


def rollout_stats(run_dir: RunDir) -> dict[str, Any]:
    """Tokens generated (distinct sampled turns) and, per turn index, Σ|A| and the trained turns' count."""
    seen: set[tuple[Any, ...]] = set()
    generated = 0
    abs_sum: dict[int, float] = {}
    count: dict[int, int] = {}
    files = run_dir.train_rollout_files()
    for path in files:
        for ep in iter_episodes(path):
            for t, turn in enumerate(ep.turns):
                key = (path.name, *_turn_key(ep, t))
                if key not in seen:
                    seen.add(key)
                    generated += len(turn.action_ids)
                if turn.advantage is not None:
                    abs_sum[t] = abs_sum.get(t, 0.0) + abs(turn.advantage)
                    count[t] = count.get(t, 0) + 1
    if not files:
        return {}
    return {"tokens_generated": generated, "abs_adv_sum": abs_sum, "trained_turns": count}


def eval_spread(run_dir: RunDir, steps: Sequence[int]) -> dict[int, dict[str, Any]]:
    """Per evaluated step: the number of saved eval episodes and the sample variance of each metric."""
    out: dict[int, dict[str, Any]] = {}
    for step in sorted(set(steps)):
        episodes = list(iter_episodes(run_dir.eval_rollouts(step)))
        if not episodes:
            continue
        spread: dict[str, Any] = {"n": len(episodes)}
        for metric, value in EPISODE_VALUES.items():
            var = sample_variance([value(e) for e in episodes])
            if var is not None:
                spread[metric] = var
        out[step] = spread
    return out


def read_run(arm: str, seed: int, run_dir: Path, spread: bool = True) -> RunResult:
    """The progress rows, runner record, (``spread``) evaluation spread and rollout stats of one run directory.

    The spread needs every saved evaluation episode; pass ``spread=False`` when only rates are
    judged (their SE is binomial).
    """
    rd = RunDir(run_dir)
    record = rd.root / RUN_RECORD
    info = json.loads(record.read_text()) if record.exists() else {}
    eval_rows = read_csv(rd.eval_csv)
    steps = [int(r["step"]) for r in eval_rows if "step" in r]
    return RunResult(
        arm,
        seed,
        rd.root,
        eval_rows,
        read_csv(rd.train_csv),
        info.get("wall_s"),
        bool(info.get("reused", False)),
        eval_spread(rd, steps) if spread else {},
        rollouts=rollout_stats(rd),
    )


def is_complete(run_dir: Path) -> bool:
    """Whether the run finished, as its record says (:attr:`turnrl.train.summary.Summary.complete`: its
    last planned iteration has ended). No record, or a damaged one, is not complete."""
    try:
        record = read_summary(RunDir(run_dir))
    except SummaryError:
        return False
    return record is not None and record.complete


def curves_by_arm(results: Sequence[RunResult], metric: str) -> dict[str, dict[int, Curve]]:
    out: dict[str, dict[int, Curve]] = {}
    for r in results:
        out.setdefault(r.arm, {})[r.seed] = r.curve(metric)
    return out


def evaluate_on_runs(criterion: Any, results: Sequence[RunResult]) -> CriterionResult:
    return evaluate(criterion, lambda metric: curves_by_arm(results, metric))


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _quarter_means(
    rewards: list[tuple[int, float]],
) -> tuple[float | None, float | None, float | None]:
    values = [v for _, v in sorted(rewards)]
    if not values:
        return None, None, None
    k = max(1, len(values) // 4)
    return _mean(values[:k]), _mean(values[-k:]), _mean(values)


def compute_of(results: Sequence[RunResult]) -> dict[str, Any]:
    """Per arm, means per run: tokens generated and trained, train seconds; advantage scale per turn (pooled).

    ``adv_scale[t]`` = Σ|A_t| / (trained turns at index t) over every run, turns numbered from 1;
    ``trained_turns[t]``: trained turns at index t per run. None where no run recorded it.
    """
    stats = [r.rollouts for r in results if r.rollouts]
    abs_sum: dict[int, float] = {}
    count: dict[int, int] = {}
    for st in stats:
        for t, x in st["abs_adv_sum"].items():
            abs_sum[t] = abs_sum.get(t, 0.0) + x
            count[t] = count.get(t, 0) + st["trained_turns"][t]
    trained = [x for r in results if (x := r.column_sum("num_tokens")) is not None]
    seconds = [x for r in results if (x := r.column_sum("time/collect_s", "time/train_s")) is not None]
    return {
        "tokens_generated": _mean([st["tokens_generated"] for st in stats]),
        "tokens_trained": _mean(trained),
        "train_s": _mean(seconds),
        "adv_scale": {t + 1: abs_sum[t] / count[t] for t in sorted(count)} if stats else None,
        "trained_turns": {t + 1: count[t] / len(stats) for t in sorted(count)} if stats else None,
    }


def arm_summary(results: Sequence[RunResult], metric: str) -> dict[str, Any]:
    """Per-arm numbers (means over seeds): before, after (± SE), best (step), train reward, compute."""
    curves = [r.curve(metric) for r in results]
    befores = [c[0].value for c in curves if c and c[0].step == 0]
    finals = [c[-1] for c in curves if c]
    after = after_se = None
    if finals:
        variances = [eval_var(p, metric) for p in finals]
        after = sum(p.value for p in finals) / len(finals)
        if all(v is not None for v in variances):
            est = combine([p.value for p in finals], variances)  # type: ignore[arg-type]
            after, after_se = est.mean, est.se
    mc = mean_curve(curves, metric)
    best = max(mc, key=lambda x: x[1]) if mc else None
    quarters = [_quarter_means(r.rewards()) for r in results]
    firsts, lasts, means = zip(*quarters, strict=True) if results else ((), (), ())
    walls = [r.wall_s for r in results if r.wall_s is not None]
    before = _mean(befores) if len(befores) == len(results) else None
    zero_std = [x for r in results if (x := r.column_mean("frac_reward_zero_std")) is not None]
    return {
        "seeds": [r.seed for r in results],
        "before": before,
        "after": after,
        "after_se": after_se,
        "delta": after - before if after is not None and before is not None else None,
        "best": best[1] if best else None,
        "best_step": best[0] if best else None,
        "final_step": max((p.step for p in finals), default=None),
        "eval_n": finals[0].n if finals else None,
        "train_reward_first": _mean([x for x in firsts if x is not None]),
        "train_reward_last": _mean([x for x in lasts if x is not None]),
        "train_reward_mean": _mean([x for x in means if x is not None]),
        "train_steps": max((len(r.rewards()) for r in results), default=0),
        "frac_reward_zero_std": _mean(zero_std),
        "wall_s": sum(walls) if walls else None,
        "extra_games": [r.extra["n"] for r in results if r.extra] or None,
        **compute_of(results),
        "run_dirs": [str(r.run_dir) for r in results],
    }
