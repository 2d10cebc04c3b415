"""Text → :class:`~turnrl.envs.key_door.game.Action`: the key-door action parser.

One action per reply: a JSON tool call such as
``{"name": "pickup", "arguments": {"color": "red"}}`` (optionally inside
``<tool_call>...</tool_call>``) or a bare action word such as ``pickup_red``.
JSON tool calls take precedence over bare words; among several, the last
counts. ``None`` means no action was found (an *invalid action* for the game).
"""

from __future__ import annotations

import json
import re
from typing import Any

from turnrl.envs.key_door.game import Action

_TOOL_NAMES = {
    "inspect": "inspect",
    "pickup": "pickup",
    "pick_up": "pickup",
    "open": "open",
    "open_door": "open",
    "finish": "finish",
}
_BARE_RE = re.compile(
    r"\b(?:(?P<inspect>inspect)|(?P<finish>finish)"
    r"|(?:pickup|pick_up)_(?P<pickup>[a-z]+)|open_(?:door_)?(?P<open>[a-z]+))\b",
    re.IGNORECASE,
)
_DECODER = json.JSONDecoder()


def parse_action(text: str) -> Action | None:
    """The action in a reply, or ``None`` when there is none.

    JSON tool calls (``{"name": ..., "arguments": {"color": ...}}``; ``arguments``
    may also be a JSON string, ``parameters`` is accepted as its alias) take
    precedence over bare action words (``inspect``, ``pickup_red``,
    ``open_red``, ``finish``); among several of the same kind, the last counts.
    Colours are lower-cased; whether a colour exists is the game's business.
    """
    if not isinstance(text, str):
        return None
    calls = [a for a in (_action_from_json(obj) for obj in _json_objects(text)) if a is not None]
    if calls:
        return calls[-1]
    bare = list(_BARE_RE.finditer(text))
    if not bare:
        return None
    m = bare[-1]
    if m.group("inspect"):
        return Action("inspect")
    if m.group("finish"):
        return Action("finish")
    if m.group("pickup"):
        return Action("pickup", m.group("pickup").lower())
    color = m.group("open").lower()
    return Action("open", None if color == "door" else color)  # bare "open_door": no colour


_JSON_START_RE = re.compile(r'\{\s*"')
_MAX_JSON_ATTEMPTS = 256


def _json_objects(text: str) -> list[Any]:
    """The JSON objects embedded in ``text``, left to right.

    Only ``{`` followed by a quoted key can start one, and at most
    ``_MAX_JSON_ATTEMPTS`` starts are tried, so pathological replies stay cheap.
    """
    found: list[Any] = []
    pos, attempts = 0, 0
    while attempts < _MAX_JSON_ATTEMPTS:
        m = _JSON_START_RE.search(text, pos)
        if m is None:
            break
        attempts += 1
        try:
            obj, end = _DECODER.raw_decode(text, m.start())
        except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
            pos = m.start() + 1
            continue
        found.append(obj)
        pos = end
    return found


def _action_from_json(obj: Any) -> Action | None:
    if not isinstance(obj, dict):
        return None
    # OpenAI style: {"type": "function", "function": {"name": ..., "arguments": "..."}}
    if isinstance(obj.get("function"), dict):
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    name = name.strip().lower()
    color = args.get("color", args.get("colour"))
    if name not in _TOOL_NAMES:
        # "pickup_red" / "open_red" as a tool name with no arguments
        m = _BARE_RE.fullmatch(name)
        if m is None:
            return None
        return parse_action(name)
    verb = _TOOL_NAMES[name]
    if verb in ("inspect", "finish"):
        return Action(verb)
    if not isinstance(color, str) or not color.strip():
        return Action(verb, None)
    return Action(verb, color.strip().lower())
