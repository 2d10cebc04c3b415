"""The credit audit on recorded episodes: the audited episodes come from a record file (written by TRL,
verl, verifiers or turnrl), the continuations from the config's sampler (any backend).

Each record's ``task_id`` must name a task of the config's split: the ground truth replays the record's
``action_text`` through a fresh environment of that task (:mod:`turnrl.audit.replay`), so the records
must come from the config's environment and tasks, and their token ids from the sampler's tokenizer
(``replay_exact_frac`` reports how often a replayed context equals the recorded one).
"""

from __future__ import annotations

from pathlib import Path

from turnrl.records import RecordError, episode_of, iter_records
from turnrl.types import Episode, Task


def recorded_episodes(path: Path, tasks: list[Task], n: int, split: str) -> tuple[list[Task], list[Episode]]:
    """The first ``n`` episodes of the record file ``path`` and their tasks (from ``tasks``, the config's
    ``split``); a record whose task is not there is one error naming its line."""
    by_id = {t.task_id: t for t in tasks}
    chosen: list[Task] = []
    audited: list[Episode] = []
    for lineno, rec in iter_records(path):
        if len(audited) == n:
            break
        task = by_id.get(rec.task_id)
        if task is None:
            raise RecordError(
                f"{path}:{lineno}: task_id: {rec.task_id!r} is not one of the {len(tasks)} tasks of the config's"
                f" {split} split; audit records of the config's environment and tasks (--split, data.*_file)"
            )
        chosen.append(task)
        audited.append(episode_of(rec))
    if not audited:
        raise RecordError(f"{path}: holds no record; nothing to audit")
    return chosen, audited
