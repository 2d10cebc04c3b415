"""CISPO (MiniMax-M1): REINFORCE weighted by a truncated, detached ratio (``loss.type: cispo``)."""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from turnrl.losses.spec import LossParams, LossSpec


def cispo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, eps_max: float = 5.0) -> Tensor:
    """CISPO (MiniMax-M1): REINFORCE weighted by a truncated, detached ratio.

        ℓ_t = −sg(min(ρ_t, ε_max)) A_t logp_t,   ρ_t = exp(logp_t − old_logp_t)

    No token is dropped: a clipped token still gets gradient, only its weight is capped.
    """
    weight = torch.clamp(torch.exp(logp - old_logp), max=eps_max).detach()
    return -weight * advantages * logp


class CispoParams(LossParams):
    eps_max: float = Field(5.0, gt=0)
    """CISPO's upper truncation of the importance ratio."""


def _cispo_metrics(ratio: Tensor, adv: Tensor, p: CispoParams, token_sum) -> dict[str, Tensor]:
    return {"cispo_clip_ratio": token_sum((ratio > p.eps_max) & (adv > 0))}


CISPO = LossSpec(
    lambda x, p: cispo_loss(x.logp, x.old_logp, x.advantages, p.eps_max), CispoParams, metrics=_cispo_metrics
)
