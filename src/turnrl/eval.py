"""Held-out evaluation and the base-vs-trained comparison."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from rich.table import Table

from turnrl.chat import ChatTemplate
from turnrl.config import RunConfig
from turnrl.rollout.collect import RolloutSettings, collect
from turnrl.sampling.base import Sampler
from turnrl.types import Episode, SamplingParams, StopReason, Task

EVAL_METRICS = ("success_rate", "mean_reward", "mean_turns", "malformed_rate", "wellformed_success_rate")


@dataclass
class EvalResult:
    metrics: dict[str, float]
    episodes: list[Episode]


@dataclass(frozen=True)
class EvalSettings:
    """How a run evaluates, resolved once: one game per task at ``temperature`` (greedy by default),
    plus ``samples_per_task`` sampled games at ``sample_temperature``; the rollout limits of training."""

    rollout: RolloutSettings = RolloutSettings()
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 64
    samples_per_task: int = 0
    sample_temperature: float = 1.0
    every: int = 0
    before: bool = True

    @classmethod
    def from_config(cls, cfg: RunConfig) -> EvalSettings:
        e, s = cfg.eval, cfg.sampler
        return cls(
            rollout=RolloutSettings.from_config(cfg).for_evaluation(),
            temperature=e.temperature,
            top_p=s.top_p,
            max_tokens=e.max_tokens or s.max_tokens,
            samples_per_task=e.samples_per_task,
            sample_temperature=e.sample_temperature or s.temperature or 1.0,
            every=e.every,
            before=e.before,
        )


def _stratified_se(values: dict[tuple[str, str], list[float]], n: int) -> float:
    """SE of the overall mean for a fixed evaluation set: strata = (task, greedy|sampled).

    SE² = Σ_s (n_s / N)² · var_s / n_s, with var_s the within-stratum sample variance
    (ddof 1; 0 for a single or deterministic game). The held-out tasks are fixed, so the only
    randomness is the sampling of each game; games of one task are not independent draws of
    the task population and are not treated as such.
    """
    total = 0.0
    for xs in values.values():
        k = len(xs)
        if k > 1:
            mean = sum(xs) / k
            var = sum((x - mean) ** 2 for x in xs) / (k - 1)
            total += (k / n) ** 2 * var / k
    return math.sqrt(total)


def summarize(episodes: list[Episode]) -> dict[str, float]:
    """Success rate, mean reward (with standard errors), mean turns, malformed rate of evaluation games,
    and the success rate of the well-formed games (those not ended by a malformed reply): the
    strategy with the answer format taken out (its SE is conditional on which games were well-formed).

    Games whose id contains ``-sampled-`` are the sampled ones (see :func:`evaluate`).
    """
    n = max(len(episodes), 1)
    success: dict[tuple[str, str], list[float]] = {}
    reward: dict[tuple[str, str], list[float]] = {}
    wellformed: dict[tuple[str, str], list[float]] = {}
    for e in episodes:
        key = (e.task_id, "sampled" if "-sampled-" in e.episode_id else "greedy")
        won = float(e.stop_reason == StopReason.SUCCESS)
        success.setdefault(key, []).append(won)
        reward.setdefault(key, []).append(e.reward)
        if e.stop_reason != StopReason.MALFORMED:
            wellformed.setdefault(key, []).append(won)
    n_wellformed = sum(len(xs) for xs in wellformed.values())
    return {
        "success_rate": sum(e.stop_reason == StopReason.SUCCESS for e in episodes) / n,
        "success_rate_se": _stratified_se(success, n),
        "mean_reward": sum(e.reward for e in episodes) / n,
        "mean_reward_se": _stratified_se(reward, n),
        "mean_turns": sum(e.num_turns for e in episodes) / n,
        "malformed_rate": sum(e.stop_reason == StopReason.MALFORMED for e in episodes) / n,
        "wellformed_success_rate": sum(map(sum, wellformed.values())) / n_wellformed if n_wellformed else math.nan,
        "wellformed_success_rate_se": _stratified_se(wellformed, n_wellformed) if n_wellformed else math.nan,
        "num_tasks": float(len(episodes)),
        "num_wellformed": float(n_wellformed),
    }


def evaluate(
    tasks: list[Task], sampler: Sampler, chat: ChatTemplate, settings: EvalSettings, seed: int = 0
) -> EvalResult:
    """One game per task at ``eval.temperature`` (greedy by default), plus ``eval.samples_per_task``
    sampled games per task at ``eval.sample_temperature`` (default: the training temperature)."""
    e = settings
    params = SamplingParams(temperature=e.temperature, top_p=e.top_p, max_tokens=e.max_tokens, seed=seed)
    episodes = collect(tasks, sampler, chat, params, [1], e.rollout, id_prefix="eval-")
    if e.samples_per_task:
        params = replace(params, temperature=e.sample_temperature, seed=seed + 1)
        episodes += collect(tasks, sampler, chat, params, [e.samples_per_task], e.rollout, id_prefix="eval-sampled-")
    return EvalResult(summarize(episodes), episodes)


def _cell(metrics: dict[str, float], key: str) -> str:
    value = metrics.get(key, float("nan"))
    se = metrics.get(f"{key}_se")
    if key.endswith("rate"):
        return f"{value:.1%}" + (f" ± {se:.1%}" if se is not None else "")
    return f"{value:.3f}" + (f" ± {se:.3f}" if se is not None else "")


def comparison_table(rows: dict[str, dict[str, float]], title: str = "held-out evaluation") -> Table:
    """A rich table with one column per labelled evaluation (e.g. base, trained), ± standard errors.

    With exactly two columns, a third gives the difference (second − first) and its standard
    error sqrt(se₁² + se₂²) (the two evaluations sample their games independently).
    """
    table = Table(title=title)
    table.add_column("metric")
    labels = list(rows)
    for label in labels:
        table.add_column(label, justify="right")
    diff = len(labels) == 2
    if diff:
        table.add_column(f"{labels[1]} − {labels[0]}", justify="right")
    for key in EVAL_METRICS:
        cells = [_cell(m, key) for m in rows.values()]
        if diff:
            a, b = rows[labels[0]], rows[labels[1]]
            d = b.get(key, float("nan")) - a.get(key, float("nan"))
            se = math.hypot(a[f"{key}_se"], b[f"{key}_se"]) if f"{key}_se" in a and f"{key}_se" in b else None
            pct = key.endswith("rate")
            text = f"{d:+.1%}" if pct else f"{d:+.3f}"
            if se is not None:
                text += f" ± {se:.1%}" if pct else f" ± {se:.3f}"
                if se > 0:
                    text += f" ({d / se:+.1f} SE)"
            cells.append(text)
        table.add_row(key.replace("_", " "), *cells)
    num = rows[labels[0]].get("num_tasks") if labels else None
    if num:
        table.caption = f"{int(num)} games; ± = standard error"
    return table
