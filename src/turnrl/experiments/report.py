"""Experiment output: the per-arm table, the plot, ``summary.md``, the ``RESULT`` line, the dry-run plan.

A rate metric (``success_rate``) is shown in percent and differences in points;
any other metric (``mean_reward``) in its own units.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from turnrl.config import dump_config
from turnrl.experiments.plan import PlannedRun, config_diff
from turnrl.experiments.results import RUN_RECORD, RunResult
from turnrl.experiments.spec import ExperimentSpec, LadderRung
from turnrl.experiments.verdict import RATE_METRICS, CriterionResult, mean_curve
from turnrl.rundir import atomic_write_bytes


def _f(x: Any, pct: bool = True, se: Any = None) -> str:
    if x is None:
        return "–"
    s = f"{100 * x:.1f}%" if pct else f"{x:.3f}"
    if se is not None:
        s += f" ± {100 * se:.1f}" if pct else f" ± {se:.3f}"
    return s


def _table_rows(arms: Mapping[str, dict[str, Any]], metric: str) -> list[list[str]]:
    pct = metric in RATE_METRICS
    rows = []
    for name, a in arms.items():
        if a["delta"] is None:
            delta = "–"
        else:
            delta = f"{100 * a['delta']:+.1f}" if pct else f"{a['delta']:+.3f}"
        best = "–" if a["best"] is None else f"{_f(a['best'], pct)} @ {a['best_step']}"
        reward = f"{_f(a['train_reward_first'], False)} → {_f(a['train_reward_last'], False)}"
        wall = "–" if a["wall_s"] is None else f"{a['wall_s']:.0f}"
        zero = "–" if a["frac_reward_zero_std"] is None else f"{100 * a['frac_reward_zero_std']:.0f}%"
        rows.append(
            [
                name,
                ",".join(map(str, a["seeds"])),
                str(a["train_steps"]),
                _f(a["before"], pct),
                _f(a["after"], pct, se=a["after_se"]),
                delta,
                best,
                reward,
                zero,
                wall,
            ]
        )
    return rows


def table_header(metric: str) -> list[str]:
    delta = "Δ (points)" if metric in RATE_METRICS else "Δ"
    return [
        "arm",
        "seeds",
        "steps",
        f"{metric} before",
        "after ± SE",
        delta,
        "best @ step",
        "train reward first → last ¼",
        "zero-var groups",
        "wall s",
    ]


def _count(x: Any) -> str:
    return "–" if x is None else f"{x:,.0f}"


COMPUTE_HEADER = ["arm", "leaves / step", "tokens generated", "tokens trained", "train s", "wall s (all seeds)"]
"""Equal leaves and equal compute side by side; tokens and train seconds are means per run."""


def compute_rows(arms: Mapping[str, dict[str, Any]]) -> list[list[str]]:
    return [
        [
            name,
            _count(a.get("leaves_per_step")),
            _count(a["tokens_generated"]),
            _count(a["tokens_trained"]),
            "–" if a["train_s"] is None else f"{a['train_s']:.0f}",
            "–" if a["wall_s"] is None else f"{a['wall_s']:.0f}",
        ]
        for name, a in arms.items()
    ]


def advantage_table(arms: Mapping[str, dict[str, Any]], max_turns: int = 8) -> tuple[list[str], list[list[str]]]:
    """Header and rows of mean |A_t| per turn (trained turns per run in brackets), turns 1..``max_turns``."""
    turns = sorted({t for a in arms.values() for t in (a["adv_scale"] or {})})[:max_turns]
    rows = []
    for name, a in arms.items():
        scale, n = a["adv_scale"] or {}, a["trained_turns"] or {}
        rows.append([name] + [f"{scale[t]:.3f} ({n[t]:.0f})" if t in scale else "–" for t in turns])
    return ["arm"] + [f"turn {t}" for t in turns], rows


def rich_table(header: Sequence[str], rows: Sequence[Sequence[str]], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for i, col in enumerate(header):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    return table


def markdown_rows(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + ["--:"] * (len(header) - 1)) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def results_table(arms: Mapping[str, dict[str, Any]], metric: str, title: str) -> Table:
    return rich_table(table_header(metric), _table_rows(arms, metric), title)


def markdown_table(arms: Mapping[str, dict[str, Any]], metric: str) -> str:
    return markdown_rows(table_header(metric), _table_rows(arms, metric))


def compute_tables(arms: Mapping[str, dict[str, Any]]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of the compute table and, when rollouts were saved, the advantage-scale table."""
    out = [("compute per run (equal leaves vs equal compute)", COMPUTE_HEADER, compute_rows(arms))]
    header, rows = advantage_table(arms)
    if len(header) > 1:
        out.append(("advantage scale: mean |A| per turn (trained turns per run)", header, rows))
    return out


def primary_line(primary: CriterionResult) -> str:
    """The primary outcome, stated in the spec before the runs: its comparison, SE, MDE and verdict."""
    return f"primary outcome (stated before the runs): {primary.text}"


def plot_experiment(results: Sequence[RunResult], metric: str, path: Path, title: str = "") -> Path:
    """Held-out ``metric`` (mean over seeds ± SE) and train reward vs step for every arm, as one PNG."""
    from matplotlib.figure import Figure  # Agg through Figure.savefig; no pyplot state
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(11, 4.2))
    ax_eval, ax_reward = fig.subplots(1, 2)
    arms = list(dict.fromkeys(r.arm for r in results))
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "D", "v"]
    rate = metric in RATE_METRICS
    top = 0.1
    for k, arm in enumerate(arms):
        color, style = f"C{k % 10}", styles[k % len(styles)]
        runs = [r for r in results if r.arm == arm]
        mc = mean_curve([r.curve(metric) for r in runs], metric)
        if mc:
            steps, means, raw_ses = zip(*mc, strict=True)
            ses = [0.0 if s is None else s for s in raw_ses]  # SE unknown: no error bar
            lower = [min(s, m) if rate else s for m, s in zip(means, ses, strict=True)]
            upper = [min(s, 1 - m) if rate else s for m, s in zip(means, ses, strict=True)]
            # arms with identical curves stay visible: distinct line styles and markers
            ax_eval.errorbar(
                steps,
                means,
                yerr=[lower, upper],
                marker=markers[k % len(markers)],
                linestyle=style,
                capsize=3 + 2 * k,
                color=color,
                label=arm,
                alpha=0.85,
            )
            top = max(top, *(m + s for m, s in zip(means, upper, strict=True)))
        by_step: dict[int, list[float]] = {}
        for r in runs:
            for step, value in r.rewards():
                by_step.setdefault(step, []).append(value)
        if by_step:
            xs = sorted(by_step)
            ys = [sum(by_step[x]) / len(by_step[x]) for x in xs]
            ax_reward.plot(xs, ys, color=color, alpha=0.35, linewidth=1, linestyle=style)
            w = max(1, len(xs) // 10)
            smooth = [sum(ys[max(0, i - w + 1) : i + 1]) / len(ys[max(0, i - w + 1) : i + 1]) for i in range(len(ys))]
            ax_reward.plot(xs, smooth, color=color, linewidth=2, linestyle=style, label=arm)
    ax_eval.set(
        xlabel="step",
        ylabel=f"held-out {metric}",
        title=f"held-out {metric} (mean over seeds ± SE)",
    )
    ax_reward.set(
        xlabel="step",
        ylabel="train reward",
        title="train reward (batch mean; thick: moving average)",
    )
    if rate:  # a rate stays within [0, 1]; other metrics keep matplotlib's limits
        ax_eval.set_ylim(-0.02, min(1.02, top + 0.05))
    for ax in (ax_eval, ax_reward):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write_bytes(path, buf.getvalue())
    return path


def json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def result_line(
    name: str,
    metric: str,
    arms: Mapping[str, dict[str, Any]],
    verdict: str | None,
    criterion: CriterionResult | None,
    primary: CriterionResult | None = None,
) -> str:
    """``RESULT {json}``: per-arm metrics under ``arms``, ``primary``, ``verdict`` (null when no criterion)."""
    keep = (
        "seeds",
        "before",
        "after",
        "after_se",
        "delta",
        "best",
        "best_step",
        "final_step",
        "eval_n",
        "train_reward_first",
        "train_reward_last",
        "train_reward_mean",
        "train_steps",
        "frac_reward_zero_std",
        "wall_s",
        "leaves_per_step",
        "extra_games",
        "tokens_generated",
        "tokens_trained",
        "train_s",
        "adv_scale",
    )
    payload = {
        "experiment": name,
        "metric": metric,
        "primary": primary.to_dict() if primary else None,
        "arms": {arm: {k: a.get(k) for k in keep} for arm, a in arms.items()},
        "verdict": verdict,
        "criterion": criterion.to_dict() if criterion else None,
    }
    return "RESULT " + json.dumps(json_safe(payload), allow_nan=False, ensure_ascii=False)


def criterion_lines(result: CriterionResult, depth: int = 0) -> list[str]:
    lines = ["  " * depth + f"- **{result.verdict}**: {result.text}"]
    for part in result.parts:
        lines += criterion_lines(part, depth + 1)
    return lines


VERDICT_RULE = (
    "SE of one evaluation on n examples: for a rate (success_rate), Agresti–Caffo binomial,"
    " p~ = (pn+1)/(n+2), var = p~(1−p~)/(n+2); for any other metric (mean_reward), s²/n with s² the"
    " sample variance of the n per-example values in the run's eval episodes (unknown without them)."
    " With m ≥ 2 seeds (arms paired by seed) the estimate is the mean D of the per-seed differences d_s"
    " and SE = s_d/√m (s_d: their sample sd, which already holds the evaluation noise), judged at the"
    " t critical value c = t_{m−1, 0.975} (2.78 at m = 5). With one seed (or all d_s equal) only the"
    " evaluations' variances are known: SE = √(Σ var_s)/m at c = 1.96 — weaker, it leaves out"
    " run-to-run variation. Margin: validated when diff − min_diff > c·SE, failed when < −c·SE, else"
    " inconclusive; its minimum detectable difference at 80 % power is λ·SE with λ from the noncentral"
    " t (3.76 at m = 5; 2.80 at c = 1.96). Collapse: an arm collapsed when (peak − final) − drop > c·SE,"
    " stable when < −c·SE; validated when the baseline collapsed and the treatment is stable, failed"
    " when the baseline is stable or the treatment collapsed. any_of: validated if any part is, failed"
    " if all parts failed."
)


def summary_markdown(
    spec: ExperimentSpec,
    name: str,
    plan: Sequence[PlannedRun],
    arms: Mapping[str, dict[str, Any]],
    metric: str,
    criterion: CriterionResult | None,
    plot: Path | None,
    wall_s: float,
    primary: CriterionResult | None = None,
) -> str:
    lines = [
        f"# {spec.title}",
        "",
        f"Experiment `{name}`" + (f" (spec `{spec.source}`)" if spec.source else "") + ".",
        "",
    ]
    if primary is not None:
        lines += [f"**Primary outcome** (stated before the runs): **{primary.verdict}**: {primary.text}", ""]
    lines += [f"**Hypothesis.** {spec.hypothesis}", ""]
    if criterion is None:
        lines += ["**Verdict:** none (the spec states no criterion).", ""]
    else:
        lines += [f"**Verdict: {criterion.verdict}.**", "", *criterion_lines(criterion), ""]
    lines += [
        f"Held-out {metric} (means over seeds; SE as in the rule below):",
        "",
        markdown_table(arms, metric),
        "",
    ]
    for title, header, rows in compute_tables(arms):
        lines += [f"{title[0].upper()}{title[1:]}:", "", markdown_rows(header, rows), ""]
    if plot is not None:
        lines += [f"![{name}]({plot.name})", ""]
    lines += ["## Setup", "", f"- base config: `{spec.base_config}`"]
    if spec.overrides:
        lines.append("- common overrides: " + ", ".join(f"`{k}: {json.dumps(v)}`" for k, v in spec.overrides.items()))
    for arm in spec.all_arms():
        ov = ", ".join(f"`{k}: {json.dumps(v)}`" for k, v in arm.overrides.items()) or "(base config)"
        lines.append(f"- arm **{arm.name}**: {ov}" + (f" — {arm.description}" if isinstance(arm, LadderRung) else ""))
    first = plan[0].config
    lines.append(
        f"- seeds {spec.seeds}; budget: train.steps {first.train.steps}, train.max_seconds {first.train.max_seconds};"
        f" evaluation every {first.eval.every} steps on {first.data.num_eval_tasks or 'all'} held-out examples,"
        f" temperature {first.eval.temperature}"
    )
    if spec.evaluation.extra_games:
        lines.append(
            f"- extra held-out games per final policy: {spec.evaluation.extra_games} (sampled, fresh seeds),"
            " pooled with the last evaluation (`turnrl.experiments.extra`)"
        )
    lines.append(f"- wall time of the runs (sum): {wall_s:.0f} s")
    lines += ["", "## Runs", "", "| arm | seed | run directory | wall s |", "|---|--:|---|--:|"]
    for run in plan:
        record = run.run_dir / RUN_RECORD
        info = json.loads(record.read_text()) if record.exists() else {}
        wall = info.get("wall_s")
        reused = " (reused)" if info.get("reused") else ""
        lines.append(f"| {run.arm} | {run.seed} | `{run.run_dir}` | {'–' if wall is None else f'{wall:.0f}'}{reused} |")
    lines += ["", "## Verdict rule", "", VERDICT_RULE, ""]
    return "\n".join(lines)


def describe_plan(spec: ExperimentSpec, plan: Sequence[PlannedRun], console: Console) -> None:
    """Print each run directory and how its config differs from the first arm's (``--dry-run``)."""
    first = {p.seed: p for p in reversed(plan)}
    table = Table(title=f"{spec.title}: {len(plan)} runs", title_justify="left")
    for col in ("arm", "seed", "run directory", "differs from the first arm in"):
        table.add_column(col)
    for p in plan:
        ref = first[p.seed]
        diff = config_diff(ref.config, p.config)
        text = ", ".join(f"{k}: {b!r}" for k, (_, b) in diff.items()) if p is not ref else "(reference)"
        table.add_row(p.arm, str(p.seed), str(p.run_dir), text or "(nothing)")
    console.print(table)
    console.print(f"resolved config of the first run:\n{dump_config(plan[0].config)}", highlight=False)
