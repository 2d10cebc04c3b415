"""Tinker's importance-sampled policy gradient (``loss.type: importance_sampling``)."""

from __future__ import annotations

import torch
from torch import Tensor

from turnrl.losses.spec import LossParams, LossSpec, need


def importance_sampling_loss(logp: Tensor, behavior_logp: Tensor, advantages: Tensor) -> Tensor:
    """Tinker's importance-sampled policy gradient, against the sampler's log-probs.

        ℓ_t = −ρ_t A_t,   ρ_t = exp(logp_t − behavior_logp_t)

    ∇ℓ_t = −ρ_t A_t ∇logp_t: off-policy correct for a stale sampler, unclipped.
    """
    return -torch.exp(logp - behavior_logp) * advantages


IMPORTANCE_SAMPLING: LossSpec[LossParams] = LossSpec(
    lambda x, p: importance_sampling_loss(
        x.logp,
        need(x.behavior_logp, "behavior_logp (the sampler's log-probs)", "importance_sampling"),
        x.advantages,
    ),
    needs_behavior=True,
)
