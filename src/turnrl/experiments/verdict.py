"""Statistics and verdicts of experiments: pure functions on numbers and eval curves (no I/O).

An evaluation is an :class:`EvalPoint`: the metric's value at a step, the number
of held-out examples ``n`` it was measured on and, when the run saved its
evaluation episodes, the sample variance of the per-example values.

Standard error of one evaluation (:func:`eval_var` gives SE²):

- **rates** (``success_rate``, ``malformed_rate``; per-example values 0 or 1):
  binomial with the Agresti–Caffo adjustment (one success and one failure
  added), p̃ = (p·n + 1)/(n + 2), SE² = p̃(1 − p̃)/(n + 2), so that 0/20 still
  has a non-zero SE;
- **any other metric** (``mean_reward`` of a reward on any scale, bounded or
  not): the textbook SE of a mean, SE² = s²/n with s² = Σ(xᵢ − x̄)²/(n − 1) the
  sample variance of the n per-example values. Without those values (or with
  n < 2) the SE is unknown (None) and a criterion on that metric is not
  measurable.

A difference of two evaluations adds their variances. With m seeds each seed
gives one difference d_s (arms paired by seed); the estimate is the mean D and
SE² = Σ_s var_s / m² + s_d² / m (s_d: sample sd of the d_s; second term only
when m ≥ 2). margin, collapse, any_of and all_of are judged on D and SE as
described in ``docs/experiments.md``.

Power. The margin rule calls D > 0 when D > 2·SE; a true difference δ is called
with probability Φ(δ/SE − 2), so the minimum detectable difference at power π is
MDE = (2 + z_π)·SE (z_0.8 = 0.8416: MDE = 2.84·SE). Before running, the SE of a
design with m seeds per arm is predicted from a measured run-to-run variance σ²
of the final metric (seed to seed, one arm) and the evaluation's own variance v:
SE² = (2v + 2σ²)/m, the same sum :func:`combine` forms.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from turnrl.experiments.spec import CollapseCriterion, MarginCriterion

Verdict = Literal["validated", "failed", "inconclusive"]

RATE_METRICS = ("success_rate", "malformed_rate")
"""Metrics that are a share of examples (values 0 or 1): their SE is binomial."""


@dataclass(frozen=True)
class EvalPoint:
    step: int
    value: float
    n: int
    """Examples the value was measured on."""
    sample_var: float | None = None
    """Sample variance (n − 1 denominator) of the per-example values; None when unknown."""


Curve = list[EvalPoint]


def as_curve(points: Sequence[EvalPoint | Sequence[float]]) -> Curve:
    """A curve from ``EvalPoint``s or ``(step, value, n[, sample_var])`` tuples, sorted by step.

    The last point of a step wins.
    """
    by_step: dict[int, EvalPoint] = {}
    for p in points:
        if isinstance(p, EvalPoint):
            point = p
        else:
            var = float(p[3]) if len(p) > 3 and p[3] is not None else None
            point = EvalPoint(int(p[0]), float(p[1]), int(p[2]), var)
        by_step[point.step] = point
    return [by_step[s] for s in sorted(by_step)]


def binomial_var(value: float, n: int) -> float:
    """Agresti–Caffo variance of a rate on n examples: p̃(1 − p̃)/(n + 2), p̃ = (pn + 1)/(n + 2)."""
    p = min(max(value, 0.0), 1.0)
    pt = (p * n + 1) / (n + 2)
    return pt * (1 - pt) / (n + 2)


def sample_variance(values: Sequence[float]) -> float | None:
    """s² = Σ(xᵢ − x̄)²/(n − 1); None for fewer than two values."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    return sum((x - mean) ** 2 for x in values) / (n - 1)


def mean_se(values: Sequence[float]) -> float | None:
    """The textbook standard error of the mean, s/√n; None for fewer than two values."""
    var = sample_variance(values)
    return None if var is None else math.sqrt(var / len(values))


def eval_var(point: EvalPoint, metric: str) -> float | None:
    """SE² of one evaluation: binomial for a rate, s²/n otherwise; None when unknown."""
    if metric in RATE_METRICS:
        return binomial_var(point.value, point.n)
    if point.sample_var is None or point.n < 2:
        return None
    return point.sample_var / point.n


def combine(diffs: Sequence[float], variances: Sequence[float]) -> tuple[float, float]:
    """Mean over seeds and its SE: sqrt(Σ var_s / m² + s_d² / m) (second term only with m ≥ 2)."""
    m = len(diffs)
    mean = sum(diffs) / m
    var = sum(variances) / m**2
    if m >= 2:
        var += sum((d - mean) ** 2 for d in diffs) / (m - 1) / m
    return mean, math.sqrt(var)


def mde(se: float, power: float = 0.8) -> float:
    """Minimum detectable difference of the 2-SE rule at ``power``: (2 + z_power)·SE."""
    return (2.0 + statistics.NormalDist().inv_cdf(power)) * se


def planned_se(run_var: float, eval_var: float, seeds: int) -> float:
    """Predicted SE of a paired seed-mean difference: sqrt((2·eval_var + 2·run_var)/seeds)."""
    return math.sqrt((2 * eval_var + 2 * run_var) / seeds)


def seeds_for(target_mde: float, run_var: float, eval_var: float, power: float = 0.8) -> int:
    """Seeds per arm for which the planned MDE is at most ``target_mde``."""
    z = 2.0 + statistics.NormalDist().inv_cdf(power)
    return max(2, math.ceil((2 * eval_var + 2 * run_var) * (z / target_mde) ** 2))


def mean_curve(curves: Sequence[Curve], metric: str) -> list[tuple[int, float, float | None]]:
    """Mean over seeds at the steps every curve has: (step, mean, SE from :func:`combine` or None)."""
    if not curves:
        return []
    steps = sorted(set.intersection(*(set(p.step for p in c) for c in curves)))
    out = []
    for step in steps:
        pts = [next(p for p in c if p.step == step) for c in curves]
        values = [p.value for p in pts]
        variances = [eval_var(p, metric) for p in pts]
        if any(v is None for v in variances):
            out.append((step, sum(values) / len(values), None))
        else:
            out.append((step, *combine(values, variances)))  # type: ignore[arg-type]
    return out


# ----------------------------------------------------------------------------- verdicts


@dataclass
class CriterionResult:
    kind: str
    verdict: Verdict
    text: str
    numbers: dict[str, Any] = field(default_factory=dict)
    parts: list[CriterionResult] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.kind,
            "verdict": self.verdict,
            "text": self.text,
            **self.numbers,
        }
        if self.parts:
            out["parts"] = [p.to_dict() for p in self.parts]
        return out


def _classify(excess: float, se: float) -> Verdict:
    if excess > 2 * se:
        return "validated"
    if excess < -2 * se:
        return "failed"
    return "inconclusive"


def _signed(x: float, metric: str) -> str:
    return f"{100 * x:+.1f} points" if metric in RATE_METRICS else f"{x:+.4g}"


def _amount(x: float, metric: str) -> str:
    return f"{100 * x:.1f} points" if metric in RATE_METRICS else f"{x:.4g}"


def _se(se: float, metric: str) -> str:
    return f"SE {100 * se:.1f}" if metric in RATE_METRICS else f"SE {se:.3g}"


def _in_se(excess: float, se: float) -> str:
    return f"{excess / se:+.2f} SE" if se > 0 else "SE 0 (no spread in the examples or seeds)"


def _point_at(curve: Curve, at_step: int | str) -> tuple[EvalPoint | None, str]:
    if not curve:
        return None, "no evaluations"
    if at_step == "final":
        return curve[-1], ""
    exact = [p for p in curve if p.step == at_step]
    if exact:
        return exact[0], ""
    if curve[-1].step < int(at_step):
        return None, f"stopped at step {curve[-1].step} before step {at_step}"
    earlier = [p for p in curve if p.step <= int(at_step)]
    if not earlier:
        return None, f"no evaluation at or before step {at_step}"
    return earlier[-1], f"no evaluation at step {at_step}; used step {earlier[-1].step}"


def _unknown_se(metric: str, step: int) -> str:
    return f"no per-example values of {metric} at step {step}, so its SE is unknown"


def _paired_seeds(curves: Mapping[str, Mapping[int, Curve]], a: str, b: str) -> list[int]:
    return [s for s in curves.get(a, {}) if s in curves.get(b, {})]


def evaluate_margin(c: MarginCriterion, curves: Mapping[str, Mapping[int, Curve]]) -> CriterionResult:
    """treatment − baseline at ``at_step``, paired by seed, against ``min_diff`` (module docstring)."""
    metric = c.metric
    where = "the last evaluation" if c.at_step == "final" else f"step {c.at_step}"
    label = f"{c.treatment} ≥ {c.baseline} {_signed(c.min_diff, metric)} of {metric} at {where}"
    seeds = _paired_seeds(curves, c.treatment, c.baseline)
    diffs, variances, notes, steps = [], [], [], []
    for s in seeds:
        t, nt = _point_at(curves[c.treatment][s], c.at_step)
        b, nb = _point_at(curves[c.baseline][s], c.at_step)
        notes += [f"{arm} seed {s}: {note}" for arm, note in ((c.treatment, nt), (c.baseline, nb)) if note]
        if t is None or b is None:
            continue
        vt, vb = eval_var(t, metric), eval_var(b, metric)
        for arm, p, v in ((c.treatment, t, vt), (c.baseline, b, vb)):
            if v is None:
                notes.append(f"{arm} seed {s}: {_unknown_se(metric, p.step)}")
        if vt is None or vb is None:
            continue
        diffs.append(t.value - b.value)
        variances.append(vt + vb)
        steps.append((t.step, b.step))
    if not seeds or len(diffs) < len(seeds):
        why = "; ".join(notes) or "no seed has both arms"
        return CriterionResult("margin", "inconclusive", f"{label}: not measurable ({why})", {"notes": notes})
    diff, se = combine(diffs, variances)
    excess = diff - c.min_diff
    verdict = _classify(excess, se)
    text = (
        f"{label}: difference {_signed(diff, metric)} ({_se(se, metric)}, {len(diffs)} seed(s)),"
        f" {_signed(excess, metric).removesuffix(' points')} vs the threshold = {_in_se(excess, se)}"
        f" → {verdict}; minimum detectable difference at 80 % power {_amount(mde(se), metric)}"
    )
    if notes:
        text += " [" + "; ".join(notes) + "]"
    numbers = {
        "treatment": c.treatment,
        "baseline": c.baseline,
        "metric": metric,
        "at_step": c.at_step,
        "min_diff": c.min_diff,
        "diff": diff,
        "se": se,
        "excess": excess,
        "mde_80": mde(se),
        "per_seed_diff": diffs,
        "steps": steps,
        "notes": notes,
    }
    return CriterionResult("margin", verdict, text, numbers)


def _drop(curves: Mapping[int, Curve], metric: str) -> tuple[float, float, list[float], list[tuple[int, int]]] | str:
    """Mean drop (peak − final) over seeds with its SE, per-seed drops and (peak, final) steps; or why not."""
    drops, variances, where = [], [], []
    for curve in curves.values():
        if not curve:
            return "no evaluations"
        peak = max(curve, key=lambda p: p.value)  # first maximum
        final = curve[-1]
        vp, vf = eval_var(peak, metric), eval_var(final, metric)
        if vp is None or vf is None:
            return _unknown_se(metric, (peak if vp is None else final).step)
        drops.append(peak.value - final.value)
        variances.append(vp + vf)
        where.append((peak.step, final.step))
    if not drops:
        return "no evaluations"
    mean, se = combine(drops, variances)
    return mean, se, drops, where


def evaluate_collapse(c: CollapseCriterion, curves: Mapping[str, Mapping[int, Curve]]) -> CriterionResult:
    """Baseline collapses (peak − final > drop) while treatment does not (module docstring)."""
    metric = c.metric
    threshold = f"{100 * c.drop:.0f} points" if metric in RATE_METRICS else f"{c.drop:.4g}"
    label = f"{c.baseline} drops > {threshold} of {metric} from its peak while {c.treatment} does not"
    seeds = _paired_seeds(curves, c.treatment, c.baseline)
    states: dict[str, dict[str, Any]] = {}
    for arm in (c.baseline, c.treatment):
        got = _drop({s: curves[arm][s] for s in seeds}, metric)
        if isinstance(got, str):
            return CriterionResult("collapse", "inconclusive", f"{label}: not measurable ({arm}: {got})")
        drop, se, per_seed, where = got
        excess = drop - c.drop
        status = {"validated": "collapsed", "failed": "stable", "inconclusive": "uncertain"}[_classify(excess, se)]
        states[arm] = {
            "drop": drop,
            "se": se,
            "excess": excess,
            "status": status,
            "per_seed_drop": per_seed,
            "peak_final_steps": where,
        }
    b, t = states[c.baseline], states[c.treatment]
    if b["status"] == "collapsed" and t["status"] == "stable":
        verdict: Verdict = "validated"
    elif b["status"] == "stable" or t["status"] == "collapsed":
        verdict = "failed"
    else:
        verdict = "inconclusive"
    text = (
        f"{label}: {c.baseline} drop {_amount(b['drop'], metric)} ({_se(b['se'], metric)}) → {b['status']};"
        f" {c.treatment} drop {_amount(t['drop'], metric)} ({_se(t['se'], metric)}) → {t['status']}"
        f" → {verdict}"
    )
    numbers = {
        "treatment": c.treatment,
        "baseline": c.baseline,
        "metric": metric,
        "threshold": c.drop,
        "arms": states,
    }
    return CriterionResult("collapse", verdict, text, numbers)


CurvesFor = Callable[[str], Mapping[str, Mapping[int, Curve]]]
"""``curves_for(metric)[arm][seed]``: the eval curves of a metric."""


def evaluate(criterion: Any, curves_for: CurvesFor) -> CriterionResult:
    """The verdict of a (possibly combined) criterion, with the curves of each leaf's metric."""
    if getattr(criterion, "type", None) == "margin":
        return evaluate_margin(criterion, curves_for(criterion.metric))
    if getattr(criterion, "type", None) == "collapse":
        return evaluate_collapse(criterion, curves_for(criterion.metric))
    kinds = [k for k in ("any_of", "all_of") if hasattr(criterion, k)]
    kind = kinds[0] if kinds else None
    if kind is None:
        raise TypeError(f"not a criterion: {criterion!r}")
    parts = [evaluate(c, curves_for) for c in getattr(criterion, kind)]
    verdicts = [p.verdict for p in parts]
    if kind == "any_of":
        verdict: Verdict = (
            "validated"
            if "validated" in verdicts
            else "failed"
            if all(v == "failed" for v in verdicts)
            else "inconclusive"
        )
    else:
        verdict = (
            "validated"
            if all(v == "validated" for v in verdicts)
            else "failed"
            if "failed" in verdicts
            else "inconclusive"
        )
    word = "any" if kind == "any_of" else "all"
    text = f"{word} of {len(parts)} criteria ({', '.join(verdicts)}) → {verdict}"
    return CriterionResult(kind, verdict, text, parts=parts)


def evaluate_criterion(criterion: Any, curves: Mapping[str, Mapping[int, Sequence[Any]]]) -> CriterionResult:
    """The verdict of a criterion on eval curves: ``curves[arm][seed]`` = points ``(step, value, n[, s²])``.

    The curves must hold the criterion's metric (for combined criteria with different metrics,
    use :func:`evaluate` with a curve per metric).
    """
    normalized = {arm: {s: as_curve(c) for s, c in by_seed.items()} for arm, by_seed in curves.items()}
    return evaluate(criterion, lambda metric: normalized)
