"""Environment registry: one line per task family, imported lazily."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from turnrl.envs.base import Env, Message, StepResult, StopReason, Task, load_task_file

ENV_REGISTRY: dict[str, str | type[Env]] = {
    "number_guess": "turnrl.envs.number_guess:NumberGuessEnv",
    "slosh_tank": "turnrl.envs.slosh_tank:SloshTankEnv",
    "math": "turnrl.envs.math:MathEnv",
    "key_door": "turnrl.envs.key_door:KeyDoorEnv",
}


def register_env(name: str, target: str | type[Env]) -> None:
    """Register an environment class (or its ``"module:Class"`` path) under ``name``."""
    ENV_REGISTRY[name] = target


def get_env_class(name: str) -> type[Env]:
    """The environment class registered under ``name``."""
    if name not in ENV_REGISTRY:
        raise ValueError(f"unknown environment {name!r}; registered: {', '.join(sorted(ENV_REGISTRY))}")
    target = ENV_REGISTRY[name]
    if not isinstance(target, str):
        return target
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def tasks_from_file(env_name: str, path: str | Path, split: str) -> list[Task]:
    """Tasks of an environment from a JSONL file, with the environment's own validation when it has one."""
    loader = getattr(get_env_class(env_name), "load_tasks", None)
    return loader(path, split) if loader else load_task_file(path, split)


def make_env(task: Task, **options: Any) -> Env:
    """Build the environment for a task."""
    return get_env_class(task.env)(task, **options)


__all__ = [
    "ENV_REGISTRY",
    "Env",
    "Message",
    "StepResult",
    "StopReason",
    "Task",
    "get_env_class",
    "load_task_file",
    "make_env",
    "register_env",
    "tasks_from_file",
]
