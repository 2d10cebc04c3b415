"""Planning an experiment: every arm × seed as one validated run config.

A run's config is the base config, then the spec's ``overrides``, then
``budget`` and ``evaluation``, then ``--set`` values, then the arm's
overrides, then ``seed: k``; it trains into ``<output root>/<name>/<arm>/seed<k>``.
A batch-ladder rung (``ladder:``, :class:`~turnrl.experiments.spec.LadderRung`)
is its base arm's config with ``rollout.<scale>`` multiplied by its factor, so
its leaves per step (``rollout.tasks_per_step`` × episodes per task: the
``group_size``, or the product of ``rollout.branching``) are k× the base arm's.
The base config is read with :func:`turnrl.config.read_config_data`, dotted
keys are set with :func:`turnrl.config.set_dotted`, ``--set`` strings go
through :func:`turnrl.config.apply_overrides` and every result through
:func:`turnrl.config.parse_config`, exactly as ``turnrl train`` does.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnrl.config import ConfigError, RunConfig, parse_config
from turnrl.configfile import apply_overrides, read_config_data, set_dotted
from turnrl.experiments.spec import (
    ExperimentError,
    ExperimentSpec,
    LadderRung,
    MarginCriterion,
    is_under,
    leaves,
)


@dataclass
class PlannedRun:
    arm: str
    seed: int
    config: RunConfig

    @property
    def run_dir(self) -> Path:
        return Path(self.config.paths.output_dir) / self.config.run_name


def _set(data: dict[str, Any], key: str, value: Any, where: str) -> None:
    try:
        set_dotted(data, key, copy.deepcopy(value))
    except ConfigError as exc:
        raise ExperimentError(f"{where}: {exc}") from None


def _base_data(spec: ExperimentSpec) -> dict[str, Any]:
    path = spec.base_config_path()
    if not path.is_file():
        raise ExperimentError(
            f"base_config: {path} does not exist (the path is relative to the spec file {spec.source})"
        )
    try:
        return read_config_data(path)
    except ConfigError as exc:
        raise ExperimentError(f"base_config: {exc}") from None


def plan_runs(
    spec: ExperimentSpec, output_root: str | Path = "runs", extra_overrides: Sequence[str] = ()
) -> list[PlannedRun]:
    """Every arm × seed as a validated :class:`RunConfig`, seed-major (all arms of seed 0 first).

    ``extra_overrides`` (``key=value`` strings, e.g. from ``--set``) apply to every arm after
    the spec's overrides, budget and evaluation, before the arm's overrides. Raises
    :class:`ExperimentError` naming the arm, seed and key.
    """
    name = spec.experiment_name()
    common = _base_data(spec)
    for key, value in spec.overrides.items():
        _set(common, key, value, "overrides")
    if spec.budget.steps is not None:
        _set(common, "train.steps", spec.budget.steps, "budget")
    if spec.budget.max_seconds is not None:
        _set(common, "train.max_seconds", spec.budget.max_seconds, "budget")
    ev = spec.evaluation
    _set(common, "eval.every", ev.every, "evaluation")
    _set(common, "eval.before", ev.before, "evaluation")
    if ev.greedy:
        _set(common, "eval.temperature", 0.0, "evaluation")
    if ev.n is not None:
        _set(common, "data.num_eval_tasks", ev.n, "evaluation")
    try:  # --set last among the common values: a quick `--set train.steps=1` shrinks every arm alike
        apply_overrides(common, list(extra_overrides))
    except ConfigError as exc:
        raise ExperimentError(str(exc)) from None

    runs = []
    arms = spec.all_arms()
    for seed in spec.seeds:
        planned: dict[str, RunConfig] = {}
        for i, arm in enumerate(arms):
            data = copy.deepcopy(common)
            for key, value in arm.overrides.items():
                _set(data, key, value, f"arms[{i}] ({arm.name!r}).overrides")
            if isinstance(arm, LadderRung):  # the base arm is planned first: all_arms lists rungs last
                base = planned[arm.base].rollout
                if arm.scale == "group_size" and base.branching:
                    raise ExperimentError(
                        f"ladder: arm {arm.base!r} samples trees (rollout.branching {base.branching}), which"
                        " group_size does not size; use scale: tasks_per_step"
                    )
                _set(data, f"rollout.{arm.scale}", getattr(base, arm.scale) * arm.factor, f"ladder ({arm.name!r})")
            data["seed"] = seed
            data["run_name"] = f"seed{seed}"
            data.setdefault("paths", {})
            if not isinstance(data["paths"], dict):
                raise ExperimentError("base_config: 'paths' must be a section")
            data["paths"]["output_dir"] = str(Path(output_root) / name / arm.name)
            source = f"(experiment {name}, arm {arm.name!r}, seed {seed}; base {spec.base_config_path()})"
            try:
                cfg = parse_config(data, source)
            except ConfigError as exc:
                raise ExperimentError(str(exc)) from None
            planned[arm.name] = cfg
            runs.append(PlannedRun(arm.name, seed, cfg))
    _check_eval_steps(spec, runs)
    _check_extra_games(spec, runs)
    return runs


def _check_extra_games(spec: ExperimentSpec, runs: list[PlannedRun]) -> None:
    if not spec.evaluation.extra_games:
        return
    e = runs[0].config.eval  # eval.* is shared by every arm
    if e.samples_per_task == 0 and e.temperature == 0:
        raise ExperimentError(
            "evaluation.extra_games: the evaluation is greedy only (eval.samples_per_task 0), and a greedy"
            " game replayed is the same game; set eval.samples_per_task > 0 in the overrides (the extra"
            " games are sampled like those) or evaluation.greedy: false"
        )


def evaluation_steps(cfg: RunConfig) -> tuple[list[int], int]:
    """The steps a run evaluates at (step budget permitting) and its final step."""
    per_iter = cfg.loop.steps_per_iteration or cfg.train.steps
    total = per_iter * cfg.loop.iterations
    steps = {per_iter * (i + 1) for i in range(cfg.loop.iterations)}
    if cfg.eval.before:
        steps.add(0)
    if cfg.eval.every:
        steps |= set(range(cfg.eval.every, total + 1, cfg.eval.every))
    return sorted(steps), total


def _check_eval_steps(spec: ExperimentSpec, runs: list[PlannedRun]) -> None:
    if spec.criterion is None:
        return
    for leaf in leaves(spec.criterion):
        if not isinstance(leaf, MarginCriterion) or leaf.at_step == "final":
            continue
        for run in runs:
            if run.arm not in (leaf.treatment, leaf.baseline):
                continue
            steps, total = evaluation_steps(run.config)
            if leaf.at_step > total:
                raise ExperimentError(
                    f"criterion.at_step: {leaf.at_step} is beyond the budget of arm {run.arm!r}"
                    f" (train.steps {total}); raise budget.steps or use at_step: final"
                )
            if leaf.at_step not in steps:
                raise ExperimentError(
                    f"criterion.at_step: arm {run.arm!r} does not evaluate at step {leaf.at_step}"
                    f" (evaluation.every {run.config.eval.every}, {total} steps); choose a multiple"
                    " of evaluation.every or the last step"
                )


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping as dotted keys → leaf values."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_diff(
    a: RunConfig, b: RunConfig, ignore: Sequence[str] = ("paths.output_dir",)
) -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose values differ between two configs → (value in a, value in b)."""
    fa, fb = flatten(a.model_dump(mode="json")), flatten(b.model_dump(mode="json"))
    return {
        k: (fa.get(k), fb.get(k))
        for k in sorted(set(fa) | set(fb))
        if fa.get(k) != fb.get(k) and not is_under(k, ignore)
    }
