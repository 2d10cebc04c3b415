"""The tracking sinks as registry entries, like the other plug-in kinds.

A sink is one class following :class:`MetricsSink` plus one :func:`register_sink`
call: a :class:`SinkSpec` with its factory (the class itself works: it is called with a
:class:`SinkContext`), the pydantic model of its own ``tracking.*`` parameters, the
modules it needs and how to install them. ``tracking.backends`` accepts every
registered name; :func:`~turnrl.tracking.sinks.make_sinks` checks every chosen sink's
modules before it creates any, so a missing package fails fast with its own hint.

This module imports nothing of turnrl but the config's base sections, so the config can
look the registry up while it is being validated.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

from turnrl.sections import ConfigError

Metrics = Mapping[str, Any]
"""Metric name → value (float/int; ``label`` in evaluation rows is a string)."""


@runtime_checkable
class MetricsSink(Protocol):
    def log_step(self, step: int, metrics: Metrics) -> None: ...

    def log_eval(self, step: int, metrics: Metrics) -> None: ...

    def log_iteration(self, iteration: int, metrics: Metrics) -> None: ...

    def close(self) -> None: ...


class SinkParams(BaseModel):
    """A sink's own ``tracking.*`` parameters (none by default); subclass it to add some."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class SinkContext:
    """What a sink's factory is given: where the run lives and what it is."""

    run_dir: Path
    run_name: str
    config: Mapping[str, Any]
    """The run's whole config as plain data (``RunConfig.model_dump(mode="json")``)."""
    params: BaseModel
    """This sink's own parameters, validated by its ``SinkSpec.params``."""
    resume_step: int | None = None
    """The step a resumed run continues from (None: a fresh run)."""
    console: Any = None
    """The trainer's rich Console (so output prints above its live progress bar), or None."""


@dataclass(frozen=True)
class SinkSpec:
    """A metrics sink: ``factory(SinkContext) -> MetricsSink``."""

    factory: str | Callable[[SinkContext], MetricsSink]
    """A callable (the sink class itself, say), or its ``"module:attr"`` path (imported lazily)."""
    params: type[BaseModel] = SinkParams
    requires: tuple[str, ...] = ()
    """Modules the sink imports, checked before any sink of the run is created."""
    install: str = ""
    """How to install ``requires`` (shown when one cannot be imported)."""


SINKS: dict[str, SinkSpec] = {}


def register_sink(name: str, spec: SinkSpec) -> None:
    """Add a sink under ``name`` (then ``tracking.backends: [..., name]`` works in configs)."""
    SINKS[name] = spec


def get_sink(name: str) -> SinkSpec:
    if name not in SINKS:
        raise ValueError(f"unknown tracking backend {name!r}; choose one of {', '.join(sorted(SINKS))}")
    return SINKS[name]


class MissingBackendError(ConfigError):
    """A tracking backend named in ``tracking.backends`` is not installed."""


def require(name: str) -> None:
    """Import the modules sink ``name`` needs, or raise one clear error with its install hint."""
    spec = get_sink(name)
    for module in spec.requires:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            hint = f"; install it with: {spec.install}" if spec.install else ""
            raise MissingBackendError(
                f"tracking.backends includes {name!r} but it cannot be imported ({exc}){hint}"
                f"  (or remove {name!r} from tracking.backends)"
            ) from None


def build_sink(name: str, context: SinkContext) -> MetricsSink:
    """The sink ``name`` made by its factory."""
    factory = get_sink(name).factory
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        factory = obj
    return factory(context)
