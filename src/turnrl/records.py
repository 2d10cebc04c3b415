"""The rollout-record contract: one versioned JSONL record per episode, that turnrl writes and reads
and that any framework training elsewhere (TRL, verl, verifiers; docs/integrations.md) can write.

A record file is UTF-8 JSONL, one JSON object per line, one line per episode::

    {"schema": "turnrl.records/1", "episode_id": "s0-t3-1", "task_id": "t3", "group_id": "s0-t3",
     "branch": [], "prompt": "Guess a number", "reward": 1.0, "terminated": true, "truncated": false,
     "stop_reason": "success", "metrics": {}, "source": "trl",
     "turns": [{"index": 0, "context": "extend", "prompt_ids": [1, 2, 3], "action_ids": [10, 11],
                "action_logprobs": [-0.4, -1.2], "action_text": "50", "observation": "higher",
                "reward": 0.0, "policy_version": 7, "finish_reason": "stop", "state_key": null,
                "advantage": null}]}

Episode fields: ``schema`` (required, exactly :data:`SCHEMA`: a reader refuses a version it does not
know), ``episode_id`` (unique in the file), ``task_id``, ``group_id`` (the episodes sampled for one
task in one step: a GRPO group, or one tree), ``branch`` (the leaf's path in its tree, ``[i, j]`` =
first-turn variant i, continuation j; ``[]`` for flat groups; unique within a group), ``prompt`` (the
task's opening text), ``reward`` (the final reward: the episode's return), ``terminated`` /
``truncated`` (the task ended / a horizon cut it; never both), ``stop_reason`` (one of
:class:`~turnrl.types.StopReason` or null), ``metrics`` (name → finite number), ``source`` (who wrote
the record: ``turnrl``, ``trl``, ``verifiers``, ...).

Turn fields: ``index`` (0, 1, ... in order), ``context`` and ``prompt_ids`` (below), ``action_ids``
(the sampled token ids, at least one), ``action_logprobs`` (the sampler's log-prob of each, finite,
≤ 0), ``action_text`` (the decoded reply: the credit audit replays it), ``observation`` (the
environment's reply text), ``reward`` (this turn's reward, or null), ``policy_version`` (the sampler
weights' version, ≥ 0), ``finish_reason`` (``stop``: the end-of-turn token was sampled; ``length``),
``state_key`` (the environment's state key, canonical JSON, or null: equal keys in a group = the same
state, GiGPO's anchor), ``advantage`` (the advantage the turn is trained with, null = not trained:
``turnrl credit`` fills it), and optionally ``prompt_sources`` (``[[source, count], ...]`` over the
turn's whole context) and ``topk_ids`` / ``topk_logprobs`` (one row per action token).

Tokens and masks: the episode's token sequence is, turn by turn, ``prompt_ids`` (loss mask 0: system,
user, environment and template tokens) then ``action_ids`` (loss mask 1 where the turn's advantage is
not null). With ``context: "extend"`` (the default) a turn's ``prompt_ids`` are the tokens after the
previous turn's action (turn 0: the whole prompt), so a record is linear in the episode's length;
``"full"`` marks a turn whose whole context is given because it does not extend the previous turn
(a template that strips earlier thinking). :func:`sequence` gives the ids and the mask.

Reading (:func:`read_records`, :func:`iter_records`) opens a regular file only (a FIFO, device or
directory is refused; the size is checked on the open descriptor) of at most :data:`MAX_FILE_BYTES`,
streams lines of at most :data:`MAX_RECORD_BYTES`, types every field (pydantic, strict: no string for
a number, no unknown key), holds each record to the contract above and the file to unique episode
ids, one task per group and unique leaf paths. A bad record raises :class:`RecordError` with one line:
``FILE:LINE: FIELD: what is wrong``. (The opening is this module's :func:`_open_regular`, written to be
replaced by the project's one regular-file reader once ``turnrl.bounded.open_regular`` is on main.)
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from turnrl.bounded import short_repr
from turnrl.rundir import append_text, atomic_write_text
from turnrl.types import SOURCES, Episode, StopReason, Turn

SCHEMA = "turnrl.records/1"
"""The version of the contract this module writes and reads."""
MAX_RECORD_BYTES = 64 << 20
"""Longest line (one episode record) read: 64 MiB."""
MAX_FILE_BYTES = 16 << 30
"""Largest record file read: 16 GiB."""
MAX_RECORDS = 1 << 20
"""Most records in one file (credit holds a file's episodes in memory at once)."""
MAX_TURNS = 4096
"""Most turns in one record."""
MAX_CONTEXT_TOKENS = 1 << 24
"""Most context tokens of one record summed over its turns (an Episode holds each turn's whole context:
a record linear in its length must not expand into a quadratic one past this, 16,777,216)."""
MAX_TOKEN_ID = (1 << 31) - 1
MAX_TEXT = 1 << 24
"""Longest text field (16 Mi characters)."""

_STRICT = ConfigDict(extra="forbid", strict=True)
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
LogProb = Annotated[float, Field(le=0, allow_inf_nan=False)]
Name = Annotated[str, Field(max_length=1000)]
Text = Annotated[str, Field(max_length=MAX_TEXT)]


class RecordError(ValueError):
    """A record file that breaks the contract; the message is one line, ``FILE:LINE: FIELD: problem``."""


class TurnRecord(BaseModel):
    """One turn of an episode record (the module doc lists the fields)."""

    model_config = _STRICT

    index: int = Field(ge=0)
    context: Literal["extend", "full"] = "extend"
    prompt_ids: list[TokenId]
    action_ids: list[TokenId] = Field(min_length=1)
    action_logprobs: list[LogProb]
    action_text: Text = ""
    observation: Text | None = None
    reward: Finite | None = None
    policy_version: int = Field(ge=0)
    finish_reason: Literal["stop", "length"] = "stop"
    state_key: Text | None = None
    advantage: Finite | None = None
    prompt_sources: list[tuple[Literal[SOURCES], Annotated[int, Field(ge=0)]]] | None = None  # type: ignore[valid-type]
    topk_ids: list[list[TokenId]] | None = None
    topk_logprobs: list[list[LogProb]] | None = None


class EpisodeRecord(BaseModel):
    """One episode record (the module doc lists the fields)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    schema_: Literal["turnrl.records/1"] = Field(alias="schema")
    episode_id: Name = Field(min_length=1)
    task_id: Name
    group_id: Name = ""
    branch: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=64)
    prompt: Text = ""
    reward: Finite
    terminated: bool
    truncated: bool
    stop_reason: StopReason | None = None
    metrics: dict[Name, Finite] = Field(default_factory=dict)
    source: Name = "turnrl"
    turns: list[TurnRecord] = Field(min_length=1, max_length=MAX_TURNS)


def _field(loc: Iterable[Any]) -> str:
    """``("turns", 0, "index")`` → ``turns[0].index``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + str(part)
    return out or "the record"


def _problems(rec: EpisodeRecord) -> list[tuple[str, str]]:
    """What the types cannot say: (field, problem) for every break of the contract within a record."""
    out: list[tuple[str, str]] = []
    lengths = _context_lengths(rec.turns)
    if sum(lengths) > MAX_CONTEXT_TOKENS:
        out.append(("turns", f"the turns' contexts add up to {sum(lengths):,} tokens; at most {MAX_CONTEXT_TOKENS:,}"))
    if rec.terminated and rec.truncated:
        out.append(("truncated", "an episode is not both terminated and truncated"))
    for k, t in enumerate(rec.turns):
        at = f"turns[{k}]"
        if t.index != k:
            out.append((f"{at}.index", f"is {t.index}; turns are numbered 0, 1, ... in order (expected {k})"))
        if len(t.action_logprobs) != len(t.action_ids):
            out.append(
                (f"{at}.action_logprobs", f"{len(t.action_logprobs)} log-probs for {len(t.action_ids)} action ids")
            )
        if (t.topk_ids is None) != (t.topk_logprobs is None):
            out.append((f"{at}.topk_ids", "topk_ids and topk_logprobs come together"))
        elif t.topk_ids is not None and t.topk_logprobs is not None:
            widths = [len(r) for r in t.topk_ids]
            if len(t.topk_ids) != len(t.action_ids) or widths != [len(r) for r in t.topk_logprobs]:
                out.append((f"{at}.topk_ids", "needs one row per action token, each as long as its topk_logprobs row"))
        if t.prompt_sources is not None:
            context = lengths[k]
            covered = sum(n for _, n in t.prompt_sources)
            if covered != context:
                out.append((f"{at}.prompt_sources", f"cover {covered} tokens of a {context}-token context"))
    return out


def _context_lengths(turns: list[TurnRecord]) -> list[int]:
    """The length of every turn's whole context (``extend``: the previous sequence + its ``prompt_ids``)."""
    out, before = [], 0  # before: the sequence length up to the end of the previous action
    for t in turns:
        n = len(t.prompt_ids) + (before if t.context == "extend" else 0)
        out.append(n)
        before = n + len(t.action_ids)
    return out


def parse_record(line: str | bytes) -> EpisodeRecord:
    """One record line, typed and held to the contract; ValueError ``FIELD: problem`` (the first one)."""
    try:
        rec = EpisodeRecord.model_validate_json(line)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        where, kind, got = _field(first["loc"]), first["type"], first.get("input")
        if kind == "json_invalid":
            msg = f"not a JSON object ({first['msg']})"
        elif where == "schema":
            msg = (
                "missing: every record names its version"
                if kind == "missing"
                else f"{short_repr(got)} is not a version this turnrl reads"
            )
            msg += f' ("schema": "{SCHEMA}")'
        elif kind == "extra_forbidden":
            msg = "not a field of a turnrl record (docs/integrations.md lists them)"
        else:
            shown = "" if isinstance(got, dict | list) or kind == "missing" else f" (got {short_repr(got)})"
            msg = first["msg"] + shown
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ValueError(f"{where}: {msg}{more}") from None
    problems = _problems(rec)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ValueError(f"{problems[0][0]}: {problems[0][1]}{more}")
    return rec


# ----------------------------------------------------------------------------- episodes <-> records


def episode_of(rec: EpisodeRecord) -> Episode:
    """The :class:`~turnrl.types.Episode` a (valid) record describes; every turn's context rebuilt whole."""
    turns = []
    before: list[int] = []  # the sequence up to the end of the previous action
    for t in rec.turns:
        context = before + t.prompt_ids if t.context == "extend" else list(t.prompt_ids)
        before = context + t.action_ids
        turns.append(
            Turn(
                index=t.index,
                prompt_ids=context,
                action_ids=list(t.action_ids),
                action_logprobs=list(t.action_logprobs),
                action_text=t.action_text,
                observation=t.observation,
                reward=t.reward,
                policy_version=t.policy_version,
                finish_reason=t.finish_reason,
                advantage=t.advantage,
                topk_ids=t.topk_ids,
                topk_logprobs=t.topk_logprobs,
                state_key=t.state_key,
                prompt_sources=None if t.prompt_sources is None else [list(p) for p in t.prompt_sources],
            )
        )
    return Episode(
        episode_id=rec.episode_id,
        task_id=rec.task_id,
        turns=turns,
        reward=rec.reward,
        terminated=rec.terminated,
        truncated=rec.truncated,
        stop_reason=rec.stop_reason,
        metrics=dict(rec.metrics),
        group_id=rec.group_id,
        branch=list(rec.branch),
        prompt=rec.prompt,
    )


def record_of(episode: Episode, source: str = "turnrl") -> dict[str, Any]:
    """The record of ``episode`` as a JSON-able dict (each turn's context as the tokens after the previous
    turn's action where it extends it, else whole)."""
    turns = []
    before: list[int] = []
    for t in episode.turns:
        extends = bool(before) and t.prompt_ids[: len(before)] == before
        row: dict[str, Any] = {
            "index": t.index,
            "context": "extend" if extends or not before else "full",
            "prompt_ids": t.prompt_ids[len(before) :] if extends else list(t.prompt_ids),
            "action_ids": list(t.action_ids),
            "action_logprobs": [float(x) for x in t.action_logprobs],
            "action_text": t.action_text,
            "observation": t.observation,
            "reward": None if t.reward is None else float(t.reward),
            "policy_version": t.policy_version,
            "finish_reason": t.finish_reason,
            "state_key": t.state_key,
            "advantage": None if t.advantage is None else float(t.advantage),
        }
        for key in ("prompt_sources", "topk_ids", "topk_logprobs"):
            if getattr(t, key) is not None:
                row[key] = getattr(t, key)
        turns.append(row)
        before = t.sequence_ids
    return {
        "schema": SCHEMA,
        "episode_id": episode.episode_id,
        "task_id": episode.task_id,
        "group_id": episode.group_id,
        "branch": list(episode.branch),
        "prompt": episode.prompt,
        "reward": float(episode.reward),
        "terminated": bool(episode.terminated),
        "truncated": bool(episode.truncated),
        "stop_reason": None if episode.stop_reason is None else str(episode.stop_reason),
        "metrics": {k: float(v) for k, v in episode.metrics.items()},
        "source": source,
        "turns": turns,
    }


def sequence(episode: Episode) -> tuple[list[int], list[int]]:
    """The episode's token sequence and its loss mask (1 on the action tokens of turns with an advantage),
    for episodes whose turns extend each other (the common case; else ValueError naming the turn)."""
    ids: list[int] = []
    mask: list[int] = []
    for t in episode.turns:
        if t.prompt_ids[: len(ids)] != ids:
            raise ValueError(f"episode {episode.episode_id}: turn {t.index}'s context does not extend the previous")
        new = t.prompt_ids[len(ids) :]
        ids += new + t.action_ids
        mask += [0] * len(new) + [int(t.advantage is not None)] * len(t.action_ids)
    return ids, mask


def write_records(path: str | Path, episodes: Iterable[Episode], source: str | Sequence[str] = "turnrl") -> Path:
    """Write ``episodes`` as a record file, atomically (a kill leaves the old file or the new one).

    ``source``: who wrote them (one name, or one per episode)."""
    path = Path(path)
    atomic_write_text(path, record_lines(episodes, source))
    return path


def append_records(path: str | Path, episodes: Iterable[Episode], source: str | Sequence[str] = "turnrl") -> Path:
    """Append ``episodes`` to a record file in one write, never through a link (a trainer's running log)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    append_text(path, record_lines(episodes, source))
    return path


def record_lines(episodes: Iterable[Episode], source: str | Sequence[str] = "turnrl") -> str:
    """The JSONL text of ``episodes``. Each record is checked by :func:`parse_record` first, so turnrl never
    writes a file it would refuse; a bad episode raises ValueError naming it and the field."""
    lines = []
    for k, ep in enumerate(episodes):
        who = source if isinstance(source, str) else source[k]
        try:
            text = json.dumps(record_of(ep, who), allow_nan=False, separators=(",", ":"))
        except ValueError:
            bad = next((k for k, v in ep.metrics.items() if not math.isfinite(v)), "reward")
            raise ValueError(f"episode {ep.episode_id}: {bad} is not finite; a record holds finite numbers") from None
        try:
            parse_record(text)
        except ValueError as exc:
            raise ValueError(f"episode {ep.episode_id}: {exc}") from None
        lines.append(text + "\n")
    return "".join(lines)


# ----------------------------------------------------------------------------- reading, bounded


def _open_regular(path: Path) -> int:
    """A read-only descriptor of ``path`` if it is a regular file of at most :data:`MAX_FILE_BYTES`.

    The user named the path, so a link to a regular file is followed; the type and size are checked on
    the open descriptor (``fstat``), and the open never blocks on a FIFO (``O_NONBLOCK``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise RecordError(f"{path}: no such file; give a record file (JSONL)") from None
        raise
    info = os.fstat(fd)
    problem = None
    if stat.S_ISDIR(info.st_mode):
        problem = "is a directory; give a record file (JSONL)"
    elif not stat.S_ISREG(info.st_mode):
        problem = "is not a regular file (a FIFO, socket or device); only plain files are read"
    elif info.st_size > MAX_FILE_BYTES:
        problem = f"is {info.st_size:,} bytes; a record file is read up to {MAX_FILE_BYTES:,}: split it"
    if problem:
        os.close(fd)
        raise RecordError(f"{path}: {problem}")
    os.set_blocking(fd, True)
    return fd


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of a record file, streamed; a line over :data:`MAX_RECORD_BYTES` is refused."""
    with os.fdopen(_open_regular(path), "rb") as fh:
        lineno = 0
        while line := fh.readline(MAX_RECORD_BYTES + 2):
            lineno += 1
            if len(line.rstrip(b"\r\n")) > MAX_RECORD_BYTES:
                raise RecordError(f"{path}:{lineno}: a line over {MAX_RECORD_BYTES:,} bytes; no record is that long")
            yield lineno, line


def iter_records(path: str | Path) -> Iterator[tuple[int, EpisodeRecord]]:
    """(line number, record) of every non-blank line, each held to the contract and the file to its rules
    (unique episode ids, one task per group, unique leaf paths in a group); :class:`RecordError` names
    ``FILE:LINE: FIELD`` at the first break."""
    path = Path(path)
    ids: dict[str, int] = {}
    groups: dict[str, tuple[str, int]] = {}
    leaves: dict[tuple[str, tuple[int, ...]], int] = {}
    count = 0
    for lineno, line in _lines(path):
        if not line.strip():
            continue
        count += 1
        if count > MAX_RECORDS:
            raise RecordError(f"{path}:{lineno}: more than {MAX_RECORDS:,} records; split the file")
        try:
            rec = parse_record(line)
        except ValueError as exc:
            raise RecordError(f"{path}:{lineno}: {exc}") from None
        if rec.episode_id in ids:
            raise RecordError(
                f"{path}:{lineno}: episode_id: {short_repr(rec.episode_id)} is also on line {ids[rec.episode_id]};"
                " episode ids are unique in a file"
            )
        ids[rec.episode_id] = lineno
        task, first = groups.setdefault(rec.group_id, (rec.task_id, lineno))
        if task != rec.task_id:
            raise RecordError(
                f"{path}:{lineno}: task_id: {short_repr(rec.task_id)}, but group {short_repr(rec.group_id)} holds"
                f" task {short_repr(task)} (line {first}); a group is the episodes of one task"
            )
        if rec.branch:
            leaf = (rec.group_id, tuple(rec.branch))
            if leaf in leaves:
                raise RecordError(
                    f"{path}:{lineno}: branch: {rec.branch} is also the path of line {leaves[leaf]} in group"
                    f" {short_repr(rec.group_id)}; leaves of a tree have distinct paths"
                )
            leaves[leaf] = lineno
        yield lineno, rec


def read_records(path: str | Path) -> list[Episode]:
    """Every episode of a record file (:func:`iter_records`'s checks), in file order."""
    return [episode_of(rec) for _, rec in iter_records(path)]


__all__ = [
    "MAX_FILE_BYTES",
    "MAX_RECORDS",
    "MAX_RECORD_BYTES",
    "SCHEMA",
    "EpisodeRecord",
    "append_records",
    "RecordError",
    "TurnRecord",
    "episode_of",
    "iter_records",
    "parse_record",
    "read_records",
    "record_lines",
    "record_of",
    "sequence",
    "write_records",
]
