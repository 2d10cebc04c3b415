"""Samplers (generation backends) as registry entries, built by :func:`make_sampler`.

A backend is one module with a class following :class:`turnrl.sampling.base.Sampler`
plus one :data:`SAMPLERS` entry: the ``"module:Class"`` path (imported only when
used, so optional heavy dependencies stay optional) and the pydantic model of its
own ``sampler.*`` parameters. ``register_sampler`` adds one from user code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic

from turnrl.sampling.base import P, Sampler, SamplerParams, SamplerSection, SamplerSettings


@dataclass(frozen=True)
class SamplerSpec(Generic[P]):
    """A generation backend, generic in its parameter model ``P``: ``factory(model, tokenizer, settings,
    stale=...)`` → Sampler (``settings`` a :class:`SamplerSettings` whose ``params`` are a ``P``)."""

    factory: str | Callable[..., Sampler]
    """A callable, or its ``"module:attr"`` path (imported lazily)."""
    params: type[P] = SamplerParams  # type: ignore[assignment]  # a backend without parameters of its own
    shares_weights: bool = True
    """Generates with the trainer's own module (no stale-sampler correction needed when fresh)."""


SAMPLERS: dict[str, SamplerSpec[Any]] = {}


def _register_builtin_backends() -> None:
    """``hf``, ``openai`` and ``vllm``: their modules import no optional dependency at import time."""
    from turnrl.sampling.hf import HFSamplerParams
    from turnrl.sampling.openai import OpenAISamplerParams
    from turnrl.sampling.vllm import VLLMSamplerParams

    SAMPLERS["hf"] = SamplerSpec("turnrl.sampling.hf:HFSampler.from_config", HFSamplerParams)
    SAMPLERS["openai"] = SamplerSpec(
        "turnrl.sampling.openai:OpenAISampler.from_config", OpenAISamplerParams, shares_weights=False
    )
    SAMPLERS["vllm"] = SamplerSpec(
        "turnrl.sampling.vllm:VLLMSampler.from_config", VLLMSamplerParams, shares_weights=False
    )


def register_sampler(name: str, spec: SamplerSpec[Any]) -> None:
    """Add a backend under ``name`` (then ``sampler.backend: name`` works in configs)."""
    SAMPLERS[name] = spec


def get_sampler(name: str) -> SamplerSpec[Any]:
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler.backend {name!r}; choose one of {', '.join(sorted(SAMPLERS))}")
    return SAMPLERS[name]


def _resolve(target: str | Any) -> Any:
    if not isinstance(target, str):
        return target
    module, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def make_sampler(settings: SamplerSettings[Any], model: Any, tokenizer: Any, *, stale: bool | None = None) -> Sampler:
    """The sampler ``settings.backend`` for a policy.

    ``stale`` (default: ``settings.refresh_every > 1`` or ``settings.max_staleness > 0``) keeps the sampler's own
    copy of the weights between :meth:`Sampler.refresh` calls.
    """
    spec = get_sampler(settings.backend)
    stale = (settings.refresh_every > 1 or settings.max_staleness > 0) if stale is None else stale
    return _resolve(spec.factory)(model, tokenizer, settings, stale=stale)


_register_builtin_backends()

__all__ = [
    "SAMPLERS",
    "Sampler",
    "SamplerParams",
    "SamplerSection",
    "SamplerSettings",
    "SamplerSpec",
    "get_sampler",
    "make_sampler",
    "register_sampler",
]
