"""Config text to a raw mapping: a YAML file or ``--set key.sub=value`` overrides, before validation.

Every failure is a :class:`ConfigError` naming the file (and line) or the override. Keys that moved
between sections (:data:`MOVED_KEYS`) are refused in a config a person writes (:func:`refuse_moved`) and
read at their new place in one a run directory saved (:func:`upgrade_saved`). YAML is read by
:func:`turnrl.bounded.load_yaml` (size, depth and alias-expansion limits; a repeated key refused).
:mod:`turnrl.config` validates what these return.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from turnrl.bounded import BoundedYAMLError, InputTooLarge, load_yaml, short_repr, yaml_problem
from turnrl.sections import ConfigError

__all__ = [
    "MAX_OVERRIDE_BYTES",
    "MOVED_KEYS",
    "apply_overrides",
    "read_config_data",
    "refuse_moved",
    "set_dotted",
    "upgrade_saved",
]


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set the dotted key ``a.b.c`` of a nested dict to ``value``, creating sections on the way."""
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(f"{key!r} is not a dotted config key like 'loss.type'")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{part!r} in {key!r} is not a section")
    node[parts[-1]] = value


MAX_OVERRIDE_BYTES = 64 << 10
"""Longest ``--set`` value (64 KiB)."""


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (values parsed as bounded YAML) to a nested dict.

    Every failure names the override: a value that is not YAML, is too large, or a key that is not a section.
    """
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {short_repr(item)} must look like key.sub=value")
        try:
            value = load_yaml(raw, max_bytes=MAX_OVERRIDE_BYTES)
        except BoundedYAMLError as exc:
            raise ConfigError(f"override {short_repr(item)}: the value is refused: {yaml_problem(exc)}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(
                f"override {short_repr(item)}: the value is not valid YAML ({yaml_problem(exc)});"
                " quote a string, close brackets, e.g. --set 'train.steps=5'"
            ) from None
        except InputTooLarge as exc:
            raise ConfigError(f"override {short_repr(item)}: the value is {exc}") from None
        try:
            set_dotted(data, key, value)
        except ConfigError as exc:
            raise ConfigError(f"override {short_repr(item)}: {exc}") from None
    return data


def read_config_data(path: str | Path) -> dict[str, Any]:
    """The raw mapping of a YAML config file (not validated yet); every failure names the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}: not valid UTF-8 (byte {exc.start}, line {line}); save the config as UTF-8 text"
        ) from None
    try:
        data = load_yaml(text) or {}
    except BoundedYAMLError as exc:
        raise ConfigError(f"{path}: {yaml_problem(exc)}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {yaml_problem(exc)}") from None
    except InputTooLarge as exc:
        raise ConfigError(f"{path}: {exc}; a config is a small file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data


MOVED_KEYS: dict[tuple[str, str], tuple[str, str]] = {
    ("credit", "shaping"): ("rollout.shaping", "the collector applies it"),
    ("credit", "shaping_gamma"): ("rollout.shaping_gamma", "the collector applies it"),
    ("train", "truncated_completion_reward"): ("rollout.truncated_completion_reward", "the collector applies it"),
    ("credit", "exclude_think"): (
        "model.exclude_think",
        "the chat template applies it, in training, its evaluation, turnrl eval and the credit audit alike",
    ),
}
"""Keys that moved to the section whose stage reads them: (old section, key) → (new key, why)."""


def refuse_moved(data: Any, section: str) -> Any:
    """Refuse keys of ``section`` that moved (:data:`MOVED_KEYS`), naming the new key."""
    if isinstance(data, dict):
        moved = [(key, MOVED_KEYS[(section, key)]) for key in data if (section, key) in MOVED_KEYS]
        if moved:
            raise ValueError(
                "; ".join(f"{section}.{key} moved to {new} ({why}): write {new}" for key, (new, why) in moved)
            )
    return data


def upgrade_saved(data: dict[str, Any]) -> dict[str, Any]:
    """A config a run directory saved before keys moved, with each moved key at its new place.

    Only for configs turnrl wrote itself (``config.yaml`` of a run: every key is there, defaults
    included); a config a person writes gets the refusal of :func:`refuse_moved` instead.
    """
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for (section, key), (new, _) in MOVED_KEYS.items():
        old_section = out.get(section)
        if not isinstance(old_section, dict) or key not in old_section:
            continue
        value = old_section.pop(key)
        to_section, _, to_key = new.partition(".")
        target = out.setdefault(to_section, {})
        if isinstance(target, dict):
            target.setdefault(to_key, value)
    return out
