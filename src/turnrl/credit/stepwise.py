"""Stepwise credit: every assistant turn is its own sample with a discounted return.

After verifiers PR #536 and Kevin (arXiv:2507.11948). Per-turn scores r_t
(the environment's score of the transcript so far, or per-turn rewards) become
returns by backward recursion; returns are z-scored over all step samples of
one task's episodes (``pooled``) or over the samples with the same turn index
(``per_turn_index``).

ALGORITHMS.md §1 "stepwise".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import Field

from turnrl.credit.result import (
    CreditResult,
    EstimatorParams,
    EstimatorSpec,
    all_equal,
    group_indices,
)
from turnrl.credit.returns import discounted_return
from turnrl.types import Episode

Z_EPS = 1e-8


def stepwise_returns(
    scores: Sequence[float], gamma: float = 0.4, aggregation: Literal["sum", "max"] = "sum"
) -> np.ndarray:
    """Per-turn returns by backward recursion from the last turn, R_{T−1} = r_{T−1}.

    ``sum``: R_t = r_t + γ R_{t+1}        ``max``: R_t = max(r_t, γ R_{t+1})

    (``max`` starts from the last score itself, not max(r_{T−1}, 0), so a
    negative final score stays negative.)
    """
    r = np.asarray(scores, dtype=float)
    if aggregation == "sum":
        return discounted_return(r, gamma)
    if aggregation != "max":
        raise ValueError(f"aggregation must be sum or max (got {aggregation!r})")
    out = np.zeros_like(r)
    for t in range(r.size - 1, -1, -1):
        out[t] = r[t] if t == r.size - 1 else max(r[t], gamma * out[t + 1])
    return out


def _zscore(x: np.ndarray) -> np.ndarray:
    """(x − mean) / (std + 1e-8), population std (ddof 0); exactly 0 when all x are equal."""
    if all_equal(x):
        return np.zeros_like(x)
    return (x - x.mean()) / (x.std() + Z_EPS)


def stepwise_advantages(
    returns: Sequence[Sequence[float] | np.ndarray], baseline: Literal["pooled", "per_turn_index"] = "pooled"
) -> list[np.ndarray]:
    """Normalise the per-turn returns of one task's episodes (one array per episode).

    ``pooled``: z-score over every step sample of every episode,
    A_{e,t} = (R_{e,t} − mean) / (std + 1e-8).
    ``per_turn_index``: the same, but only among samples with the same turn
    index t (removes the position bias of pooling; a turn index reached by
    one episode only gets 0). std is the population std (ddof 0); a
    zero-variance pool gives exactly 0.
    """
    rets = [np.asarray(r, dtype=float) for r in returns]
    out = [np.zeros_like(r) for r in rets]
    if baseline == "pooled":
        if not rets or not sum(r.size for r in rets):
            return out
        z = _zscore(np.concatenate(rets))
        start = 0
        for e, r in enumerate(rets):
            out[e] = z[start : start + r.size]
            start += r.size
        return out
    if baseline != "per_turn_index":
        raise ValueError(f"baseline must be pooled or per_turn_index (got {baseline!r})")
    for t in range(max((r.size for r in rets), default=0)):
        members = [e for e, r in enumerate(rets) if r.size > t]
        z = _zscore(np.array([rets[e][t] for e in members]))
        for e, v in zip(members, z, strict=True):
            out[e][t] = v
    return out


class StepwiseParams(EstimatorParams):
    gamma: float = Field(0.4, ge=0, le=1)
    """Discount of the stepwise returns."""
    aggregation: Literal["sum", "max"] = "sum"
    baseline: Literal["pooled", "per_turn_index"] = "pooled"


def stepwise_credit(episodes: list[Episode], cfg: StepwiseParams) -> CreditResult:
    """Per-turn scores ``Turn.reward`` (None → 0.0) → returns (``cfg.aggregation``,
    ``cfg.gamma``) → normalised within each ``group_id`` per ``cfg.baseline``.
    Every turn is trained. Reports ``stepwise/return_mean`` (mean R_t over all
    step samples) and ``stepwise/turns_per_episode``.
    """
    returns = [stepwise_returns([t.reward or 0.0 for t in e.turns], cfg.gamma, cfg.aggregation) for e in episodes]
    advantages: dict[str, list[float | None]] = {}
    for idx in group_indices([e.group_id for e in episodes]).values():
        adv = stepwise_advantages([returns[i] for i in idx], cfg.baseline)
        for i, a in zip(idx, adv, strict=True):
            advantages[episodes[i].episode_id] = [float(x) for x in a]
    flat = np.concatenate(returns) if returns else np.zeros(0)
    metrics = {
        "stepwise/return_mean": float(flat.mean()) if flat.size else 0.0,
        "stepwise/turns_per_episode": float(np.mean([e.num_turns for e in episodes])) if episodes else 0.0,
    }
    return CreditResult(advantages, metrics)


STEPWISE = EstimatorSpec(stepwise_credit, StepwiseParams, per_turn_rows=True)
