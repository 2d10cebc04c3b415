"""``turnrl credit-audit``: ground truth, every estimator, a table, ``credit_audit.json`` and a plot."""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field, ValidationError, model_validator
from rich.table import Table

from turnrl.audit.core import (
    EstimatorArm,
    Rollouts,
    default_arms,
    estimator_runs,
    ground_truth,
    sample_episodes,
)
from turnrl.audit.exact import (
    DEFAULT_MAX_NODES,
    MAX_EXACT_NODES,
    Scorer,
    check_sampling,
    check_trees,
    exact_ground_truth,
    policy_scorer,
)
from turnrl.audit.metrics import audit_metrics
from turnrl.audit.records import recorded_episodes
from turnrl.bounded import (
    MAX_AUDIT_EPISODES,
    MAX_AUDIT_REPEATS,
    MAX_AUDIT_SHAPES,
    MAX_AUDIT_TASKS,
    MAX_EPISODES_PER_STEP,
    MAX_GROUP,
    short_repr,
)
from turnrl.config import RunConfig
from turnrl.sections import Section, error_lines, strict_validate
from turnrl.train.settings import RunSettings
from turnrl.train.standalone import policy_sampler

_SHAPE = re.compile(r"([0-9]{1,6})x([0-9]{1,6})")


class AuditSettings(Section):
    """The options of ``turnrl credit-audit``, typed with bounds like the config's (the CLI and
    :func:`run_audit` share this model). One collector call holds N × M (ground truth) or
    N × L (estimators) episodes per turn, so those products are held to the config's
    :data:`~turnrl.config.MAX_EPISODES_PER_STEP`; each count alone to the ``MAX_AUDIT_*`` bounds
    (M and L to the config's group bound :data:`~turnrl.config.MAX_GROUP`)."""

    episodes: int = Field(8, ge=1, le=MAX_AUDIT_EPISODES)
    continuations: int = Field(8, ge=2, le=MAX_GROUP)
    """Monte-Carlo rollouts M per value estimate (at least 2: the standard error needs two)."""
    leaves: int = Field(8, ge=2, le=MAX_GROUP)
    repeats: int = Field(4, ge=1, le=MAX_AUDIT_REPEATS)
    gamma: float = Field(1.0, ge=0, le=1)
    split: Literal["train", "eval"] = "train"
    shapes: list[tuple[Annotated[int, Field(ge=2, le=MAX_GROUP)], Annotated[int, Field(ge=2, le=MAX_GROUP)]]] | None = (
        Field(None, min_length=1, max_length=MAX_AUDIT_SHAPES)
    )
    num_tasks: int | None = Field(None, ge=1, le=MAX_AUDIT_TASKS)
    exact: bool = False
    """Exact A* by enumerating a finite action set (:mod:`turnrl.audit.exact`) instead of Monte Carlo."""
    max_nodes: int = Field(DEFAULT_MAX_NODES, ge=1, le=MAX_EXACT_NODES)
    """``--exact``: the most states where the policy acts in one task's tree."""

    @model_validator(mode="after")
    def _per_call(self) -> AuditSettings:
        for what, m in (("--continuations", self.continuations), ("--leaves", self.leaves)):
            if self.episodes * m > MAX_EPISODES_PER_STEP:
                raise ValueError(
                    f"--episodes {self.episodes} x {what} {m} = {self.episodes * m:,} episodes in one collector"
                    f" call; allowed: at most {MAX_EPISODES_PER_STEP:,} (lower one of them)"
                )
        return self

    @classmethod
    def from_options(cls, **options: Any) -> AuditSettings:
        """The settings from command-line options, or one ``ValueError`` naming each bad option."""
        try:
            return strict_validate(cls, options)
        except ValidationError as exc:
            lines = [_as_option(line, cls.model_fields) for line in error_lines(exc)]
            raise ValueError("; ".join(lines)) from None


def _as_option(line: str, fields) -> str:
    """``num_tasks: ...`` → ``--num-tasks: ...`` (an error line of a field, named as the option)."""
    key, sep, what = line.partition(": ")
    head = key.split(".")[0]
    return f"--{head.replace('_', '-')}{key[len(head) :]}: {what}" if sep and head in fields else line


def parse_shapes(text: str | None) -> list[tuple[int, int]] | None:
    """``"2x12,4x6"`` → [(2, 12), (4, 6)]; None/empty → None (the default shapes)."""
    if not text:
        return None
    if len(text) > 20 * MAX_AUDIT_SHAPES:
        raise ValueError(f"--shapes: {len(text):,} characters; at most {MAX_AUDIT_SHAPES} shapes G1xG2, e.g. 2x12,4x6")
    out = []
    for part in text.split(","):
        m = _SHAPE.fullmatch(part.strip())
        if m is None or int(m[1]) < 2 or int(m[2]) < 2:
            raise ValueError(f"--shapes {short_repr(text)}: each shape is G1xG2 with G1, G2 >= 2, e.g. 2x12,4x6")
        out.append((int(m[1]), int(m[2])))
    if len(set(out)) != len(out):
        raise ValueError(f"--shapes {short_repr(text)}: a shape is given twice; give each once")
    return out


def run_audit(
    rollouts: Rollouts,
    tasks,
    settings: AuditSettings,
    arms: list[EstimatorArm],
    recorded=None,
    scorer: Scorer | None = None,
) -> dict[str, Any]:
    """Both stages on ``tasks`` with ``rollouts``; the report as a JSON-able dict. ``recorded``: (tasks,
    episodes) to audit instead of sampling them (:func:`turnrl.audit.records.recorded_episodes`). With
    ``settings.exact``, A* is enumerated with ``scorer`` (the policy's log-probs) instead of sampled."""
    t0 = time.perf_counter()
    chosen, audited = recorded or sample_episodes(tasks, settings.episodes, rollouts)
    exact = None
    if settings.exact:
        if scorer is None:
            raise ValueError("--exact needs a scorer of the policy (its log-prob of each choice)")
        truth, exact = exact_ground_truth(chosen, audited, rollouts, scorer, settings.max_nodes, settings.gamma)
    else:
        truth = ground_truth(chosen, audited, rollouts, settings.continuations, settings.gamma)
    gt_cost, t_gt = rollouts.cost(), time.perf_counter() - t0
    ahat = estimator_runs(chosen, audited, rollouts, arms, settings.leaves, settings.repeats)
    total = rollouts.cost()
    estimators = {
        a.label: audit_metrics(ahat[a.label], truth.a_star, truth.se, truth.turn, truth.episode) for a in arms
    }
    abs_a = np.abs(truth.a_star)
    return {
        "settings": {**settings.model_dump(), "shapes": [list(a.shape) for a in arms if a.shape is not None]},
        "arms": [asdict(a) for a in arms],
        "ground_truth": {
            "turns": truth.rows(),
            "mean_abs_a_star": float(abs_a.mean()) if abs_a.size else float("nan"),
            "mean_se": float(truth.se.mean()) if truth.se.size else float("nan"),
            "frac_resolved": float(np.mean(abs_a > 2 * truth.se)) if abs_a.size else float("nan"),
            "replay_exact_frac": truth.replay_exact_frac,
            "audited_reward_mean": float(np.mean([e.reward for e in audited])),
            "method": "exact" if exact is not None else "monte_carlo",
            "exact": exact,
        },
        "estimators": estimators,
        "cost": {
            "ground_truth": gt_cost,
            "estimators": {k: total[k] - gt_cost[k] for k in total},
            "total": total,
            "seconds_ground_truth": round(t_gt, 1),
            "seconds_total": round(time.perf_counter() - t0, 1),
        },
    }


def _jsonable(x: Any) -> Any:
    """NaN and ±inf become null (strict JSON)."""
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, float | np.floating):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x


def _fmt(x: float, pct: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, float) and math.isinf(x):
        return "∞"
    return f"{x:.0%}" if pct else f"{x:.2f}"


def audit_table(report: dict[str, Any]) -> Table:
    """One row per estimator × turn index (and all turns)."""
    gt = report["ground_truth"]
    exact = gt.get("exact")
    table = Table(title=f"credit audit: estimators against {'exact' if exact else 'Monte-Carlo'} A*")
    for col in ("estimator", "turn", "n", "corr ± se", "MSE", "MSE (std.)", "sign", "var", "SNR ± se"):
        table.add_column(col, justify="left" if col == "estimator" else "right")
    for label, per_turn in report["estimators"].items():
        for t, m in per_turn.items():
            table.add_row(
                label if t == "1" else "",
                t,
                str(m["n_turns"]),
                f"{_fmt(m['corr'])} ± {_fmt(m.get('corr_se_total', m['corr_se']))}",
                _fmt(m["mse"]),
                _fmt(m["mse_std"]),
                f"{_fmt(m['sign'], pct=True)} ({m['sign_n']})",
                _fmt(m["var"]),
                f"{_fmt(m['snr'])} ± {_fmt(m['snr_se'])}",
            )
    cost = report["cost"]["total"]
    truth = (
        f"A* exact: mean |A*| {gt['mean_abs_a_star']:.3f}, {exact['states_scored']} states scored, audited states on"
        f" the tree {exact['on_tree_frac']:.0%}, malformed mass mean {exact['malformed_mass_mean']:.3f}"
        f"{_approximate(exact)}. "
        if exact
        else f"A*: mean |A*| {gt['mean_abs_a_star']:.3f}, mean se {gt['mean_se']:.3f}, "
        f"{gt['frac_resolved']:.0%} of turns with |A*| > 2 se; replay exact {gt['replay_exact_frac']:.0%}. "
    )
    table.caption = (
        f"{truth}corr ± covers the repeats and the audited games (a bootstrap over them). "
        f"Cost: {cost['model_turns']} model turns, {cost['new_tokens']} new tokens, "
        f"{report['cost']['seconds_total']} s"
    )
    return table


def _approximate(exact: dict[str, Any]) -> str:
    """The caption's warning where an exact V passes a malformed reply that continues (W > 0)."""
    w = exact.get("approx_mass_max") or 0.0
    return f"; approximate past malformed replies that continue (W up to {w:.3f})" if w > 0 else ""


def audit_plot(report: dict[str, Any], path: Path) -> Path:
    """Per-turn correlation with A* and gradient SNR, one line per estimator, error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = list(report["estimators"])
    for n, label in enumerate(labels):
        per_turn = {t: m for t, m in report["estimators"][label].items() if t != "all"}
        ts = np.array([int(t) for t in per_turn], dtype=float) + (n - len(labels) / 2) * 0.03
        for ax, key in zip(axes, ("corr", "snr"), strict=True):
            y = [per_turn[t][key] for t in per_turn]
            err = [per_turn[t][f"{key}_se"] for t in per_turn]
            y = [v if math.isfinite(v) else np.nan for v in y]
            err = [e if math.isfinite(e) else 0.0 for e in err]
            ax.errorbar(ts, y, yerr=err, marker="o", capsize=3, label=label)
    kind = "exact" if report["ground_truth"].get("exact") else "Monte-Carlo"
    axes[0].set(xlabel="turn", ylabel="corr(Â, A*)", title=f"correlation with {kind} A*")
    axes[1].set(xlabel="turn", ylabel="SNR", title="gradient SNR (projection on the A* direction)")
    for ax in axes:
        ax.axhline(0, color="grey", lw=0.5)
    axes[1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def credit_audit(
    cfg: RunConfig,
    settings: AuditSettings,
    out_dir: Path,
    console,
    *,
    adapter=None,
    scripted: str | None = None,
    records: Path | None = None,
    arms: list[EstimatorArm] | None = None,
) -> dict[str, Any]:
    """The ``turnrl credit-audit`` command: the policy of ``cfg`` (or ``adapter`` / ``scripted``), its
    episodes collected, rendered and sampled as training collects them (:meth:`RunSettings.from_config`);
    with ``records``, the audited episodes are that file's first ``settings.episodes``. With ``settings.exact``,
    every audited task's tree is checked (finite menus, ``max_nodes``) before the model loads."""
    arms = default_arms(settings.leaves, settings.shapes) if arms is None else arms
    run = RunSettings.from_config(cfg)
    tasks = run.tasks.tasks(settings.split)
    if settings.num_tasks:
        tasks = tasks[: settings.num_tasks]
    recorded = None if records is None else recorded_episodes(records, tasks, settings.episodes, settings.split)
    params = run.sampler.sampling(run.seed)
    if settings.exact:
        if scripted:
            raise ValueError("--exact scores each choice with the policy's model; a scripted policy has none")
        check_sampling(params, run.eval.rollout)
        if run.sampler.params.differs_from_trainer:  # e.g. hf's decode_dtype: bfloat16
            raise ValueError(
                "--exact scores each choice in float32 with the policy's model, and this sampler samples from"
                " another distribution (sampler.params.decode_dtype is not float32): set it to float32"
            )
        audited_tasks = recorded[0] if recorded else [tasks[i % len(tasks)] for i in range(settings.episodes)]
        check_trees(audited_tasks, run.eval.rollout, settings.max_nodes)
    sampler, tokenizer, label = policy_sampler(run, adapter=adapter, scripted=scripted)
    chat = run.chat.template(tokenizer)
    rollouts = Rollouts(sampler, chat, params, run.eval.rollout)
    scorer = policy_scorer(sampler, chat, params) if settings.exact else None
    report = run_audit(rollouts, tasks, settings, arms, recorded, scorer)
    report["records"] = None if records is None else str(records)
    report["policy"] = label
    report["env"] = run.tasks.env_name
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "credit_audit.json").write_text(json.dumps(_jsonable(report), indent=1) + "\n")
    audit_plot(report, out_dir / "credit_audit.png")
    console.print(audit_table(report))
    console.print(f"wrote {out_dir / 'credit_audit.json'} and {out_dir / 'credit_audit.png'}")
    return report
