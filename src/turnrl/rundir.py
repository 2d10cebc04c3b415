"""The run directory: every path of a run named once, atomic writes, episode JSONL.

``runs/<run_name>/`` holds ``config.yaml`` (resolved), ``progress/`` (train.csv,
eval.csv, steps.jsonl, summary.json), ``rollouts/`` (``iter_NNN.jsonl`` training
episodes, ``eval_step_NNNNN.jsonl`` evaluation episodes), ``adapters/iter_NNN/``,
``checkpoint/state.pt``, ``plots/`` and ``report.html``. Files are written
atomically (temp file + rename) so a kill never leaves a half-written file.

A run directory may be hostile (trainers often run as root): nothing is written
through a symbolic link. Appends, the lock and temp files open with
``O_NOFOLLOW`` (a temp file is created exclusively, so a planted one is never
reused), a rename replaces a link rather than its target, and a trainer that
takes a run directory first refuses any link inside it (:func:`refuse_links`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from turnrl.types import Episode


class MissingAdapterError(FileNotFoundError):
    """A run directory lacks an adapter a policy is built from; the message lists the ones there."""


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    def __truediv__(self, other: str | Path) -> Path:
        return self.root / other

    def __fspath__(self) -> str:
        return str(self.root)

    @property
    def name(self) -> str:
        return self.root.name

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def progress(self) -> Path:
        return self.root / "progress"

    @property
    def train_csv(self) -> Path:
        return self.progress / "train.csv"

    @property
    def eval_csv(self) -> Path:
        return self.progress / "eval.csv"

    @property
    def steps_jsonl(self) -> Path:
        return self.progress / "steps.jsonl"

    @property
    def summary(self) -> Path:
        return self.progress / "summary.json"

    @property
    def iteration_rows(self) -> Path:
        """Row counts of the progress files at the end of each iteration (for ``--start-iter``)."""
        return self.progress / "iteration_rows.json"

    @property
    def rollouts(self) -> Path:
        return self.root / "rollouts"

    def train_rollouts(self, iteration: int) -> Path:
        return self.rollouts / f"iter_{iteration:03d}.jsonl"

    def eval_rollouts(self, step: int) -> Path:
        return self.rollouts / f"eval_step_{step:05d}.jsonl"

    def train_rollout_files(self) -> list[Path]:
        return sorted(self.rollouts.glob("iter_*.jsonl"))

    def eval_rollout_files(self) -> list[Path]:
        return sorted(self.rollouts.glob("eval_step_*.jsonl"))

    def adapter(self, iteration: int) -> Path:
        return self.root / "adapters" / f"iter_{iteration:03d}"

    def adapters_through(self, last: int, *, purpose: str = "") -> list[Path]:
        """The saved adapters 0..``last`` in order (none for ``last`` < 0): the policy after iteration
        ``last`` is the base with all of them merged. The one implementation training (the base of the
        next iteration), ``turnrl eval --iteration`` and ``turnrl export`` use.

        An adapter counts as saved when its ``adapter_config.json`` exists; a missing one raises
        :class:`MissingAdapterError` naming it, the adapters there, and ``purpose`` (what needed them).
        """
        dirs = [self.adapter(i) for i in range(last + 1)]
        missing = [d for d in dirs if not (d / "adapter_config.json").is_file()]
        if missing:
            folder = self.root / "adapters"
            have = sorted(p.name for p in folder.glob("iter_*")) if folder.is_dir() else []
            raise MissingAdapterError(
                f"{purpose + ': ' if purpose else ''}{self.root} has no adapter {missing[0].name} (adapters there:"
                f" {', '.join(have) or 'none'}); choose an iteration whose adapters 0..N were all saved"
            )
        return dirs

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / "checkpoint"

    @property
    def checkpoint(self) -> Path:
        return self.checkpoint_dir / "state.pt"

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    @property
    def report(self) -> Path:
        return self.root / "report.html"

    def stale_temp_files(self) -> list[Path]:
        """Half-written temp files of :func:`atomic_file` (``.NAME.XXXX.tmp``) a killed writer left
        behind; plain files only (a link or directory of that name is not one of ours)."""
        return sorted(p for p in self.root.rglob(".*.tmp") if p.is_file() and not p.is_symlink())

    def progress_files(self) -> list[Path]:
        """Every append-only file a resumed run must cut back to its checkpoint."""
        return [self.train_csv, self.eval_csv, self.steps_jsonl, *self.train_rollout_files()]


# ----------------------------------------------------------------------------- safe opens


MAX_LINE_BYTES = 64 * 2**20
"""The longest rollout line :func:`iter_episodes` reads (a 32k-token context over 16 turns is ~4 MB)."""


class RunDirError(OSError):
    """A run directory holds something a trainer must not write through (a link, a non-regular file)."""


def open_nofollow(path: str | Path, flags: int, mode: int = 0o666, *, own: bool = True) -> int:
    """``os.open`` that refuses a symbolic link as the last component (``O_NOFOLLOW``) and a non-regular file
    (and, ``own``: a file with other names, a hard link — for writes; a reader passes ``own=False``)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO with no reader (O_NONBLOCK: the open does not hang)
            raise RunDirError(f"{path} is not a regular file; run files must be plain files. Remove it") from None
        if exc.errno == errno.ELOOP:
            raise RunDirError(
                f"{path} is a symbolic link; run files are never written through links. Remove it"
                " (or choose another --run-name)"
            ) from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or (own and info.st_nlink > 1):
        os.close(fd)
        what = "not a regular file" if not stat.S_ISREG(info.st_mode) else f"a hard link ({info.st_nlink} names)"
        raise RunDirError(f"{path} is {what}; run files must be plain files of their own. Remove it")
    os.set_blocking(fd, True)
    return fd


def append_text(path: str | Path, text: str) -> None:
    """Append ``text`` (UTF-8) to ``path`` in one write, never through a link."""
    fd = open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    with os.fdopen(fd, "a", encoding="utf-8", newline="") as fh:
        fh.write(text)


def contained(path: str | Path, root: str | Path, what: str) -> Path:
    """``path`` resolved, if it lies strictly under ``root`` resolved (links followed), else
    :class:`RunDirError`: checked before anything under ``root`` is deleted or copied out."""
    resolved, base = Path(path).resolve(), Path(root).resolve()
    if resolved == base or not resolved.is_relative_to(base):
        raise RunDirError(f"{what} {path} resolves to {resolved}, outside {base}; refusing to touch it")
    return resolved


def refuse_links(root: str | Path) -> None:
    """Refuse a run directory that holds a symbolic link anywhere below it (planted to redirect a write)."""
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            if path.is_symlink():
                raise RunDirError(
                    f"{path} is a symbolic link (to {os.readlink(path)}); a run directory must hold none,"
                    " as the trainer would write through it. Remove it, or choose another --run-name"
                )


# ----------------------------------------------------------------------------- atomic writes


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write a file so that a kill leaves either the old or the new content, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as fh:
        fh.write(data)


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file that replaces ``path`` when the block ends (fsynced); on error ``path`` is untouched.

    The temp file is created exclusively (``mkstemp``: ``O_CREAT | O_EXCL``, never a planted file or link)
    and renamed over ``path`` (a link at ``path`` is replaced, its target untouched).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; give the usual permissions
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


FULL_DISK_BYTES = 1 << 20
"""A failed write with less free space than this (1 MiB) left on its file system is reported as a full disk."""


def write_failure(path: str | Path, exc: BaseException) -> str:
    """Why writing ``path`` failed, naming a full disk when it is one, as ``reason; what to do``.

    Call it while the partial output still exists: libraries report a short write in their own
    words (torch: ``unexpected pos 73088 vs 72980``; safetensors: ``I/O error``), so the disk's
    free space (``os.statvfs``) is measured as well as the error number.
    """
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        st = os.statvfs(where)
        free: int | None = st.f_bavail * st.f_frsize
    except OSError:
        free = None
    code = getattr(exc, "errno", None)
    text = " ".join(str(exc).split())
    reason = os.strerror(code) if isinstance(exc, OSError) and code else f"{type(exc).__name__}: {text}"
    full = (
        code in (errno.ENOSPC, errno.EDQUOT) or "No space left" in text or (free is not None and free < FULL_DISK_BYTES)
    )
    if full:
        left = "unknown" if free is None else f"{free:,}"
        return f"{reason[:300]}; the disk holding {where} is full ({left} bytes free while writing): free space there"
    return f"{reason[:300]}; check that {where} is writable and has space"


def atomic_write_text(path: str | Path, text: str) -> None:
    """:func:`atomic_write_bytes` for text (UTF-8)."""
    atomic_write_bytes(path, text.encode("utf-8"))


# ----------------------------------------------------------------------------- episode JSONL


def write_jsonl(path: str | Path, records: Iterable[Episode], append: bool = False) -> None:
    """Write episodes as JSONL. A fresh file is written atomically (temp + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(r.to_dict()) + "\n" for r in records)
    if append:
        append_text(path, lines)
        return
    atomic_write_text(path, lines)


def read_jsonl(path: str | Path) -> list[Episode]:
    """Read episodes written by :func:`write_jsonl`; a bad line raises naming the file and line."""
    out = []
    with os.fdopen(open_nofollow(path, os.O_RDONLY, own=False), encoding="utf-8") as fh:
        text = fh.read()
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                out.append(Episode.from_dict(json.loads(line)))
            except (json.JSONDecodeError, TypeError, KeyError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: not an episode record ({exc})") from exc
    return out


def iter_episodes(path: str | Path) -> Iterator[Episode]:
    """Episodes of a JSONL file, skipping lines that do not parse (a run killed mid-write).

    For readers of a run that may still be written to (plots, reports); training
    itself uses :func:`read_jsonl`, which refuses a bad line. Each record is typed
    (:meth:`Episode.from_dict`); the file is opened as a plain file, never through a
    link (a FIFO, or a link to ``/dev/zero``, is :class:`RunDirError`), and a line over
    :data:`MAX_LINE_BYTES` is skipped unread.
    """
    path = Path(path)
    if not path.exists():
        return
    with os.fdopen(open_nofollow(path, os.O_RDONLY, own=False), "rb") as fh:
        while line := fh.readline(MAX_LINE_BYTES + 1):
            if len(line) > MAX_LINE_BYTES:  # no episode is that long: skip to the line's end
                while line and not line.endswith(b"\n"):
                    line = fh.readline(MAX_LINE_BYTES)
                continue
            if not line.strip():
                continue
            try:
                yield Episode.from_dict(json.loads(line.decode("utf-8", errors="replace")))
            except (json.JSONDecodeError, TypeError, KeyError, ValueError, RecursionError):
                continue


# ----------------------------------------------------------------------------- sync (paths.sync_to)


def _remote(url: str, run: RunDir):
    """The fsspec filesystem and the remote copy's path of a run under ``url``."""
    try:
        import fsspec
    except ImportError as exc:
        raise ImportError("paths.sync_to needs fsspec: pip install 'turnrl[sync]'") from exc
    fs, root = fsspec.core.url_to_fs(url)
    return fs, f"{root.rstrip('/')}/{run.name}"


def push_run(url: str | None, run: RunDir) -> None:
    """Copy the run directory to ``url`` (any fsspec URL), file by file; dotfiles (the lock) stay."""
    if not url:
        return
    fs, remote = _remote(url, run)
    for path in sorted(p for p in run.root.rglob("*") if p.is_file() and not p.name.startswith(".")):
        target = f"{remote}/{path.relative_to(run.root).as_posix()}"
        fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        fs.put_file(str(path), target)


def pull_run(url: str | None, run: RunDir) -> bool:
    """Fetch a run directory back from ``url`` when it is missing here (resume elsewhere)."""
    if not url or run.config.exists():
        return False
    fs, remote = _remote(url, run)
    if not fs.exists(f"{remote}/config.yaml"):
        return False
    for path in fs.find(remote):
        rel = path[len(remote.rstrip("/")) :].lstrip("/")
        local = run.root / rel
        local.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(path, str(local))
    return True
