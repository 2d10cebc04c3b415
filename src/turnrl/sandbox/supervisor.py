"""The parent side: decide the isolation, start the child, relay host calls, judge the end.

:func:`run_python` never raises because of what the code does (a crash, hang,
fork bomb, memory bomb, flood of output or protocol garbage becomes a status);
it raises :class:`SandboxUnavailable` *before* running anything when a required
layer cannot be set up.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from turnrl.sandbox import layers as kernel
from turnrl.sandbox.channel import supervise
from turnrl.sandbox.limits import PRELOAD_ON_IMPORT, ExecResult, SandboxLimits, SandboxUnavailable

_MAX_CODE_BYTES = 1 << 20
CHILD_SOURCE = (Path(__file__).parent / "child.py").read_text(encoding="utf-8")
"""The child program, shipped to the child as source (``python -c``)."""


def _imports_of(source: str) -> set[str]:
    """Top-level module names a source imports (statically; empty if it does not parse)."""
    import ast

    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError, SystemError):  # SystemError: see extract.py
        return set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def _nobody() -> tuple[int, int]:
    try:
        import pwd

        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except (ImportError, KeyError):
        return 65534, 65534


def _minimal_env(home: str) -> dict[str, str]:
    return {
        "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "0",
        "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1", "HOME": home, "TMPDIR": home,
    }  # fmt: skip


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


# --------------------------------------------------------------------------- which sandbox


class _Plan:
    """What one run will use: kernel sandbox or weaker, and the child-side layers to expect."""

    def __init__(self, kernel_mode: bool, run_as: tuple[int, int] | None, bpf: bytes | None) -> None:
        self.kernel = kernel_mode
        self.run_as = run_as
        self.bpf = bpf


def _refusal(limits: SandboxLimits, python: str | None) -> SandboxUnavailable | None:
    """Why the kernel sandbox cannot be used with these limits (None: it can)."""
    if not limits.namespaces:
        return SandboxUnavailable("namespaces", "switched off by SandboxLimits(namespaces=False)")
    if not limits.seccomp:
        return SandboxUnavailable("seccomp", "switched off by SandboxLimits(seccomp=False)")
    if _is_root() and not limits.drop_privileges:
        return SandboxUnavailable("uid", "running as root with SandboxLimits(drop_privileges=False)")
    return _kernel_refusal(limits.bwrap, python, _is_root())


_probe_lock = threading.Lock()


def _kernel_refusal(bwrap: str, python: str | None, as_root: bool) -> SandboxUnavailable | None:
    with _probe_lock:
        return _kernel_probe(bwrap, python, as_root)


@functools.lru_cache(maxsize=8)
def _kernel_probe(bwrap: str, python: str | None, as_root: bool) -> SandboxUnavailable | None:
    """Try the kernel sandbox once per (bwrap, interpreter, root); cached for the process."""
    try:
        bpf = kernel.seccomp_program()
    except Exception as exc:  # ImportError (no pyseccomp), OSError (no libseccomp)
        return SandboxUnavailable(
            "seccomp",
            f"{type(exc).__name__}: {exc}; install libseccomp and `pip install pyseccomp`",
        )
    if kernel.find_bwrap(bwrap) is None:
        return SandboxUnavailable(
            "namespaces",
            f"bubblewrap ({bwrap!r}) is not installed; `apt-get install bubblewrap` or `make setup` as root",
        )
    plan = _Plan(True, _nobody() if as_root else None, bpf)
    r = _execute("result = 1", plan, SandboxLimits(timeout_s=30.0, bwrap=bwrap), python=python)
    if r.status == "ok" and r.value == 1 and "seccomp" in r.isolation:
        return None
    why = (r.stdout.strip().splitlines() or [r.reason])[0][:300] or r.status
    return SandboxUnavailable("namespaces", f"bubblewrap could not start the sandbox: {why}")


def kernel_sandbox_error(limits: SandboxLimits | None = None, python: str | None = None) -> str | None:
    """Why these limits would be refused without ``allow_weaker`` (None: the kernel sandbox works)."""
    err = _refusal(limits or SandboxLimits(), python)
    return None if err is None else str(err)


def check_isolation(limits: SandboxLimits | None = None, python: str | None = None) -> None:
    """Raise :class:`SandboxUnavailable` now if :func:`run_python` would refuse these limits."""
    limits = limits or SandboxLimits()
    err = _refusal(limits, python)
    if err is not None and not limits.allow_weaker:
        raise err


def _plan(limits: SandboxLimits, python: str | None) -> _Plan:
    err = _refusal(limits, python)
    if err is not None and not limits.allow_weaker:
        raise err
    run_as = _nobody() if limits.drop_privileges and _is_root() else None
    bpf = None
    if limits.seccomp:
        try:
            bpf = kernel.seccomp_program()
        except Exception:
            bpf = None  # weaker sandbox, accepted by allow_weaker
    return _Plan(err is None, run_as, bpf)


# --------------------------------------------------------------------------- running


def run_python(
    code: str,
    *,
    driver: str | None = None,
    inputs: Any = None,
    host: Callable[[Any], Any] | None = None,
    limits: SandboxLimits | None = None,
    prelude: str | None = None,
    filename: str = "<model>",
    python: str | None = None,
) -> ExecResult:
    """Execute untrusted ``code`` in a fresh, isolated interpreter.

    ``prelude`` (trusted, e.g. an environment's source) runs first in the same
    namespace as ``code``. ``driver`` (trusted) then runs in its own namespace
    with ``user`` (the code's globals), ``host(payload)`` (a round trip to
    ``host`` here in the parent), ``inputs``, ``set_result(value)`` and
    ``report(exc)`` (print a traceback of the code's frames and record the
    error). Without a driver, a global named ``result`` in the code becomes
    ``value``. Never raises for anything the code does; raises
    :class:`SandboxUnavailable` (before running anything) when a required
    layer cannot be set up and ``limits.allow_weaker`` is False.
    """
    limits = limits or SandboxLimits()
    if len(code.encode("utf-8", "replace")) > _MAX_CODE_BYTES:
        return ExecResult("error", f"code longer than {_MAX_CODE_BYTES} bytes")
    plan = _plan(limits, python)
    return _execute(code, plan, limits, driver=driver, inputs=inputs, host=host, prelude=prelude,
                    filename=filename, python=python)  # fmt: skip


def _execute(
    code: str,
    plan: _Plan,
    limits: SandboxLimits,
    *,
    driver: str | None = None,
    inputs: Any = None,
    host: Callable[[Any], Any] | None = None,
    prelude: str | None = None,
    filename: str = "<model>",
    python: str | None = None,
) -> ExecResult:
    start = time.monotonic()
    # the kernel sandbox's private directory is a bounded tmpfs the child mounts in its own view;
    # the weaker sandbox gets a fresh host temp dir (bounded per file only)
    workdir = None if plan.kernel else tempfile.mkdtemp(prefix="turnrl-sandbox-")
    inner = kernel.SANDBOX_DIR if workdir is None else workdir
    fds: list[int] = []
    proc: subprocess.Popen | None = None
    try:
        if workdir is not None:
            os.chmod(workdir, 0o700)
            if plan.run_as is not None:
                os.chown(workdir, plan.run_as[0], plan.run_as[1])
        expected = {"rlimits", "nnp"}
        expected |= {"dirquota"} | (set() if plan.run_as else {"subuserns"}) if plan.kernel else set()
        expected |= {"seccomp"} if plan.bpf else set()
        expected |= {"audit"} if limits.audit else set()
        expected |= {f"uid:{plan.run_as[0]}"} if plan.run_as else set()
        expected |= set() if plan.kernel else {"netns", "pidns", "userns"}
        preload = list(limits.preload) + sorted(
            (_imports_of(code) | _imports_of(prelude or "")) & PRELOAD_ON_IMPORT - set(limits.preload)
        )
        job = {
            "code": code, "prelude": prelude or "", "driver": driver or "", "inputs": inputs,
            "filename": filename, "workdir": inner, "audit": limits.audit, "parent": os.getpid(),
            "kernel": plan.kernel, "namespaces": limits.namespaces, "preload": preload,
            "seccomp": base64.b64encode(plan.bpf).decode() if plan.bpf else "",
            "uid": plan.run_as[0] if plan.run_as else None, "gid": plan.run_as[1] if plan.run_as else None,
            "limits": {
                "cpu_s": limits.effective_cpu_s(), "memory_mb": limits.memory_mb,
                "max_file_mb": limits.max_file_mb, "max_dir_mb": limits.max_dir_mb,
                "max_dir_files": limits.max_dir_files, "max_open_files": limits.max_open_files,
                "max_processes": limits.max_processes,
            },
        }  # fmt: skip
        try:
            job_line = (json.dumps(job) + "\n").encode("utf-8")
        except (TypeError, ValueError) as exc:
            return ExecResult("error", f"inputs are not JSON-serializable: {exc}")
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        fds = [to_child_r, to_child_w, from_child_r, from_child_w]
        exe, _ = kernel.interpreter(python)
        child_argv = [exe, "-I", "-S", "-B", "-c", CHILD_SOURCE, str(to_child_r), str(from_child_w)]
        outer: tuple[str, ...] = ("session",)
        if plan.kernel:
            prefix, ns_layers = kernel.bwrap_command(
                kernel.find_bwrap(limits.bwrap) or limits.bwrap, python, plan.run_as is not None
            )
            child_argv = prefix + child_argv
            outer += tuple(ns_layers)
        try:
            proc = subprocess.Popen(
                child_argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                env=_minimal_env(inner), cwd=workdir or "/", pass_fds=(to_child_r, from_child_w),
                close_fds=True, start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            return ExecResult("error", f"could not start the sandbox: {exc}", duration_s=time.monotonic() - start)
        for fd in (to_child_r, from_child_w):
            os.close(fd)
            fds.remove(fd)
        return supervise(proc, job_line, to_child_w, from_child_r, host, limits, start, outer, expected)
    finally:
        if proc is not None:
            _kill_group(proc)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            if proc.stdout is not None:
                proc.stdout.close()
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), lambda: proc.kill()):
        try:
            kill()
        except (ProcessLookupError, PermissionError, OSError):
            pass


__all__ = ["CHILD_SOURCE", "check_isolation", "kernel_sandbox_error", "run_python"]
_ = sys
