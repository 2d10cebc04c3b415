"""Rollout records: the contract between collection, credit, batching and reports.

Token-in/token-out: a turn's ``action_ids`` are exactly the ids the sampler
drew, and ``prompt_ids`` are every token the model saw before them (system
prompt, earlier turns, environment replies), none of which is trained. When a
turn's context extends the previous turn's sequence (the usual case), the whole
episode is the last turn's ``prompt_ids + action_ids``.

Trees: an episode of a branched rollout carries ``branch``, its path in the
tree (``[i, j]`` = first-turn variant i, continuation j). Leaves with the same
``group_id`` and the same ``branch[:k]`` share their first k turns token for
token.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Turn:
    """One assistant turn and the environment's reply to it."""

    index: int
    prompt_ids: list[int]
    """Every token before this action, as the model saw it (not trained)."""
    action_ids: list[int]
    """The sampled token ids (trained)."""
    action_logprobs: list[float]
    """Behavior (sampler) log-prob of each action token, ≤ 0."""
    action_text: str
    observation: str | None = None
    """The environment's reply text after this turn, if any."""
    reward: float | None = None
    """Per-turn reward (or per-turn score) when the environment gives one."""
    policy_version: int | None = None
    """Sampler weight version that produced the action."""
    finish_reason: str = "stop"
    """``stop`` (end-of-turn token sampled) or ``length`` (max tokens reached)."""
    advantage: float | None = None
    """The advantage this turn was trained with (filled in after credit; None = not trained)."""
    topk_ids: list[list[int]] | None = None
    """Optional: the sampler's top-k token ids per action position."""
    topk_logprobs: list[list[float]] | None = None
    """Optional: the sampler's log-probs of ``topk_ids``."""

    @property
    def sequence_ids(self) -> list[int]:
        return self.prompt_ids + self.action_ids


@dataclass
class Episode:
    """One rollout of one task."""

    episode_id: str
    task_id: str
    turns: list[Turn]
    reward: float
    terminated: bool
    truncated: bool
    stop_reason: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    group_id: str = ""
    """All episodes sampled for one task in one step share a group id."""
    branch: list[int] = field(default_factory=list)
    """Path in a branched tree (empty for flat groups)."""
    prompt: str = ""
    """The task's opening user text (for similarity baselines and reports)."""

    @property
    def parent(self) -> str | None:
        """The tree node this leaf descends from (``"i"`` for first-turn variant i)."""
        return "/".join(map(str, self.branch[:-1])) if len(self.branch) > 1 else None

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def success(self) -> bool:
        return self.stop_reason == "success"

    def validate(self) -> list[str]:
        """Every violation of the record contract, as messages (empty = valid)."""
        errors: list[str] = []
        if not self.episode_id:
            errors.append("episode_id is empty")
        if self.terminated and self.truncated:
            errors.append("episode is both terminated and truncated")
        if not math.isfinite(self.reward):
            errors.append(f"reward {self.reward!r} is not finite")
        for k, turn in enumerate(self.turns):
            where = f"turn {k}"
            if turn.index != k:
                errors.append(f"{where}: index {turn.index} breaks contiguity (expected {k})")
            if len(turn.action_logprobs) != len(turn.action_ids):
                errors.append(
                    f"{where}: {len(turn.action_ids)} action ids but {len(turn.action_logprobs)} log-probs"
                )
            bad = [lp for lp in turn.action_logprobs if not math.isfinite(lp) or lp > 0]
            if bad:
                errors.append(f"{where}: {len(bad)} log-probs not finite or > 0 (first {bad[0]!r})")
            if not turn.action_ids:
                errors.append(f"{where}: no action tokens")
            if turn.policy_version is None:
                errors.append(f"{where}: policy_version missing")
            if turn.finish_reason not in ("stop", "length"):
                errors.append(f"{where}: finish_reason {turn.finish_reason!r} not in stop/length")
            if turn.topk_ids is not None and len(turn.topk_ids) != len(turn.action_ids):
                errors.append(f"{where}: top-k rows do not match action tokens")
        return errors

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> Episode:
        obj = dict(obj)
        obj["turns"] = [Turn(**t) for t in obj["turns"]]
        return cls(**obj)


def new_prompt_lengths(episode: Episode) -> list[int]:
    """For each turn, how many of its context tokens are new (after the previous turn's action).

    Requires every turn's context to extend the previous turn's sequence, so the whole
    episode is one sequence: ``turns[-1].prompt_ids + turns[-1].action_ids``.
    """
    lengths: list[int] = []
    before: list[int] = []  # the sequence up to the end of the previous turn's action
    for turn in episode.turns:
        if turn.prompt_ids[: len(before)] != before:
            raise ValueError(
                f"episode {episode.episode_id}: turn {turn.index}'s context does not extend the previous"
                " turn (e.g. exclude_think); it must be trained as per-turn rows"
            )
        lengths.append(len(turn.prompt_ids) - len(before))
        before = turn.sequence_ids
    return lengths


def loss_mask(episode: Episode) -> tuple[list[int], list[int]]:
    """The whole episode as one sequence and its loss mask (1 on model tokens only)."""
    mask: list[int] = []
    for turn, n_new in zip(episode.turns, new_prompt_lengths(episode), strict=True):
        mask += [0] * n_new + [1] * len(turn.action_ids)
    last = episode.turns[-1]
    return last.prompt_ids + last.action_ids, mask


def write_jsonl(path: str | Path, records: Iterable[Episode], append: bool = False) -> None:
    """Write episodes as JSONL. A fresh file is written atomically (temp + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(r.to_dict()) + "\n" for r in records)
    if append:
        with path.open("a") as fh:
            fh.write(lines)
        return
    atomic_write_text(path, lines)


def read_jsonl(path: str | Path) -> list[Episode]:
    """Read episodes written by :func:`write_jsonl`."""
    out = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if line.strip():
            try:
                out.append(Episode.from_dict(json.loads(line)))
            except (json.JSONDecodeError, TypeError, KeyError) as exc:
                raise ValueError(f"{path}:{lineno}: not an episode record ({exc})") from exc
    return out


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write a file so that a kill leaves either the old or the new content, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; give the usual permissions
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """:func:`atomic_write_bytes` for text (UTF-8)."""
    atomic_write_bytes(path, text.encode("utf-8"))
