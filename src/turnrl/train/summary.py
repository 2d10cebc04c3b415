"""The run record ``progress/summary.json``: who the run is, its held-out evaluations, whether it is complete.

One typed record (:class:`Summary`) is what the loop updates, the checkpoint carries
(:attr:`~turnrl.train.checkpoint.Checkpoint.summary`), ``train()`` returns and the experiment runner
asks whether a run is finished (:attr:`Summary.complete`), so no reader guesses from the keys a file
happens to hold. On disk::

    {"run_id": "3f9c0a1b2d4e", "base": {...} | null, "iterations": [{...}, ...], "complete": true}

``iterations[n]`` is the held-out evaluation at the end of outer iteration n. A run is complete when
its last planned iteration has ended; until then ``complete`` is false, whatever evaluations it
holds (a two-iteration run killed after iteration 0 holds one and is not complete).

A ``summary.json`` written before this record (``{"base": ..., "final": ...}``) is read as a record of
that one evaluation, not complete: the experiment runner then resumes the run from its checkpoint,
which for a finished run trains nothing and writes the complete record.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError

from turnrl.rundir import RunDir, RunDirError, atomic_write_text, open_nofollow

Metrics = dict[str, float]

MAX_SUMMARY_BYTES = 1 << 24
"""Most bytes a ``summary.json`` may hold (16 MiB: thousands of iterations' evaluations)."""


class SummaryError(ValueError):
    """``summary.json`` is unreadable or not a run record; the message names the file."""


def new_run_id() -> str:
    """A run's identity, drawn once when its directory is created (48 random bits, hex)."""
    return uuid.uuid4().hex[:12]


@dataclass
class Summary:
    """The run record (see the module docstring)."""

    run_id: str = ""
    """The run's identity ("" for a run from before identities); its checkpoints carry it."""
    base: Metrics | None = None
    """The base model's held-out evaluation, before any training (``eval.before``)."""
    iterations: list[Metrics] = field(default_factory=list)
    """The held-out evaluation at the end of each finished outer iteration, in order."""
    complete: bool = False
    """Every planned outer iteration has ended."""

    @property
    def final(self) -> Metrics | None:
        """The last finished iteration's evaluation (the trained policy's, once complete)."""
        return self.iterations[-1] if self.iterations else None

    def end_iteration(self, iteration: int, metrics: Metrics, last: bool) -> None:
        """Record the evaluation that ends ``iteration``; ``last``: it was the last planned one."""
        del self.iterations[iteration:]
        self.iterations.append(dict(metrics))
        self.complete = last

    def before(self, iteration: int) -> Summary:
        """The record as it stood when ``iteration`` began (``--start-iter``): the earlier iterations'
        evaluations, and the base's unless ``iteration`` is 0 (a restart at 0 evaluates the base again)."""
        base = self.base if iteration > 0 else None
        return Summary(self.run_id, base, [dict(m) for m in self.iterations[:iteration]], False)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any, source: str = "summary.json") -> Summary:
        """The record from its JSON form, or from the ``{"base", "final"}`` form of older runs."""
        if isinstance(data, dict) and "iterations" not in data and set(data) <= {"base", "final"}:
            final = data.get("final")
            data = {"base": data.get("base"), "iterations": [final] if final is not None else []}
        try:
            return _ADAPTER.validate_python(data, strict=False)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "the record"
            raise SummaryError(
                f"{source} is not a turnrl run summary ({where}: {err['msg']}); the run directory is damaged"
            ) from None

    def write(self, run: RunDir) -> None:
        atomic_write_text(run.summary, json.dumps(self.to_json(), indent=2))


_ADAPTER = TypeAdapter(Summary)


def read_summary(run: RunDir) -> Summary | None:
    """The run's record, or None when it has none; a damaged one raises :class:`SummaryError`.

    The file is opened without following a link and must be a plain file (:func:`open_nofollow`) of at
    most :data:`MAX_SUMMARY_BYTES` (a run directory may be hostile).
    """
    path = run.summary
    try:
        fd = open_nofollow(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as exc:  # a link, a FIFO, a hard link (RunDirError says which), or unreadable
        raise SummaryError(str(exc) if isinstance(exc, RunDirError) else f"{path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > MAX_SUMMARY_BYTES:
            raise SummaryError(
                f"{path} holds {size:,} bytes; a run summary is a small JSON file: the run directory is damaged"
            )
        text = fh.read(MAX_SUMMARY_BYTES + 1)
    try:
        data = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SummaryError(f"{path} is not JSON ({exc}); the run directory is damaged") from None
    return Summary.from_json(data, str(path))
