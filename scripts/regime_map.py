"""The regime map of credit (issue 31 part 5, docs/results.md §17): one table and one plot across experiments.

Each variant of ``experiments/regime/`` is a ``turnrl experiment`` spec (its arms, seeds, audit and verdict);
this script reads their finished runs and puts the variants side by side:

* per variant × arm: the held-out metric before, at step 5 and at the end (means over seeds), the gain
  (end − before), and **vs group_mean** the paired difference at step 5 (the specs' primary step) and at
  the end: D = mean_s d_s, SE = s_d/√m, the t verdict at 97.5 % and the MDE at 80 % power
  (:mod:`turnrl.experiments.verdict`, the experiments' own rule);
* sample efficiency: held-out metric against the leaves seen (steps × leaves per step; the batch
  ladder's rungs see 2× and 4× the leaves per step);
* the audit's prediction (``experiment.json`` → ``prediction``, stated before the runs) beside the
  measured ordering: Spearman's ρ between the predicted figure and the measured step-5 difference, per
  variant and pooled over every (variant, arm);
* per decision (the per-turn D variants only: there a decision's own reward marks it right): each position's
  held-out success at step 5 and its paired difference vs group_mean, an explanatory table read after the
  runs (not a primary outcome);
* a plot: the step-5 difference vs group_mean and the gain per arm against D (per-turn and terminal
  reward), and the held-out metric against leaves seen per variant.

Run (from the repository root, after the specs): ``python scripts/regime_map.py [--runs runs] [--out DIR]``.
A variant with no finished run is listed as missing, never guessed.

Run directories are not kept in git (a fresh checkout has none), so each variant's summary — everything
above, per-seed differences included — is recorded in ``experiments/regime/results/<name>.json`` whenever
its runs are read, and a variant whose runs are absent is read back from there (its ``source`` says from
what). A record is replaced only by runs covering at least as many (arm, seed) pairs, and only by an
``experiment.json`` with group_mean and another arm (one arm's run of a spec writes one with that arm alone).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from scipy.stats import spearmanr

from turnrl.experiments.results import RunResult, read_run
from turnrl.experiments.verdict import combine, eval_var, mde

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "experiments" / "regime" / "results"
VARIANTS = [  # (experiment name, D, reward timing, label)
    ("regime_d1_turn", 1, "per_turn", "D 1"),
    ("regime_d2_turn", 2, "per_turn", "D 2, per turn"),
    ("regime_d4_turn", 4, "per_turn", "D 4, per turn"),
    ("regime_d4_word_turn", 4, "per_turn", "D 4 (word rule), per turn"),
    ("regime_d8_word_turn", 8, "per_turn", "D 8 (word rule), per turn"),
    ("regime_d2_terminal", 2, "terminal", "D 2, terminal"),
    ("regime_d4_terminal", 4, "terminal", "D 4, terminal"),
    ("regime_d4_word_terminal", 4, "terminal", "D 4 (word rule), terminal"),
    ("regime_d8_word_terminal", 8, "terminal", "D 8 (word rule), terminal"),
    ("regime_noisy_turn", 1, "per_turn", "noisy prefix, per turn"),
    ("regime_noisy_terminal", 1, "terminal", "noisy prefix, terminal"),
    ("regime_corridor", 3, "per_turn", "corridor D 3"),
]
BASELINE = "group_mean"
MID = 5


def _point(run: RunResult, metric: str, step: int | None):
    """The run's evaluation at ``step`` (None: its last)."""
    curve = run.curve(metric)
    if not curve:
        return None
    if step is None:
        return curve[-1]
    return next((p for p in curve if p.step == step), None)


def _paired(runs: dict[str, dict[int, RunResult]], arm: str, metric: str, step: int | None) -> dict | None:
    """arm − baseline over the seeds both finished: mean, SE (s_d/√m), t, verdict, MDE."""
    seeds = sorted(set(runs.get(arm, {})) & set(runs.get(BASELINE, {})))
    diffs, variances = [], []
    for s in seeds:
        a, b = _point(runs[arm][s], metric, step), _point(runs[BASELINE][s], metric, step)
        if a is None or b is None:
            continue
        diffs.append(a.value - b.value)
        variances.append((eval_var(a, metric) or 0.0) + (eval_var(b, metric) or 0.0))
    return _judged(diffs, variances)


def _judged(diffs: list[float], variances: list[float]) -> dict | None:
    """Per-seed paired differences judged by the verdict's rule: mean, SE (s_d/√m), t, verdict, MDE."""
    if not diffs:
        return None
    est = combine(diffs, variances)
    t = est.mean / est.se if est.se > 0 else math.nan
    verdict = "better" if t > est.critical else "worse" if t < -est.critical else "no difference resolved"
    return {
        "diff": est.mean,
        "se": est.se,
        "t": t,
        "critical": est.critical,
        "df": est.df,
        "seeds": len(diffs),
        "mde": mde(est.se, est.df),
        "verdict": verdict,
        "per_seed": diffs,
    }


def _decision_rates(run_dir: Path, step: int) -> list[tuple[float, int]] | None:
    """Per decision position: (fraction of held-out games whose turn earned a positive reward, games) at
    ``step``, from the run's saved evaluation episodes; None without them."""
    path = run_dir / "rollouts" / f"eval_step_{step:05d}.jsonl"
    if not path.exists():
        return None
    hits: dict[int, list[float]] = {}
    for line in path.read_text().splitlines():
        for turn in json.loads(line)["turns"]:
            hits.setdefault(turn["index"], []).append(1.0 if (turn.get("reward") or 0) > 0 else 0.0)
    return [(statistics.fmean(hits[k]), len(hits[k])) for k in sorted(hits)]


def per_decision(exp: dict, step: int) -> dict[str, Any]:
    """Each arm's per-position success at ``step`` (means over seeds) and its paired difference vs the
    baseline per position (the verdict's rule; a seed's variance from the binomial p(1−p)/n)."""
    rates: dict[str, dict[int, list[tuple[float, int]]]] = {}
    for r in exp["runs"]:
        got = _decision_rates(Path(r["run_dir"]), step)
        if got is not None:
            rates.setdefault(r["arm"], {})[r["seed"]] = got
    out: dict[str, Any] = {}
    base = rates.get(BASELINE, {})
    for arm, by_seed in rates.items():
        positions = min(len(v) for v in by_seed.values())
        row: dict[str, Any] = {"mean": [statistics.fmean(v[k][0] for v in by_seed.values()) for k in range(positions)]}
        if arm != BASELINE and base:
            row["vs"] = []
            for k in range(positions):
                diffs, variances = [], []
                for seed in sorted(set(by_seed) & set(base)):
                    (a, na), (b, nb) = by_seed[seed][k], base[seed][k]
                    diffs.append(a - b)
                    variances.append(a * (1 - a) / na + b * (1 - b) / nb)
                row["vs"].append(_judged(diffs, variances))
        out[arm] = row
    return out


def decision_table(variants: list[tuple[tuple, dict | None]]) -> str:
    lines = [
        "| variant | arm | success per decision at step 5 (%) | vs group_mean per decision (points; MDE, seeds) |",
        "|---|---|---|---|",
    ]
    for (name, _d, timing, label), v in variants:
        if v is None or timing != "per_turn" or not name.startswith("regime_d"):
            continue
        for arm, row in v["decisions"].items():
            rates = " / ".join(f"{100 * m:.0f}" for m in row["mean"])
            vs = " / ".join(_diff(d, pct=True) for d in row["vs"]) if row.get("vs") else "–"
            lines.append(f"| {label} | {arm} | {rates} | {vs} |")
    return "\n".join(lines)


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def _figure(prediction: dict | None, arm: str) -> float | None:
    """The audit's predicted figure for ``arm``: Σ_t n_eff,t = Σ_t n_t·c_t² (the perfectly credited samples its
    gradients are worth per task, :mod:`turnrl.experiments.prediction`; higher: predicted to learn more)."""
    if not prediction:
        return None
    value = ((prediction.get("arms") or {}).get(arm) or {}).get("all", {}).get("n_eff")
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def read_variant(runs_root: Path, name: str) -> dict[str, Any] | None:
    exp_json = runs_root / name / "experiment.json"
    if not exp_json.exists():
        return None
    exp = json.loads(exp_json.read_text())
    arms_run = {r["arm"] for r in exp["runs"]}
    if BASELINE not in arms_run or len(arms_run) < 2:  # one arm's own run of the spec overwrote the cell's
        print(
            f"{exp_json}: only {', '.join(sorted(arms_run)) or 'no arm'}; not a cell (run the whole spec)",
            file=sys.stderr,
        )
        return None
    metric = exp["metric"]
    runs: dict[str, dict[int, RunResult]] = {}
    for r in exp["runs"]:
        runs.setdefault(r["arm"], {})[r["seed"]] = read_run(r["arm"], r["seed"], Path(r["run_dir"]))
    arms: dict[str, dict[str, Any]] = {}
    for arm, by_seed in runs.items():
        leaves = exp["arms"][arm].get("leaves_per_step")
        curves = [run.curve(metric) for run in by_seed.values()]
        steps = sorted({p.step for c in curves for p in c})
        at = {st: _mean([p.value for c in curves for p in c if p.step == st]) for st in steps}
        finals = [c[-1].value for c in curves if c]
        befores = [c[0].value for c in curves if c and c[0].step == 0]
        arms[arm] = {
            "seeds": sorted(by_seed),
            "leaves_per_step": leaves,
            "curve": [(st, st * (leaves or 0), at[st]) for st in steps],
            "before": _mean(befores),
            "mid": at.get(MID),
            "final": _mean(finals),
            "gain": (_mean(finals) - _mean(befores)) if finals and befores else None,  # type: ignore[operator]
            "vs_mid": _paired(runs, arm, metric, MID) if arm != BASELINE else None,
            "vs_final": _paired(runs, arm, metric, None) if arm != BASELINE else None,
            "predicted": _figure(exp.get("prediction"), arm),
            "wall_s": exp["arms"][arm].get("wall_s"),
        }
    return {
        "name": name,
        "metric": metric,
        "arms": arms,
        "prediction": exp.get("prediction"),
        "decisions": per_decision(exp, MID),
    }


def _pairs(v: dict[str, Any]) -> int:
    return sum(len(a["seeds"]) for a in v["arms"].values())


def load_variant(runs_root: Path, name: str, recorded: Path) -> dict[str, Any] | None:
    """The variant from its finished runs (recording the summary), else from its recorded summary."""
    path = recorded / f"{name}.json"
    old = json.loads(path.read_text()) if path.exists() else None
    v = read_variant(runs_root, name)
    if v is None or (old is not None and _pairs(old) > _pairs(v)):
        return old
    v["source"] = f"runs/{name}, read {datetime.date.today().isoformat()}"
    recorded.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(v, indent=1, default=str) + "\n")
    return json.loads(path.read_text())  # the same form either way (tuples as lists)


def _fmt(x: float | None, pct: bool) -> str:
    if x is None or not math.isfinite(x):
        return "–"
    return f"{100 * x:.1f}" if pct else f"{x:.3f}"


def _diff(d: dict | None, pct: bool) -> str:
    if d is None:
        return "–"
    k = 100 if pct else 1
    mark = "**" if d["verdict"] != "no difference resolved" else ""
    return f"{mark}{k * d['diff']:+.1f} ± {k * d['se']:.1f}{mark} (MDE {k * d['mde']:.1f}, {d['seeds']} seeds)"


def table(variants: list[tuple[tuple, dict | None]]) -> str:
    """The regime map as markdown: one row per variant × arm (values in points of per-decision success)."""
    lines = [
        "| variant | arm | leaves/step | before | step 5 | end | gain"
        " | vs group_mean at step 5 | at the end | audit figure |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (name, _d, _timing, label), v in variants:
        if v is None:
            lines.append(f"| {label} (`{name}`) | not run | | | | | | | | |")
            continue
        pct = True  # both metrics are rates in [0, 1] here: per-decision success, episode success, progress
        for arm, a in v["arms"].items():
            lines.append(
                f"| {label} | {arm} | {a['leaves_per_step']} | {_fmt(a['before'], pct)} | {_fmt(a['mid'], pct)}"
                f" | {_fmt(a['final'], pct)} | {_fmt(a['gain'], pct)} | {_diff(a['vs_mid'], pct)}"
                f" | {_diff(a['vs_final'], pct)} | {_fmt(a['predicted'], False)} |"
            )
    return "\n".join(lines)


def orderings(variants: list[tuple[tuple, dict | None]]) -> tuple[list[str], float | None]:
    """Spearman's ρ between the audit's figure and the measured step-5 difference: per variant, and pooled."""
    lines, pooled_x, pooled_y = [], [], []
    for (name, *_), v in variants:
        if v is None:
            continue
        xs, ys = [], []
        for arm, a in v["arms"].items():
            if a["predicted"] is None or "_x" in arm:  # ladder rungs have no audit arm
                continue
            measured = 0.0 if arm == BASELINE else (a["vs_mid"] or {}).get("diff")
            if measured is None:
                continue
            xs.append(a["predicted"])
            ys.append(measured)
        if len(xs) >= 3:
            rho = float(spearmanr(xs, ys).statistic)
            lines.append(f"{name}: Spearman ρ = {rho:+.2f} over {len(xs)} arms")
        elif xs:
            lines.append(f"{name}: {len(xs)} arms, too few for a rank correlation")
        # pooled: each arm's figure relative to the baseline's, against its difference
        base = v["arms"].get(BASELINE, {}).get("predicted")
        if base is not None and base > 0:  # each arm's predicted ratio to the baseline, scale-free across variants
            for x, y in zip(xs, ys, strict=True):
                if x > 0:
                    pooled_x.append(math.log(x / base))
                    pooled_y.append(y)
    pooled = float(spearmanr(pooled_x, pooled_y).statistic) if len(pooled_x) >= 3 else None
    return lines, pooled


def against_rungs(variants: list[tuple[tuple, dict | None]]) -> list[str]:
    """Each per-turn arm against the batch ladder's rungs at step 5, paired by seed (arm − rung = the two
    differences to group_mean subtracted seed by seed): whether credit beats simply sampling k× the leaves,
    and, where the arm's training time matches a rung's, the equal-compute comparison."""
    lines = []
    for (name, *_), v in variants:
        if v is None:
            continue
        rungs = [r for r in v["arms"] if "_x" in r and (v["arms"][r]["vs_mid"] or {}).get("per_seed")]
        for rung in rungs:
            for arm, a in v["arms"].items():
                if arm == BASELINE or "_x" in arm or not (a["vs_mid"] or {}).get("per_seed"):
                    continue
                mine, theirs = a["vs_mid"]["per_seed"], v["arms"][rung]["vs_mid"]["per_seed"]
                if a["seeds"] != v["arms"][rung]["seeds"] or len(mine) != len(theirs):
                    continue  # paired by position: only the same seeds, each with both evaluations
                d = _judged([x - y for x, y in zip(mine, theirs, strict=True)], [0.0] * len(mine))
                assert d is not None  # per_seed is non-empty
                lines.append(f"{name}: {arm} vs {rung} at step 5: {_diff(d, pct=True)} → {d['verdict']}")
    return lines


def plot(variants: list[tuple[tuple, dict | None]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    names = sorted({arm for _, v in variants if v is not None for arm in v["arms"]})
    color = {arm: f"C{i}" for i, arm in enumerate(names)}  # one colour per arm in every panel
    styles = {  # (rule, timing) -> (line style, x offset: the word series sits beside the position one)
        ("position", "per_turn"): ("-o", 1.0), ("position", "terminal"): ("--s", 1.0),
        ("word", "per_turn"): ("-*", 1.08), ("word", "terminal"): ("--*", 1.08),
    }  # fmt: skip
    series: dict[tuple[str, str, str], list[tuple[int, dict]]] = {}
    for (name, d, timing, _label), v in variants:
        if v is None or "noisy" in name or "corridor" in name:
            continue
        rule = "word" if "_word" in name else "position"
        for arm, a in v["arms"].items():
            series.setdefault((rule, timing, arm), []).append((d, a))
    for (rule, timing, arm), pts in sorted(series.items()):
        style, dx = styles[(rule, timing)]
        pts.sort(key=lambda p: p[0])
        label = f"{arm} ({rule}, {timing.replace('_', ' ')})"
        vs = [p for p in pts if p[1]["vs_mid"] is not None]
        if vs:
            axes[0].errorbar(
                [p[0] * dx for p in vs],
                [100 * p[1]["vs_mid"]["diff"] for p in vs],
                yerr=[100 * p[1]["vs_mid"]["se"] for p in vs],
                fmt=style,
                color=color[arm],
                capsize=3,
                label=label,
            )
        gains = [p for p in pts if p[1]["gain"] is not None]
        axes[1].plot(
            [p[0] * dx for p in gains], [100 * p[1]["gain"] for p in gains], style, color=color[arm], label=label
        )
    axes[0].axhline(0, color="grey", lw=0.8)
    axes[0].set(xscale="log", xlabel="D (decisions per episode)", ylabel="points", title="vs group_mean at step 5")
    axes[1].set(xscale="log", xlabel="D", ylabel="points", title="gain, before → end")
    for ax in axes[:2]:
        ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
        ax.minorticks_off()
        ax.legend(fontsize=7)
    found = {n: v for (n, *_), v in variants if v is not None}
    curves = (
        ("regime_d4_turn", "-o", "D 4, position"),
        ("regime_d4_word_turn", "--*", "D 4, word"),
        ("regime_d8_word_turn", ":^", "D 8, word"),
    )
    for name, style, what in curves:
        for arm, a in found.get(name, {"arms": {}})["arms"].items():
            xs, ys = [c[1] for c in a["curve"]], [100 * c[2] for c in a["curve"]]
            axes[2].plot(xs, ys, style, color=color[arm], label=f"{arm} ({what})")
    axes[2].set(xlabel="leaves seen", ylabel="held-out per-decision success (%)", title="per turn, against leaves")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=str(ROOT / "runs"), help="the experiments' output root")
    ap.add_argument("--out", default=str(ROOT / "runs" / "regime_map"), help="where the table, JSON and plot go")
    ap.add_argument("--recorded", default=str(RECORDED), help="each variant's summary, kept in git")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = [(spec, load_variant(Path(args.runs), spec[0], Path(args.recorded))) for spec in VARIANTS]
    md = table(variants)
    lines, pooled = orderings(variants)
    text = md + "\n\n" + "\n".join(lines) + f"\n\npooled over variants: Spearman ρ = {pooled}\n"
    text += "\nPer decision (explanatory, read after the runs):\n\n" + decision_table(variants) + "\n"
    text += (
        "\nAgainst the batch ladder's rungs (step 5, paired by seed):\n\n" + "\n".join(against_rungs(variants)) + "\n"
    )
    text += "\nSources:\n\n" + "\n".join(f"- {s[0]}: {v.get('source', '?')}" for s, v in variants if v) + "\n"
    (out / "regime_map.md").write_text(text)
    (out / "regime_map.json").write_text(json.dumps({s[0]: v for s, v in variants}, indent=1, default=str))
    if any(v is not None for _, v in variants):
        plot(variants, out / "regime_map.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
