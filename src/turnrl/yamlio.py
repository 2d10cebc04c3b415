"""The one YAML reader of the project: safe, and a mapping that gives a key twice is an error.

PyYAML's ``safe_load`` keeps the last of two equal keys, so a config whose ``train:`` section
is written twice silently loses the first. :func:`load_yaml` refuses it, naming the key and both
lines. Every YAML the project reads (run configs, ``--set`` values, experiment specs, a run
directory's saved config) goes through it.
"""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["DuplicateKeyError", "StrictLoader", "load_yaml"]


class DuplicateKeyError(yaml.YAMLError):
    """A mapping gives the same key twice."""


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` whose mappings refuse a repeated key (merge keys ``<<`` may still override)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
                seen.setdefault(key, line)
            except TypeError:  # an unhashable key: SafeLoader's own error says so below
                continue
            if first is not None:
                raise DuplicateKeyError(
                    f"line {line}: key {key!r} is given twice (first on line {first}); a repeated key would"
                    " silently replace the first. Merge the two into one"
                )
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load(text)`` with :class:`StrictLoader`: a repeated mapping key raises :class:`DuplicateKeyError`."""
    return yaml.load(text, Loader=StrictLoader)  # noqa: S506 - StrictLoader is a SafeLoader
