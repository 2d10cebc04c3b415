"""``turnrl credit-audit``: ground truth, every estimator, a table, ``credit_audit.json`` and a plot."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from turnrl.audit.core import (
    EstimatorArm,
    Rollouts,
    default_arms,
    estimator_runs,
    ground_truth,
    sample_episodes,
)
from turnrl.audit.metrics import audit_metrics
from turnrl.chat import ChatTemplate
from turnrl.config import RunConfig
from turnrl.envs.splits import TaskSource
from turnrl.eval import policy_sampler
from turnrl.types import SamplingParams


@dataclass
class AuditSettings:
    episodes: int = 8
    continuations: int = 8
    leaves: int = 8
    repeats: int = 4
    gamma: float = 1.0
    split: str = "train"
    shapes: list[tuple[int, int]] | None = None
    num_tasks: int | None = None

    def check(self) -> None:
        for name in ("episodes", "continuations", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1 (got {getattr(self, name)})")
        if self.continuations < 2:
            raise ValueError("--continuations must be at least 2 (the standard error needs two rollouts)")
        if self.leaves < 2:
            raise ValueError(f"--leaves must be at least 2 (got {self.leaves})")
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"--gamma must lie in [0, 1] (got {self.gamma})")
        if self.split not in ("train", "eval"):
            raise ValueError(f"--split must be train or eval (got {self.split!r})")


def parse_shapes(text: str | None) -> list[tuple[int, int]] | None:
    """``"2x12,4x6"`` → [(2, 12), (4, 6)]; None/empty → None (the default shapes)."""
    if not text:
        return None
    out = []
    for part in text.split(","):
        a, sep, b = part.strip().partition("x")
        if not sep or not a.isdigit() or not b.isdigit() or int(a) < 2 or int(b) < 2:
            raise ValueError(f"--shapes {text!r}: each shape is G1xG2 with G1, G2 >= 2, e.g. 2x12,4x6")
        out.append((int(a), int(b)))
    return out


def run_audit(rollouts: Rollouts, tasks, settings: AuditSettings, arms: list[EstimatorArm]) -> dict[str, Any]:
    """Both stages on ``tasks`` with ``rollouts``; the report as a JSON-able dict."""
    settings.check()
    t0 = time.perf_counter()
    chosen, audited = sample_episodes(tasks, settings.episodes, rollouts)
    truth = ground_truth(chosen, audited, rollouts, settings.continuations, settings.gamma)
    gt_cost, t_gt = rollouts.cost(), time.perf_counter() - t0
    ahat = estimator_runs(chosen, audited, rollouts, arms, settings.leaves, settings.repeats)
    total = rollouts.cost()
    estimators = {a.label: audit_metrics(ahat[a.label], truth.a_star, truth.se, truth.turn) for a in arms}
    abs_a = np.abs(truth.a_star)
    return {
        "settings": {**asdict(settings), "shapes": [list(a.shape) for a in arms if a.shape is not None]},
        "arms": [asdict(a) for a in arms],
        "ground_truth": {
            "turns": truth.rows(),
            "mean_abs_a_star": float(abs_a.mean()) if abs_a.size else float("nan"),
            "mean_se": float(truth.se.mean()) if truth.se.size else float("nan"),
            "frac_resolved": float(np.mean(abs_a > 2 * truth.se)) if abs_a.size else float("nan"),
            "replay_exact_frac": truth.replay_exact_frac,
            "audited_reward_mean": float(np.mean([e.reward for e in audited])),
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
    table = Table(title="credit audit: estimators against Monte-Carlo A*")
    for col in ("estimator", "turn", "n", "corr ± se", "MSE", "MSE (std.)", "sign", "var", "SNR ± se"):
        table.add_column(col, justify="left" if col == "estimator" else "right")
    for label, per_turn in report["estimators"].items():
        for t, m in per_turn.items():
            table.add_row(
                label if t == "1" else "",
                t,
                str(m["n_turns"]),
                f"{_fmt(m['corr'])} ± {_fmt(m['corr_se'])}",
                _fmt(m["mse"]),
                _fmt(m["mse_std"]),
                f"{_fmt(m['sign'], pct=True)} ({m['sign_n']})",
                _fmt(m["var"]),
                f"{_fmt(m['snr'])} ± {_fmt(m['snr_se'])}",
            )
    cost = report["cost"]["total"]
    table.caption = (
        f"A*: mean |A*| {gt['mean_abs_a_star']:.3f}, mean se {gt['mean_se']:.3f}, "
        f"{gt['frac_resolved']:.0%} of turns with |A*| > 2 se; replay exact {gt['replay_exact_frac']:.0%}. "
        f"Cost: {cost['model_turns']} model turns, {cost['new_tokens']} new tokens, "
        f"{report['cost']['seconds_total']} s"
    )
    return table


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
    axes[0].set(xlabel="turn", ylabel="corr(Â, A*)", title="correlation with Monte-Carlo A*")
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
) -> dict[str, Any]:
    """The ``turnrl credit-audit`` command: the policy of ``cfg`` (or ``adapter`` / ``scripted``)."""
    settings.check()
    arms = default_arms(settings.leaves, settings.shapes)
    tasks = TaskSource.from_config(cfg).tasks(settings.split)
    if settings.num_tasks:
        tasks = tasks[: settings.num_tasks]
    sampler, tokenizer, label = policy_sampler(cfg, adapter=adapter, scripted=scripted)
    chat = ChatTemplate(tokenizer, cfg.model.chat_template_kwargs)
    params = SamplingParams(
        temperature=cfg.sampler.temperature, top_p=cfg.sampler.top_p, max_tokens=cfg.sampler.max_tokens, seed=cfg.seed
    )
    rollouts = Rollouts(sampler, chat, params, cfg.env.options, cfg.rollout.max_turns, cfg.rollout.max_context_tokens)
    report = run_audit(rollouts, tasks, settings, arms)
    report["policy"] = label
    report["env"] = cfg.env.name
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "credit_audit.json").write_text(json.dumps(_jsonable(report), indent=1) + "\n")
    audit_plot(report, out_dir / "credit_audit.png")
    console.print(audit_table(report))
    console.print(f"wrote {out_dir / 'credit_audit.json'} and {out_dir / 'credit_audit.png'}")
    return report
