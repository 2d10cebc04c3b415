"""The sandbox's vocabulary: limits in (a strict model), results out, and the exceptions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

STATUSES = ("ok", "error", "timeout", "killed", "output_limit")

DEFAULT_PRELOAD: tuple[str, ...] = (
    "math", "random", "itertools", "functools", "collections", "heapq", "bisect",
    "operator", "copy", "time", "json",
)  # fmt: skip
"""Standard-library modules imported before the untrusted code runs.

In the kernel sandbox the whole standard library is readable, so this only saves
import time. In the weaker sandbox, when the child runs as ``nobody`` the
interpreter's own library directory may be unreadable (e.g. a pyenv install
under ``/root``); modules imported before the drop stay importable from
``sys.modules``. Modules in :data:`PRELOAD_ON_IMPORT` are added when the code
(or prelude) imports them.
"""

PRELOAD_ON_IMPORT: frozenset[str] = frozenset({
    "abc", "array", "base64", "binascii", "calendar", "cmath", "contextlib", "copyreg",
    "dataclasses", "datetime", "decimal", "enum", "fractions", "hashlib", "inspect", "io",
    "numbers", "pprint", "queue", "re", "statistics", "string", "struct", "textwrap",
    "threading", "types", "typing", "warnings", "weakref", "zlib",
})  # fmt: skip
"""Pure-computation standard-library modules preloaded on demand (never network or processes)."""

WEAKER_SETTING = "SandboxLimits(allow_weaker=True) (config: env.options.sandbox.allow_weaker: true)"
"""How a user accepts a sandbox without the kernel layers; named in every refusal."""


_MODULE_NAME = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"


class SandboxLimits(BaseModel):
    """Resource limits and required isolation for one execution: a strict, typed, frozen model.

    Every value is checked by type (no string-to-bool or float-to-int coercion), sign and range
    (finite floats only); a wrong value raises ``ValueError`` with one line naming the field, the
    value and what is allowed (:meth:`from_options` adds the config key).
    """

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    timeout_s: float = Field(10.0, gt=0, le=3600, allow_inf_nan=False)
    """Wall-clock limit for the whole run, start-up included (seconds)."""
    cpu_s: int | None = Field(None, ge=1, le=3601)
    """RLIMIT_CPU soft limit (seconds); None = ceil(timeout_s) + 1, so the wall clock usually fires first."""
    memory_mb: int = Field(1024, ge=64, le=1 << 20)
    """RLIMIT_AS: address-space limit (MiB). Allocations beyond it raise MemoryError."""
    max_output_bytes: int = Field(256_000, ge=1, le=1 << 30)
    """Combined stdout+stderr kept; producing more kills the run (status ``output_limit``)."""
    max_processes: int = Field(32, ge=1, le=65_536)
    """RLIMIT_NPROC (threads of the child's user); root is exempt, so as root the child runs as ``nobody``."""
    max_file_mb: int = Field(16, ge=0, le=1 << 20)
    """RLIMIT_FSIZE: largest file the child may write (MiB)."""
    max_dir_mb: int = Field(64, ge=1, le=1 << 16)
    """Total bytes of the private directory (MiB): in the kernel sandbox it is a tmpfs of this size
    (RAM-backed: a call may hold up to ``memory_mb + max_dir_mb``); writes beyond it fail with ENOSPC."""
    max_dir_files: int = Field(4096, ge=1, le=1 << 20)
    """Entries the private directory may hold (files, directories, links, hard links; the tmpfs's inodes)."""
    max_open_files: int = Field(64, ge=16, le=65_536)
    """RLIMIT_NOFILE."""
    drop_privileges: bool = True
    """When the parent is root, run the child as ``nobody``."""
    namespaces: bool = True
    """Use the kernel sandbox (bubblewrap: mount, PID, network, IPC, UTS and, when not root, user
    namespaces, read-only minimal filesystem). False is a weaker sandbox (needs ``allow_weaker``)."""
    seccomp: bool = True
    """Install the seccomp filter (no exec, no new processes, no network sockets, no ptrace/mount/...)."""
    audit: bool = True
    """Install the audit-hook layer in the child (clear errors; Python-level, not a boundary)."""
    allow_weaker: bool = False
    """Run untrusted code even when a kernel layer (namespaces, seccomp, privilege drop) cannot be
    set up or is switched off; the result's ``isolation`` then lists what was active. False (the
    default): such a run is refused with :class:`SandboxUnavailable` naming the missing layer."""
    bwrap: str = Field("bwrap", min_length=1, max_length=4096, pattern=r"^[^\x00]+$")
    """The bubblewrap executable (name on ``PATH`` or a path)."""
    preload: tuple[Annotated[str, Field(pattern=_MODULE_NAME, max_length=200)], ...] = Field(
        DEFAULT_PRELOAD, strict=False, max_length=256
    )
    """Modules always imported before the code runs (see :data:`DEFAULT_PRELOAD`); a list in a config."""

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise LimitsError(_one_line(exc)) from None

    def effective_cpu_s(self) -> int:
        return self.cpu_s if self.cpu_s is not None else int(self.timeout_s + 0.999) + 1

    @classmethod
    def from_options(cls, value: SandboxLimits | dict[str, Any] | None, owner: str) -> SandboxLimits:
        """Limits from a config value (a mapping of these fields); a bad field names ``owner``'s key."""
        if value is None:
            return cls()
        if isinstance(value, SandboxLimits):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                f"{owner} option 'sandbox' must be a mapping of SandboxLimits fields, got {_show(value)}; "
                f"known fields: {', '.join(cls.model_fields)}"
            )
        try:
            return cls(**value)
        except LimitsError as exc:
            where = f"{owner} option " + ("sandbox" if exc.detail.startswith(".") else "'sandbox'")
            raise LimitsError(where + exc.detail) from None


class LimitsError(ValueError):
    """A bad :class:`SandboxLimits` value: one line naming the field, the value and what is allowed."""

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(detail if not detail.startswith((".", " ")) else "SandboxLimits" + detail)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _allowed(name: str) -> str:
    """What a field accepts, from its type and its range (one home: the field's own declaration)."""
    info = SandboxLimits.model_fields[name]
    bound = {k: getattr(m, k) for m in info.metadata for k in ("gt", "ge", "lt", "le") if hasattr(m, k)}
    if name == "preload":
        return "a list of module names (e.g. [math, json])"
    kind = {bool: "true or false (a boolean, not a string)", str: "a non-empty path or name", float: "a finite number",
            int: "an integer"}.get(info.annotation, "null or an integer")  # fmt: skip
    low = f"> {bound['gt']}" if "gt" in bound else f">= {bound['ge']}" if "ge" in bound else ""
    high = f"<= {bound['le']}" if "le" in bound else f"< {bound['lt']}" if "lt" in bound else ""
    return kind + (" " + " and ".join(b for b in (low, high) if b) if low or high else "")


def _one_line(exc: ValidationError) -> str:
    """The first error of ``exc`` as the tail of one line: ``.key: value ...; allowed: ...``."""
    err = exc.errors()[0]
    loc = [str(x) for x in err["loc"]]
    name = loc[0] if loc else ""
    if err["type"] == "extra_forbidden":
        return f" has unknown field {name!r}; known: {', '.join(SandboxLimits.model_fields)}"
    allowed = _allowed(name) if name in SandboxLimits.model_fields else ""
    why = err["msg"][:1].lower() + err["msg"][1:]
    return f".{'.'.join(loc)}: {_show(err.get('input'))} is not allowed ({why}); allowed: {allowed}"


@dataclass
class ExecResult:
    """What happened to one execution.

    ``status``: ``ok`` (ran to the end), ``error`` (raised, exited non-zero, or
    broke the protocol), ``timeout`` (wall clock or CPU time), ``killed`` (died
    from a signal: memory, crash, process limit), ``output_limit`` (printed too
    much). ``value`` is what the child's driver reported (untrusted, JSON).
    """

    status: str
    reason: str = ""
    stdout: str = ""
    value: Any = None
    duration_s: float = 0.0
    returncode: int | None = None
    output_bytes: int = 0
    pid: int | None = None
    """Process id of the sandbox's outermost process (its process group and session id too)."""
    isolation: tuple[str, ...] = ()
    """Layers that were active, as the parent set them up (``session``, ``mountns``, ``pidns``,
    ``netns``, ``ipcns``, ``utsns``, ``userns``, ``rlimits``, ``uid:N``, ``nnp``, ``seccomp``,
    ``audit``). The child's own setup report is accepted once, before any untrusted code ran, and
    only for layers the parent asked for."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status, "reason": self.reason, "stdout": self.stdout, "value": self.value,
            "duration_s": self.duration_s, "returncode": self.returncode,
            "output_bytes": self.output_bytes, "pid": self.pid, "isolation": list(self.isolation),
        }  # fmt: skip


class HostError(Exception):
    """Raise from a host function to make ``host(...)`` raise in the child.

    ``kind`` names the builtin exception the child raises (``ValueError``,
    ``RuntimeError``, ``TypeError``; anything else becomes ``RuntimeError``).
    """

    def __init__(self, message: str, kind: str = "RuntimeError") -> None:
        super().__init__(message)
        self.kind = kind


class SandboxUnavailable(RuntimeError):
    """A required isolation layer cannot be set up; the untrusted code was not run.

    The message names the missing layer, why, and :data:`WEAKER_SETTING`.
    """

    def __init__(self, layer: str, why: str) -> None:
        self.layer = layer
        self.why = why
        super().__init__(
            f"sandbox refused to run untrusted code: the {layer!r} layer cannot be set up ({why}); "
            f"to run with a weaker sandbox set {WEAKER_SETTING}"
        )
