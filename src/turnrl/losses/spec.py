"""What every surrogate loss is: its inputs, its own parameters, and its registry entry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict
from torch import Tensor


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


P = TypeVar("P", bound=BaseModel)
"""A loss's own parameter model."""

TokenSum = Callable[[Tensor], Tensor]
Metrics = Callable[[Tensor, Tensor, Any, TokenSum], dict[str, Tensor]]


@dataclass(frozen=True)
class LossSpec(Generic[P]):
    """A surrogate loss as a registry entry, generic in its parameter model ``P``.

    ``fn(inputs, params)`` → per-token loss [B, T]. ``metrics(ratio, adv, params, token_sum)``
    → extra token-sum metrics (``ratio`` = exp(logp − old_logp), detached). ``params`` is
    the model's class; ``fn``, ``metrics``, ``aux_top_k`` and ``num_aux`` receive an instance of it.
    """

    fn: Callable[[LossInputs, P], Tensor]
    params: type[P] = LossParams  # type: ignore[assignment]  # a loss without parameters of its own
    needs_behavior: bool = False
    """Uses the sampler's log-probs itself (then a mismatch weight would correct twice)."""
    aux_top_k: Callable[[P], int] | None = None
    """How many sampler top-k log-probs it needs per token (auxiliary tokens), if any."""
    num_aux: Callable[[P], int] | None = None
    metrics: Callable[[Tensor, Tensor, P, TokenSum], dict[str, Tensor]] | None = None


def need(x: Tensor | None, what: str, loss: str) -> Tensor:
    if x is None:
        raise ValueError(f"loss.type {loss} needs {what}")
    return x
