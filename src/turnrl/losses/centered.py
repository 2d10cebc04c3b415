"""Policy gradient whose score is centered by auxiliary tokens (``loss.type: centered``)."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from turnrl.losses.spec import LossParams, LossSpec, need


def centered_loss(logp: Tensor, aux_logp: Tensor, advantages: Tensor) -> Tensor:
    """Policy gradient whose score is centered by auxiliary tokens.

        ℓ_t = −A_t logp_t + A_t (m̄_t − sg(m̄_t)),   m̄_t = (1/K) Σ_k log π_θ(a_{t,k})

    ``aux_logp`` [B, T, K] is log π_θ of K tokens drawn at each position from
    the sampler's renormalised top-k (:func:`sample_aux_tokens`). The value
    equals plain PG (−A_t logp_t); the gradient is −A_t (∇logp_t − ∇m̄_t).
    """
    mbar = aux_logp.mean(dim=-1)
    return -advantages * logp + advantages * (mbar - mbar.detach())


def sample_aux_tokens(
    topk_ids: Tensor,
    topk_logprobs: Tensor,
    num_aux: int,
    generator: torch.Generator | None = None,
    *,
    top_k: int | None = None,
) -> Tensor:
    """Draw K auxiliary tokens per position from the sampler's renormalised top-k.

        a_{t,k} ~ p̃_t(i) = exp(lp_{t,i}) / Σ_{i'} exp(lp_{t,i'})   (i.i.d., with replacement)

    ``topk_ids``/``topk_logprobs``: [B, T, k]. ``top_k`` keeps only the k most
    likely candidates when the sampler recorded more. Positions whose
    log-probs are all −inf (padding) draw uniformly. Returns ids [B, T, num_aux].
    """
    if top_k is not None and top_k < topk_logprobs.shape[-1]:
        topk_logprobs, pick = topk_logprobs.topk(top_k, dim=-1)
        topk_ids = topk_ids.gather(-1, pick)
    b, t, k = topk_ids.shape
    probs = torch.softmax(topk_logprobs.float().reshape(-1, k), dim=-1)
    bad = ~torch.isfinite(probs).all(dim=-1)
    probs[bad] = 1.0 / k
    draws = torch.multinomial(probs, num_aux, replacement=True, generator=generator)
    return topk_ids.reshape(-1, k).gather(-1, draws).reshape(b, t, num_aux)


class CenteredConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    top_k: int = Field(20, ge=1)
    num_aux: int = Field(8, ge=1)


class CenteredParams(LossParams):
    centered: CenteredConfig = CenteredConfig()


CENTERED = LossSpec(
    lambda x, p: centered_loss(
        x.logp, need(x.aux_logp, "aux_logp [B, T, K] (see sample_aux_tokens)", "centered"), x.advantages
    ),
    CenteredParams,
    aux_top_k=lambda p: p.centered.top_k,
    num_aux=lambda p: p.centered.num_aux,
)
