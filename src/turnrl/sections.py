"""Base classes of the config's sections: strict sections, and plug-in sections built from a registry.

The strict rules, one home for every option any component reads (config sections, plug-in
parameters, environment options): no unknown key; a ``bool`` field takes only ``true``/``false``
(never a string or a number: ``"false"`` is refused, not read as true), a number field
takes no string and no boolean; every float, nested ones
included, is finite; a free-form value (``dict[str, Any]``) holds at most
:data:`turnrl.bounded.FREE_FORM_NODES` values. :class:`Section` applies them to its own fields;
:func:`strict_validate` applies them to any pydantic model, so a plug-in's or an environment's
parameter model gets them whatever its base class.

A :class:`PluginSection` names its plug-in (an estimator, loss or sampler backend) or a
list of them (the tracking sinks) and takes each plug-in's own parameters, validated
by the plug-in's pydantic model; the registry is looked up when a config is validated,
so plug-ins registered from user code are accepted without editing the config module.
:class:`ConfigError` lives here, below every layer that reports a bad setting.
"""

from __future__ import annotations

import importlib
import math
import types
import typing
from collections.abc import Iterator
from typing import Any, ClassVar, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from turnrl.bounded import InputTooLarge, check_bounded, short_repr

M = TypeVar("M", bound=BaseModel)

NOT_A_BOOL = "must be true or false (an unquoted YAML boolean)"
NOT_A_NUMBER = "must be a number (unquoted; not a string or true/false)"
NOT_FINITE = "must be a finite number"


def _strict_problem(annotation: Any, value: Any) -> str | None:
    """Why ``value`` may not be coerced into a field of this annotation, or None.

    A ``bool`` field (or ``bool | None``) takes only a real boolean; an ``int``/``float`` field
    (or ``| None``) no string and no boolean — pydantic's lax mode would turn ``"false"`` into
    False, ``"inf"`` into a float and ``true`` into 1.
    """
    if value is None:
        return None
    args = (
        set(typing.get_args(annotation))
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else {annotation}
    )
    args.discard(type(None))
    if args == {bool}:
        return None if isinstance(value, bool) else NOT_A_BOOL
    if args and args <= {int, float} and isinstance(value, str | bool):
        return NOT_A_NUMBER
    return None


def _model_type(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if len(models) == 1 else None
    return None


def _non_finite(value: Any, loc: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], float]]:
    """(location, value) of every non-finite float in a (bounded) nested value or model."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(value, loc)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                yield where, item
        elif isinstance(item, BaseModel):
            stack.extend((getattr(item, name), (*where, name)) for name in type(item).model_fields)
        elif isinstance(item, dict):
            stack.extend((v, (*where, k)) for k, v in item.items())
        elif isinstance(item, list | tuple):
            stack.extend((v, (*where, i)) for i, v in enumerate(item))


def _strict_input(model: type[BaseModel], data: Any, loc: tuple[Any, ...] = ()) -> Iterator[InitErrorDetails]:
    """Errors for inputs the strict rules refuse before pydantic's lax coercion would accept them."""
    if not isinstance(data, dict):
        return
    for name, field in model.model_fields.items():
        key = field.alias or name
        if key not in data:
            continue
        value, where = data[key], (*loc, key)
        if problem := _strict_problem(field.annotation, value):
            yield {"type": PydanticCustomError("strict_type", problem), "loc": where, "input": value}
        elif (sub := _model_type(field.annotation)) is not None:
            yield from _strict_input(sub, value, where)


def strict_validate(model: type[M], data: dict[str, Any]) -> M:
    """``model.model_validate(data)`` under the strict rules (see the module doc), for any model.

    Raises ``pydantic.ValidationError`` whose errors locate the key, as pydantic's own do.
    """
    try:
        check_bounded(data)
    except InputTooLarge as exc:
        raise ValidationError.from_exception_data(
            model.__name__, [{"type": PydanticCustomError("too_large", str(exc)), "loc": (), "input": "..."}]
        ) from None
    errors = list(_strict_input(model, data))
    if errors:
        raise ValidationError.from_exception_data(model.__name__, errors)
    obj = model.model_validate(data)
    bad = [
        InitErrorDetails(type=PydanticCustomError("finite_number", NOT_FINITE), loc=loc, input=value)
        for loc, value in _non_finite(obj)
    ]
    if bad:
        raise ValidationError.from_exception_data(model.__name__, bad)
    return obj


def located(err: Any) -> tuple[tuple[Any, ...], Any]:
    """(full location, offending value) of a pydantic error, looking inside free-form values."""
    ctx = err.get("ctx") or {}
    if err["type"] == "finite_number" and "within" in ctx:
        return (*err["loc"], *ctx["within"]), ctx["value"]
    return tuple(err["loc"]), err.get("input")


def error_lines(exc: ValidationError, prefix: str = "") -> list[str]:
    """Each error of ``exc`` as ``prefix.key: what is wrong (got a short repr of the value)``."""
    lines = []
    for err in exc.errors():
        loc, value = located(err)
        key = ".".join(str(p) for p in (prefix, *loc) if p != "")
        msg = err["msg"].removeprefix("Value error, ")
        got = "" if err["type"] in ("too_large", "missing") else f" (got {short_repr(value)})"
        lines.append(f"{key}: {msg}{got}" if key else f"{msg}{got}")
    return lines


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key and the fix."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _strict_types(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and (problem := _strict_problem(field.annotation, value)):
            raise ValueError(problem)
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _finite(cls, value: Any) -> Any:
        if isinstance(value, dict | list | tuple):
            check_bounded(value)  # free-form values (dict[str, Any]) stay small
        for loc, bad in _non_finite(value):  # inside a free-form value: the error carries the key within it
            raise PydanticCustomError("finite_number", NOT_FINITE, {"within": loc, "value": bad})
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
        return strict_validate(model, {k: v for k, v in extra.items() if k in model.model_fields})

    @field_validator("*", mode="after")
    @classmethod
    def _registered(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name != cls._registry[2]:
            return value
        for name in value if isinstance(value, list) else [value]:
            if name not in cls.registry():
                allowed = ", ".join(map(repr, sorted(cls.registry())))
                raise ValueError(f"{short_repr(name)} is not registered; choose one of {allowed}")
        return value

    def _check_other_plugins(self, registry: dict[str, Any], owners: dict[str, list[str]]) -> None:
        """A key of a plug-in not chosen here (kept for arms that switch to it) must still be valid
        for some plug-in owning it: refused when every owner's strict model refuses its value."""
        extra = self.__pydantic_extra__ or {}
        refused: dict[str, list[str]] = {}
        for name, spec in registry.items():
            given = {k: v for k, v in extra.items() if k in spec.params.model_fields}
            if not given or name in self.chosen:
                continue
            try:
                strict_validate(spec.params, given)
            except ValidationError as exc:
                for err, line in zip(exc.errors(), error_lines(exc), strict=True):
                    if err["loc"]:
                        refused.setdefault(str(err["loc"][0]), []).append(f"{line} for {self._registry[2]} {name!r}")
        for key, lines in sorted(refused.items()):
            if len(lines) >= len(owners.get(key, [])) and not set(self.chosen) & set(owners.get(key, [])):
                raise ValueError(lines[0])

    @model_validator(mode="after")
    def _check_plugin(self) -> PluginSection:
        registry, field = self.registry(), self._registry[2]
        extra = self.__pydantic_extra__
        for key, value in extra.items():
            check_bounded(value, key)
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
                raise ValueError(f"{error_lines(exc)[0]} for {field} {name!r}") from None
        self._check_other_plugins(registry, owners)
        filled = dict(chosen)
        for spec in registry.values():
            for key, value in spec.params().model_dump(mode="json").items():
                filled.setdefault(key, value)
        for key, value in filled.items():
            if key not in extra or key in chosen:
                extra[key] = value
        return self
