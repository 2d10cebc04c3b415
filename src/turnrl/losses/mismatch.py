"""Correction weights for a sampler whose weights differ from the trainer's (``loss.mismatch``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor


class MismatchConfig(BaseModel):
    """``loss.mismatch``: correction weights for a sampler that differs from the trainer."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    mode: Literal["auto", "none", "truncate", "mask"] = "auto"
    """``auto`` (default): on when the sampler can differ from the trainer, as TRL does (``RunConfig``
    decides it; :meth:`MismatchCorrection.from_config` of a bare section reads it as ``none``)."""
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


Mode = Literal["none", "truncate", "mask"]


@dataclass(frozen=True)
class MismatchCorrection:
    """The correction a run applies, resolved: ``auto`` is already decided (there is no ``auto`` here)."""

    mode: Mode = "none"
    level: Literal["token", "sequence"] = "token"
    c: float = 2.0
    clip_min: float | None = None
    c_min: float = 0.5
    c_max: float = 2.0

    @classmethod
    def from_config(cls, section: MismatchConfig) -> MismatchCorrection:
        """The correction of a ``loss.mismatch`` section. A run config has decided ``auto`` against its
        sampler already (``RunConfig``); a section outside one has no sampler to decide against: ``none``."""
        mode: Mode = "none" if section.mode == "auto" else section.mode
        return cls(mode, section.level, section.c, section.clip_min, section.c_min, section.c_max)


def mismatch_weights(
    old_logp: Tensor, behavior_logp: Tensor, mask: Tensor, cfg: MismatchCorrection
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
    if cfg.mode == "none":
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
    if cfg.mode != "none":
        metrics["mismatch/weight_mean"] = w.float().sum()
    return w, metrics
