"""The base model's held-out evaluation, shared by runs that would compute the same one.

Before any training a run evaluates its base policy (``eval.before``: iteration 0, a fresh LoRA whose B is
zero). That evaluation depends on the model, the environment and its tasks, the evaluation and sampler
settings, the rollout limits, the chat template, the LoRA shape and the seed — not on what the arms of an
experiment vary (the credit estimator, the loss, the optimizer, the batch's shape). ``turnrl experiment``
runs every arm of a seed from the same base, so it evaluated the same policy on the same games once per
arm; with a :class:`BaseEvaluations` store the first run of a key evaluates and the others take its
episodes and metrics, written to their run directories as their own (the same bytes: ``tests/test_base_eval.py``
compares a run that took it with one that evaluated).

:class:`BaseEvalKey` is the resolved config with exactly the keys listed in :data:`UNUSED` removed: everything not
listed stays in the key, so a share that is missed costs time, never correctness. Given a directory (``turnrl
experiment`` gives ``<output>/<name>/base_eval/``), the store also keeps each evaluation there as one JSON file
named by the key's hash and holding the key's full text, so the experiment's later processes (a rerun, one
arm run at a time, two arms run side by side) take it too; a file whose key text differs, or that does not
read back as episodes, is a miss. What the key cannot see — the bytes of a local model directory it names —
is trusted unchanged, as reusing a finished run trusts it; ``--fresh`` deletes the directory with the runs.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnrl.config import RunConfig
from turnrl.eval import EvalResult
from turnrl.rundir import atomic_write_text
from turnrl.types import Episode

UNUSED = (
    "run_name",
    "paths",
    "tracking",
    "credit",
    "loss",
    "train",
    "loop",
    "eval.every",
    "rollout.tasks_per_step",
    "rollout.group_size",
    "rollout.branching",
    "rollout.dynamic_sampling",
    "rollout.refill",
    "sampler.refresh_every",
    "sampler.max_staleness",
)
"""Config keys the base evaluation does not read: what is trained and how (the base is evaluated before any
update, by a sampler that shares the trainer's weights), where the run writes, and the training batch's shape
(the evaluation's games are ``eval.*`` and ``data.num_eval_tasks``)."""


@dataclass(frozen=True)
class BaseEvalKey:
    """Everything in the resolved config that the base evaluation can depend on, as canonical JSON."""

    text: str

    @classmethod
    def from_config(cls, cfg: RunConfig) -> BaseEvalKey:
        data: dict[str, Any] = cfg.model_dump(mode="json")
        for dotted in UNUSED:
            *parents, last = dotted.split(".")
            node = data
            for p in parents:
                node = node.get(p, {})
            node.pop(last, None)
        return cls(json.dumps(data, sort_keys=True))

    def file_name(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:24] + ".json"


class BaseEvaluations:
    """Base evaluations by :class:`BaseEvalKey`, for the runs of one process and, given ``directory``, of every
    process that shares it (copies in and out: a run's episodes are its own objects)."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self._store: dict[BaseEvalKey, EvalResult] = {}
        self.directory = Path(directory) if directory is not None else None

    def get(self, key: BaseEvalKey) -> EvalResult | None:
        hit = self._store.get(key)
        if hit is None and self.directory is not None:
            hit = self._read(self.directory / key.file_name(), key)
            if hit is not None:
                self._store[key] = hit
        return copy.deepcopy(hit) if hit is not None else None

    def put(self, key: BaseEvalKey, result: EvalResult) -> None:
        self._store[key] = copy.deepcopy(result)
        if self.directory is not None:  # whole or absent: written to a temporary name, then renamed
            self.directory.mkdir(parents=True, exist_ok=True)
            record = {
                "key": key.text,
                "metrics": result.metrics,
                "episodes": [ep.to_dict() for ep in result.episodes],
            }
            atomic_write_text(self.directory / key.file_name(), json.dumps(record))

    @staticmethod
    def _read(path: Path, key: BaseEvalKey) -> EvalResult | None:
        """The evaluation kept in ``path`` for ``key``; None when absent, for another key, or unreadable."""
        try:
            record = json.loads(path.read_text())
            if not isinstance(record, dict) or record.get("key") != key.text:
                return None
            metrics = {str(k): float(v) for k, v in record["metrics"].items()}
            return EvalResult(metrics, [Episode.from_dict(ep) for ep in record["episodes"]])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def __len__(self) -> int:
        return len(self._store)
