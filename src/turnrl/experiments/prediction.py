"""The credit audit of the starting policy, run before training: what it predicts for each arm.

With ``audit:`` in a spec, ``turnrl experiment`` audits the base policy once before any arm trains
(``turnrl credit-audit`` with the spec's own arms as its estimators, each with its configured parameters
and tree shape, at the leaves of the primary baseline; :func:`turnrl.audit.run.credit_audit`) and
writes ``<experiment>/audit/``. For arm a and turn index t the audit gives c_{a,t} = corr(Â_a, A*)
(± covering the repeats and the audited games) and the gradient SNR. An advantage that tracks A*
with correlation c carries signal variance c² of its total, so at equal leaves the audit predicts

    variance ratio to the baseline b at turn t   ρ_{a,t} = c_{b,t}² / c_{a,t}²

(< 1: the arm's per-turn advantage is the less noisy estimate of A*, so it should learn more per
sample). The prediction is stated before the runs; after them the predicted ordering (by the
correlation over all turns, ``corr["all"]``) is compared with the measured one (each arm's mean
final held-out metric) by Spearman's rank correlation over the arms, reported whatever it is.
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
    return predict(report["estimators"], baseline)


def _settings(report: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.get("settings", {}).items() if k != "shapes"}


def predict(estimators: Mapping[str, Mapping[str, Mapping[str, float]]], baseline: str) -> dict[str, Any]:
    """Per arm and turn index: corr ± se, SNR, and ρ = c_baseline² / c_arm² (module doc)."""
    out: dict[str, Any] = {"baseline": baseline, "arms": {}}
    base = estimators[baseline]
    for arm, per_turn in estimators.items():
        rows = {}
        for t, m in per_turn.items():
            c, cb = m.get("corr", math.nan), base.get(t, {}).get("corr", math.nan)
            ratio = cb**2 / c**2 if math.isfinite(c) and math.isfinite(cb) and c != 0 else math.nan
            se = m.get("corr_se_total", m.get("corr_se", math.nan))
            rows[t] = {"corr": c, "corr_se": se, "snr": m.get("snr", math.nan), "variance_ratio": ratio}
        out["arms"][arm] = rows
    return out


def compare_ordering(prediction: Mapping[str, Any], measured: Mapping[str, float]) -> dict[str, Any]:
    """Spearman's rank correlation between the predicted score (corr over all turns) and the measured one
    over the arms both name; NaN with fewer than three arms or a constant column."""
    arms = [a for a in prediction["arms"] if a in measured and math.isfinite(measured[a])]
    predicted = [prediction["arms"][a].get("all", {}).get("corr", math.nan) for a in arms]
    pairs = [(p, measured[a], a) for p, a in zip(predicted, arms, strict=True) if math.isfinite(p)]
    rho = math.nan
    if len(pairs) >= 3 and len({p for p, _, _ in pairs}) > 1 and len({m for _, m, _ in pairs}) > 1:
        rho = float(spearmanr([p for p, _, _ in pairs], [m for _, m, _ in pairs]).statistic)
    return {
        "arms": [a for _, _, a in pairs],
        "predicted_corr": [p for p, _, _ in pairs],
        "measured": [m for _, m, _ in pairs],
        "spearman": rho,
    }


def prediction_lines(prediction: Mapping[str, Any], ordering: Mapping[str, Any] | None) -> list[str]:
    """The prediction as markdown lines (a table per turn index), and the ordering's rank correlation."""
    turns = sorted({t for rows in prediction["arms"].values() for t in rows}, key=lambda t: (t == "all", t))
    lines = [
        f"Credit audit of the starting policy (before training; variance ratio ρ = c_{prediction['baseline']}² / c²,"
        " < 1 predicts less noise than the baseline):",
        "",
        "| arm | " + " | ".join(f"turn {t}: corr ± se, ρ" for t in turns) + " |",
        "|---|" + "---|" * len(turns),
    ]
    for arm, rows in prediction["arms"].items():
        cells = []
        for t in turns:
            r = rows.get(t)
            cells.append("–" if r is None else f"{_f(r['corr'])} ± {_f(r['corr_se'])}, {_f(r['variance_ratio'])}")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    if ordering is not None:
        lines += ["", f"Predicted vs measured ordering of the arms: Spearman {_f(ordering['spearman'])}"
                  f" over {len(ordering['arms'])} arms."]  # fmt: skip
    return lines


def _f(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, int | float) and math.isfinite(x) else "–"
