"""Token-level policy losses, KL, sampler/trainer mismatch weights and normalisers.

Every tensor is padded [B, T]; ``mask`` is 1.0 on trained tokens. Log-probs:
``logp`` = log π_θ(y_t) (with grad), ``old_logp`` = log π_old(y_t) (the policy
at the start of this optimizer step's rollouts; None = on-policy,
``logp.detach()``), ``behavior_logp`` = log q(y_t) (the sampler's). The
importance ratio is ρ_t = exp(logp_t − old_logp_t) unless stated otherwise;
sg(·) is stop-gradient.

The trainer calls :func:`per_token_loss` for each micro-batch, then
:func:`normalize` with batch-wide totals, so micro-batch losses add up to the
full-batch loss. Metrics come back as token sums (see :func:`finalize_metrics`).
Each surrogate is one module and one :class:`LossSpec` in :data:`LOSSES` (function, own
pydantic parameters, needs, metrics), as estimators are in :mod:`turnrl.credit`:
:mod:`~turnrl.losses.clip`, :mod:`~turnrl.losses.importance_sampling`,
:mod:`~turnrl.losses.cispo`, :mod:`~turnrl.losses.centered`; what every loss shares is
:mod:`~turnrl.losses.kl` (k3), :mod:`~turnrl.losses.mismatch` and
:mod:`~turnrl.losses.normalize`. ``register_loss`` adds one from user code.

ALGORITHMS.md §2.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from pydantic import BaseModel
from torch import Tensor

from turnrl.losses.centered import CENTERED, CenteredConfig, CenteredParams, centered_loss, sample_aux_tokens
from turnrl.losses.cispo import CISPO, CispoParams, cispo_loss
from turnrl.losses.clip import CLIP, ClipParams, clip_loss
from turnrl.losses.importance_sampling import IMPORTANCE_SAMPLING, importance_sampling_loss
from turnrl.losses.kl import kl_k3
from turnrl.losses.mismatch import MismatchConfig, MismatchCorrection, mismatch_weights
from turnrl.losses.normalize import normalize
from turnrl.losses.spec import LossInputs, LossParams, LossSpec, Metrics

LOSSES: dict[str, LossSpec[Any]] = {
    "clip": CLIP,
    "importance_sampling": IMPORTANCE_SAMPLING,
    "cispo": CISPO,
    "centered": CENTERED,
}
"""Per-token surrogate by ``loss.type``: one entry per loss."""


def register_loss(name: str, spec: LossSpec[Any]) -> None:
    """Add a loss under ``name`` (then ``loss.type: name`` works in configs)."""
    LOSSES[name] = spec


def get_loss(name: str) -> LossSpec[Any]:
    if name not in LOSSES:
        raise ValueError(f"unknown loss.type {name!r}; choose one of {', '.join(sorted(LOSSES))}")
    return LOSSES[name]


class LossSection(Protocol):
    """The keys of the ``loss`` config section that :class:`LossPlan` reads (this module may not
    import the config: the section is passed in, and this Protocol says what it must have)."""

    @property
    def type(self) -> str: ...
    @property
    def norm(self) -> str: ...
    @property
    def beta(self) -> float: ...
    @property
    def mismatch(self) -> MismatchConfig: ...
    @property
    def params(self) -> BaseModel: ...


@dataclass(frozen=True)
class LossPlan:
    """The loss of a run, resolved once: the surrogate with its own parameters, the normaliser,
    the KL coefficient and the (resolved) mismatch correction."""

    type: str
    params: BaseModel
    norm: str = "token_sum"
    beta: float = 0.0
    mismatch: MismatchCorrection = field(default_factory=MismatchCorrection)

    @property
    def spec(self) -> LossSpec[Any]:
        return get_loss(self.type)

    @classmethod
    def from_config(cls, section: LossSection) -> LossPlan:
        """The plan of a ``loss`` config section (``mismatch.mode: auto`` is resolved by the run config)."""
        get_loss(section.type)
        mismatch = MismatchCorrection.from_config(section.mismatch)
        return cls(section.type, section.params, section.norm, section.beta, mismatch)


def per_token_loss(
    plan: LossPlan,
    logp: Tensor,
    old_logp: Tensor | None,
    behavior_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    aux_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token loss [B, T] (0 where mask = 0) and metric sums for one micro-batch.

        ℓ_t = w_t · surrogate_t + β · k3_t

    surrogate = ``LOSSES[plan.type]``; w = :func:`mismatch_weights` (1 unless
    ``plan.mismatch.mode`` is set; applied to the policy term only, as TRL
    does); the k3 term only when β > 0 (needs ``ref_logp``). ``advantages`` is
    [B, T] or [B] (one per row). ``old_logp`` None means on-policy
    (``logp.detach()``). Padding values never reach exp(): masked positions
    are replaced by zeros first, so they give neither inf nor NaN gradients.

    Metrics (detached 0-dim tensors, sums over trained tokens; aggregate with
    :func:`finalize_metrics`): ``trained_tokens``; for ``clip`` TRL's
    ``clip_ratio/low_mean`` (ρ < 1 − ε_lo and A < 0), ``clip_ratio/high_mean``
    (ρ > 1 + ε_hi and A > 0), ``clip_ratio/region_mean`` (either); for
    ``cispo`` TRL's ``cispo_clip_ratio`` (ρ > ε_max and A > 0); ``kl`` (mean
    k3) whenever ``ref_logp`` is given; ``mismatch/abs_logp_gap_mean``
    (|logp − behavior_logp|) whenever ``behavior_logp`` is given; and the
    ``mismatch/...`` sums of :func:`mismatch_weights`; a registered loss's own ``metrics``.
    Two diagnostics are always there, on the sampled (trained) tokens y_t:

        entropy   = −log π_θ(y_t)                       (Monte-Carlo estimate of H(π_θ(·|y_<t)), y_t ~ π)
        approx_kl = (ρ_t − 1) − log ρ_t,  ρ_t = exp(logp_t − old_logp_t)   (CleanRL's approx_kl, k3 of KL(π_old‖π_θ))

    ``approx_kl`` is 0 on a batch's first pass and grows over the ``train.num_iterations`` passes.
    """
    spec = get_loss(plan.type)
    params = plan.params
    if spec.needs_behavior and plan.mismatch.mode != "none":
        raise ValueError(
            f"loss.type {plan.type} already corrects against the sampler's log-probs;"
            " set loss.mismatch.mode: none (a mismatch weight would correct twice)"
        )
    m = mask > 0
    zeros = torch.zeros_like(logp)

    def clean(x: Tensor) -> Tensor:
        return torch.where(m, x, zeros)

    if advantages.dim() == 1:
        advantages = advantages[:, None]
    adv = clean(advantages.to(logp.dtype).expand_as(logp))
    lp = clean(logp)
    old = lp.detach() if old_logp is None else clean(old_logp.detach())
    beh = None if behavior_logp is None else clean(behavior_logp.detach())
    aux = None
    if aux_logp is not None:
        aux = torch.where(m[..., None], aux_logp, torch.zeros_like(aux_logp))

    loss = spec.fn(LossInputs(lp, old, beh, adv, aux), params)
    metrics: dict[str, Tensor] = {"trained_tokens": m.sum().float()}

    def token_sum(x: Tensor) -> Tensor:
        return torch.where(m, x.detach().float(), torch.zeros_like(x, dtype=torch.float32)).sum()

    log_ratio = (lp - old).detach()
    metrics["entropy"] = token_sum(-lp)
    metrics["approx_kl"] = token_sum(torch.expm1(log_ratio) - log_ratio)

    if spec.metrics is not None:
        metrics.update(spec.metrics(torch.exp(lp - old).detach(), adv, params, token_sum))

    if plan.mismatch.mode != "none":
        if beh is None:
            raise ValueError(f"loss.mismatch.mode {plan.mismatch.mode} needs behavior_logp (the sampler's log-probs)")
        w, mis = mismatch_weights(old, beh, mask, plan.mismatch)
        loss = loss * w
        metrics.update(mis)
    if beh is not None:
        metrics["mismatch/abs_logp_gap_mean"] = token_sum((lp - beh).abs())

    if ref_logp is not None:
        k3 = kl_k3(lp, clean(ref_logp.detach()))
        metrics["kl"] = token_sum(k3)
        if plan.beta > 0:
            loss = loss + plan.beta * k3
    elif plan.beta > 0:
        raise ValueError(f"loss.beta is {plan.beta} > 0: pass ref_logp (the reference model's log-probs)")

    return torch.where(m, loss, zeros), metrics


def finalize_metrics(sums: Mapping[str, Tensor | float], exclude: Collection[str] = ()) -> dict[str, float]:
    """Turn :func:`per_token_loss` metric sums into means over the optimizer batch.

    Aggregate by summing every key over micro-batches (and ranks), including
    ``trained_tokens``; then every key (the built-in ones and a registered loss's own) is
    divided by the summed ``trained_tokens``. ``exclude`` names the caller's own sums
    (e.g. the loss value), which are left out; ``trained_tokens`` itself is left out too.
    """
    n = max(float(sums.get("trained_tokens", 0.0)), 1.0)
    skip = {"trained_tokens", *exclude}
    return {k: float(v) / n for k, v in sums.items() if k not in skip}


__all__ = [
    "LOSSES",
    "CenteredConfig",
    "CenteredParams",
    "CispoParams",
    "ClipParams",
    "LossInputs",
    "LossParams",
    "LossPlan",
    "LossSection",
    "LossSpec",
    "Metrics",
    "MismatchConfig",
    "MismatchCorrection",
    "centered_loss",
    "cispo_loss",
    "clip_loss",
    "finalize_metrics",
    "get_loss",
    "importance_sampling_loss",
    "kl_k3",
    "mismatch_weights",
    "normalize",
    "per_token_loss",
    "register_loss",
    "sample_aux_tokens",
]
