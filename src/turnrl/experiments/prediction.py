"""The credit audit of the starting policy, run before training: what it predicts for each arm.

With ``audit:`` in a spec, ``turnrl experiment`` audits the base policy once before any arm trains
(``turnrl credit-audit`` with the spec's own arms as its estimators, each with its configured parameters
and tree shape, at the leaves of the primary baseline; :func:`turnrl.audit.run.credit_audit`) and
writes ``<experiment>/audit/``. For arm a and turn index t the audit gives c_{a,t} = corr(Â_a, A*)
(± covering the repeats and the audited games). What it predicts, at equal leaves:

    n_eff,{a,t} = n_{a,t} · c_{a,t}²                       (signed: n·c·|c|)      :func:`predict`
    ratio to the baseline b at turn t = n_eff,{b,t} / n_eff,{a,t}   (< 1: less gradient noise, learns faster)
    the arm over all turns = Σ_t n_eff,{a,t}                                        (the predicted ordering)

n_{a,t} counts the distinct replies of index t the arm trains per task (:func:`samples_per_turn`): L for
a flat group of L and for the per-turn estimators (stepwise, gigpo, critic), k1 at turn 1 and k1·k2
after for a (k1, k2) tree (its k2 leaves share their first reply, trained once), each times the share
of the audited episodes that reach turn t. n_eff is the number of perfectly credited samples (Â = A*)
the arm's turn-t gradient is worth. Why: write Â = βA* + ε with ε uncorrelated with A* (β the
regression of Â on A*, so c² = β² Var A* / Var Â) and with the score s = ∇log π(a_t|s_t) (the past,
the later turns and the baseline do not depend on a_t). n samples give g = Σ_i Â_i s_i with

    E g = n β G,   tr Cov g ≈ n Var(Â) E|s|²      (G = E[A* s]; |G|² ≪ Var(A*) E|s|²: a reply's score is
                                                   mostly reward-free, the audit's own idealisation)
    SNR² = |E g|² / tr Cov g ≈ n c² · |G|² / (Var(A*) E|s|²) = n c² · SNR²(one sample credited with A*)

(exactly, with κ = |G|² / (Var(A*) E|s|²): n c² (1 − κ) / (1 − κ c²); κ → 0 for a reply of many
tokens). Within-group centring needs no correction: a sample's own reward in its baseline lowers c² by
(n − 1)/n, which is what the centring costs the gradient (n samples centred on their own mean are
worth n − 1 against an independent baseline). Correlation
alone (the per-sample c², still reported as ``variance_ratio`` ρ = c_b² / c_a²) favours a tree at
turn 1: each first reply's value averages k2 leaves, so its c is higher than a flat group's, but there
are k1 of them, not L (2 × 4 against 8, four turns of equal weight: c² 0.29 vs 0.22, n·c² 0.57 vs
1.75). The audit's gradient SNR is not the figure either: it holds the audited turns fixed and
varies only the rest of the group, so it grows like √N with the number of audited episodes and like
√(P − 1) with the pool a baseline is taken over (batch_mean's batch) while the gradient does not; for a
flat group it is ≈ √(N · n · c²). Over turns the sum counts a perfect sample as worth the same at
every turn: what one is worth at turn t (SNR²(one sample credited with A*) above, larger where the
turn's stakes are) needs the model's gradients, which the audit does not take; within a turn it
cancels, so the per-turn ratio needs no such assumption. Checked on a simulated chain where the answer is known
(:mod:`turnrl.experiments.simchain`, ``tests/test_prediction_figure.py``): per arm and turn the
measured gradient's SNR² in perfect samples is n·c² within a few percent. Not covered: a biased
advantage (ε correlated with the score, e.g. γ < 1 where later turns matter) and the compute a tree's
shared prefix saves (equal leaves, not equal cost); Monte-Carlo noise in A* lowers every arm's c at a
turn alike (ratios keep, the sum over turns does not).

A turn no arm has a correlation for (A* constant there, or under two audited turns) is left out; an
arm without one where another has it gives that turn no signal (n_eff 0). After the runs, the
predicted ordering (Σ_t n_eff) is compared with the measured one (each arm's mean final held-out
metric) by Spearman's rank correlation over the arms, reported whatever it is.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from scipy.stats import spearmanr

from turnrl.audit.core import EstimatorArm
from turnrl.audit.run import AuditSettings, credit_audit
from turnrl.experiments.plan import PlannedRun
from turnrl.experiments.spec import AuditPlan

AUDIT_DIR = "audit"


def audit_arms(plan: Sequence[PlannedRun]) -> list[EstimatorArm]:
    """One audit arm per experiment arm (its first seed's config): its estimator, parameters and shape."""
    arms: dict[str, EstimatorArm] = {}
    for run in plan:
        if run.arm in arms:
            continue
        credit = run.config.credit
        branching = run.config.rollout.branching
        shape = tuple(branching) if credit.estimator == "branched" and branching else None
        if shape is not None and len(shape) != 2:
            raise ValueError(
                f"arm {run.arm!r}: the audit compares two-level trees only (rollout.branching {branching})"
            )
        arms[run.arm] = EstimatorArm(run.arm, credit.estimator, credit.params.model_dump(), shape)
    return list(arms.values())


def run_prediction(
    plan: Sequence[PlannedRun], baseline: str, settings: AuditPlan, exp_dir: Path, console: Console
) -> dict[str, Any]:
    """The audit (reused from ``exp_dir/audit`` when its arms and settings are the same) and its prediction."""
    arms = audit_arms(plan)
    base = next(r for r in plan if r.arm == baseline)
    audit = AuditSettings(
        episodes=settings.episodes,
        continuations=settings.continuations,
        leaves=base.config.episodes_per_task,
        repeats=settings.repeats,
        split=settings.split,
        num_tasks=settings.num_tasks,
    )
    out = exp_dir / AUDIT_DIR
    saved = out / "credit_audit.json"
    report = json.loads(saved.read_text()) if saved.is_file() else None
    wanted = [a.label for a in arms]
    if (
        report is None
        or list(report.get("estimators", {})) != wanted
        or _settings(report) != _settings({"settings": audit.model_dump()})
    ):
        console.rule(f"credit audit of the starting policy → {out}")
        report = credit_audit(base.config, audit, out, console, arms=arms)
    else:
        console.print(f"reusing the credit audit in {out}")
    return predict(report["estimators"], baseline, arm_samples(arms, audit.leaves, report["estimators"]))


def _settings(report: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.get("settings", {}).items() if k != "shapes"}


def samples_per_turn(shape: tuple[int, int] | None, leaves: int, reach: Mapping[str, float]) -> dict[str, float]:
    """n_t per turn index of ``reach`` (the share of episodes with a turn t, ``"1"`` = 1): distinct trained
    replies of index t per task, L·reach_t flat, k1 at turn 1 and k1·k2·reach_t after for a (k1, k2) tree."""
    out = {}
    for t, share in reach.items():
        if shape is None:
            out[t] = leaves * share
        else:
            out[t] = shape[0] * (1.0 if t == "1" else shape[1] * share)
    return out


def arm_samples(
    arms: Sequence[EstimatorArm], leaves: int, estimators: Mapping[str, Any]
) -> dict[str, dict[str, float]]:
    """:func:`samples_per_turn` of every audit arm, the share reaching turn t from the audited turns'
    count (``n_turns``, the same for every arm)."""
    counts = {t: m.get("n_turns", 0) for t, m in next(iter(estimators.values()), {}).items() if t != "all"}
    first = counts.get("1", 0)
    reach = {t: (n / first if first else 1.0) for t, n in counts.items()}
    return {a.label: samples_per_turn(a.shape, leaves, reach) for a in arms}


def predict(
    estimators: Mapping[str, Mapping[str, Mapping[str, float]]],
    baseline: str,
    samples: Mapping[str, Mapping[str, float]] | None = None,
) -> dict[str, Any]:
    """Per arm and turn index: corr ± se, the audit's SNR, ``samples`` n (1 where not given), ``n_eff`` =
    n·c·|c|, ``n_eff_ratio`` = n_eff(baseline) / n_eff (both > 0, else NaN), and the per-sample
    ``variance_ratio`` ρ = c_baseline² / c²; ``all``: corr over all turns, n and n_eff summed over the
    turns some arm has a correlation for (``turns``). Module doc."""
    turns = sorted({t for per in estimators.values() for t in per if t != "all"}, key=_turn_key)
    scored = [
        t for t in turns if any(math.isfinite(per.get(t, {}).get("corr", math.nan)) for per in estimators.values())
    ]
    out: dict[str, Any] = {"baseline": baseline, "turns": scored, "arms": {}}
    for arm, per_turn in estimators.items():
        rows = {}
        for t, m in per_turn.items():
            c, cb = m.get("corr", math.nan), estimators[baseline].get(t, {}).get("corr", math.nan)
            ratio = cb**2 / c**2 if math.isfinite(c) and math.isfinite(cb) and c != 0 else math.nan
            se = m.get("corr_se_total", m.get("corr_se", math.nan))
            n = (samples or {}).get(arm, {}).get(t, 1.0)
            eff = n * c * abs(c) if math.isfinite(c) else (0.0 if t in scored else math.nan)
            rows[t] = {"corr": c, "corr_se": se, "snr": m.get("snr", math.nan), "variance_ratio": ratio,
                       "samples": n, "n_eff": eff}  # fmt: skip
        if scored:
            rows.setdefault("all", {"corr": math.nan, "corr_se": math.nan, "snr": math.nan, "variance_ratio": math.nan})
            rows["all"]["samples"] = sum(rows[t]["samples"] for t in scored if t in rows)
            rows["all"]["n_eff"] = sum(rows[t]["n_eff"] for t in scored if t in rows)
        elif "all" in rows:  # no per-turn rows: the pooled correlation alone
            rows["all"]["n_eff"] = rows["all"]["samples"] * rows["all"]["corr"] * abs(rows["all"]["corr"])
        out["arms"][arm] = rows
    for rows in out["arms"].values():
        for t, r in rows.items():
            eb = out["arms"][baseline].get(t, {}).get("n_eff", math.nan)
            r["n_eff_ratio"] = eb / r["n_eff"] if eb > 0 and r["n_eff"] > 0 else math.nan
    return out


def compare_ordering(prediction: Mapping[str, Any], measured: Mapping[str, float]) -> dict[str, Any]:
    """Spearman's rank correlation between the predicted score (Σ_t n_eff, ``all``) and the measured one
    over the arms both name; NaN with fewer than three arms or a constant column."""
    arms = [a for a in prediction["arms"] if a in measured and math.isfinite(measured[a])]
    predicted = [prediction["arms"][a].get("all", {}).get("n_eff", math.nan) for a in arms]
    pairs = [(p, measured[a], a) for p, a in zip(predicted, arms, strict=True) if math.isfinite(p)]
    rho = math.nan
    if len(pairs) >= 3 and len({p for p, _, _ in pairs}) > 1 and len({m for _, m, _ in pairs}) > 1:
        rho = float(spearmanr([p for p, _, _ in pairs], [m for _, m, _ in pairs]).statistic)
    return {
        "arms": [a for _, _, a in pairs],
        "predicted_n_eff": [p for p, _, _ in pairs],
        "predicted_corr": [prediction["arms"][a].get("all", {}).get("corr", math.nan) for _, _, a in pairs],
        "measured": [m for _, m, _ in pairs],
        "spearman": rho,
    }


def prediction_lines(prediction: Mapping[str, Any], ordering: Mapping[str, Any] | None) -> list[str]:
    """The prediction as markdown lines (a table per turn index), and the ordering's rank correlation."""
    turns = sorted({t for rows in prediction["arms"].values() for t in rows}, key=_turn_key)
    b = prediction["baseline"]
    lines = [
        f"Credit audit of the starting policy (before training). Per turn: corr c ± se; n·c² of n, the perfectly"
        f" credited samples the arm's gradient is worth of the distinct replies it trains per task; the ratio"
        f" n_{b}·c_{b}² / (n·c²), < 1 predicts less gradient noise than the baseline; ρ = c_{b}² / c² per sample"
        " (correlation alone). All turns: c pooled, n·c² summed over the turns:",
        "",
        "| arm | " + " | ".join(f"turn {t}: c ± se; n·c² of n; ratio (ρ)" for t in turns) + " |",
        "|---|" + "---|" * len(turns),
    ]
    for arm, rows in prediction["arms"].items():
        cells = []
        for t in turns:
            r = rows.get(t)
            cells.append(
                "–"
                if r is None
                else f"{_f(r['corr'])} ± {_f(r['corr_se'])}; {_f(r.get('n_eff'))} of {_f(r.get('samples'), 1)};"
                f" {_f(r.get('n_eff_ratio'))} ({_f(r['variance_ratio'])})"
            )
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    if ordering is not None:
        lines += ["", f"Predicted (Σ_t n·c²) vs measured ordering of the arms: Spearman {_f(ordering['spearman'])}"
                  f" over {len(ordering['arms'])} arms."]  # fmt: skip
    return lines


def _f(x: Any, digits: int = 3) -> str:
    return f"{x:.{digits}f}" if isinstance(x, int | float) and math.isfinite(x) else "–"


def _turn_key(t: str) -> tuple[int, str]:
    """Turn indices in numeric order, ``all`` last."""
    return (int(t), "") if t.isdigit() else (10**9, t)
