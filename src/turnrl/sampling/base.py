"""The sampler interface: token ids in, sampled token ids and their log-probs out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from turnrl.envs.base import Message


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    max_tokens: int = 64
    """Maximum new tokens for this turn."""
    top_k_logprobs: int = 0
    """Also return the top-k log-probs per sampled position (0 = off)."""
    seed: int = 0


@dataclass
class Sample:
    """One completion of one context."""

    ids: list[int]
    """Sampled token ids, including the end-of-turn token when one was sampled."""
    logprobs: list[float]
    """Log-prob of each sampled id under the sampling distribution (after temperature)."""
    finish_reason: str
    """``stop`` (end-of-turn sampled) or ``length``."""
    topk_ids: list[list[int]] | None = None
    topk_logprobs: list[list[float]] | None = None
    text: str | None = None
    """Set by samplers that produce text directly (scripted policies); else decoded by the collector."""


class Sampler(Protocol):
    """A generation backend for the current policy."""

    policy_version: int
    """Version of the weights the sampler generates with (increments on refresh)."""

    def sample(
        self, contexts: list[list[int]], params: SamplingParams, messages: list[list[Message]] | None = None
    ) -> list[Sample]:
        """One completion per context (token ids of the chat rendered with a generation prompt).

        ``messages`` (the same contexts as chat messages) is passed for backends that work
        on text, such as scripted policies; token backends ignore it.
        """
        ...

    def refresh(self) -> None:
        """Take the trainer's current weights (a no-op for samplers that share them)."""
        ...
