"""Where a run's tasks come from, resolved once: :class:`TaskSource` (the ``data`` and ``env`` sections)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from turnrl.envs import load_tasks
from turnrl.types import Task


class _DataSection(Protocol):
    @property
    def train_file(self) -> str | None: ...
    @property
    def eval_file(self) -> str | None: ...
    @property
    def train_split(self) -> str: ...
    @property
    def eval_split(self) -> str: ...
    @property
    def num_eval_tasks(self) -> int | None: ...


class _EnvSection(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def options(self) -> dict[str, Any]: ...


class TaskSourceConfig(Protocol):
    """What :meth:`TaskSource.from_config` reads of a run config (this package may not import the
    config; this Protocol says what it must have)."""

    @property
    def data(self) -> _DataSection: ...
    @property
    def env(self) -> _EnvSection: ...


@dataclass(frozen=True)
class TaskSource:
    """A run's train and eval tasks: ``data.*_file`` when set, else the environment's built-in sets."""

    env_name: str
    env_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    train_file: str | None = None
    eval_file: str | None = None
    train_split: str = "train"
    eval_split: str = "eval"
    num_eval_tasks: int | None = None

    @classmethod
    def from_config(cls, cfg: TaskSourceConfig) -> TaskSource:
        d = cfg.data
        return cls(
            cfg.env.name,
            MappingProxyType(dict(cfg.env.options)),
            d.train_file,
            d.eval_file,
            d.train_split,
            d.eval_split,
            d.num_eval_tasks,
        )

    def tasks(self, split: str) -> list[Task]:
        """The ``train`` or ``eval`` tasks (eval: the first ``data.num_eval_tasks``)."""
        train = split == "train"
        return load_tasks(
            self.env_name,
            dict(self.env_options),
            path=self.train_file if train else self.eval_file,
            split=split,
            named_split=self.train_split if train else self.eval_split,
            limit=None if train else self.num_eval_tasks,
        )
