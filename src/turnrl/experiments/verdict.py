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

A difference of two evaluations adds their variances. With m seeds (arms paired
by seed: same tasks, LoRA init and held-out examples) each seed gives one
difference d_s; :func:`combine` forms the estimate and its SE:

    D = (1/m) Σ_s d_s,   SE = s_d/√m,   s_d² = Σ_s (d_s − D)²/(m − 1),   df = m − 1

The spread s_d of the d_s already holds each seed's evaluation noise (and the
run-to-run variation), so the evaluations' variances are not added again (the
old rule SE² = Σ var_s/m² + s_d²/m counted that noise twice). Decisions use the
t critical value c = t_{m−1, 0.975} (12.71 at m = 2, 2.78 at m = 5, 2.26 at
m = 10; :func:`critical`): with an SE estimated from m − 1 degrees of freedom,
"D > 2·SE" is passed by chance 5.8 % of the time at m = 5 (one side), "D > c·SE"
2.5 %.

Weaker rule where the seeds give no spread (m = 1, or every d_s equal): only
the evaluations' own variances are known, SE = √(Σ_s var_s)/m, judged at the
normal c = z_0.975 = 1.96 (``df`` None). That SE leaves out run-to-run
variation, so it understates the true SE of a comparison of training runs; the
verdict text says so.

margin, collapse, any_of and all_of are judged on D, SE and c as described in
``docs/experiments.md``: margin is validated when D − min_diff > c·SE and failed
when < −c·SE.

Power. With T = D/SE, a true difference δ gives T ~ noncentral t(m − 1, λ),
λ = δ√m/σ_d, so the rule calls it with probability P(T > c). The minimum
detectable difference at power π (:func:`mde`) is MDE = λ_π·SE, λ_π solving
P(t'(m − 1, λ) > c) = π (3.76 at m = 5, π = 0.8; the textbook approximation
(c + z_π)·SE gives 3.62 and powers of 0.77); with ``df`` None, MDE =
(1.96 + z_π)·SE = 2.80·SE. Before running, plan from a measured variance σ_d²
of one seed's paired difference (:func:`planned_se`: SE = σ_d/√m;
:func:`seeds_for`): a pilot's s_d², or 2·s² from one arm's seed-to-seed variance
s² of the final metric (which holds its evaluation noise; arms independent
given the seed), not from per-arm variances added to evaluation variances.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
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


def pool_points(a: EvalPoint, b: EvalPoint) -> EvalPoint:
    """Two evaluations of one policy as one of n = n_a + n_b examples, at ``a``'s step.

    x̄ = (n_a·x̄_a + n_b·x̄_b)/n; s² = ((n_a − 1)s_a² + (n_b − 1)s_b² + n_a·n_b·(x̄_a − x̄_b)²/n)/(n − 1),
    the sample variance of the n values together (None when either part's is unknown).
    """
    n = a.n + b.n
    mean = (a.n * a.value + b.n * b.value) / n
    var = None
    if a.sample_var is not None and b.sample_var is not None and n >= 2:
        between = a.n * b.n * (a.value - b.value) ** 2 / n
        var = ((a.n - 1) * a.sample_var + (b.n - 1) * b.sample_var + between) / (n - 1)
    return EvalPoint(a.step, mean, n, var)


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


@dataclass(frozen=True)
class Estimate:
    """A mean over seeds with its SE and the degrees of freedom behind that SE (module docstring)."""

    mean: float
    se: float
    df: int | None
    """m − 1 when the SE is the seeds' spread s_d/√m; None when only evaluation variances are known."""
    seeds: int

    @property
    def critical(self) -> float:
        """The decision threshold in SEs: t_{df, 0.975}, or z_0.975 without df."""
        return critical(self.df)

    def basis(self) -> str:
        """How the SE was formed, for the verdict text."""
        if self.df is not None:
            return f"{self.seeds} seeds: s_d/√m, t_{self.df} = {self.critical:.2f}"
        why = "1 seed" if self.seeds == 1 else f"{self.seeds} seeds with equal values"
        return f"{why}: evaluation noise only, no run-to-run spread, z = {self.critical:.2f}; weaker"


def combine(values: Sequence[float], variances: Sequence[float]) -> Estimate:
    """Mean over seeds with SE s_d/√m on m − 1 df; with no spread (m = 1, all equal): √(Σ var_s)/m, df None."""
    m = len(values)
    mean = sum(values) / m
    spread = sum((d - mean) ** 2 for d in values) / (m - 1) if m >= 2 else 0.0
    if spread > 0:
        return Estimate(mean, math.sqrt(spread / m), m - 1, m)
    return Estimate(mean, math.sqrt(sum(variances)) / m, None, m)


@lru_cache(maxsize=256)
def critical(df: int | None, level: float = 0.975) -> float:
    """t_{df, level} (Student t quantile, scipy), or the normal quantile z_level when df is None."""
    if df is None:
        return statistics.NormalDist().inv_cdf(level)
    from scipy.stats import t  # lazily: scipy.stats takes ~0.7 s to import

    return float(t.ppf(level, df))


@lru_cache(maxsize=256)
def _mde_factor(df: int | None, power: float) -> float:
    """λ with P(noncentral t(df, λ) > t_{df, 0.975}) = power; (z_0.975 + z_power) without df."""
    c = critical(df)
    if df is None:
        return c + statistics.NormalDist().inv_cdf(power)
    from scipy.optimize import brentq
    from scipy.stats import nct

    return float(brentq(lambda lam: nct.sf(c, df, lam) - power, 0.0, c + 40.0))


def mde(se: float, df: int | None, power: float = 0.8) -> float:
    """Minimum detectable difference of the rule at ``power``: λ_power·SE (module docstring)."""
    return _mde_factor(df, power) * se


def planned_se(diff_var: float, seeds: int) -> float:
    """Predicted SE of the mean paired difference over ``seeds`` seeds: √(σ_d²/m)."""
    return math.sqrt(diff_var / seeds)


def seeds_for(target_mde: float, diff_var: float, power: float = 0.8) -> int:
    """The fewest seeds (≥ 2) whose planned MDE, on m − 1 df, is at most ``target_mde``."""

    if target_mde <= 0:
        raise ValueError(f"seeds_for: target_mde must be > 0, got {target_mde}")

    def enough(m: int) -> bool:
        return mde(planned_se(diff_var, m), m - 1, power) <= target_mde

    if enough(2):
        return 2
    lo, hi = 2, 4  # not enough(lo); double hi until enough(hi), then bisect
    while not enough(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    return hi


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
            est = combine(values, variances)  # type: ignore[arg-type]
            out.append((step, est.mean, est.se))
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


def _classify(excess: float, est: Estimate) -> Verdict:
    """validated when excess > c·SE, failed when < −c·SE (c: :func:`critical` at the estimate's df)."""
    if excess > est.critical * est.se:
        return "validated"
    if excess < -est.critical * est.se:
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
    est = combine(diffs, variances)
    diff, se = est.mean, est.se
    excess = diff - c.min_diff
    verdict = _classify(excess, est)
    text = (
        f"{label}: difference {_signed(diff, metric)} ({_se(se, metric)}, {est.basis()}),"
        f" {_signed(excess, metric).removesuffix(' points')} vs the threshold = {_in_se(excess, se)}"
        f" → {verdict}; minimum detectable difference at 80 % power {_amount(mde(se, est.df), metric)}"
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
        "df": est.df,
        "critical": est.critical,
        "excess": excess,
        "mde_80": mde(se, est.df),
        "per_seed_diff": diffs,
        "steps": steps,
        "notes": notes,
    }
    return CriterionResult("margin", verdict, text, numbers)


def _drop(curves: Mapping[int, Curve], metric: str) -> tuple[Estimate, list[float], list[tuple[int, int]]] | str:
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
    return combine(drops, variances), drops, where


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
        est, per_seed, where = got
        excess = est.mean - c.drop
        status = {"validated": "collapsed", "failed": "stable", "inconclusive": "uncertain"}[_classify(excess, est)]
        states[arm] = {
            "drop": est.mean,
            "se": est.se,
            "df": est.df,
            "critical": est.critical,
            "basis": est.basis(),
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
        f"{label}: {c.baseline} drop {_amount(b['drop'], metric)} ({_se(b['se'], metric)}, {b['basis']})"
        f" → {b['status']}; {c.treatment} drop {_amount(t['drop'], metric)} ({_se(t['se'], metric)},"
        f" {t['basis']}) → {t['status']}"
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
