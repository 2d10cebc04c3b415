"""Environment registry: one line per task family, imported lazily.

``env.name`` in a config is a registered name or ``package.module:Class`` (an
environment in your own package, no registration call needed). Options are validated
by the environment's :class:`~turnrl.envs.base.EnvOptions` model here, before tasks are
listed or an environment is built.

Import paths belong to the config alone: the tasks of a task file may name only the config's
environment (that name, or a registered name of the same class), compared by name and never
imported (:func:`turnrl.tasks.check_task_file`); every task a run holds then names ``env.name``,
so :func:`make_env` imports nothing the config did not choose.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

from turnrl.bounded import short_repr
from turnrl.envs.base import Env, EnvOptions, check_split
from turnrl.tasks import check_task_file, load_task_file
from turnrl.types import Message, StepResult, StopReason, Task

ENV_REGISTRY: dict[str, str | type[Env]] = {
    "number_guess": "turnrl.envs.number_guess:NumberGuessEnv",
    "slosh_tank": "turnrl.envs.slosh_tank:SloshTankEnv",
    "math": "turnrl.envs.math:MathEnv",
    "key_door": "turnrl.envs.key_door:KeyDoorEnv",
    "key_door_tools": "turnrl.envs.key_door.env:KeyDoorToolsEnv",
    "probe_commit": "turnrl.envs.probe_commit:ProbeCommitEnv",
    "decisions": "turnrl.envs.decisions:DecisionsEnv",
}


def register_env(name: str, target: str | type[Env]) -> None:
    """Register an environment class (or its ``"module:Class"`` path) under ``name``."""
    ENV_REGISTRY[name] = target


_TARGET = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


def _import_class(target: str, name: str) -> type[Env]:
    if not _TARGET.match(target):
        raise ValueError(
            f"env.name {short_repr(name)}: {short_repr(target)} is not 'package.module:Class' (dotted Python names"
            f" on both sides of one ':'); give that, or a registered name: {', '.join(sorted(ENV_REGISTRY))}"
        )
    module, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"env.name {name!r}: cannot import {target!r} ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed while importing: name it, not a traceback
        raise ValueError(
            f"env.name {name!r}: importing {module!r} failed ({type(exc).__name__}: {str(exc)[:200]}); fix that module"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        raise ValueError(
            f"env.name {short_repr(name)}: {short_repr(target)} is not a subclass of turnrl.envs.Env;"
            " name an environment class"
        )
    return cls


def get_env_class(name: str) -> type[Env]:
    """The environment class registered under ``name``, or imported from ``"package.module:Class"``."""
    if name in ENV_REGISTRY:
        target = ENV_REGISTRY[name]
        return _import_class(target, name) if isinstance(target, str) else target
    if ":" in name:
        return _import_class(name, name)
    raise ValueError(
        f"env.name: unknown environment {short_repr(name)}; registered: {', '.join(sorted(ENV_REGISTRY))}"
        " (or give 'package.module:Class')"
    )


def _names_env(name: str, env_name: str, cls: type[Env]) -> bool:
    """Whether a task's ``env`` names the run's environment: ``env_name`` itself, or a registered
    name whose entry is that class (or its import path). Compared as names: nothing is imported."""
    if name == env_name:
        return True
    target = ENV_REGISTRY.get(name)
    if target is None:
        return False
    own = ENV_REGISTRY.get(env_name, env_name)
    return target is cls or target == own or target == f"{cls.__module__}:{cls.__qualname__}"


def _file_tasks(cls: type[Env], env_name: str, path: str | Path, split: str) -> list[Task]:
    tasks = cls.load_tasks(path, split)
    return check_task_file(tasks, env_name=env_name, split=split, names_env=lambda n: _names_env(n, env_name, cls))


def tasks_from_file(env_name: str, path: str | Path, split: str) -> list[Task]:
    """Tasks of an environment from a JSONL file, with the environment's own validation and the
    task-file rules (:func:`turnrl.tasks.check_task_file`)."""
    return _file_tasks(get_env_class(env_name), env_name, path, split)


def load_tasks(
    env_name: str,
    env_options: dict[str, Any],
    *,
    path: str | Path | None,
    split: str,
    named_split: str,
    limit: int | None = None,
) -> list[Task]:
    """Tasks from ``path`` when given, else the environment's built-in set ``named_split``; first ``limit``.

    The options are validated first (by the environment's ``Options`` model), for every environment.
    """
    cls = get_env_class(env_name)
    cls.parse_options(env_options)
    if path:
        tasks = _file_tasks(cls, env_name, path, split)
    else:
        tasks = cls.default_tasks(named_split, **env_options)
    return tasks[:limit] if limit else tasks


def make_env(task: Task, **options: Any) -> Env:
    """Build the environment for a task."""
    return get_env_class(task.env)(task, **options)


__all__ = [
    "ENV_REGISTRY",
    "Env",
    "EnvOptions",
    "Message",
    "StepResult",
    "StopReason",
    "Task",
    "check_split",
    "get_env_class",
    "load_task_file",
    "load_tasks",
    "make_env",
    "register_env",
    "tasks_from_file",
]
