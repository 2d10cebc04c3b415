"""The experiment runner: spec validation, shared seeds/data, verdict rules, outputs (fake runner, no model)."""

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from turnrl.config import RunConfig, dump_config, resume_conflicts
from turnrl.experiments import (
    CollapseCriterion,
    EvalPoint,
    ExperimentError,
    MarginCriterion,
    binomial_var,
    combine,
    config_diff,
    critical,
    eval_var,
    evaluate_criterion,
    evaluate_margin,
    load_spec,
    mde,
    mean_se,
    parse_spec,
    plan_runs,
    planned_se,
    run_experiment,
    sample_variance,
    seeds_for,
)
from turnrl.rundir import RunDir, write_jsonl
from turnrl.tracking.sinks import CsvSink
from turnrl.train.summary import Summary, new_run_id
from turnrl.types import Episode

REPO = Path(__file__).resolve().parents[1]

BASE = {
    "run_name": "base",
    "model": {"name": "tiny"},
    "env": {"name": "number_guess"},
    "rollout": {"tasks_per_step": 2, "group_size": 4},
    "train": {"steps": 4},
    "tracking": {"backends": ["csv"], "plots": False, "report": False},
}


def _spec_dict(**extra):
    spec = {
        "title": "t",
        "hypothesis": "h",
        "base_config": "base.yaml",
        "seeds": [0, 1],
        "budget": {"steps": 4},
        "evaluation": {"every": 2, "n": 100},
        "arms": [
            {"name": "a", "overrides": {"credit.estimator": "group_mean"}},
            {
                "name": "b",
                "overrides": {
                    "credit.estimator": "batch_mean",
                    "loss.type": "cispo",
                    "loss.eps_max": 3.0,
                },
            },
        ],
    }
    spec.update(extra)
    if "primary" not in extra and len(spec["arms"]) > 1:  # the criterion's first comparison, or the first two arms
        leaf = spec.get("criterion") or {}
        while "any_of" in leaf or "all_of" in leaf:
            leaf = (leaf.get("any_of") or leaf.get("all_of"))[0]
        names = [a["name"] for a in spec["arms"]]
        spec["primary"] = {
            "treatment": leaf.get("treatment", names[0]),
            "baseline": leaf.get("baseline", names[1]),
            "metric": leaf.get("metric", "success_rate"),
        }
    return spec


def _write_spec(tmp_path: Path, **extra) -> Path:
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(BASE))
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(_spec_dict(**extra)))
    return path


def _error(data, source="spec.yaml") -> str:
    with pytest.raises(ExperimentError) as info:
        parse_spec(data, source)
    return str(info.value)


# ----------------------------------------------------------------------------- spec validation


@pytest.mark.parametrize(
    "change, needles",
    [
        (
            {"arms": [{"name": "a", "overides": {}}]},
            ["arms[0].overides", "allowed keys here: name, overrides"],
        ),
        ({"title": None}, ["title"]),
        ({"seeds": []}, ["seeds"]),
        ({"seeds": [1, 1]}, ["seeds", "duplicate"]),
        ({"evaluation": {"n": 0}}, ["evaluation.n"]),
        ({"evaluation": {"evry": 2}}, ["evaluation.evry", "every"]),
        ({"budget": {"steps": 0}}, ["budget.steps"]),
        ({"arms": [{"name": "a/b"}]}, ["arms[0].name"]),
        ({"arms": [{"name": "a"}, {"name": "a"}]}, ["arms", "duplicate", "'a'"]),
        (
            {"arms": [{"name": "a", "overrides": {"train.steps": 9}}]},
            ["arms[0]", "'train.steps'", "budget.steps"],
        ),
        (
            {"arms": [{"name": "a", "overrides": {"env.options.few_shot": True}}]},
            ["arms[0]", "'env.options.few_shot'"],
        ),
        ({"overrides": {"seed": 3}}, ["overrides", "'seed'", "seeds"]),
        (
            {"criterion": {"type": "margn", "treatment": "a", "baseline": "b"}},
            ["criterion", "type: margin"],
        ),
        (
            {"criterion": {"type": "margin", "treatment": "a", "baseline": "zz"}},
            ["criterion.baseline", "'zz'"],
        ),
        (
            {"criterion": {"type": "margin", "treatment": "a", "baseline": "b", "min_dif": 0.1}},
            ["criterion.min_dif", "min_diff"],
        ),
        (
            {"criterion": {"any_of": [{"type": "collapse", "treatment": "a", "baseline": "b", "drop": -1}]}},
            ["criterion.any_of[0].drop"],
        ),
        (
            {
                "criterion": {
                    "type": "collapse",
                    "treatment": "a",
                    "baseline": "b",
                    "metric": "accuracy",
                }
            },
            ["criterion.metric", "success_rate"],
        ),
        ({"extra_key": 1}, ["extra_key", "allowed keys here", "hypothesis"]),
    ],
)
def test_spec_errors_name_the_key(change, needles):
    message = _error(_spec_dict(**change))
    assert message.startswith("invalid experiment spec spec.yaml")
    for needle in needles:
        assert needle in message, (needle, message)


def test_plan_errors_name_the_arm_seed_and_key(tmp_path):
    bad_key = _write_spec(tmp_path, arms=[{"name": "a", "overrides": {"loss.typ": "cispo"}}])
    with pytest.raises(ExperimentError, match=r"(?s)arm 'a', seed 0.*loss\.typ"):
        plan_runs(load_spec(bad_key), tmp_path / "runs")
    bad_value = _write_spec(tmp_path, arms=[{"name": "a", "overrides": {"loss.type": "nope"}}])
    with pytest.raises(ExperimentError, match=r"(?s)arm 'a'.*loss\.type"):
        plan_runs(load_spec(bad_value), tmp_path / "runs")
    crit = {"type": "margin", "treatment": "a", "baseline": "b", "at_step": 3}
    with pytest.raises(ExperimentError, match=r"criterion\.at_step: arm 'a' does not evaluate at step 3"):
        plan_runs(load_spec(_write_spec(tmp_path, criterion=crit)), tmp_path / "runs")
    crit["at_step"] = 8
    with pytest.raises(ExperimentError, match=r"criterion\.at_step: 8 is beyond the budget"):
        plan_runs(load_spec(_write_spec(tmp_path, criterion=crit)), tmp_path / "runs")
    missing = _write_spec(tmp_path, base_config="nowhere.yaml")
    with pytest.raises(ExperimentError, match=r"base_config: .*nowhere\.yaml does not exist"):
        plan_runs(load_spec(missing), tmp_path / "runs")
    with pytest.raises(ExperimentError, match="does not exist"):
        load_spec(tmp_path / "missing.yaml")


# ----------------------------------------------------------------------------- shared seeds, data, budget


def test_arms_share_everything_but_their_overrides(tmp_path):
    spec = load_spec(_write_spec(tmp_path, overrides={"train.lr": 0.001}))
    runs = plan_runs(spec, tmp_path / "runs", ["sampler.max_tokens=12", "eval.every=1"])
    assert [(r.arm, r.seed) for r in runs] == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    for run in runs:
        cfg = run.config
        assert cfg.seed == run.seed and cfg.run_name == f"seed{run.seed}"
        assert run.run_dir == tmp_path / "runs" / "exp" / run.arm / f"seed{run.seed}"
        # common overrides, budget, --set and evaluation reach every arm
        assert cfg.train.lr == 0.001 and cfg.sampler.max_tokens == 12 and cfg.train.steps == 4
        assert (cfg.eval.temperature, cfg.eval.before, cfg.data.num_eval_tasks) == (0.0, True, 100)
        assert cfg.eval.every == 1  # --set wins over the spec's common values
    for seed in (0, 1):
        a, b = (r.config for r in runs if r.seed == seed)
        assert config_diff(a, b) == {
            "credit.estimator": ("group_mean", "batch_mean"),
            "loss.type": ("clip", "cispo"),
            "loss.eps_max": (5.0, 3.0),
        }
    # across seeds only the seed (and run name) differ
    assert set(config_diff(runs[0].config, runs[2].config)) == {"seed", "run_name"}


def test_arms_with_the_same_seed_see_the_same_task_stream(tmp_path):
    from turnrl.envs.splits import TaskSource
    from turnrl.tasks import TaskStream

    runs = plan_runs(load_spec(_write_spec(tmp_path)), tmp_path / "runs")
    a, b = (r.config for r in runs if r.seed == 0)
    tasks_a, tasks_b = TaskSource.from_config(a).tasks("train"), TaskSource.from_config(b).tasks("train")
    stream = [t.task_id for t in TaskStream(tasks_a, a.seed).take(0, 12)]
    assert stream == [t.task_id for t in TaskStream(tasks_b, b.seed).take(0, 12)]
    assert [t.task_id for t in TaskSource.from_config(a).tasks("eval")] == [
        t.task_id for t in TaskSource.from_config(b).tasks("eval")
    ]


# ----------------------------------------------------------------------------- statistics and verdicts


def _margin(**kw) -> MarginCriterion:
    return MarginCriterion(type="margin", treatment="t", baseline="b", **kw)


def _collapse(**kw) -> CollapseCriterion:
    return CollapseCriterion(type="collapse", treatment="t", baseline="b", **kw)


def test_binomial_variance_is_agresti_caffo():
    # 0/20: p~ = 1/22 → var = (1/22)(21/22)/22, not 0
    assert binomial_var(0.0, 20) == pytest.approx((1 / 22) * (21 / 22) / 22)
    assert binomial_var(0.5, 100) == pytest.approx(0.25 / 102)
    assert binomial_var(0.3, 100) == pytest.approx((31 / 102) * (71 / 102) / 102)


def test_combine_is_the_paired_t_estimate():
    # m = 2: d = (0.1, 0.3), s_d² = 0.02, SE = √(0.02/2) = 0.1 on 1 df; the evaluation variances are in s_d already
    est = combine([0.1, 0.3], [0.001, 0.003])
    assert (est.mean, est.se, est.df, est.seeds) == (pytest.approx(0.2), pytest.approx(0.1), 1, 2)
    assert est.critical == pytest.approx(12.7062, abs=1e-4)
    # §14's 500-game gigpo − group_mean per seed (points): mean 0.84, Σ(d − 0.84)² = 5.872, SE √(5.872/4/5)
    est = combine([-0.2, 1.2, 2.6, -0.4, 1.0], [0.0] * 5)
    assert est.mean == pytest.approx(0.84) and est.se == pytest.approx(math.sqrt(5.872 / 20)) and est.df == 4
    # no spread to measure (one seed, or equal values): the evaluations' variances, √(Σ var)/m, judged at z
    one = combine([0.2], [0.004])
    assert (one.mean, one.se, one.df) == (pytest.approx(0.2), pytest.approx(math.sqrt(0.004)), None)
    assert one.critical == pytest.approx(1.959964, abs=1e-6) and "weaker" in one.basis()
    equal = combine([0.2, 0.2], [0.004, 0.005])
    assert equal.se == pytest.approx(math.sqrt(0.009) / 2) and equal.df is None


def test_t_critical_values_match_the_table():
    # two-sided 5 % (one-sided 2.5 %) Student t quantiles, as printed in every statistics table
    for df, value in [(1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (29, 2.0452)]:
        assert critical(df) == pytest.approx(value, abs=1e-4)
    assert critical(None) == pytest.approx(1.959964, abs=1e-6)
    assert critical(4, 0.9) == pytest.approx(1.5332, abs=1e-4)


def test_power_and_planning_by_hand():
    # no df: (z_0.975 + z_0.8)·SE = (1.959964 + 0.841621)·SE; z_0.5 = 0 leaves the critical value
    assert mde(0.05, None) == pytest.approx(0.05 * 2.801585, abs=1e-6)
    assert mde(0.05, None, power=0.5) == pytest.approx(0.05 * 1.959964, abs=1e-6)
    # a noncentral t's median lies above its λ, so the λ that puts the median at t_4 = 2.776 is a little below it
    assert 2.7764 - 0.3 < mde(1.0, 4, power=0.5) < 2.7764
    # larger than the (t + z) approximation (3.618) at m = 5; it tends to 2.80 as df grows
    assert mde(1.0, 4) == pytest.approx(3.761, abs=1e-3)
    assert mde(1.0, 10_000) == pytest.approx(2.8016, abs=1e-3)
    # planning: SE = σ_d/√m; σ_d² = 0.02 (2 × a 10-point seed sd), m = 5
    assert planned_se(0.02, 5) == pytest.approx(math.sqrt(0.004))
    m = seeds_for(0.05, 0.02)
    assert mde(planned_se(0.02, m), m - 1) <= 0.05 < mde(planned_se(0.02, m - 1), m - 2)
    assert m == 65  # the large-m rule (2.8016·√0.02/0.05)² = 62.8 → 63, plus the t's heavier tails
    assert seeds_for(0.05, 0.0) == 2
    with pytest.raises(ValueError, match="target_mde"):
        seeds_for(0.0, 0.02)


def _simulated_verdicts(rng, seeds: int, delta: float, run_sd: float, n: int, reps: int, p: float = 0.5):
    """The margin rule on ``reps`` simulated experiments with known variances: per arm and seed a true rate
    (p ± δ/2 plus N(0, run_sd²) run-to-run noise), evaluated on n binomial games; the verdicts and (D, SE)."""
    noise = rng.normal(0.0, run_sd, (2, reps, seeds))
    rates = np.clip(np.array([p + delta / 2, p - delta / 2])[:, None, None] + noise, 0.0, 1.0)
    observed = rng.binomial(n, rates) / n
    crit = _margin(at_step="final")
    verdicts, diffs, ses = [], [], []
    for r in range(reps):
        curves = {
            arm: {s: [EvalPoint(1, float(observed[k, r, s]), n)] for s in range(seeds)} for k, arm in enumerate("tb")
        }
        got = evaluate_margin(crit, curves)
        verdicts.append(got.verdict)
        diffs.append(got.numbers["diff"])
        ses.append(got.numbers["se"])
    return np.array(verdicts), np.array(diffs), np.array(ses)


def test_the_rule_keeps_its_level_and_power_in_a_simulation_with_known_variances():
    rng = np.random.default_rng(20261204)
    reps, m, n, run_sd = 4000, 5, 100, 0.05

    def within(rate, target):  # within 3 binomial SEs of the target over `reps` replications
        return abs(rate - target) < 3 * math.sqrt(target * (1 - target) / reps)

    # no true difference: validated and failed each 2.5 % of the time; "> 2 SE" would be ~6 %
    v, d, se = _simulated_verdicts(rng, m, 0.0, run_sd, n, reps)
    assert within((v == "validated").mean(), 0.025) and within((v == "failed").mean(), 0.025)
    assert (d > 2 * se).mean() > 0.045
    # a true difference of one MDE is called 80 % of the time; σ_d² = 2·run_sd² + 2·Var(binomial at p ± δ/2)
    delta = 0.1
    for _ in range(4):  # δ depends on σ_d, which depends on δ through p(1 − p): a fixed point
        sd_d = math.sqrt(2 * run_sd**2 + 2 * (0.25 - delta**2 / 4 - run_sd**2) / n)
        delta = mde(sd_d / math.sqrt(m), m - 1)
    v, _, _ = _simulated_verdicts(rng, m, delta, run_sd, n, reps)
    assert within((v == "validated").mean(), 0.8)
    # one seed, no run-to-run noise: the evaluations' own SE at z keeps the level (n = 400: little discreteness)
    v, _, _ = _simulated_verdicts(rng, 1, 0.0, 0.0, 400, 2000)
    assert abs((v == "validated").mean() - 0.025) < 3 * math.sqrt(0.025 * 0.975 / 2000)
    # ... but with run-to-run noise it does not: the one-seed rule is the weaker one
    v, _, _ = _simulated_verdicts(rng, 1, 0.0, run_sd, 400, 2000)
    assert (v == "validated").mean() > 0.06


def test_margin_validated_failed_inconclusive():
    def curves(t_final, b_final, n=100):
        return {
            "t": {0: [(0, 0.2, n), (10, t_final, n)]},
            "b": {0: [(0, 0.2, n), (10, b_final, n)]},
        }

    r = evaluate_criterion(_margin(at_step=10, min_diff=0.04), curves(0.5, 0.3))
    se = math.sqrt(0.25 / 102 + (31 / 102) * (71 / 102) / 102)  # ≈ 0.0673
    assert r.verdict == "validated"
    assert r.numbers["diff"] == pytest.approx(0.2) and r.numbers["se"] == pytest.approx(se)
    assert r.numbers["excess"] == pytest.approx(0.16)  # 0.16 > 1.96·0.0673 (one seed: z, no df)
    assert r.numbers["df"] is None and r.numbers["critical"] == pytest.approx(1.959964, abs=1e-6)
    assert r.numbers["mde_80"] == pytest.approx(2.801585 * se, abs=1e-6)
    assert f"minimum detectable difference at 80 % power {100 * 2.801585 * se:.1f} points" in r.text
    assert "1 seed: evaluation noise only" in r.text and "weaker" in r.text
    assert evaluate_criterion(_margin(at_step=10, min_diff=0.04), curves(0.4, 0.3)).verdict == "inconclusive"
    assert evaluate_criterion(_margin(at_step=10, min_diff=0.04), curves(0.2, 0.4)).verdict == "failed"
    # "final" = each run's last evaluation
    assert evaluate_criterion(_margin(at_step="final", min_diff=0.04), curves(0.5, 0.3)).verdict == "validated"
    # 0/20 vs 0/20 is not evidence either way with 20 examples
    assert evaluate_criterion(_margin(min_diff=0.04), curves(0.0, 0.0, n=20)).verdict == "inconclusive"


def test_margin_pairs_seeds_and_judges_their_spread_at_t():
    n = 10_000  # binomial noise negligible: the seed spread decides
    same = {
        "t": {0: [(5, 0.50, n)], 1: [(5, 0.52, n)]},
        "b": {0: [(5, 0.40, n)], 1: [(5, 0.42, n)]},
    }
    r = evaluate_criterion(_margin(at_step=5, min_diff=0.04), same)
    assert r.verdict == "validated" and r.numbers["per_seed_diff"] == pytest.approx([0.1, 0.1])
    spread = {
        "t": {0: [(5, 0.50, n)], 1: [(5, 0.62, n)]},
        "b": {0: [(5, 0.50, n)], 1: [(5, 0.42, n)]},
    }
    r = evaluate_criterion(_margin(at_step=5, min_diff=0.04), spread)
    assert r.numbers["diff"] == pytest.approx(0.1)
    # diffs 0.0 and 0.2: s_d = 0.141, SE = 0.1 (the binomial noise is inside s_d), t_1 = 12.7
    assert r.numbers["se"] == pytest.approx(0.1) and r.numbers["df"] == 1 and r.verdict == "inconclusive"
    assert "2 seeds: s_d/√m, t_1 = 12.71" in r.text
    # five seeds, d = 0.03, 0.05, 0.07, 0.05, 0.05: s_d² = 0.0008/4, SE = √(0.0002/5) = 0.0063
    five = {
        "t": {s: [(5, 0.5 + d, n)] for s, d in enumerate([0.03, 0.05, 0.07, 0.05, 0.05])},
        "b": {s: [(5, 0.5, n)] for s in range(5)},
    }
    r = evaluate_criterion(_margin(at_step=5, min_diff=0.035), five)
    assert r.numbers["se"] == pytest.approx(math.sqrt(0.0002 / 5)) and r.numbers["df"] == 4
    assert r.verdict == "inconclusive"  # excess 0.015 = 2.37 SE: past 2, short of t_4 = 2.78
    assert evaluate_criterion(_margin(at_step=5, min_diff=0.03), five).verdict == "validated"  # 3.16 SE


def test_margin_at_a_step_a_run_never_reached_is_inconclusive():
    curves = {"t": {0: [(0, 0.2, 100), (6, 0.9, 100)]}, "b": {0: [(0, 0.2, 100), (10, 0.1, 100)]}}
    r = evaluate_criterion(_margin(at_step=10, min_diff=0.04), curves)
    assert r.verdict == "inconclusive" and "stopped at step 6" in r.text


def test_collapse_validated_failed_inconclusive():
    n = 500
    collapsing = [(0, 0.3, n), (10, 0.6, n), (20, 0.2, n)]  # drop 0.40
    steady = [(0, 0.3, n), (10, 0.5, n), (20, 0.55, n)]  # peak at the end: drop 0
    r = evaluate_criterion(_collapse(drop=0.1), {"t": {0: steady}, "b": {0: collapsing}})
    assert r.verdict == "validated"
    b = r.numbers["arms"]["b"]
    assert b["drop"] == pytest.approx(0.4) and b["status"] == "collapsed"
    assert b["se"] == pytest.approx(math.sqrt(binomial_var(0.6, n) + binomial_var(0.2, n)))
    assert b["peak_final_steps"] == [(10, 20)]
    assert r.numbers["arms"]["t"]["status"] == "stable"
    # baseline stable → failed; treatment collapsed too → failed
    assert evaluate_criterion(_collapse(drop=0.1), {"t": {0: steady}, "b": {0: steady}}).verdict == "failed"
    assert evaluate_criterion(_collapse(drop=0.1), {"t": {0: collapsing}, "b": {0: collapsing}}).verdict == "failed"
    # a 12-point drop on 50 examples is within noise of the 10-point threshold
    small = [(0, 0.3, 50), (10, 0.42, 50), (20, 0.30, 50)]
    r = evaluate_criterion(_collapse(drop=0.1), {"t": {0: steady}, "b": {0: small}})
    assert r.numbers["arms"]["b"]["status"] == "uncertain" and r.verdict == "inconclusive"


def test_any_of_and_all_of():
    n = 500
    collapsing = [(0, 0.3, n), (10, 0.6, n), (20, 0.2, n)]
    steady = [(0, 0.3, n), (10, 0.3, n), (20, 0.3, n)]
    curves = {"t": {0: steady}, "b": {0: collapsing}}
    margin = {"type": "margin", "treatment": "t", "baseline": "b", "min_diff": 0.04}
    collapse = {"type": "collapse", "treatment": "t", "baseline": "b", "drop": 0.1}
    spec = parse_spec(_spec_dict(arms=[{"name": "t"}, {"name": "b"}], criterion={"any_of": [margin, collapse]}))
    r = evaluate_criterion(spec.criterion, curves)  # margin: 0.30 vs 0.20 → +10 ± 2.7: validated too
    assert r.kind == "any_of" and r.verdict == "validated" and [p.kind for p in r.parts] == ["margin", "collapse"]

    level = [(0, 0.3, 2000), (10, 0.3, 2000), (20, 0.3, 2000)]
    flat = {
        "t": {0: level},
        "b": {0: level},
    }  # margin: 0 − 4 points ± 1.5 → failed; collapse: stable → failed
    assert evaluate_criterion(spec.criterion, flat).verdict == "failed"
    noisy = {"t": {0: [(0, 0.3, 20), (20, 0.3, 20)]}, "b": {0: [(0, 0.3, 500), (20, 0.3, 500)]}}
    assert evaluate_criterion(spec.criterion, noisy).verdict == "inconclusive"  # margin uncertain, collapse failed

    both = parse_spec(_spec_dict(arms=[{"name": "t"}, {"name": "b"}], criterion={"all_of": [margin, collapse]}))
    assert evaluate_criterion(both.criterion, curves).verdict == "validated"
    assert evaluate_criterion(both.criterion, flat).verdict == "failed"


def test_standard_error_of_an_unbounded_reward_is_the_textbook_one():
    # [-1, 2, 5]: mean 2, Σ(x − 2)² = 18, s² = 18 / 2 = 9, SE = 3 / √3 = √3
    assert sample_variance([-1, 2, 5]) == pytest.approx(9.0)
    assert mean_se([-1, 2, 5]) == pytest.approx(math.sqrt(3))
    assert sample_variance([7.0]) is None and mean_se([]) is None  # one value has no spread to measure
    assert eval_var(EvalPoint(4, 2.0, 3, sample_var=9.0), "mean_reward") == pytest.approx(3.0)
    # no per-example values: the SE of a mean reward is unknown (no clamping into [0, 1])
    assert eval_var(EvalPoint(4, 2.0, 3), "mean_reward") is None


def test_standard_error_of_a_rate_is_binomial():
    # 30/100 with one success and one failure added: 31/102, SE² = p(1 − p)/n on those counts
    p, n = 31 / 102, 102
    assert eval_var(EvalPoint(4, 0.3, 100), "success_rate") == pytest.approx(p * (1 - p) / n)
    assert eval_var(EvalPoint(4, 0.3, 100), "malformed_rate") == pytest.approx(p * (1 - p) / n)
    # the per-example spread does not change a rate's SE: the values are 0 or 1
    assert eval_var(EvalPoint(4, 0.3, 100, sample_var=0.5), "success_rate") == pytest.approx(p * (1 - p) / n)


def _reward_margin(**kw) -> MarginCriterion:
    return MarginCriterion(type="margin", treatment="t", baseline="b", metric="mean_reward", **kw)


def test_margin_on_an_unbounded_reward_uses_the_sample_variance_paired_by_seed():
    # seed 0: t = [-1, 2, 5] (mean 2, s² 9), b = [0, 0, 3] (mean 1, s² 3): d = 1, var = 9/3 + 3/3 = 4
    # seed 1: t = [1, 2, 3] (mean 2, s² 1), b = [0, 1, 2] (mean 1, s² 1): d = 1, var = 1/3 + 1/3
    curves = {
        "t": {0: [(10, 2.0, 3, 9.0)], 1: [(10, 2.0, 3, 1.0)]},
        "b": {0: [(10, 1.0, 3, 3.0)], 1: [(10, 1.0, 3, 1.0)]},
    }
    r = evaluate_criterion(_reward_margin(at_step=10, min_diff=0.0), curves)
    # the two differences agree (no spread): the evaluations' SE² = (4 + 2/3) / 2² = 7/6, judged at z
    assert r.numbers["diff"] == pytest.approx(1.0) and r.numbers["se"] == pytest.approx(math.sqrt(7 / 6))
    assert r.verdict == "inconclusive"  # 1 < 1.96 · 1.08
    assert "difference +1 (SE 1.08, 2 seeds with equal values: evaluation noise only" in r.text
    assert "points" not in r.text  # reward units, not %
    many = {arm: {0: [(10, v, 10_000, 9.0)]} for arm, v in (("t", 2.0), ("b", 1.0))}
    assert evaluate_criterion(_reward_margin(at_step=10), many).verdict == "validated"  # SE 0.042

    unknown = {"t": {0: [(10, 2.0, 3)]}, "b": {0: [(10, 1.0, 3, 3.0)]}}
    r = evaluate_criterion(_reward_margin(at_step=10), unknown)
    assert r.verdict == "inconclusive" and "not measurable" in r.text and "SE is unknown" in r.text

    # every example got the same reward in both arms: SE 0, the sign of the excess decides
    flat = {"t": {0: [(10, 2.0, 3, 0.0)]}, "b": {0: [(10, 1.0, 3, 0.0)]}}
    r = evaluate_criterion(_reward_margin(at_step=10, min_diff=0.5), flat)
    assert r.numbers["se"] == 0.0 and r.verdict == "validated" and "SE 0" in r.text


def test_collapse_on_an_unbounded_reward():
    # drop = peak 5 − final −3 = 8, SE² = 4/4 + 4/4 = 2; threshold 1: excess 7 > 2√2 → collapsed
    falling = [(0, 0.0, 4, 4.0), (10, 5.0, 4, 4.0), (20, -3.0, 4, 4.0)]
    rising = [(0, 0.0, 400, 4.0), (10, 1.0, 400, 4.0), (20, 6.0, 400, 4.0)]  # drop 0, SE √0.02
    c = CollapseCriterion(type="collapse", treatment="t", baseline="b", metric="mean_reward", drop=1.0)
    r = evaluate_criterion(c, {"t": {0: rising}, "b": {0: falling}})
    b = r.numbers["arms"]["b"]
    assert b["drop"] == pytest.approx(8.0) and b["se"] == pytest.approx(math.sqrt(2)) and b["status"] == "collapsed"
    t = r.numbers["arms"]["t"]
    assert t["drop"] == 0.0 and t["se"] == pytest.approx(math.sqrt(0.02)) and t["status"] == "stable"
    assert r.verdict == "validated" and "drop 8 (SE 1.41, 1 seed" in r.text


def test_verdict_module_is_pure():
    import ast

    import turnrl.experiments.verdict as verdict

    tree = ast.parse(Path(verdict.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    runtime = imported - {"turnrl.experiments.spec"}  # that one only under TYPE_CHECKING
    allowed = {"__future__", "math", "statistics", "functools", "collections.abc", "dataclasses", "typing"}
    assert runtime <= allowed | {"scipy.stats", "scipy.optimize"}, runtime  # scipy: t and noncentral t
    assert not any(isinstance(n, ast.Call) and getattr(n.func, "id", "") == "open" for n in ast.walk(tree))


# ----------------------------------------------------------------------------- the runner, with a fake trainer

FINALS = {"a": [0.20, 0.40, 0.60], "b": [0.20, 0.25, 0.20]}


def fake_runner(calls: list):
    """Writes the progress files a real run would: eval rows at 0, every, final; train rewards per step."""

    def run(cfg: RunConfig, console=None):
        calls.append(cfg)
        run_dir = Path(cfg.paths.output_dir) / cfg.run_name
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        arm = Path(cfg.paths.output_dir).name
        sink = CsvSink(run_dir)
        values = FINALS[arm]
        for k, step in enumerate([0, 2, 4]):
            label = "base" if step == 0 else "final" if step == 4 else "step"
            sink.log_eval(
                step,
                {
                    "iteration": 0,
                    "label": label,
                    "success_rate": values[k],
                    "mean_reward": values[k],
                    "mean_turns": 1.0,
                    "malformed_rate": 0.0,
                    "num_tasks": cfg.data.num_eval_tasks,
                },
            )
        for step in range(1, cfg.train.steps + 1):
            sink.log_step(step, {"iteration": 0, "reward": 0.1 * step + 0.01 * cfg.seed, "loss": 0.0})
        Summary(new_run_id(), {}, [{}], complete=True).write(RunDir(run_dir))
        return {}

    return run


def test_run_experiment_writes_table_plot_json_summary_and_result_line(tmp_path):
    crit = {
        "any_of": [
            {"type": "margin", "treatment": "a", "baseline": "b", "at_step": 4, "min_diff": 0.04},
            {"type": "collapse", "treatment": "a", "baseline": "b", "drop": 0.1},
        ]
    }
    spec = load_spec(_write_spec(tmp_path, criterion=crit))
    calls: list = []
    out = io.StringIO()
    result = run_experiment(spec, fake_runner(calls), output_root=tmp_path / "runs", out=out)

    assert [(c.paths.output_dir, c.run_name) for c in calls] == [
        (str(tmp_path / "runs" / "exp" / arm), f"seed{seed}") for seed in (0, 1) for arm in ("a", "b")
    ]
    lines = out.getvalue().strip().splitlines()
    assert lines[-1].startswith("RESULT {")
    payload = json.loads(lines[-1].removeprefix("RESULT "))
    assert payload["verdict"] == "validated" and payload["experiment"] == "exp" and payload["metric"] == "success_rate"
    assert set(payload["arms"]) == {"a", "b"}
    a = payload["arms"]["a"]
    assert a["seeds"] == [0, 1] and a["eval_n"] == 100 and a["train_steps"] == 4
    assert (a["before"], a["after"], a["best"], a["best_step"]) == (
        pytest.approx(0.2),
        pytest.approx(0.6),
        pytest.approx(0.6),
        4,
    )
    assert a["delta"] == pytest.approx(0.4)
    assert a["train_reward_first"] == pytest.approx(0.105) and a["train_reward_last"] == pytest.approx(0.405)
    assert payload["arms"]["b"]["best"] == pytest.approx(0.25) and payload["arms"]["b"]["best_step"] == 2
    assert [p["kind"] for p in payload["criterion"]["parts"]] == ["margin", "collapse"]
    assert payload["criterion"]["parts"][0]["diff"] == pytest.approx(0.4)

    exp_dir = tmp_path / "runs" / "exp"
    assert result.directory == exp_dir and result.verdict == "validated"
    saved = json.loads((exp_dir / "experiment.json").read_text())
    assert (
        saved["verdict"] == "validated"
        and len(saved["runs"]) == 4
        and set(saved["configs"]) == {"a/seed0", "b/seed0", "a/seed1", "b/seed1"}
    )
    assert saved["runs"][0]["train_reward"][0] == [1, pytest.approx(0.1)]
    assert (exp_dir / "experiment.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (exp_dir / "summary.md").read_text()
    assert "**Verdict: validated.**" in summary and "| a | 0,1 | 4 | 20.0% |" in summary
    assert "![exp](experiment.png)" in summary


def test_finished_runs_are_reused_and_a_changed_config_is_refused(tmp_path):
    spec_path = _write_spec(tmp_path)
    calls: list = []
    run_experiment(load_spec(spec_path), fake_runner(calls), output_root=tmp_path / "runs", out=io.StringIO())
    assert len(calls) == 4

    def refuse(cfg, console=None):
        raise AssertionError("a finished run was retrained")

    out = io.StringIO()
    result = run_experiment(load_spec(spec_path), refuse, output_root=tmp_path / "runs", out=out)
    assert result.verdict is None and json.loads(out.getvalue().splitlines()[-1][7:])["verdict"] is None
    assert all(r.reused for r in result.runs)

    with pytest.raises(ExperimentError, match=r"different config \(in train\.lr\).*--fresh"):
        run_experiment(
            load_spec(spec_path),
            refuse,
            output_root=tmp_path / "runs",
            overrides=["train.lr=0.5"],
            out=io.StringIO(),
        )
    calls.clear()
    run_experiment(
        load_spec(spec_path),
        fake_runner(calls),
        output_root=tmp_path / "runs",
        overrides=["train.lr=0.5"],
        fresh=True,
        out=io.StringIO(),
    )
    assert len(calls) == 4 and all(c.train.lr == 0.5 for c in calls)


REWARDS = {  # arm → seed → held-out rewards at the final step (step 0: all zero)
    "a": {0: [-1.0, 2.0, 5.0], 1: [1.0, 2.0, 3.0]},
    "b": {0: [0.0, 0.0, 3.0], 1: [0.0, 1.0, 2.0]},
}


def reward_runner(calls: list, save_episodes: bool = True):
    """A fake run whose held-out rewards lie outside [0, 1]; eval episodes saved as training saves them."""

    def run(cfg: RunConfig, console=None):
        calls.append(cfg)
        rd = RunDir(Path(cfg.paths.output_dir) / cfg.run_name)
        rd.root.mkdir(parents=True, exist_ok=True)
        rd.config.write_text(dump_config(cfg))
        sink = CsvSink(rd.root)
        final = REWARDS[Path(cfg.paths.output_dir).name][cfg.seed]
        for step, rewards in ((0, [0.0] * len(final)), (cfg.train.steps, final)):
            episodes = [Episode(f"eval-{i}", f"t{i}", [], r, True, False) for i, r in enumerate(rewards)]
            if save_episodes:
                write_jsonl(rd.eval_rollouts(step), episodes)
            sink.log_eval(
                step,
                {
                    "iteration": 0,
                    "label": "base" if step == 0 else "final",
                    "success_rate": 0.0,
                    "mean_reward": sum(rewards) / len(rewards),
                    "num_tasks": len(rewards),
                },
            )
        for step in range(1, cfg.train.steps + 1):
            sink.log_step(step, {"iteration": 0, "reward": 1.0, "loss": 0.0})
        Summary(new_run_id(), {}, [{}], complete=True).write(rd)
        return {}

    return run


def test_run_experiment_on_an_unbounded_reward_reads_the_eval_episodes(tmp_path):
    crit = {
        "type": "margin",
        "treatment": "a",
        "baseline": "b",
        "metric": "mean_reward",
        "min_diff": 0.0,
    }
    spec_path = _write_spec(tmp_path, evaluation={"every": 0, "n": 3, "metric": "mean_reward"}, criterion=crit)
    out = io.StringIO()
    run_experiment(load_spec(spec_path), reward_runner([]), output_root=tmp_path / "runs", out=out)
    payload = json.loads(out.getvalue().splitlines()[-1].removeprefix("RESULT "))
    a = payload["arms"]["a"]
    # after = mean of the seeds' means (2, 2), equal: the evaluations' SE² = (9/3 + 1/3) / 2² = 5/6
    assert (a["before"], a["after"], a["delta"]) == (0.0, pytest.approx(2.0), pytest.approx(2.0))
    assert a["after_se"] == pytest.approx(math.sqrt(5 / 6))
    # a − b per seed: 1 and 1 (no spread); SE² = ((9 + 3)/3 + (1 + 1)/3) / 2² = 7/6
    assert payload["criterion"]["diff"] == pytest.approx(1.0)
    assert payload["criterion"]["se"] == pytest.approx(math.sqrt(7 / 6)) and payload["verdict"] == "inconclusive"
    summary = (tmp_path / "runs" / "exp" / "summary.md").read_text()
    assert "| a | 0,1 | 4 | 0.000 | 2.000 ± 0.913 | +2.000 |" in summary  # reward units, SE √(5/6)

    # without the eval episodes the SE of a mean reward is unknown: no SE, no verdict either way
    out = io.StringIO()
    run_experiment(
        load_spec(spec_path),
        reward_runner([], save_episodes=False),
        output_root=tmp_path / "bare",
        out=out,
    )
    payload = json.loads(out.getvalue().splitlines()[-1].removeprefix("RESULT "))
    assert payload["arms"]["a"]["after"] == pytest.approx(2.0) and payload["arms"]["a"]["after_se"] is None
    assert payload["verdict"] == "inconclusive" and "SE is unknown" in payload["criterion"]["text"]


def test_a_run_train_resume_accepts_is_reused_by_experiment(tmp_path):
    from turnrl.train.checkpoint import ResumeError, check_resume_config

    spec_path = _write_spec(tmp_path)
    run_experiment(load_spec(spec_path), fake_runner([]), output_root=tmp_path / "runs", out=io.StringIO())
    planned = {(p.arm, p.seed): p for p in plan_runs(load_spec(spec_path), tmp_path / "runs")}
    for run in planned.values():  # edit what resuming may change: tracking.*, eval.every
        rd = RunDir(run.run_dir)
        saved = yaml.safe_load(rd.config.read_text())
        saved["tracking"]["plots"] = not saved["tracking"]["plots"]
        saved["tracking"]["backends"] = ["csv", "console"]
        saved["eval"]["every"] = 1
        rd.config.write_text(yaml.safe_dump(saved))
        assert resume_conflicts(saved, run.config) == []
        check_resume_config(rd, run.config, allow_change=False)  # train --resume accepts it

    def refuse(cfg, console=None):
        raise AssertionError("a finished run was retrained")

    result = run_experiment(load_spec(spec_path), refuse, output_root=tmp_path / "runs", out=io.StringIO())
    assert all(r.reused for r in result.runs) and len(result.runs) == 4  # ... and so does experiment

    rd = RunDir(planned[("a", 0)].run_dir)  # a change resuming refuses is refused by both
    saved = yaml.safe_load(rd.config.read_text())
    saved["train"]["lr"] = 0.5
    rd.config.write_text(yaml.safe_dump(saved))
    with pytest.raises(ResumeError, match=r"train\.lr"):
        check_resume_config(rd, planned[("a", 0)].config, allow_change=False)
    with pytest.raises(ExperimentError, match=r"different config \(in train\.lr\)"):
        run_experiment(load_spec(spec_path), refuse, output_root=tmp_path / "runs", out=io.StringIO())


def test_cli_dry_run_shows_the_arm_differences(tmp_path):
    from typer.testing import CliRunner

    from turnrl.cli import app

    result = CliRunner().invoke(
        app,
        [
            "experiment",
            str(_write_spec(tmp_path)),
            "--dry-run",
            "--output-dir",
            str(tmp_path / "runs"),
        ],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    assert "credit.estimator: 'batch_mean'" in result.output and "(reference)" in result.output
    assert not (tmp_path / "runs").exists()
    bad = CliRunner().invoke(app, ["experiment", str(tmp_path / "nope.yaml")])
    assert bad.exit_code == 2 and "nope.yaml does not exist" in " ".join(bad.output.split())


@pytest.mark.parametrize("name", ["gsm8k_baselines", "gsm8k_baselines_cpu", "centered_vs_is", "centered_vs_is_cpu"])
def test_shipped_specs_resolve(name, tmp_path):
    spec = load_spec(REPO / "experiments" / f"{name}.yaml")
    runs = plan_runs(spec, tmp_path)
    assert spec.experiment_name() == name and len(runs) == len(spec.arms) * len(spec.seeds)
    for run in runs:
        assert run.config.env.name == "math" and run.config.rollout.max_turns == 1
        assert run.config.env.options["train_path"].endswith("gsm8k/train.jsonl")
    if name.startswith("centered"):
        assert {r.config.loss.type for r in runs} == {"centered", "importance_sampling"}
        assert all(r.config.sampler.refresh_every == 4 for r in runs)
    else:
        assert {r.config.credit.estimator for r in runs} == {
            "group_mean",
            "batch_mean",
            "loo_similarity",
        }


@pytest.mark.parametrize("name", ["credit_number_guess_cpu", "credit_number_guess_formatted_cpu"])
def test_number_guess_credit_specs_resolve_to_their_measured_design(name, tmp_path):
    """The main job changed after §2 was measured; its comparison pins the design it ran with."""
    spec = load_spec(REPO / "experiments" / f"{name}.yaml")
    runs = plan_runs(spec, tmp_path)
    assert len(runs) == 4 * len(spec.seeds)
    assert {r.config.credit.estimator for r in runs} == {"group_mean", "branched", "stepwise", "gigpo"}
    assert all(r.config.rollout.tasks_per_step == 3 and r.config.train.steps == 8 for r in runs)
    leaves = {r.config.rollout.tasks_per_step * r.config.episodes_per_task for r in runs}
    assert leaves == {24}  # equal sampled leaves per step in every arm
    if name == "credit_number_guess_cpu":
        assert all(r.config.train.lr == 3.0e-4 and r.config.model.name == "embedded" for r in runs)
    else:  # from the main job's exported output (its comment says how to make it)
        assert all(r.config.model.name == "models/number_guess_formatted" for r in runs)
