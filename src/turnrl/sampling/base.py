"""The sampler interface: token ids in, sampled token ids and their log-probs out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict

from turnrl.types import Message, Sample, SamplingParams


class SamplerParams(BaseModel):
    """Base of a backend's own parameters (``sampler.<name>`` keys of the config)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @property
    def differs_from_trainer(self) -> bool:
        """These settings make the sampler's log-probs other than the trainer's even with the same weights
        (e.g. generating with rounded weights), so ``loss.mismatch.mode: auto`` corrects for it."""
        return False


class SamplerSection(Protocol):
    """The keys of the ``sampler`` config section that :class:`SamplerSettings` reads (this package
    may not import the config: the section is passed in, and this Protocol says what it must have)."""

    @property
    def backend(self) -> str: ...
    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def top_k_logprobs(self) -> int: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def refresh_every(self) -> int: ...
    @property
    def max_staleness(self) -> int: ...
    @property
    def params(self) -> BaseModel: ...


P = TypeVar("P", bound=BaseModel)
"""A backend's own parameter model."""


@dataclass(frozen=True)
class SamplerSettings(Generic[P]):
    """The sampler of a run, resolved once: the backend with its own parameters (an instance of the
    backend's model ``P``), how it samples, how often its weights are refreshed. A backend's factory
    receives this object, typed ``SamplerSettings[ItsParams]``."""

    backend: str = "hf"
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    top_k_logprobs: int = 0
    batch_size: int = 32
    refresh_every: int = 1
    max_staleness: int = 0
    """1: each step's batch is collected while the previous step trains (one version behind); 0: synchronous."""
    params: P = field(default_factory=SamplerParams)  # type: ignore[assignment]  # a backend without parameters

    @classmethod
    def from_config(cls, section: SamplerSection) -> SamplerSettings[BaseModel]:
        return SamplerSettings(
            section.backend,
            section.temperature,
            section.top_p,
            section.max_tokens,
            section.top_k_logprobs,
            section.batch_size,
            section.refresh_every,
            section.max_staleness,
            section.params,
        )

    def sampling(self, seed: int) -> SamplingParams:
        """The training rollouts' sampling parameters with ``seed``."""
        return SamplingParams(self.temperature, self.top_p, self.max_tokens, self.top_k_logprobs, seed)


class Sampler(Protocol):
    """A generation backend for the current policy."""

    policy_version: int
    """Version of the weights the sampler generates with (increments on refresh)."""

    # Optional: ``detached: bool``, True when between refreshes sampling reads none of the trainer's tensors
    # (its own copy of the weights), so collection may run while the trainer steps (``sampler.max_staleness``);
    # a sampler without it is taken as not detached.

    def sample(
        self, contexts: list[list[int]], params: SamplingParams, messages: list[list[Message]] | None = None
    ) -> list[Sample]:
        """One completion per context (token ids of the chat rendered with a generation prompt).

        ``messages`` (the same contexts as chat messages) is passed for backends that work
        on text, such as scripted policies; token backends ignore it.
        """
        ...

    def refresh(self, weights: dict | None = None) -> None:
        """Take the trainer's current weights (``Trainer.policy_weights()``); the version increments.

        Backends that share the trainer's module may ignore ``weights``; a backend that
        does not (another process, a server) loads them.
        """
        ...

    def state_dict(self) -> dict:
        """What a checkpoint needs to restore this sampler (version, stale snapshot)."""
        ...

    def load_state_dict(self, state: dict) -> None: ...
