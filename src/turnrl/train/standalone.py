"""A run's policy outside the training loop: ``turnrl eval``, and the policy ``turnrl credit-audit`` audits.

Both resolve their config through :meth:`~turnrl.train.settings.RunSettings.from_config`, the one
resolution point, so they render chats (:class:`~turnrl.chat.ChatSettings`: template arguments,
``model.exclude_think``), limit rollouts and sample exactly as training and its held-out evaluation do.
"""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console

from turnrl import envs
from turnrl.adapterfile import check_adapter_dir
from turnrl.config import RunConfig
from turnrl.eval import comparison_table, evaluate
from turnrl.models import load_adapter, load_model, load_tokenizer, merge_adapters
from turnrl.rundir import RunDir
from turnrl.sampling import Sampler, make_sampler
from turnrl.sampling.scripted import ScriptedSampler
from turnrl.train.settings import RunSettings


def policy_sampler(
    settings: RunSettings,
    *,
    adapter: str | Path | None = None,
    run_dir: str | Path | None = None,
    iteration: int | None = None,
    scripted: str | None = None,
) -> tuple[Sampler, Any, str]:
    """The policy to evaluate or audit as (sampler, tokenizer, label): the run's base model, with
    the merged adapters of ``iteration`` of ``run_dir`` and/or one ``adapter``, or the environment's
    scripted policy ``scripted``."""
    env_name = settings.tasks.env_name
    if scripted:
        policies = envs.get_env_class(env_name).scripted_policies()
        if scripted not in policies:
            raise ValueError(
                f"environment {env_name!r} has no scripted policy {scripted!r}; available: {sorted(policies)}"
            )
        tokenizer = load_tokenizer(settings.policy.model.name)
        return ScriptedSampler(policies[scripted], tokenizer), tokenizer, f"scripted:{scripted}"
    dirs: list[Path] = []
    if iteration is not None:
        if run_dir is None:
            raise ValueError("--iteration needs --run-dir (the run whose adapters to merge)")
        dirs = RunDir(Path(run_dir)).adapters_through(iteration, purpose=f"--iteration {iteration}")
    for path in [*dirs, *([Path(adapter)] if adapter is not None else [])]:
        check_adapter_dir(path)  # before the model loads: a bad adapter costs nothing
    model, tokenizer = load_model(settings.policy.model, seed=settings.policy.seed)
    label = "base"
    if iteration is not None:
        model = merge_adapters(model, dirs)
        label = f"iteration {iteration}"
    if adapter is not None:
        model = load_adapter(model, adapter)
        label = f"adapter {adapter}"
    return make_sampler(settings.sampler, model, tokenizer, stale=False), tokenizer, label


def run_eval(
    cfg: RunConfig,
    console: Console,
    *,
    adapter: str | Path | None = None,
    run_dir: str | Path | None = None,
    iteration: int | None = None,
    tasks: str | Path | None = None,
    scripted: str | None = None,
    max_turns: int | None = None,
    out: str | Path | None = None,
) -> dict[str, float]:
    """``turnrl eval``: the base model, one adapter, the merged model of an iteration, or a scripted policy,
    evaluated as training's held-out evaluation is (its :class:`~turnrl.eval.EvalSettings` and chat).

    ``max_turns`` overrides ``rollout.max_turns`` for this evaluation (``cfg`` is not changed)."""
    settings = RunSettings.from_config(cfg)
    evaluation = settings.eval
    if max_turns is not None:
        evaluation = replace(evaluation, rollout=replace(evaluation.rollout, max_turns=max_turns))
    env_name = settings.tasks.env_name
    task_list = envs.tasks_from_file(env_name, tasks, "eval") if tasks is not None else settings.tasks.tasks("eval")
    sampler, tokenizer, label = policy_sampler(
        settings, adapter=adapter, run_dir=run_dir, iteration=iteration, scripted=scripted
    )
    result = evaluate(task_list, sampler, settings.chat.template(tokenizer), evaluation, seed=settings.seed)
    console.print(comparison_table({label: result.metrics}, f"evaluation on {len(task_list)} tasks"))
    if out is not None:
        out = Path(out)
        new = not out.exists()
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=["label", *result.metrics])
            if new:
                writer.writeheader()
            writer.writerow({"label": label, **result.metrics})
    return result.metrics
