"""Resumable state: the checkpoint file, the one truncation rule, the resume checks, the run lock.

After every ``train.checkpoint_every`` steps (and at the end of each iteration)
the resumable state is written atomically to ``checkpoint/state.pt``: counters,
the trainer's state (adapter, optimizer), the sampler's (version, stale
snapshot), a stateful credit estimator's (the critic), RNG states, and how
many rows every progress and rollout file had.
A resumed run cuts each of those files back to that row count — the only
truncation rule — so it never duplicates a row. Rows are complete records: a
torn last line (a kill mid-append) is not a row, and a counted row that is not a
record refuses the resume; a resume that finds no checkpoint cuts every file back
to nothing and starts clean (:func:`cut_back`). The file holds only tensors and
plain values and is loaded with ``weights_only=True``: resuming never executes
pickled code from the run directory.
"""

from __future__ import annotations

import errno as _errno
import fcntl
import json
import os
import random
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import yaml

from turnrl.bounded import load_yaml
from turnrl.config import RunConfig, resume_conflicts, upgrade_saved
from turnrl.rundir import RunDir, atomic_file, atomic_write_text, open_nofollow, refuse_links, write_failure
from turnrl.train.summary import Summary


class ResumeError(RuntimeError):
    """Resuming (or starting) is not possible or would invalidate the run; the message says why."""


@dataclass
class RunState:
    step: int = 0
    """Optimizer steps completed (global, across iterations)."""
    iteration: int = 0
    """The iteration in progress (or the next one, when its steps have not started)."""
    iteration_step: int = 0
    """Steps completed within the current iteration."""
    cursor: int = 0
    """Tasks consumed from the training stream."""
    sampler_version: int = 0
    train_seconds: float = 0.0
    """Wall-clock seconds spent in training steps (for ``train.max_seconds``)."""


@dataclass
class Checkpoint:
    """The resumable state of a run, as saved in ``checkpoint/state.pt``.

    On disk it is a mapping of plain values and tensors (:meth:`to_payload`), read back with
    ``weights_only=True`` (:meth:`from_payload`); in the code it is this typed record.
    """

    state: RunState = field(default_factory=RunState)
    summary: Summary = field(default_factory=Summary)
    """The run record so far (its identity and evaluations): ``progress/summary.json`` at this point."""
    trainer: dict[str, Any] = field(default_factory=dict)
    """:meth:`Trainer.state_dict` (adapter, optimizer, schedule)."""
    sampler: dict[str, Any] = field(default_factory=dict)
    """:meth:`Sampler.state_dict` (version, stale snapshot)."""
    rng: dict[str, Any] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    """Rows of every progress and rollout file when it was written (:func:`truncate_to` cuts back to them)."""
    credit: dict[str, Any] = field(default_factory=dict)
    """:meth:`CreditSettings.state_dict` (a learned critic's statistics; empty for a stateless estimator)."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ("credit",)
    """Fields an older checkpoint may lack (it resumes with their defaults: a fresh critic)."""

    def to_payload(self) -> dict[str, Any]:
        plain = {"state": asdict(self.state), "summary": self.summary.to_json()}
        return {f.name: plain.get(f.name, getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_payload(cls, payload: Any) -> Checkpoint:
        names = [f.name for f in fields(cls)]
        required = [n for n in names if n not in cls.OPTIONAL]
        if not isinstance(payload, dict) or not set(required) <= set(payload):
            have = sorted(payload) if isinstance(payload, dict) else type(payload).__name__
            raise ValueError(f"not a turnrl checkpoint (needs {', '.join(required)}; has {have})")
        values = {name: payload[name] for name in names if name in payload}
        values["state"] = RunState(**values["state"])
        values["summary"] = Summary.from_json(values["summary"], "the checkpoint's summary")
        return cls(**values)


def _lines(path: Path) -> list[str]:
    """The complete rows of a progress file: its newline-ended lines (a torn unterminated tail is not one)."""
    if not path.exists():
        return []
    text = path.read_bytes().decode("utf-8", errors="replace")
    return text.split("\n")[:-1]  # "a\nb\n" → [a, b]; "a\nb\ntorn" → [a, b]


def row_counts(run: RunDir) -> dict[str, int]:
    return {str(p.relative_to(run.root)): len(_lines(p)) for p in run.progress_files()}


def _check_records(path: Path, lines: list[str]) -> None:
    """Every kept row of a JSONL file must be a JSON record; a damaged one refuses the resume, naming it."""
    if path.suffix != ".jsonl":
        return
    for lineno, line in enumerate(lines, start=1):
        try:
            json.loads(line)
        except ValueError:
            raise ResumeError(
                f"{path}:{lineno} is not a complete record ({line[:60]!r}...) but the checkpoint counts it;"
                " the run directory changed after the checkpoint. Restore the file, or start a new run"
                " (another --run-name)"
            ) from None


def truncate_to(run: RunDir, counts: dict[str, int]) -> None:
    """Cut every progress/rollout file back to its row count at the checkpoint.

    A file shorter than the checkpoint recorded was changed after it (deleted or cut
    by hand): resuming would silently continue a partial record, so it is refused.
    """
    for rel, keep in counts.items():
        path = run.root / rel
        if len(_lines(path)) < keep:
            have = "is missing" if not path.exists() else f"has {len(_lines(path))} rows"
            raise ResumeError(
                f"{path} {have} but the checkpoint recorded {keep}; the run directory changed after the"
                " checkpoint. Restore the file, or start a new run (another --run-name)"
            )
    for path in run.progress_files():
        lines = _lines(path)
        keep = counts.get(str(path.relative_to(run.root)), 0)
        if not path.exists():
            continue
        _check_records(path, lines[:keep])
        if path.stat().st_size != sum(len(line.encode("utf-8")) + 1 for line in lines[:keep]):
            atomic_write_text(path, "".join(line + "\n" for line in lines[:keep]))  # rows past it, a torn tail


def cut_back(run: RunDir, ckpt: Checkpoint | None) -> None:
    """Before a resume writes: every progress/rollout file back to the checkpoint's rows, or, with no
    checkpoint (a kill before the first one), back to nothing — the resumed run starts from step 0.
    The temp files a kill left half-written (``RunDir.stale_temp_files``) are removed (the run lock is held)."""
    for tmp in run.stale_temp_files():
        tmp.unlink(missing_ok=True)
    if ckpt is None:
        truncate_to(run, {})
        run.iteration_rows.unlink(missing_ok=True)
    else:
        truncate_to(run, ckpt.rows)


def record_iteration_rows(run: RunDir, iteration: int) -> None:
    """Remember the progress files' row counts at the end of ``iteration`` (``--start-iter`` cuts back to them)."""
    data = json.loads(run.iteration_rows.read_text()) if run.iteration_rows.exists() else {}
    data[str(iteration)] = row_counts(run)
    atomic_write_text(run.iteration_rows, json.dumps(data, indent=1))


def rows_before_iteration(run: RunDir, iteration: int) -> dict[str, int]:
    """The row counts at the end of ``iteration - 1`` (nothing before iteration 0)."""
    if iteration == 0:
        return {}
    data = json.loads(run.iteration_rows.read_text()) if run.iteration_rows.exists() else {}
    if str(iteration - 1) not in data:
        raise ResumeError(
            f"cannot restart at iteration {iteration}: {run.root} has no record of iteration {iteration - 1}'s end"
        )
    return data[str(iteration - 1)]


def _rng_state() -> dict[str, Any]:
    legacy = np.random.get_state(legacy=True)
    if not isinstance(legacy, tuple):  # numpy's legacy state is (name, keys, pos, has_gauss, cached)
        raise TypeError(f"numpy.random.get_state(legacy=True) returned {type(legacy).__name__}, not a tuple")
    name, keys, pos, has_gauss, cached = legacy
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "python": [version, list(internal), gauss],
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
    }


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def save_checkpoint(
    run: RunDir, trainer, sampler, state: RunState, summary: Summary, credit: dict[str, Any] | None = None
) -> None:
    """Write the resumable state atomically; on failure the previous checkpoint stays and the error says why."""
    from turnrl.train.distributed import is_main

    if not is_main():  # several processes: rank 0 writes (every rank holds the same state)
        return
    payload = Checkpoint(
        state, summary, trainer.state_dict(), sampler.state_dict(), _rng_state(), row_counts(run), credit or {}
    ).to_payload()
    run.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    why = ""
    try:
        with atomic_file(run.checkpoint) as fh:  # an exclusive temp file: a planted link is never followed
            try:
                torch.save(payload, fh)
                fh.flush()
            except Exception as exc:  # noqa: BLE001 - torch reports a short write as RuntimeError("unexpected pos")
                why = write_failure(run.checkpoint_dir, exc)  # measured while the partial file still fills the disk
                raise
    except Exception as exc:  # noqa: BLE001 - any failure to write (fsync, rename included) gets one message
        why = why or write_failure(run.checkpoint_dir, exc)
        kept = "the previous checkpoint is intact" if run.checkpoint.exists() else "no checkpoint was kept"
        raise ResumeError(
            f"could not write the checkpoint {run.checkpoint}: {why}; then resume with --resume ({kept})"
        ) from None


def load_checkpoint(run: RunDir) -> Checkpoint | None:
    if not run.checkpoint.exists():
        return None
    try:
        return Checkpoint.from_payload(torch.load(run.checkpoint, weights_only=True))
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same clear message
        raise ResumeError(
            f"the checkpoint {run.checkpoint} cannot be read ({type(exc).__name__}: {str(exc)[:200]});"
            " it is damaged or not a turnrl checkpoint. Start a new run, or restart an iteration from"
            " saved adapters with --start-iter N"
        ) from None


def read_saved_config(run: RunDir) -> dict[str, Any]:
    try:
        data = load_yaml(run.config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ResumeError(f"{run.config} cannot be read ({exc}); the run directory is damaged") from None
    if not isinstance(data, dict):
        raise ResumeError(f"{run.config} is not a config mapping; the run directory is damaged")
    return upgrade_saved(data)


def check_resume_config(run: RunDir, cfg: RunConfig, allow_change: bool) -> None:
    keys = resume_conflicts(read_saved_config(run), cfg)
    if keys and not allow_change:
        raise ResumeError(
            f"the config differs from the one {run.root} was started with, in: {', '.join(keys)}."
            " Resuming would mix two experiments; restore those values, or pass --allow-config-change"
        )


class RunLock:
    """An exclusive lock on a run directory while a trainer writes it.

    ``flock`` on ``<run>/.lock``: a second trainer is refused; the kernel drops the lock
    when its holder dies, so a lock left by a killed run is taken over silently. The lock
    file opens without following a link and must be a plain file (:func:`open_nofollow`);
    once held, the run directory must hold no link at all (:func:`refuse_links`).

    The lock comes first: whatever decides about the directory (is it fresh? whose is it?) runs
    while it is held. :attr:`created` says whether this process created the run directory (its
    ``mkdir`` succeeded), the one thing a failed fresh start may remove. A lock taken on a lock
    file that was removed meanwhile (its holder cleaned up) is dropped and taken again on the
    file now at the path.
    """

    def __init__(self, run: RunDir) -> None:
        self.path = run.root / ".lock"
        self.created = False
        """This process created the run directory (it did not exist before the lock was taken)."""
        self._fh: Any = None

    def __enter__(self) -> RunLock:
        root = self.path.parent
        root.parent.mkdir(parents=True, exist_ok=True)
        try:
            root.mkdir()
            self.created = True
        except FileExistsError:
            pass
        for _ in range(3):
            self._fh = self._take()
            if self._same_file():
                break
            self._release()
        else:  # pragma: no cover - the directory was removed and recreated three times while locking
            raise ResumeError(f"the run directory {root} keeps changing while it is locked; retry")
        try:
            refuse_links(root)
        except BaseException:
            self.__exit__()
            raise
        fh = self._fh
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()}\n")
        fh.flush()
        return self

    def _take(self) -> Any:
        try:
            fh = os.fdopen(open_nofollow(self.path, os.O_RDWR | os.O_CREAT, 0o644), "r+")  # held for the lock's life
        except FileNotFoundError:  # the directory vanished (its creator cleaned up): ours to create again
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.created = True
            fh = os.fdopen(open_nofollow(self.path, os.O_RDWR | os.O_CREAT, 0o644), "r+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            fh.close()
            raise ResumeError(
                f"the run directory {self.path.parent} is in use by {holder}; wait for it to finish,"
                " or choose another --run-name"
            ) from None
        except OSError as exc:  # ENOLCK (network file systems), EBADF, ...: name the lock and the fix
            fh.close()
            hint = (
                "its file system does not support locks (a network file system?): put paths.output_dir on a"
                " local disk, or mount with lock support"
                if exc.errno in (_errno.ENOLCK, _errno.EOPNOTSUPP, _errno.ENOSYS)
                else "check the run directory's file system"
            )
            raise ResumeError(
                f"cannot lock the run directory {self.path.parent} (flock on {self.path}: {exc.strerror}); {hint}"
            ) from None
        return fh

    def _same_file(self) -> bool:
        """The locked file is still the one at the path (not one its holder removed before we locked it)."""
        try:
            now = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        mine = os.fstat(self._fh.fileno())
        return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)

    def _release(self) -> None:
        if self._fh is not None:
            fcntl.flock(self._fh, fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None

    def __exit__(self, *exc: Any) -> None:
        self._release()
