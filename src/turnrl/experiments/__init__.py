"""Experiments: arms that differ only in named config fields, run on the same seeds, data and budget.

An experiment spec (YAML, validated strictly; see ``experiments/*.yaml`` and
``docs/experiments.md``)::

    name: centered_vs_is            # optional; default: the spec file's stem
    title: Centered vs importance sampling with a stale sampler
    hypothesis: centered >= IS + 4 points at step 100, or IS collapses ...
    base_config: ../configs/gsm8k_qwen.yaml     # relative to the spec file
    overrides: {sampler.refresh_every: 4}       # dotted keys, applied to every arm
    budget: {steps: 100}                        # train.steps and/or train.max_seconds
    seeds: [0, 1]                               # every arm runs once per seed
    evaluation: {every: 10, n: 500, greedy: true, before: true}   # extra_games: N more per final policy
    arms:
      - {name: centered, overrides: {loss.type: centered}}
      - {name: importance_sampling, overrides: {loss.type: importance_sampling}}
    ladder: {arm: importance_sampling, factors: [2, 4]}   # optional: the batch-ladder control
    primary: {treatment: centered, baseline: importance_sampling, metric: success_rate, at_step: 100}
    criterion:
      any_of:
        - {type: margin, treatment: centered, baseline: importance_sampling,
           metric: success_rate, at_step: 100, min_diff: 0.04}
        - {type: collapse, treatment: centered, baseline: importance_sampling,
           metric: success_rate, drop: 0.10}

One module per concern:

- :mod:`~turnrl.experiments.spec`: the spec schema, ``load_spec`` / ``parse_spec``;
- :mod:`~turnrl.experiments.plan`: arms × seeds → validated run configs (``plan_runs``);
- :mod:`~turnrl.experiments.verdict`: standard errors and verdicts, pure functions on curves;
- :mod:`~turnrl.experiments.results`: reading run directories (progress CSVs, eval episodes, compute, advantage scale);
- :mod:`~turnrl.experiments.extra`: more held-out games for finished runs (``evaluation.extra_games``);
- :mod:`~turnrl.experiments.report`: table, plot, ``summary.md``, the ``RESULT`` line;
- :mod:`~turnrl.experiments.runner`: ``run_experiment``, ``report_experiment``, ``main``.
"""

from turnrl.experiments.extra import EXTRA_SEED, Evaluator, evaluate_final, extra_seed
from turnrl.experiments.plan import PlannedRun, config_diff, evaluation_steps, flatten, plan_runs
from turnrl.experiments.report import (
    VERDICT_RULE,
    markdown_table,
    plot_experiment,
    result_line,
    results_table,
    summary_markdown,
)
from turnrl.experiments.results import (
    RUN_RECORD,
    RunResult,
    arm_summary,
    compute_of,
    curves_by_arm,
    eval_spread,
    evaluate_on_runs,
    read_run,
    rollout_stats,
)
from turnrl.experiments.runner import (
    ExperimentResult,
    Runner,
    main,
    report_experiment,
    run_experiment,
    train_run,
)
from turnrl.experiments.spec import (
    MANAGED_KEYS,
    SHARED_KEYS,
    AllOf,
    AnyOf,
    Arm,
    Budget,
    CollapseCriterion,
    Evaluation,
    ExperimentError,
    ExperimentSpec,
    Ladder,
    LadderRung,
    MarginCriterion,
    MetricName,
    Primary,
    load_spec,
    parse_spec,
)
from turnrl.experiments.verdict import (
    RATE_METRICS,
    CriterionResult,
    Curve,
    Estimate,
    EvalPoint,
    Verdict,
    as_curve,
    binomial_var,
    combine,
    critical,
    eval_var,
    evaluate,
    evaluate_collapse,
    evaluate_criterion,
    evaluate_margin,
    mde,
    mean_curve,
    mean_se,
    planned_se,
    pool_points,
    sample_variance,
    seeds_for,
)

__all__ = [
    "EXTRA_SEED", "MANAGED_KEYS", "RATE_METRICS", "RUN_RECORD", "SHARED_KEYS", "VERDICT_RULE",
    "AllOf", "AnyOf", "Arm", "Budget", "CollapseCriterion", "CriterionResult", "Curve", "Estimate", "EvalPoint",
    "Evaluation", "Evaluator", "ExperimentError", "ExperimentResult", "ExperimentSpec", "Ladder", "LadderRung",
    "MarginCriterion", "MetricName", "PlannedRun", "Primary", "RunResult", "Runner", "Verdict",
    "arm_summary", "as_curve", "binomial_var", "combine", "compute_of", "config_diff", "critical",
    "curves_by_arm", "eval_spread", "eval_var", "evaluate", "evaluate_collapse", "evaluate_criterion",
    "evaluate_final", "evaluate_margin", "evaluate_on_runs", "evaluation_steps", "extra_seed", "flatten",
    "load_spec", "main", "markdown_table", "mde", "mean_curve", "mean_se", "parse_spec", "plan_runs",
    "planned_se", "plot_experiment", "pool_points", "read_run", "report_experiment", "result_line",
    "results_table", "rollout_stats", "run_experiment", "sample_variance", "seeds_for", "summary_markdown",
    "train_run",
]  # fmt: skip
