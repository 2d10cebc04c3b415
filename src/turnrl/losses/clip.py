"""PPO / GRPO / DAPO's clipped surrogate (``loss.type: clip``)."""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from turnrl.losses.spec import LossParams, LossSpec


def clip_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, eps_lo: float = 0.2, eps_hi: float = 0.28) -> Tensor:
    """PPO / GRPO / DAPO clipped surrogate (asymmetric clip-higher).

    ℓ_t = −min(ρ_t A_t, clip(ρ_t, 1 − ε_lo, 1 + ε_hi) A_t),   ρ_t = exp(logp_t − old_logp_t)
    """
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1.0 - eps_lo, 1.0 + eps_hi)
    return -torch.minimum(ratio * advantages, clipped * advantages)


class ClipParams(LossParams):
    eps_lo: float = Field(0.2, ge=0)
    eps_hi: float = Field(0.28, ge=0)


def _clip_metrics(ratio: Tensor, adv: Tensor, p: ClipParams, token_sum) -> dict[str, Tensor]:
    low = (ratio < 1 - p.eps_lo) & (adv < 0)
    high = (ratio > 1 + p.eps_hi) & (adv > 0)
    return {
        "clip_ratio/low_mean": token_sum(low),
        "clip_ratio/high_mean": token_sum(high),
        "clip_ratio/region_mean": token_sum(low | high),
    }


CLIP = LossSpec(
    lambda x, p: clip_loss(x.logp, x.old_logp, x.advantages, p.eps_lo, p.eps_hi),
    ClipParams,
    metrics=_clip_metrics,
)
