"""The KL-to-reference penalty's per-token estimator."""

from __future__ import annotations

import torch
from torch import Tensor


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(π_θ ‖ π_ref), per token, ≥ 0.

    k3_t = exp(ref_t − logp_t) − (ref_t − logp_t) − 1
    """
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0
