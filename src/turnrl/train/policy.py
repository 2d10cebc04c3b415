"""The policy of an outer iteration: the base model, earlier iterations' adapters merged, a fresh LoRA."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turnrl.config import LoraConfig, ModelConfig, RunConfig
from turnrl.models import attach_lora, enable_gradient_checkpointing, load_model, merge_adapters
from turnrl.rundir import RunDir


def step_seed(seed: int, step: int, salt: int = 0) -> int:
    """The seed of one step's sampling (and other per-step draws): a resumed run reproduces it."""
    return (seed * 1_000_003 + step * 7_919 + salt) % (2**31)


@dataclass(frozen=True)
class PolicySettings:
    """What builds an iteration's policy: the base model, the LoRA, the seed, gradient checkpointing."""

    model: ModelConfig
    seed: int = 0
    gradient_checkpointing: bool = False

    @property
    def lora(self) -> LoraConfig:
        return self.model.lora

    @classmethod
    def from_config(cls, cfg: RunConfig) -> PolicySettings:
        return cls(cfg.model.model_copy(deep=True), cfg.seed, cfg.train.gradient_checkpointing)


def build_policy(settings: PolicySettings, run: RunDir, iteration: int):
    """Base model with adapters 0..iteration−1 merged in, plus a fresh trainable LoRA; and the tokenizer."""
    base, tokenizer = load_model(settings.model, seed=settings.seed)
    if iteration > 0:
        base = merge_adapters(base, run.adapters_through(iteration - 1, purpose=f"cannot build iteration {iteration}"))
    if settings.gradient_checkpointing:
        enable_gradient_checkpointing(base)
    torch.manual_seed(step_seed(settings.seed, 0, salt=iteration))
    model = attach_lora(base, settings.lora)
    model.train()  # from_pretrained returns eval mode; gradient checkpointing acts in train mode only
    return model, tokenizer
