"""Tool environments: the public methods are the tools, as in TRL's ``environment_factory``.

A :class:`ToolEnv` subclass writes ``reset(**task_params) -> str`` (the opening
user text), one public method per tool (type-hinted arguments and a Google-style
docstring with ``Args:``: the schema comes from ``transformers.utils.get_json_schema``,
the same helper TRL and the chat templates use), and optionally ``get_reward()``,
``is_done()`` and :meth:`~ToolEnv.episode_end`. turnrl's own collector trains it:

* the schemas go to the chat template as ``tools=`` (:meth:`Env.tools`) and, because
  small models' templates (SmolLM2's) ignore them, are also listed in the system prompt
  with the call format;
* a reply's tool calls are parsed from the model's text, Hermes/Qwen style
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (several allowed), or one
  bare JSON object ``{"name": ..., "arguments": ...}`` (:func:`parse_tool_calls`);
* each call runs and its return value comes back as a ``{"role": "tool"}`` message; an
  exception raised *by the tool* is its reply (TRL's convention), the episode goes on;
* a reply without a tool call ends the episode (TRL's convention: the final answer);
  a malformed call (bad JSON, unknown tool, arguments that do not fit) ends it with
  the environment's ``failure_reward`` and ``MALFORMED``;
* the assistant message is recorded with structured ``tool_calls``.

:func:`tool_env_from_factory` wraps an existing TRL-style class (no-argument
constructor, ``reset(**row)``, tools, ``get_reward()``) into a :class:`ToolEnv`.
"""

from __future__ import annotations

import inspect
import itertools
import json
import re
from collections.abc import Callable
from typing import Any, ClassVar

from turnrl.envs.base import Env, Message, StepResult, StopReason, Task, echo
from turnrl.types import tool_call_message

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
_JSON_START_RE = re.compile(r'\{\s*"')
_MAX_JSON_ATTEMPTS = 256
RESERVED = frozenset({"reset", "get_reward", "is_done", "episode_end", "system_prompt"})


class ToolCallError(ValueError):
    """A reply's tool call cannot be parsed or does not fit a tool."""


def _one_call(obj: Any, where: str) -> tuple[str, dict[str, Any]]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ToolCallError(f'{where}: a tool call is a JSON object with a string "name"')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # OpenAI style: arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise ToolCallError(f'{where}: "arguments" is not valid JSON ({exc.msg})') from None
        except RecursionError:
            raise ToolCallError(f'{where}: "arguments" is nested too deeply') from None
    if not isinstance(args, dict):
        raise ToolCallError(f'{where}: "arguments" must be a JSON object')
    return obj["name"], args


def tool_call_blocks(text: str) -> list[str]:
    """The contents of the ``<tool_call>...</tool_call>`` blocks of ``text``, left to right.

    Linear time by construction: one left-to-right scan with ``str.find``, each search starting
    where the previous one ended (no regular expression, so nothing backtracks: a lazy
    ``<tool_call>(.*?)</tool_call>`` rescans the rest of the text from every unclosed opening,
    quadratic in ``"<tool_call>" * n``). Every character is looked at by at most three searches:
    the one for the next opening, the one for its closing, and the check that no opening lies
    between them. An opening without its closing (or a second opening before it) raises
    :class:`ToolCallError`.
    """
    blocks: list[str] = []
    pos = 0
    while (start := text.find(OPEN_TAG, pos)) != -1:
        body = start + len(OPEN_TAG)
        end = text.find(CLOSE_TAG, body)
        if end == -1 or text.find(OPEN_TAG, body, end) != -1:
            raise ToolCallError("a <tool_call> block is not closed with </tool_call>")
        blocks.append(text[body:end])
        pos = end + len(CLOSE_TAG)
    return blocks


def parse_tool_calls(text: str) -> list[tuple[str, dict[str, Any]]]:
    """The tool calls in a reply, as (name, arguments); [] when the reply calls no tool.

    ``<tool_call>...</tool_call>`` blocks (each one JSON object) take precedence; an opened
    but unclosed block, or a block that is not a call, raises :class:`ToolCallError`.
    Without blocks, the first JSON object in the text that has a ``"name"`` is the call (among the
    first 256 places an object could start). JSON nested too deeply is a :class:`ToolCallError`.
    """
    if not isinstance(text, str):
        raise ToolCallError("the reply is not text")
    blocks = tool_call_blocks(text)
    if blocks:
        calls = []
        for k, block in enumerate(blocks):
            try:
                obj = json.loads(block.strip())
            except json.JSONDecodeError as exc:
                raise ToolCallError(f"tool call {k + 1} is not valid JSON ({exc.msg})") from None
            except RecursionError:
                raise ToolCallError(f"tool call {k + 1} is nested too deeply") from None
            calls.append(_one_call(obj, f"tool call {k + 1}"))
        return calls
    decoder = json.JSONDecoder()
    starts = (m.start() for m in _JSON_START_RE.finditer(text))  # an object with a key opens with {"
    for start in itertools.islice(starts, _MAX_JSON_ATTEMPTS):  # bounded: pathological replies stay cheap
        try:
            obj, _ = decoder.raw_decode(text, start)
        except (json.JSONDecodeError, RecursionError):
            continue
        if isinstance(obj, dict) and "name" in obj:
            return [_one_call(obj, "tool call")]
    return []


class ToolEnv(Env):
    """An environment whose public methods (defined on the subclass) are its tools.

    Subclasses implement ``reset(**task_params) -> str`` and the tools; override
    ``get_reward`` / ``is_done`` / ``episode_end`` as needed. ``max_turns`` bounds the
    replies (truncation, ``MAX_TURNS``). Rewards come at the end (0 on earlier turns).
    """

    max_turns: int = 8
    describe_tools: ClassVar[bool] = True
    """Also list the tools and the call format in the system prompt."""
    max_reply_chars: ClassVar[int] = 8000
    """The longest tool reply put into the conversation (longer ones are cut, saying how much)."""

    def __init__(self, task: Task, **options: Any) -> None:
        super().__init__(task, **options)
        self.turns = 0
        self.over = False
        self.final_text: str | None = None
        """The reply that ended the episode without a tool call (the final answer), for ``get_reward``."""

    # ---- what a subclass writes
    def reset(self, **params: Any) -> str:
        """Start the episode from the task's params; return the opening user text."""
        raise NotImplementedError(f"{type(self).__name__} must define reset(**task_params) -> str")

    def get_reward(self) -> float:
        """The episode's reward, read when it ends."""
        return 0.0

    def is_done(self) -> bool:
        """The task ended by itself (e.g. the game is over)."""
        return False

    def episode_end(self) -> tuple[float, StopReason, bool]:
        """(reward, stop reason, truncated) when the episode ends; default: success iff reward > 0."""
        reward = float(self.get_reward())
        return reward, StopReason.SUCCESS if reward > 0 else StopReason.FAILURE, False

    def bounded_reply(self, out: Any) -> str:
        """A tool's return value as its reply message: at most :attr:`max_reply_chars` characters (a
        tool that repeats its arguments must not put a 500 kB argument into the next prompt)."""
        return echo(out, self.max_reply_chars)

    # ---- the tools
    def tool_target(self) -> Any:
        """The object whose public methods are the tools (this environment)."""
        return self

    def tool_functions(self) -> dict[str, Callable[..., Any]]:
        """Tool name → bound method: the public methods the subclasses define (not Env's hooks)."""
        target = self.tool_target()
        names: list[str] = []
        if target is self:
            for klass in type(self).__mro__:
                if klass is ToolEnv:
                    break
                names += [
                    n
                    for n, v in vars(klass).items()
                    if inspect.isfunction(v)
                    and not n.startswith("_")
                    and n not in RESERVED
                    and not hasattr(ToolEnv, n)
                    and n not in names
                ]
        else:
            names = [
                n
                for n in dir(target)
                if not n.startswith("_") and n not in RESERVED and inspect.ismethod(getattr(target, n))
            ]
        return {n: getattr(target, n) for n in sorted(names)}

    def tools(self) -> list[dict[str, Any]]:
        from transformers.utils import get_json_schema

        return [get_json_schema(fn) for fn in self.tool_functions().values()]

    # ---- Env
    def system_prompt(self) -> str:
        lines = [
            "You can call tools. Call a tool by writing exactly:",
            '<tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>',
            "One call per reply. Reply without a tool call when you are done.",
            "Tools:",
        ]
        for schema in self.tools():
            fn = schema["function"]
            args = ", ".join(fn.get("parameters", {}).get("properties", {}))
            lines.append(f"- {fn['name']}({args}): {fn.get('description', '')}")
        return "\n".join(lines)

    def initial_messages(self) -> list[Message]:
        opening = self.reset(**self.task.params)
        messages: list[Message] = []
        if self.describe_tools:
            messages.append({"role": "system", "content": self.system_prompt()})
        return messages + [{"role": "user", "content": str(opening)}]

    def step(self, action_text: str) -> StepResult:
        if self.over:
            raise RuntimeError(f"{type(self).__name__} episode {self.task.task_id!r} is over; build a new env")
        self.turns += 1
        try:
            calls = parse_tool_calls(action_text)
            fns = self.tool_functions()
            bound = []
            for name, args in calls:
                if name not in fns:
                    raise ToolCallError(f"unknown tool {echo(name)!r}; tools: {', '.join(fns)}")
                try:
                    inspect.signature(fns[name]).bind(**args)
                except TypeError as exc:
                    raise ToolCallError(f"tool {name!r}: {echo(exc)}") from None
                bound.append((name, args))
        except ToolCallError as exc:
            self.over = True
            return StepResult(
                [],
                reward=self.failure_reward,
                terminated=True,
                stop_reason=StopReason.MALFORMED,
                metrics={"malformed": 1.0, "tool_calls": 0.0, "turns": float(self.turns)},
                assistant_message={"role": "assistant", "content": action_text, "error": str(exc)},
            )
        message = tool_call_message(action_text, bound) if bound else None
        replies: list[Message] = []
        for name, args in bound:
            try:
                out = fns[name](**args)
            except Exception as exc:  # noqa: BLE001 - the tool's own error is its reply (TRL's convention)
                out = f"Error: {echo(exc)}"
            replies.append({"role": "tool", "name": name, "content": self.bounded_reply(out)})
            if self.is_done():
                break
        metrics = {"malformed": 0.0, "tool_calls": float(len(bound)), "turns": float(self.turns)}
        if not bound or self.is_done():  # the final answer, or the task ended itself
            self.over = True
            self.final_text = None if bound else action_text
            reward, reason, truncated = self.episode_end()
            return StepResult(
                [],
                reward=reward,
                terminated=not truncated,
                truncated=truncated,
                stop_reason=reason,
                metrics=metrics,
                assistant_message=message,
            )
        if self.turns >= self.max_turns:
            self.over = True
            return StepResult(
                [],
                reward=self.episode_end()[0],
                truncated=True,
                stop_reason=StopReason.MAX_TURNS,
                metrics=metrics,
                assistant_message=message,
            )
        return StepResult(replies, reward=0.0, metrics=metrics, assistant_message=message)


def tool_env_from_factory(
    factory: Callable[[], Any],
    *,
    name: str,
    max_turns: int = 8,
    done: Callable[[Any], bool] | None = None,
    failure_reward: float = 0.0,
) -> type[ToolEnv]:
    """A :class:`ToolEnv` class around a TRL ``environment_factory`` class (or any no-argument callable).

    The factory's object gives ``reset(**row)`` (it receives the task's params), its public
    methods are the tools, ``get_reward()`` the reward; ``done(obj)`` tells when the task
    ended by itself (default: never; the episode ends when the model stops calling tools);
    ``failure_reward`` is the reward of a malformed call.
    """

    class FactoryToolEnv(ToolEnv):
        def __init__(self, task: Task, **options: Any) -> None:
            super().__init__(task, **options)
            self.target = factory()

        def tool_target(self) -> Any:
            return self.target

        def reset(self, **params: Any) -> str:
            return self.target.reset(**params)

        def get_reward(self) -> float:
            return float(self.target.get_reward()) if callable(getattr(self.target, "get_reward", None)) else 0.0

        def is_done(self) -> bool:
            return bool(done(self.target)) if done is not None else False

    FactoryToolEnv.name = name
    FactoryToolEnv.max_turns = max_turns
    FactoryToolEnv.failure_reward = failure_reward
    FactoryToolEnv.__name__ = FactoryToolEnv.__qualname__ = f"ToolEnv[{getattr(factory, '__name__', name)}]"
    return FactoryToolEnv
