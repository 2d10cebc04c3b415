"""What each turn's context holds (``rollout.context``): the whole history, or the task and the last turns.

A long episode (a 50-step walk, a tool loop) outgrows the model's context and makes every turn cost the
whole history. With ``window`` the context of turn t is the task — the opening messages the environment
gave (system prompt, task text, few-shot examples) — followed by the last ``k`` turns, each an assistant
message and the environment's reply to it; with ``summary`` the environment's
:meth:`~turnrl.envs.base.Env.context_summary` (a user message) stands between the two for the turns left
out. Nothing is dropped until turn k + 1, so the first k + 1 contexts are the full ones.

Once a turn is dropped, a context is no longer the previous one extended: it is rendered whole from its
messages (``ChatTemplate.initial_with_sources``, as a replayed prefix is), and ``Turn.prompt_ids`` holds
exactly those tokens, so such runs train one row per turn on what the sampler saw
(``RunConfig.per_turn_rows``) and the log-probs the trainer recomputes are the sampler's. Anchor states
(gigpo) are keyed on the environment's ``state_key()``, never on the text, so a window changes no key.
"""

from __future__ import annotations

from typing import Literal

from turnrl.types import Message

ContextMode = Literal["full", "window", "summary"]
SUMMARY_HEADER = "Summary of the earlier turns (left out of this context):"


def turn_starts(messages: list[Message], opening: int) -> list[int]:
    """Indices of the assistant messages after the first ``opening`` messages: where each turn begins."""
    return [i for i in range(opening, len(messages)) if messages[i].get("role") == "assistant"]


def windowed(
    messages: list[Message], opening: int, turns: int, mode: ContextMode, summary: str | None = None
) -> list[Message] | None:
    """The messages the next context renders, or None when it is the whole history (mode ``full``, or no
    turn is left out yet: the context extends the previous one).

    ``messages``: the episode's history so far (ending with the environment's latest reply); ``opening``:
    how many of them the environment opened with (the task); ``turns``: k, the turns kept. Mode
    ``summary`` puts ``summary`` (required) as a user message between the task and the kept turns."""
    if mode == "full":
        return None
    starts = turn_starts(messages, opening)
    if len(starts) <= turns:
        return None
    kept = messages[starts[-turns] :]
    if mode == "window":
        return messages[:opening] + kept
    if summary is None:
        raise ValueError(
            "rollout.context: summary needs the environment's context_summary(), and this environment gives"
            " none (None); use rollout.context: window, or define context_summary() on the environment"
        )
    return messages[:opening] + [{"role": "user", "content": f"{SUMMARY_HEADER}\n{summary}"}] + kept
