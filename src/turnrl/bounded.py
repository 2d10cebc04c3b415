"""Bounded reading of untrusted input: YAML with limits, a size measure of nested values, short reprs.

Everything a user hands the program (a config file, a ``--set`` override, an experiment spec, a
task line) is read here or measured here before anything expands it:

* :func:`load_yaml` parses one YAML document with :class:`BoundedLoader`: at most
  :data:`MAX_YAML_BYTES` of text, :data:`MAX_DEPTH` levels of nesting and :data:`MAX_NODES`
  values *after alias expansion* (a "billion laughs" alias bomb is refused while it is still a
  few hundred bytes), no recursive aliases, and no key given twice in one mapping.
* :func:`check_bounded` refuses a nested Python value with more than ``max_nodes`` values
  (shared references counted each time they appear, as a dump would write them) or deeper than
  ``max_depth`` — for free-form fields (``model.chat_template_kwargs``, ``env.options``).
* :func:`short_repr` is the repr every error message uses for a value it did not make: at most
  :data:`REPR_CHARS` characters whatever the value holds.
* :func:`path_component` is the one check of a name a path is built from (run, arm and experiment
  names; a spec file's stem): :data:`NAME_PATTERN`, so never ``..``, a separator or a control character.
"""

from __future__ import annotations

import re
import reprlib
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

MAX_YAML_BYTES = 1 << 20
"""Largest YAML text read (1 MiB; the shipped configs are under 4 KiB)."""
MAX_DEPTH = 32
"""Deepest nesting of a YAML document or a free-form value (the shipped configs nest 4 deep)."""
MAX_NODES = 100_000
"""Most values (scalars, lists and mappings) a YAML document may hold once its aliases are expanded."""
FREE_FORM_NODES = 10_000
"""Most values a free-form field (a mapping passed on as is) may hold."""
REPR_CHARS = 120
"""Longest repr of a user's value in an error message."""

# ---- the sizes a config or a command-line option may ask for (each checked where it is read)

MAX_TOKENS_PER_TURN = 1 << 20
"""Upper limit of ``sampler.max_tokens`` / ``eval.max_tokens`` (1,048,576: beyond any model's context)."""
MAX_GROUP = 1 << 16
"""Upper limit of ``rollout.group_size``, ``rollout.tasks_per_step`` and the product of ``rollout.branching``."""
MAX_EPISODES_PER_STEP = 1 << 16
"""Most episodes one step may collect: ``rollout.tasks_per_step`` × episodes per task (65,536)."""
MAX_ITERATIONS = 10_000
"""Upper limit of ``loop.iterations`` and of the CLI's ``--iteration`` / ``--start-iter`` (iteration n merges
n adapters into the base: past a few hundred the merges alone dominate a run)."""
MAX_TOKENS_PER_STEP = 1 << 28
"""Most tokens one step may sample: episodes × ``rollout.max_turns`` × ``sampler.max_tokens`` (268,435,456;
about 2 GiB of token ids and log-probs before any model memory)."""
MAX_LORA_RANK = 4096
"""Upper limit of ``lora.r`` and of the rank of an adapter read from disk (:mod:`turnrl.adapterfile`)."""
MAX_AUDIT_EPISODES = 4096
"""``credit-audit --episodes``: audited episodes (each costs M rollouts per turn for its ground truth)."""
MAX_AUDIT_REPEATS = 1000
"""``credit-audit --repeats``: independent estimator batches (each one collector call per shape)."""
MAX_AUDIT_SHAPES = 16
"""``credit-audit --shapes``: branched shapes audited side by side."""
MAX_AUDIT_TASKS = 1 << 20
"""``credit-audit --num-tasks``: the first N tasks of the split (a task file holds fewer)."""

_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 6
_REPR.maxlong = 40


def short_repr(value: Any, limit: int = REPR_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters, computed without expanding nested or huge values."""
    try:
        text = _REPR.repr(value)
    except Exception:  # noqa: BLE001 - a user object whose repr fails still gets a message
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class InputTooLarge(ValueError):
    """A value is larger or deeper than the stated limit; the message names the limit."""


def check_bounded(value: Any, where: str = "", max_nodes: int = FREE_FORM_NODES, max_depth: int = MAX_DEPTH) -> None:
    """Refuse ``value`` if it holds more than ``max_nodes`` values or nests deeper than ``max_depth``.

    Shared references (and cycles) count every time they are reached, as a serialiser would
    write them out; the walk stops at the first value over the limit, so it costs O(max_nodes).
    """
    prefix = f"{where}: " if where else ""
    stack: list[tuple[Any, int]] = [(value, 1)]
    seen = 0
    while stack:
        item, depth = stack.pop()
        seen += 1
        if seen > max_nodes:
            raise InputTooLarge(f"{prefix}holds more than {max_nodes:,} values (allowed: at most {max_nodes:,})")
        if depth > max_depth:
            raise InputTooLarge(f"{prefix}nests deeper than {max_depth} levels (allowed: at most {max_depth})")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
            stack.extend((k, depth + 1) for k in item)
        elif isinstance(item, list | tuple | set | frozenset):
            stack.extend((v, depth + 1) for v in item)


class BoundedYAMLError(yaml.MarkedYAMLError):
    """A YAML document over a limit of :class:`BoundedLoader` (or with a key given twice)."""


class BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with limits on nesting, alias expansion and repeated keys.

    Composition counts its depth (refused past :data:`MAX_DEPTH`, long before Python's
    recursion limit); the composed node graph is then measured as if every alias were copied
    (memoised per node, so a bomb is measured in time linear in its text) and refused past
    :data:`MAX_NODES` values, :data:`MAX_DEPTH` levels, or when an alias refers to itself.
    """

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise BoundedYAMLError(
                    None, None, f"nested deeper than {MAX_DEPTH} levels (allowed: at most {MAX_DEPTH})", mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> Node | None:
        node = super().compose_document()
        if node is not None:
            _measure(node)
        return node

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:  # an unhashable key: SafeConstructor's own error follows
                continue
            if first is not key_node:
                raise BoundedYAMLError(
                    "while reading a mapping",
                    node.start_mark,
                    f"the key {short_repr(key)} is given twice (first on line {first.start_mark.line + 1});"
                    " give each key once",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _measure(root: Node) -> None:
    """Refuse a node graph whose expansion holds more than MAX_NODES values, nests deeper than
    MAX_DEPTH, or loops (an iterative post-order walk memoised per node)."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    entered: set[int] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            entered.discard(key)
            kids = _children(node)
            size[key] = 1 + sum(size[id(k)] for k in kids)
            depth[key] = 1 + max((depth[id(k)] for k in kids), default=0)
            problem = None
            if size[key] > MAX_NODES:
                problem = f"expands to more than {MAX_NODES:,} values (aliases counted as copies; allowed: that many)"
            elif depth[key] > MAX_DEPTH:
                problem = f"nests deeper than {MAX_DEPTH} levels once aliases are expanded (allowed: {MAX_DEPTH})"
            if problem:
                raise BoundedYAMLError(None, None, problem, node.start_mark)
            continue
        if key in size:
            continue
        entered.add(key)
        stack.append((node, True))
        for kid in _children(node):
            if id(kid) in entered:
                raise BoundedYAMLError(None, None, "an alias refers to the value it is part of", kid.start_mark)
            if id(kid) not in size:
                stack.append((kid, False))


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error as one line: what is wrong and where (``line L, column C``)."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        return " ".join(str(exc).split())[:300]
    parts = [p for p in (exc.context, exc.problem) if p]
    text = "; ".join(parts) or "not valid YAML"
    mark = exc.problem_mark or exc.context_mark
    if mark is not None:
        text += f" (line {mark.line + 1}, column {mark.column + 1})"
    return text


def load_yaml(text: str | bytes, max_bytes: int = MAX_YAML_BYTES) -> Any:
    """One YAML document, parsed within the limits of :class:`BoundedLoader`.

    Raises ``yaml.YAMLError`` (a :class:`BoundedYAMLError` for a limit) and
    :class:`InputTooLarge` for text over ``max_bytes``.
    """
    size = len(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
    if size > max_bytes:
        raise InputTooLarge(f"{size:,} bytes of YAML; allowed: at most {max_bytes:,}")
    loader = BoundedLoader(text)
    try:
        return loader.get_single_data()
    except RecursionError:  # a limit above should come first; never let it escape as a traceback
        raise BoundedYAMLError(None, None, f"nested too deeply (allowed: {MAX_DEPTH} levels)", None) from None
    finally:
        loader.dispose()


NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
"""A name that becomes one path component: letters, digits, ``_ . -``, starting with a letter or digit
(so never ``.``, ``..``, a hidden name, a separator or a control character)."""


def path_component(name: str, what: str) -> str:
    """``name`` if it is safe as one directory name (:data:`NAME_PATTERN`, at most 200 characters), else
    ``ValueError`` naming ``what`` (where the name came from) and the fix. Every name that a path is built
    from and that did not come from this program goes through here."""
    if not isinstance(name, str) or len(name) > 200 or not re.fullmatch(NAME_PATTERN, name):
        raise ValueError(
            f"{what} {short_repr(name)} cannot be a directory name: use letters, digits, '_', '.' and '-',"
            " starting with a letter or digit (at most 200 characters)"
        )
    return name


__all__ = [
    "FREE_FORM_NODES",
    "MAX_DEPTH",
    "MAX_NODES",
    "MAX_YAML_BYTES",
    "BoundedLoader",
    "BoundedYAMLError",
    "InputTooLarge",
    "check_bounded",
    "load_yaml",
    "yaml_problem",
    "short_repr",
    "NAME_PATTERN",
    "path_component",
]
