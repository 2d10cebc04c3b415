"""Chat messages ↔ token ids for one tokenizer: the only place that renders a chat template.

Token-in/token-out: the first context is the template's rendering of the opening
messages; each later context is the previous context, the sampled action ids,
and the environment's reply as the template's *token difference* (rendered with
and without it). Model text is never re-tokenized to recover model tokens.

Message content is plain text: a special-token string inside it (``<|im_end|>``
written by an environment, a tool or a task file) is encoded as the ordinary
tokens that spell it, never as the control token, so an observation cannot forge
a turn. Only the template's own markup yields control tokens (:func:`render_ids`).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from turnrl.types import SOURCES, Message, TokenIds, run_lengths

THINK_END = "</think>"


def strip_think(text: str) -> str:
    """Drop everything up to and including the last ``</think>``, then leading newlines.

    Used when re-rendering earlier assistant messages into a later turn's
    context (``model.exclude_think``). The leading newlines go as well, as
    Qwen3's chat template does when it hides past reasoning. Text without
    ``</think>`` is returned unchanged.
    """
    head, sep, tail = text.rpartition(THINK_END)
    return tail.lstrip("\n") if sep else text


def end_of_turn_ids(tokenizer) -> list[int]:
    """Token ids that end an assistant turn: the eos token and ``<|im_end|>`` when present."""
    ids = {tokenizer.eos_token_id}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(i for i in ids if i is not None)


_MARK = f"\ue000{secrets.token_hex(6)}:"  # private-use characters and a per-process nonce: not in any content
_MARK_RE = re.compile(re.escape(_MARK) + r"(\d+)\ue001")


def special_strings(tokenizer) -> list[str]:
    """The strings ``tokenizer`` encodes as control tokens (its special tokens), longest first."""
    found = set(getattr(tokenizer, "all_special_tokens", []) or [])
    found |= {t.content for t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values() if t.special}
    return sorted((t for t in found if t), key=lambda t: (-len(t), t))


def plain_ids(tokenizer, text: str) -> TokenIds:
    """``text`` as ordinary tokens: special-token strings spelled out (``split_special_tokens``), never control ids."""
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids
    if set(ids) & set(tokenizer.all_special_ids):  # a tokenizer that ignores the flag: one character at a time
        ids = [i for ch in text for i in tokenizer(ch, add_special_tokens=False, split_special_tokens=True).input_ids]
    return ids


def _mark_specials(messages: list[Message], specials: list[str]) -> tuple[list[Message], bool]:
    """``messages`` with every special-token string in a string content replaced by a marker naming it."""
    if not specials:
        return messages, False
    pattern = re.compile("|".join(map(re.escape, specials)))
    index = {t: k for k, t in enumerate(specials)}
    out, marked = [], False
    for m in messages:
        content = m.get("content")
        if isinstance(content, str) and pattern.search(content):
            m = {**m, "content": pattern.sub(lambda hit: f"{_MARK}{index[hit.group(0)]}\ue001", content)}
            marked = True
        out.append(m)
    return out, marked


def render_ids(
    tokenizer,
    messages: list[Message],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    **template_kwargs: Any,
) -> TokenIds:
    """Token ids of the chat template applied to ``messages`` (with the tool schemas ``tools``, if any).

    Special-token strings inside message contents are encoded as plain text (:func:`plain_ids`):
    the contents are rendered with a marker in their place, the template's text is encoded as
    usual (its control tokens kept) and each marker becomes the ordinary tokens of its string.
    Contents without special-token strings encode exactly as the template's text always did.
    """
    if tools:
        template_kwargs = {**template_kwargs, "tools": tools}
    specials = special_strings(tokenizer)
    messages, marked = _mark_specials(messages, specials)
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    if not marked:
        return tokenizer(text, add_special_tokens=False).input_ids
    ids: TokenIds = []
    for k, piece in enumerate(_MARK_RE.split(text)):  # text, marker index, text, marker index, ...
        if k % 2:
            ids += plain_ids(tokenizer, specials[int(piece)])
        elif piece:
            ids += tokenizer(piece, add_special_tokens=False).input_ids
    return ids


def _source(message: Message) -> str:
    role = message.get("role", "user")
    return role if role in SOURCES else "user"


@dataclass
class ChatTemplate:
    """How chat messages become tokens for one tokenizer."""

    tokenizer: Any
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    exclude_think: bool = False
    """Re-render earlier assistant messages without their thinking (:func:`strip_think`), so
    later contexts are re-rendered rather than extended."""

    def __post_init__(self) -> None:
        self.eot_ids = end_of_turn_ids(self.tokenizer)
        self._gen_suffix: TokenIds | None = None

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    def initial(self, messages: list[Message], tools: list[dict[str, Any]] | None = None) -> TokenIds:
        """The first context: the opening messages with a generation prompt (with ``exclude_think``, an
        assistant message among them without its thinking: a replayed prefix renders as it did live)."""
        return render_ids(self.tokenizer, self._shown(messages), True, tools, **self.template_kwargs)

    def _shown(self, messages: list[Message]) -> list[Message]:
        """``messages`` as rendered: with ``exclude_think``, assistant messages without their thinking."""
        if not self.exclude_think:
            return messages
        return [{**m, "content": strip_think(m["content"])} if m["role"] == "assistant" else m for m in messages]

    def initial_with_sources(
        self, messages: list[Message], tools: list[dict[str, Any]] | None = None
    ) -> tuple[TokenIds, list[list[Any]]]:
        """:meth:`initial` and the provenance of its tokens (run-length ``[[source, n], ...]``)."""
        ids = self.initial(messages, tools)
        return ids, run_lengths(self._sources(ids, [], self._shown(messages), tools))

    def _generation_suffix(self) -> TokenIds:
        """The tokens a generation prompt appends (rendered once; e.g. ``<|im_start|>assistant\n``)."""
        if self._gen_suffix is None:
            probe = [{"role": "user", "content": "x"}]
            with_prompt = render_ids(self.tokenizer, probe, True, **self.template_kwargs)
            without = render_ids(self.tokenizer, probe, False, **self.template_kwargs)
            ok = with_prompt[: len(without)] == without
            self._gen_suffix = with_prompt[len(without) :] if ok else []
        return self._gen_suffix

    def _sources(
        self,
        ids: TokenIds,
        history: list[Message],
        new: list[Message],
        tools: list[dict[str, Any]] | None,
        start: int | None = None,
    ) -> list[str]:
        """Sources of ``ids[start:]`` (``start`` = the length of ``history``'s rendering), the tokens the
        ``new`` messages and the generation prompt (counted as ``assistant``) add. Each message's span is
        found by rendering one more message; the last one's by taking the generation prompt off the end.
        A template whose partial renderings are not prefixes gives the whole span to the last message."""
        if start is None:
            start = len(render_ids(self.tokenizer, history, False, tools, **self.template_kwargs)) if history else 0
        out: list[str] = []
        at = start
        suffix = self._generation_suffix()
        for k, message in enumerate(new):
            if k == len(new) - 1 and suffix and ids[len(ids) - len(suffix) :] == suffix:
                end = len(ids) - len(suffix)
            else:
                part = render_ids(self.tokenizer, history + new[: k + 1], False, tools, **self.template_kwargs)
                end = len(part) if part == ids[: len(part)] else -1
            if end < at:
                return out + [_source(new[-1])] * (len(ids) - at)
            out += [_source(message)] * (end - at)
            at = end
        return out + ["assistant"] * (len(ids) - at)

    def decode(self, ids: TokenIds) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode_reply(self, text: str) -> TokenIds:
        """A scripted reply's tokens: its encoding closed by the end-of-turn token."""
        return self.tokenizer(text, add_special_tokens=False).input_ids + [self.eot_ids[-1]]

    def extend(
        self,
        context: TokenIds,
        action_ids: TokenIds,
        history: list[Message],
        reply: list[Message],
        tools: list[dict[str, Any]] | None = None,
    ) -> TokenIds:
        """The next turn's context: ``context + action + environment tokens``.

        ``history`` ends with the assistant message just sampled; ``reply`` are the
        environment's messages. The environment tokens are the template's rendering
        of ``history + reply`` (with a generation prompt) minus its rendering of
        ``history``, preceded by whatever the template puts after the end-of-turn token
        (e.g. a newline), and by the end-of-turn token itself when the action was cut
        by the token limit.
        """
        return self.extend_with_sources(context, None, action_ids, history, reply, tools)[0]

    def extend_with_sources(
        self,
        context: TokenIds,
        sources: list[list[Any]] | None,
        action_ids: TokenIds,
        history: list[Message],
        reply: list[Message],
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[TokenIds, list[list[Any]] | None]:
        """:meth:`extend`, and the provenance of the new context when ``sources`` (that of ``context``) is
        given: the action and the template's end-of-turn bridge are ``assistant``, then each reply message."""
        kw = self.template_kwargs
        if self.exclude_think:
            stripped = self._shown(history + reply)
            ids = render_ids(self.tokenizer, stripped, True, tools, **kw)
            return ids, (run_lengths(self._sources(ids, [], stripped, tools)) if sources is not None else None)
        before = render_ids(self.tokenizer, history, False, tools, **kw)
        after = render_ids(self.tokenizer, history + reply, True, tools, **kw)
        if after[: len(before)] != before:
            raise ValueError(
                "the chat template does not render the conversation as a prefix of its continuation;"
                " token-in/token-out collection needs a prefix-stable template"
            )
        last_eot = max((k for k, t in enumerate(before) if t in self.eot_ids), default=None)
        if last_eot is None:
            raise ValueError("the chat template rendered an assistant message without an end-of-turn token")
        bridge = before[last_eot + 1 :]
        if not action_ids or action_ids[-1] not in self.eot_ids:  # cut by max_tokens: close the turn
            bridge = [before[last_eot]] + bridge
        ids = context + action_ids + bridge + after[len(before) :]
        if sources is None:
            return ids, None
        new = self._sources(after, history, reply, tools, start=len(before))
        flat = [src for src, n in sources for _ in range(n)] + ["assistant"] * (len(action_ids) + len(bridge)) + new
        return ids, run_lengths(flat)


@dataclass(frozen=True)
class ChatSettings:
    """How a run renders its chats, resolved once (``model.chat_template_kwargs``, ``model.exclude_think``).

    Training, its held-out evaluation, ``turnrl eval`` and ``turnrl credit-audit`` all build their
    template with :meth:`template` from this one object, so one config gives one context everywhere.
    """

    template_kwargs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    exclude_think: bool = False

    def template(self, tokenizer: Any) -> ChatTemplate:
        return ChatTemplate(tokenizer, dict(self.template_kwargs), exclude_think=self.exclude_think)
