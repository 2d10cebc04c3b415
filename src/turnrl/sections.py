"""Base classes of the config's sections: strict sections, and plug-in sections built from a registry.

A :class:`PluginSection` names its plug-in (an estimator, loss or sampler backend) or a
list of them (the tracking sinks) and takes each plug-in's own parameters, validated
by the plug-in's pydantic model; the registry is looked up when a config is validated,
so plug-ins registered from user code are accepted without editing the config module.
:class:`ConfigError` lives here, below every layer that reports a bad setting.
"""

from __future__ import annotations

import importlib
import math
from typing import Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key and the fix."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="after")
    @classmethod
    def _finite(cls, value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


class PluginSection(Section):
    """A config section whose plug-in (estimator, loss, sampler backend) brings its own parameters.

    The section's own fields are common to every plug-in; any other key must be a
    parameter of some registered plug-in of this kind (so arms of an experiment that
    switch plug-ins can share a base config). The chosen plug-in's parameters are
    validated by its own pydantic model and exposed as :attr:`params`; defaults of
    every registered plug-in are filled in, so the saved config is complete.

    The naming field may hold a list of plug-ins (``tracking.backends``): each must be
    registered, each one's parameters are validated, and :meth:`params_of` gives them.
    """

    model_config = ConfigDict(extra="allow", validate_assignment=True)
    _registry: ClassVar[tuple[str, str, str]]
    """(module, registry name, the field naming the plug-in)."""

    @classmethod
    def registry(cls) -> dict[str, Any]:
        module, name, _ = cls._registry
        return getattr(importlib.import_module(module), name)

    @property
    def kind(self) -> str:
        return getattr(self, self._registry[2])

    @property
    def chosen(self) -> list[str]:
        """The chosen plug-ins' names: ``[kind]``, or the list the naming field holds (unique, in order)."""
        value = getattr(self, self._registry[2])
        return list(dict.fromkeys(value)) if isinstance(value, list) else [value]

    @property
    def spec(self) -> Any:
        return self.registry()[self.kind]

    @property
    def params(self) -> BaseModel:
        """The chosen plug-in's own parameters, validated."""
        return self.params_of(self.kind)

    def params_of(self, name: str) -> BaseModel:
        """The own parameters of the registered plug-in ``name``, validated."""
        extra = self.__pydantic_extra__ or {}
        model = self.registry()[name].params
        return model.model_validate({k: v for k, v in extra.items() if k in model.model_fields})

    @field_validator("*", mode="after")
    @classmethod
    def _registered(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name != cls._registry[2]:
            return value
        for name in value if isinstance(value, list) else [value]:
            if name not in cls.registry():
                raise ValueError(
                    f"{name!r} is not registered; choose one of {', '.join(map(repr, sorted(cls.registry())))}"
                )
        return value

    @model_validator(mode="after")
    def _check_plugin(self) -> PluginSection:
        registry, field = self.registry(), self._registry[2]
        extra = self.__pydantic_extra__
        owners: dict[str, list[str]] = {}
        for name, spec in registry.items():
            for key in spec.params.model_fields:
                owners.setdefault(key, []).append(name)
        unknown = sorted(set(extra) - set(owners))
        if unknown:
            allowed = sorted(set(type(self).model_fields) | set(owners))
            raise PydanticCustomError(
                "unknown_plugin_key",
                "unknown key(s) {keys}; allowed keys here: {allowed}",
                {"keys": unknown, "allowed": ", ".join(allowed)},
            )
        chosen: dict[str, Any] = {}
        for name in self.chosen:
            try:
                chosen |= self.params_of(name).model_dump(mode="json")
            except ValidationError as exc:
                err = exc.errors()[0]
                key = ".".join(str(p) for p in err["loc"])
                raise ValueError(f"{key}: {err['msg']} (got {err.get('input')!r}) for {field} {name!r}") from None
        filled = dict(chosen)
        for spec in registry.values():
            for key, value in spec.params().model_dump(mode="json").items():
                filled.setdefault(key, value)
        for key, value in filled.items():
            if key not in extra or key in chosen:
                extra[key] = value
        return self
