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
Each surrogate is one :class:`LossSpec` in :data:`LOSSES` (function, own
pydantic parameters, needs, metrics); ``register_loss`` adds one from user code.

ALGORITHMS.md §2.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

# ---- surrogate losses: each returns the per-token loss ℓ_t [B, T] -----------------------


def clip_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, eps_lo: float = 0.2, eps_hi: float = 0.28) -> Tensor:
    """PPO / GRPO / DAPO clipped surrogate (asymmetric clip-higher).

    ℓ_t = −min(ρ_t A_t, clip(ρ_t, 1 − ε_lo, 1 + ε_hi) A_t),   ρ_t = exp(logp_t − old_logp_t)
    """
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1.0 - eps_lo, 1.0 + eps_hi)
    return -torch.minimum(ratio * advantages, clipped * advantages)


def importance_sampling_loss(logp: Tensor, behavior_logp: Tensor, advantages: Tensor) -> Tensor:
    """Tinker's importance-sampled policy gradient, against the sampler's log-probs.

        ℓ_t = −ρ_t A_t,   ρ_t = exp(logp_t − behavior_logp_t)

    ∇ℓ_t = −ρ_t A_t ∇logp_t: off-policy correct for a stale sampler, unclipped.
    """
    return -torch.exp(logp - behavior_logp) * advantages


def cispo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, eps_max: float = 5.0) -> Tensor:
    """CISPO (MiniMax-M1): REINFORCE weighted by a truncated, detached ratio.

        ℓ_t = −sg(min(ρ_t, ε_max)) A_t logp_t,   ρ_t = exp(logp_t − old_logp_t)

    No token is dropped: a clipped token still gets gradient, only its weight is capped.
    """
    weight = torch.clamp(torch.exp(logp - old_logp), max=eps_max).detach()
    return -weight * advantages * logp


def centered_loss(logp: Tensor, aux_logp: Tensor, advantages: Tensor) -> Tensor:
    """Policy gradient whose score is centered by auxiliary tokens.

        ℓ_t = −A_t logp_t + A_t (m̄_t − sg(m̄_t)),   m̄_t = (1/K) Σ_k log π_θ(a_{t,k})

    ``aux_logp`` [B, T, K] is log π_θ of K tokens drawn at each position from
    the sampler's renormalised top-k (:func:`sample_aux_tokens`). The value
    equals plain PG (−A_t logp_t); the gradient is −A_t (∇logp_t − ∇m̄_t).
    """
    mbar = aux_logp.mean(dim=-1)
    return -advantages * logp + advantages * (mbar - mbar.detach())


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(π_θ ‖ π_ref), per token, ≥ 0.

    k3_t = exp(ref_t − logp_t) − (ref_t − logp_t) − 1
    """
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


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


# ---- sampler/trainer mismatch ---------------------------------------------------------


class MismatchConfig(BaseModel):
    """``loss.mismatch``: correction weights for a sampler that differs from the trainer."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    mode: Literal["auto", "none", "truncate", "mask"] = "auto"
    """``auto`` (default): on when the sampler can differ from the trainer, as TRL does (see
    ``RunConfig``; a bare ``LossConfig`` treats it as ``none``)."""
    level: Literal["token", "sequence"] = "token"
    c: float = Field(2.0, gt=0)
    """Truncation cap C for ``truncate`` (TIS)."""
    clip_min: float | None = Field(None, gt=0)
    """Lower clamp of ``truncate``: w ← max(w, clip_min) (TRL's ``vllm_importance_sampling_clip_min``
    for its ``token_truncate`` / ``sequence_truncate`` modes; unset: none, TRL's default)."""
    c_min: float = Field(0.5, ge=0)
    c_max: float = Field(2.0, gt=0)

    @model_validator(mode="after")
    def _clip_min_below_c(self) -> MismatchConfig:
        if self.clip_min is not None and self.clip_min > self.c:
            raise ValueError(f"loss.mismatch.clip_min ({self.clip_min}) is above loss.mismatch.c ({self.c}); lower it")
        return self


def mismatch_weights(
    old_logp: Tensor, behavior_logp: Tensor, mask: Tensor, cfg: MismatchConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """Detached correction weights for a sampler that differs from the trainer.

        w = exp(old_logp − behavior_logp)                        (``token`` level)
        w = exp(Σ_t m_t (old_logp_t − behavior_logp_t)), per row  (``sequence`` level)
        ``truncate`` (TIS): w ← min(w, C), and w ← max(w, clip_min) when ``clip_min`` is set
        ``mask`` (MIS):     w ← w · 1[c_min ≤ w ≤ c_max]
        ``none``:           w ← 1

    Returns w [B, T] (a sequence weight is repeated over the row; 0 where
    mask = 0) and token sums for :func:`finalize_metrics`:
    ``mismatch/weight_mean`` and ``mismatch/frac_truncated`` (w clamped to [clip_min, C]) or
    ``mismatch/frac_masked`` (w zeroed), each counted per trained token.
    """
    m = mask > 0
    log_w = torch.where(m, old_logp - behavior_logp, torch.zeros_like(old_logp)).detach().float()
    if cfg.level == "sequence":
        log_w = log_w.sum(dim=-1, keepdim=True).expand_as(log_w)
    elif cfg.level != "token":
        raise ValueError(f"loss.mismatch.level must be token or sequence (got {cfg.level!r})")
    metrics: dict[str, Tensor] = {}
    if cfg.mode in ("none", "auto"):  # an unresolved auto (no RunConfig around it) corrects nothing
        w = torch.ones_like(log_w)
    elif cfg.mode == "truncate":
        cap = math.log(cfg.c)
        floor = math.log(cfg.clip_min) if cfg.clip_min is not None else -math.inf
        w = torch.exp(torch.clamp(log_w, min=floor, max=cap))
        metrics["mismatch/frac_truncated"] = (((log_w > cap) | (log_w < floor)) & m).sum().float()
    elif cfg.mode == "mask":
        lo = math.log(cfg.c_min) if cfg.c_min > 0 else -math.inf
        hi = math.log(cfg.c_max)
        keep = (log_w >= lo) & (log_w <= hi)
        w = torch.where(keep, torch.exp(torch.clamp(log_w, max=hi)), torch.zeros_like(log_w))
        metrics["mismatch/frac_masked"] = (~keep & m).sum().float()
    else:
        raise ValueError(f"loss.mismatch.mode must be none, truncate or mask (got {cfg.mode!r})")
    w = torch.where(m, w, torch.zeros_like(w)).to(old_logp.dtype)
    if cfg.mode not in ("none", "auto"):
        metrics["mismatch/weight_mean"] = w.float().sum()
    return w, metrics


# ---- the trainer's entry point ----------------------------------------------------------


@dataclass
class LossInputs:
    """Masked inputs of one micro-batch (padding already replaced by harmless zeros)."""

    logp: Tensor
    old_logp: Tensor
    behavior_logp: Tensor | None
    advantages: Tensor
    aux_logp: Tensor | None


class LossParams(BaseModel):
    """Base of a loss's own parameters (``loss.<name>`` keys of the config)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ClipParams(LossParams):
    eps_lo: float = Field(0.2, ge=0)
    eps_hi: float = Field(0.28, ge=0)


class CispoParams(LossParams):
    eps_max: float = Field(5.0, gt=0)
    """CISPO's upper truncation of the importance ratio."""


class CenteredConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    top_k: int = Field(20, ge=1)
    num_aux: int = Field(8, ge=1)


class CenteredParams(LossParams):
    centered: CenteredConfig = CenteredConfig()


Metrics = Callable[[Tensor, Tensor, Any, Callable[[Tensor], Tensor]], dict[str, Tensor]]


@dataclass(frozen=True)
class LossSpec:
    """A surrogate loss as a registry entry.

    ``fn(inputs, params)`` → per-token loss [B, T]. ``metrics(ratio, adv, params, token_sum)``
    → extra token-sum metrics (``ratio`` = exp(logp − old_logp), detached).
    """

    fn: Callable[[LossInputs, Any], Tensor]
    params: type[BaseModel] = LossParams
    needs_behavior: bool = False
    """Uses the sampler's log-probs itself (then a mismatch weight would correct twice)."""
    aux_top_k: Callable[[Any], int] | None = None
    """How many sampler top-k log-probs it needs per token (auxiliary tokens), if any."""
    num_aux: Callable[[Any], int] | None = None
    metrics: Metrics | None = None


def _clip_metrics(ratio: Tensor, adv: Tensor, p: ClipParams, token_sum) -> dict[str, Tensor]:
    low = (ratio < 1 - p.eps_lo) & (adv < 0)
    high = (ratio > 1 + p.eps_hi) & (adv > 0)
    return {
        "clip_ratio/low_mean": token_sum(low),
        "clip_ratio/high_mean": token_sum(high),
        "clip_ratio/region_mean": token_sum(low | high),
    }


def _cispo_metrics(ratio: Tensor, adv: Tensor, p: CispoParams, token_sum) -> dict[str, Tensor]:
    return {"cispo_clip_ratio": token_sum((ratio > p.eps_max) & (adv > 0))}


def _need(x: Tensor | None, what: str, loss: str) -> Tensor:
    if x is None:
        raise ValueError(f"loss.type {loss} needs {what}")
    return x


LOSSES: dict[str, LossSpec] = {
    "clip": LossSpec(
        lambda x, p: clip_loss(x.logp, x.old_logp, x.advantages, p.eps_lo, p.eps_hi),
        ClipParams,
        metrics=_clip_metrics,
    ),
    "importance_sampling": LossSpec(
        lambda x, p: importance_sampling_loss(
            x.logp,
            _need(x.behavior_logp, "behavior_logp (the sampler's log-probs)", "importance_sampling"),
            x.advantages,
        ),
        needs_behavior=True,
    ),
    "cispo": LossSpec(
        lambda x, p: cispo_loss(x.logp, x.old_logp, x.advantages, p.eps_max), CispoParams, metrics=_cispo_metrics
    ),
    "centered": LossSpec(
        lambda x, p: centered_loss(
            x.logp, _need(x.aux_logp, "aux_logp [B, T, K] (see sample_aux_tokens)", "centered"), x.advantages
        ),
        CenteredParams,
        aux_top_k=lambda p: p.centered.top_k,
        num_aux=lambda p: p.centered.num_aux,
    ),
}
"""Per-token surrogate by ``loss.type``: one entry per loss."""


def register_loss(name: str, spec: LossSpec) -> None:
    """Add a loss under ``name`` (then ``loss.type: name`` works in configs)."""
    LOSSES[name] = spec


def get_loss(name: str) -> LossSpec:
    if name not in LOSSES:
        raise ValueError(f"unknown loss.type {name!r}; choose one of {', '.join(sorted(LOSSES))}")
    return LOSSES[name]


class LossSection(Protocol):
    """The keys of the ``loss`` config section that :class:`LossPlan` reads (this module may not
    import the config: the section is passed in, and this Protocol says what it must have)."""

    type: str
    norm: str
    beta: float
    mismatch: MismatchConfig

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
    mismatch: MismatchConfig = field(default_factory=lambda: MismatchConfig(mode="none"))

    @property
    def spec(self) -> LossSpec:
        return get_loss(self.type)

    @classmethod
    def from_config(cls, section: LossSection) -> LossPlan:
        """The plan of a ``loss`` config section (``mismatch.mode: auto`` is resolved by the run config)."""
        get_loss(section.type)
        return cls(section.type, section.params, section.norm, section.beta, section.mismatch)


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
    if spec.needs_behavior and plan.mismatch.mode not in ("none", "auto"):
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

    if plan.mismatch.mode not in ("none", "auto"):  # auto is resolved by RunConfig; unresolved = none
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


# ---- normalisers ------------------------------------------------------------------------


def normalize(
    per_token: Tensor,
    mask: Tensor,
    norm: str,
    *,
    total_tokens: float,
    total_rows: float,
    max_len: float,
) -> Tensor:
    """Scalar loss of one micro-batch; summing over micro-batches gives the batch loss.

    The totals are constants of the whole optimizer batch (not of the
    micro-batch), so micro-batch values add up exactly:

      * ``token_sum`` (DAPO):    Σ_{b,t} ℓ m / N,   N = ``total_tokens`` (trained tokens in the batch)
      * ``seq_mean`` (GRPO):     Σ_b (Σ_t ℓ m / Σ_t m) / ``total_rows``   (a row without trained tokens adds 0)
      * ``constant`` (Dr. GRPO): Σ_{b,t} ℓ m / (``total_rows`` · ``max_len``)

    ``total_rows`` = rows in the optimizer batch; ``max_len`` should be a
    constant L_max (e.g. the configured token budget per row), not the
    longest row of the batch, so the scale does not depend on the batch.
    """
    lm = per_token * mask
    if norm == "token_sum":
        return lm.sum() / max(float(total_tokens), 1.0)
    if norm == "seq_mean":
        return (lm.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)).sum() / max(float(total_rows), 1.0)
    if norm == "constant":
        return lm.sum() / max(float(total_rows) * float(max_len), 1.0)
    raise ValueError(f"loss.norm must be token_sum, seq_mean or constant (got {norm!r})")
