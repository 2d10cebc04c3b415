"""Task files and the seeded task stream.

A task file is JSONL: one object per line with ``task_id`` and ``env``; every
other key goes into the task's ``params``. Bad lines raise
:class:`TaskFileError` naming the file, line and field — whatever is wrong with
the line (nesting past :data:`turnrl.bounded.MAX_DEPTH`, a ``params`` that is not
an object, a check of the environment that trips over an odd value). Training draws tasks
from an endless stream whose epochs are seeded permutations, so a resumed run
continues where it stopped.

A task file is data: it cannot choose code. :func:`check_task_file` holds a run's file to
the rules (issue 33): every line names the run's environment (the config's ``env.name``, or a
registered name of the same class; any other name is refused unread, never imported), says
the split the file is read as (or none), and has a ``task_id`` of its own.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

from turnrl.bounded import MAX_NODES, InputTooLarge, check_bounded, short_repr
from turnrl.types import SplitName, Task


class TaskFileError(ValueError):
    """A task file has a bad line; the message names the file, line and field."""


def read_json_lines(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``("file:line", object)`` for every non-blank line of a JSONL file.

    A line that is not a JSON object raises :class:`TaskFileError` naming the file and line.
    """
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise TaskFileError(f"task file {path} {what}; give a JSONL file (one task object per line)")
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TaskFileError(f"{where}: not valid UTF-8 (byte {exc.start}); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                check_bounded(obj, where, max_nodes=MAX_NODES)
            except json.JSONDecodeError as exc:
                raise TaskFileError(f"{where}: not valid JSON ({exc.msg}); each line must be one JSON object") from None
            except RecursionError:
                raise TaskFileError(f"{where}: the JSON nests too deeply; a task is a flat object") from None
            except InputTooLarge as exc:
                raise TaskFileError(f"{exc}; a task is a small object") from None
            if not isinstance(obj, dict):
                raise TaskFileError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            yield where, obj


def shipped_task_file(env_name: str, files: Mapping[str, str], split: str) -> Path:
    """The task file an environment ships for ``split`` (``turnrl/data/<files[split]>``), or one
    ``ValueError`` naming the splits it has."""
    if split not in files:
        raise ValueError(f"{env_name} has no split {split!r}; choose {' or '.join(files)}")
    return Path(str(resources.files("turnrl") / "data" / files[split]))


def write_task_files(out_dir: str | Path, files: Mapping[str, str], make: Callable[[str], list[Task]]) -> list[Path]:
    """Write each split's tasks (``make(split)``) as the JSONL task file ``out_dir/files[split]``, one line per
    task (``task_id``, ``env``, ``split`` and its params): how an environment rebuilds the files it ships."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, name in files.items():
        lines = [json.dumps({"task_id": t.task_id, "env": t.env, "split": split, **t.params}) for t in make(split)]
        (out / name).write_text("\n".join(lines) + "\n")
        paths.append(out / name)
    return paths


def load_task_file(
    path: str | Path, split: str | None = None, validate: Callable[[Task, str], None] | None = None
) -> list[Task]:
    """Read tasks from JSONL: one object per line with ``task_id`` and ``env``.

    Every other key goes into ``params`` (a ``params`` object is merged in as is).
    ``validate(task, "file:line")`` may check each task further (environment-specific fields).
    Raises :class:`TaskFileError` naming the file, line and field on bad input.
    """
    path = Path(path)
    if not path.exists():
        raise TaskFileError(f"task file {path} does not exist; check data.train_file/data.eval_file")
    tasks: list[Task] = []
    for where, obj in read_json_lines(path):
        for key in ("task_id", "env"):
            if not isinstance(obj.get(key), str) or not obj.get(key):
                raise TaskFileError(f"{where}: missing or empty field {key!r} (a string)")
        params = obj.pop("params", None)
        if params is not None and not isinstance(params, dict):
            raise TaskFileError(
                f"{where}: field 'params' must be a JSON object of task parameters, got {short_repr(params)}"
            )
        params = dict(params or {})
        task_id, env = obj.pop("task_id"), obj.pop("env")
        task_split = obj.pop("split", split or SplitName.TRAIN)
        if not isinstance(task_split, str):
            raise TaskFileError(f"{where}: field 'split' must be a string, got {short_repr(task_split)}")
        params.update(obj)
        task = Task(task_id=task_id, env=env, params=params, split=task_split, origin=where)
        if validate is not None:
            try:
                validate(task, where)
            except (TypeError, KeyError, AttributeError, IndexError, RecursionError) as exc:
                # an environment's check that trips over an odd value still names the line
                raise TaskFileError(f"{where}: bad task ({type(exc).__name__}: {str(exc)[:200]})") from None
        tasks.append(task)
    if not tasks:
        raise TaskFileError(f"{path}: no tasks found (the file is empty)")
    return tasks


def check_task_file(tasks: list[Task], *, env_name: str, split: str, names_env: Callable[[str], bool]) -> list[Task]:
    """The tasks of one task file held to the run's rules, each naming ``env_name`` from now on.

    ``names_env(name)`` says whether a line's ``env`` is the run's environment (the caller
    compares names only, it imports nothing). Refused, with one :class:`TaskFileError` naming
    the file, line and field: a task of another environment (or an import path the config did
    not give), a task whose ``split`` is not the split the file is read as (a train file of eval
    lines), a ``task_id`` given twice (per-task statistics would merge them).
    """
    seen: dict[str, str] = {}
    out = []
    for task in tasks:
        where = task.origin or f"task {short_repr(task.task_id)}"
        if not names_env(task.env):
            raise TaskFileError(
                f"{where}: field 'env' is {short_repr(task.env)}, but this run's environment is"
                f" {short_repr(env_name)} (env.name of the config); a task file names that environment"
                " (or its registered name) and cannot choose code: fix the line, or env.name"
            )
        if str(task.split) != str(split):
            raise TaskFileError(
                f"{where}: field 'split' is {short_repr(task.split)}, but this file is read as the"
                f" {short_repr(str(split))} tasks; drop the field or give the file as the other split's"
            )
        if task.task_id in seen:
            raise TaskFileError(
                f"{where}: field 'task_id' {short_repr(task.task_id)} is given again (first at {seen[task.task_id]});"
                " task ids are unique within a file (per-task statistics are kept by id): rename one"
            )
        seen[task.task_id] = where
        out.append(task if task.env == env_name else replace(task, env=env_name))
    return out


class TaskStream:
    """An endless stream over ``tasks``: epoch e is a permutation seeded by (seed, e)."""

    def __init__(self, tasks: list[Task], seed: int) -> None:
        if not tasks:
            raise ValueError("no tasks to draw from")
        self.tasks = tasks
        self.seed = seed

    def take(self, cursor: int, n: int) -> list[Task]:
        """Tasks ``cursor .. cursor+n`` of the stream."""
        out = []
        for i in range(cursor, cursor + n):
            epoch, pos = divmod(i, len(self.tasks))
            order = random.Random(self.seed * 7919 + epoch).sample(range(len(self.tasks)), len(self.tasks))
            out.append(self.tasks[order[pos]])
        return out
