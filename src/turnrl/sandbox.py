"""Run untrusted, model-written Python in a separate process with limits.

:func:`run_python` starts a fresh interpreter per call and returns an
:class:`ExecResult`; it never raises because of what the code does (a crash,
hang, fork bomb, memory bomb or flood of output becomes a status). Layers, from
the outside in:

1. **Process**: a new session (process group, killed as a whole), a private
   temporary working directory (removed afterwards), a minimal environment
   (no inherited variables, so no secrets), stdin closed, only two pipes
   inherited, the interpreter started without ``site`` (no third-party packages).
2. **Wall clock** in the parent: past ``timeout_s`` the whole group is killed.
   **Output cap**: past ``max_output_bytes`` of stdout+stderr the group is killed.
3. **Kernel limits** (``setrlimit``) in the child: CPU seconds, address space,
   file size, open files, processes (``RLIMIT_NPROC``) and no core files.
4. **Privileges**: when the parent runs as root the child drops to ``nobody``
   (no supplementary groups), so it cannot signal the parent, cannot write
   outside world-writable places, and ``RLIMIT_NPROC`` is enforced (root is
   exempt from it).
5. **Namespaces** (best effort): ``unshare(CLONE_NEWNET | CLONE_NEWPID)``
   (plus ``CLONE_NEWUSER`` when not root). A new network namespace has no
   interfaces but a downed loopback; in a new PID namespace the code runs as
   PID 1, and when it exits, or its root-owned parent is killed, the kernel
   kills every process it started, even ones that left the process group.
6. **Audit hook** (defence in depth, Python-level only): blocks sockets,
   subprocesses, ``fork``/``exec``, signals to other processes, ``ctypes``,
   importing network/process modules, writes outside the working directory,
   and reads of other processes' ``/proc`` entries.

``ExecResult.isolation`` lists the layers that were actually active; layers 4
and 5 depend on the platform and privileges and fall back silently.

The child talks to the parent over a line-based JSON channel: trusted *driver*
code running in the child may call ``host(payload)``, which the parent answers
with ``host_fn(payload)``. An environment keeps its secret state (for example
a hidden parameter) and its scoring in the parent this way, so nothing the
child reports can forge a score. Everything the child sends is untrusted.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

STATUSES = ("ok", "error", "timeout", "killed", "output_limit")

DEFAULT_PRELOAD: tuple[str, ...] = (
    "math", "random", "itertools", "functools", "collections", "heapq", "bisect",
    "operator", "copy", "time", "json",
)
"""Standard-library modules always imported before privileges are dropped.

When the child runs as ``nobody`` the interpreter's own library directory may
be unreadable (e.g. a pyenv install under ``/root``); modules imported before
the drop stay importable from ``sys.modules``. Modules in
:data:`PRELOAD_ON_IMPORT` are added when the code (or prelude) imports them.
"""

PRELOAD_ON_IMPORT: frozenset[str] = frozenset({
    "abc", "array", "base64", "binascii", "calendar", "cmath", "contextlib", "copyreg",
    "dataclasses", "datetime", "decimal", "enum", "fractions", "hashlib", "inspect", "io",
    "numbers", "pprint", "queue", "re", "statistics", "string", "struct", "textwrap",
    "threading", "types", "typing", "warnings", "weakref", "zlib",
})
"""Pure-computation standard-library modules preloaded on demand (never network or processes)."""


def _imports_of(source: str) -> set[str]:
    """Top-level module names a source imports (statically; empty if it does not parse)."""
    import ast

    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


_MAX_MESSAGE_BYTES = 1 << 20
_MAX_CODE_BYTES = 1 << 20


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one execution."""

    timeout_s: float = 10.0
    """Wall-clock limit for the whole run, start-up included (seconds)."""
    cpu_s: int | None = None
    """RLIMIT_CPU soft limit (seconds); None = ceil(timeout_s) + 1, so the wall clock usually fires first."""
    memory_mb: int = 1024
    """RLIMIT_AS: address-space limit (MiB). Allocations beyond it raise MemoryError."""
    max_output_bytes: int = 256_000
    """Combined stdout+stderr kept; producing more kills the run (status ``output_limit``)."""
    max_processes: int = 32
    """RLIMIT_NPROC (processes and threads of the child's user); enforced only for non-root."""
    max_file_mb: int = 16
    """RLIMIT_FSIZE: largest file the child may write (MiB)."""
    max_open_files: int = 64
    """RLIMIT_NOFILE."""
    drop_privileges: bool = True
    """When the parent is root, run the child as ``nobody``."""
    namespaces: bool = True
    """Try to unshare network and PID namespaces (silently skipped when not permitted)."""
    audit: bool = True
    """Install the audit-hook layer in the child."""
    preload: tuple[str, ...] = DEFAULT_PRELOAD
    """Modules always imported before privileges are dropped (see :data:`DEFAULT_PRELOAD`)."""

    def effective_cpu_s(self) -> int:
        return self.cpu_s if self.cpu_s is not None else int(self.timeout_s + 0.999) + 1


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
    """Process id of the child (its process group and session id too)."""
    isolation: tuple[str, ...] = ()
    """Layers that were active (``rlimits``, ``uid:nobody``, ``netns``, ``pidns``, ``userns``, ``audit``)."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status, "reason": self.reason, "stdout": self.stdout, "value": self.value,
            "duration_s": self.duration_s, "returncode": self.returncode,
            "output_bytes": self.output_bytes, "pid": self.pid, "isolation": list(self.isolation),
        }


class HostError(Exception):
    """Raise from a host function to make ``host(...)`` raise in the child.

    ``kind`` names the builtin exception the child raises (``ValueError``,
    ``RuntimeError``, ``TypeError``; anything else becomes ``RuntimeError``).
    """

    def __init__(self, message: str, kind: str = "RuntimeError") -> None:
        super().__init__(message)
        self.kind = kind


# --------------------------------------------------------------------------- child

_CHILD = r'''
import os, sys
def _boot():
    import json
    rfd, wfd = int(sys.argv[1]), int(sys.argv[2])
    rd = os.fdopen(rfd, "r", encoding="utf-8")
    wr = os.fdopen(wfd, "w", encoding="utf-8")
    job = json.loads(rd.readline())

    def send(msg):
        wr.write(json.dumps(msg) + "\n")
        wr.flush()

    try:
        return _setup_and_run(job, rd, wr, send)
    except BaseException as exc:  # the sandbox itself could not be set up
        try:
            send({"op": "error", "reason": "sandbox setup failed: %s: %s" % (type(exc).__name__, exc)})
        finally:
            os._exit(1)


def _setup_and_run(job, rd, wr, send):
    import json
    for name in job["preload"]:
        try:
            __import__(name)
        except Exception:
            pass
    import resource, signal, traceback, linecache, random
    layers = []
    ctypes = None
    libc = None
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
    except Exception:
        pass
    if libc is not None:
        libc.prctl(1, 9)  # PR_SET_PDEATHSIG = SIGKILL: die with the supervising parent
    if os.getppid() != job["parent"]:
        os._exit(1)
    uid = job["uid"]
    pidns = False
    if job["namespaces"] and libc is not None:
        NEWNET, NEWPID, NEWUSER = 0x40000000, 0x20000000, 0x10000000
        tries = [NEWNET | NEWPID, NEWNET] if os.geteuid() == 0 else [
            NEWUSER | NEWNET | NEWPID, NEWUSER | NEWNET]
        for flags in tries:
            if libc.unshare(flags) == 0:
                layers.append("netns")
                if flags & NEWUSER:
                    layers.append("userns")
                pidns = bool(flags & NEWPID)
                break
    if pidns:
        pid = os.fork()
        if pid:
            # outside the namespace: wait, then mirror the child's end
            try:
                _, st, usage = os.wait4(pid, 0)
            except ChildProcessError:
                os._exit(1)
            if os.WIFSIGNALED(st):
                sig = os.WTERMSIG(st)
                # as PID 1 the child ignores SIGXCPU and dies at the hard CPU limit by SIGKILL
                if sig == signal.SIGKILL and usage.ru_utime + usage.ru_stime >= job["limits"]["cpu_s"]:
                    sig = signal.SIGXCPU
                if sig not in (signal.SIGKILL, signal.SIGSTOP):
                    signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), sig)
                os._exit(128 + sig)
            os._exit(os.WEXITSTATUS(st) if os.WIFEXITED(st) else 1)
        layers.append("pidns")
    lim = job["limits"]
    def setlim(which, soft, hard=None):
        hard = soft if hard is None else hard
        _, cur = resource.getrlimit(which)
        if cur != resource.RLIM_INFINITY:  # cannot raise a hard limit: clamp to it
            soft, hard = min(soft, cur), min(hard, cur)
        try:
            resource.setrlimit(which, (soft, hard))
        except (ValueError, OSError):
            pass
    setlim(resource.RLIMIT_CPU, lim["cpu_s"], lim["cpu_s"] + 1)
    setlim(resource.RLIMIT_AS, lim["memory_mb"] << 20)
    setlim(resource.RLIMIT_FSIZE, lim["max_file_mb"] << 20)
    setlim(resource.RLIMIT_NOFILE, lim["max_open_files"])
    setlim(resource.RLIMIT_NPROC, lim["max_processes"])
    setlim(resource.RLIMIT_CORE, 0)
    layers.append("rlimits")
    workdir = job["workdir"]
    os.chdir(workdir)
    parent = os.getppid()
    if uid is not None:
        try:
            os.setgroups([])
            os.setgid(job["gid"])
            os.setuid(uid)
        except OSError as exc:
            raise RuntimeError("could not drop privileges to uid %d (%s); run as a non-root user "
                               "or set SandboxLimits(drop_privileges=False)" % (uid, exc)) from None
        layers.append("uid:%d" % uid)
    if libc is not None:
        libc.prctl(1, 9)  # PR_SET_PDEATHSIG = SIGKILL (after setuid, which clears it)
    if not pidns and os.getppid() != parent:
        os._exit(1)
    del libc, ctypes
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]
    sys.stdout.reconfigure(line_buffering=True)
    random.seed(0)

    def host(payload):
        send({"op": "host", "payload": payload})
        line = rd.readline()
        if not line:
            raise RuntimeError("sandbox host closed the channel")
        reply = json.loads(line)
        if "error" in reply:
            kind = {"ValueError": ValueError, "TypeError": TypeError}.get(reply.get("kind"), RuntimeError)
            raise kind(reply["error"])
        return reply.get("value")

    result = {}

    def set_result(value):
        result["value"] = value

    if job["audit"]:
        _install_audit(workdir)
        layers.append("audit")
    send({"op": "layers", "layers": layers})

    user_files = (job["filename"], "<prelude>", "<driver>")

    def report(exc):
        tb = exc.__traceback__
        frames = [f for f in traceback.extract_tb(tb) if f.filename in user_files]
        lines = ["Traceback (most recent call last):\n"] if frames else []
        lines += traceback.format_list(frames)
        lines += traceback.format_exception_only(type(exc), exc)
        sys.stdout.flush()
        sys.stderr.write("".join(lines))
        sys.stderr.flush()
        where = ""
        if frames and frames[-1].filename == job["filename"]:
            where = " (line %d)" % frames[-1].lineno
        elif isinstance(exc, SyntaxError) and exc.lineno:
            where = " (line %d)" % exc.lineno
        msg = exc.msg if isinstance(exc, SyntaxError) else str(exc)
        if len(msg) > 300:
            msg = msg[:300] + "..."
        text = type(exc).__name__ + (": " + msg if msg else "")
        send({"op": "error", "reason": text + where})

    user = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        for src, fname in ((job["prelude"], "<prelude>"), (job["code"], job["filename"])):
            if src:
                linecache.cache[fname] = (len(src), None, src.splitlines(True), fname)
                exec(compile(src, fname, "exec"), user)
        if job["driver"]:
            scope = {"__name__": "__driver__", "__builtins__": __builtins__, "user": user,
                     "host": host, "inputs": job["inputs"], "set_result": set_result,
                     "report": report}
            exec(compile(job["driver"], "<driver>", "exec"), scope)
        elif "result" in user:
            result["value"] = user["result"]
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            send({"op": "result", "value": result.get("value")})
        except (TypeError, ValueError):
            send({"op": "result", "value": None, "unserializable": True})
    except SystemExit as exc:
        code = exc.code
        sys.stdout.flush()
        if code is None or code == 0:
            os._exit(0)
        if not isinstance(code, int):
            sys.stderr.write(str(code) + "\n")
            code = 1
        send({"op": "error", "reason": "exited with code %d (sys.exit)" % code})
        sys.stderr.flush()
        os._exit(code & 0xFF or 1)
    except BaseException as exc:
        try:
            report(exc)
        except BaseException:
            pass
        os._exit(1)
    os._exit(0)


def _install_audit(workdir):
    import os, sys
    real = os.path.realpath
    root = real(workdir)
    me = str(os.getpid())
    blocked = {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
               "socket.gethostbyname", "socket.sendto", "subprocess.Popen", "os.system",
               "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
               "os.killpg", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
               "ctypes.call_function", "resource.setrlimit", "resource.prlimit",
               "os.chown", "os.link", "os.symlink"}
    blocked_modules = {"socket", "_socket", "ssl", "_ssl", "subprocess", "_posixsubprocess",
                       "multiprocessing", "_multiprocessing", "ctypes", "_ctypes", "pty"}
    modifying = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod",
                 "os.truncate", "os.utime", "shutil.rmtree"}
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def inside(path):
        if isinstance(path, int):
            return True
        if isinstance(path, bytes):
            path = path.decode("utf-8", "replace")
        path = str(path)
        if path == "/dev/null":
            return True
        full = real(os.path.join(root, path))
        return full == root or full.startswith(root + os.sep)

    def hook(event, args):
        if event in blocked:
            raise PermissionError("sandbox: %s is not allowed" % event)
        if event == "import":
            if str(args[0]).split(".")[0] in blocked_modules:
                raise ImportError("sandbox: module %r is not available" % args[0])
        elif event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags)
            if writing and not inside(path):
                raise PermissionError("sandbox: writing outside the working directory is not allowed: %r" % (path,))
            if isinstance(path, (str, bytes)):
                p = path.decode("utf-8", "replace") if isinstance(path, bytes) else path
                if p.startswith("/proc/"):
                    head = p[6:].split("/", 1)[0]
                    if head not in ("self", "thread-self", me):
                        raise PermissionError("sandbox: reading other processes is not allowed")
        elif event in modifying:
            for p in args[:2]:
                if isinstance(p, (str, bytes)) and not inside(p):
                    raise PermissionError("sandbox: %s outside the working directory is not allowed" % event)
        elif event == "os.kill":
            if args[0] != os.getpid():
                raise PermissionError("sandbox: signalling other processes is not allowed")

    sys.addaudithook(hook)


_boot()
'''


# --------------------------------------------------------------------------- parent


def _nobody() -> tuple[int, int]:
    try:
        import pwd

        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except (ImportError, KeyError):
        return 65534, 65534


def _minimal_env(workdir: str) -> dict[str, str]:
    return {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONIOENCODING": "utf-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "HOME": workdir,
        "TMPDIR": workdir,
    }


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _kill_group(proc: subprocess.Popen) -> None:
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), lambda: proc.kill()):
        try:
            kill()
        except (ProcessLookupError, PermissionError, OSError):
            pass


def _exited_unreaped(pid: int) -> bool:
    """True when ``pid`` has exited, without reaping it (its group id stays reserved)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None and info.si_pid == pid


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
    """Execute untrusted ``code`` in a fresh, limited interpreter.

    ``prelude`` (trusted, e.g. an environment's source) runs first in the same
    namespace as ``code``. ``driver`` (trusted) then runs in its own namespace
    with ``user`` (the code's globals), ``host(payload)`` (a round trip to
    ``host`` here in the parent), ``inputs``, ``set_result(value)`` and
    ``report(exc)`` (print a traceback of the code's frames and record the
    error). Without a driver, a global named ``result`` in the code becomes
    ``value``. Never raises for anything the code does.
    """
    limits = limits or SandboxLimits()
    start = time.monotonic()
    if len(code.encode("utf-8", "replace")) > _MAX_CODE_BYTES:
        return ExecResult("error", f"code longer than {_MAX_CODE_BYTES} bytes", duration_s=0.0)
    run_as: tuple[int, int] | None = None
    if limits.drop_privileges and hasattr(os, "geteuid") and os.geteuid() == 0:
        run_as = _nobody()
    workdir = tempfile.mkdtemp(prefix="turnrl-sandbox-")
    to_child_r = to_child_w = from_child_r = from_child_w = -1
    proc: subprocess.Popen | None = None
    try:
        os.chmod(workdir, 0o700)
        if run_as is not None:
            os.chown(workdir, run_as[0], run_as[1])
        job = {
            "code": code, "prelude": prelude or "", "driver": driver or "", "inputs": inputs,
            "filename": filename, "workdir": workdir, "audit": limits.audit, "parent": os.getpid(),
            "namespaces": limits.namespaces,
            "preload": list(limits.preload) + sorted(
                (_imports_of(code) | _imports_of(prelude or "")) & PRELOAD_ON_IMPORT - set(limits.preload)),
            "uid": run_as[0] if run_as else None, "gid": run_as[1] if run_as else None,
            "limits": {
                "cpu_s": limits.effective_cpu_s(), "memory_mb": limits.memory_mb,
                "max_file_mb": limits.max_file_mb, "max_open_files": limits.max_open_files,
                "max_processes": limits.max_processes,
            },
        }
        try:
            job_line = (json.dumps(job) + "\n").encode("utf-8")
        except (TypeError, ValueError) as exc:
            return ExecResult("error", f"inputs are not JSON-serializable: {exc}")
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        try:
            proc = subprocess.Popen(
                [python or sys.executable, "-S", "-s", "-B", "-P", "-c", _CHILD,
                 str(to_child_r), str(from_child_w)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                env=_minimal_env(workdir), cwd=workdir, pass_fds=(to_child_r, from_child_w),
                close_fds=True, start_new_session=True,
            )
        except OSError as exc:
            return ExecResult("error", f"could not start the sandbox: {exc}",
                              duration_s=time.monotonic() - start)
        os.close(to_child_r)
        os.close(from_child_w)
        to_child_r = from_child_w = -1
        return _supervise(proc, job_line, to_child_w, from_child_r, host, limits, start)
    finally:
        if proc is not None:
            _kill_group(proc)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            if proc.stdout is not None:
                proc.stdout.close()
        for fd in (to_child_r, to_child_w, from_child_r, from_child_w):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        shutil.rmtree(workdir, ignore_errors=True)


def _ask_host(host: Callable[[Any], Any] | None, payload: Any) -> dict[str, Any]:
    """The reply to one ``host(payload)`` call; a failing host becomes an error in the child."""
    if host is None:
        return {"error": "no host is attached", "kind": "RuntimeError"}
    try:
        return {"value": host(payload)}
    except HostError as exc:
        return {"error": str(exc), "kind": exc.kind}
    except Exception as exc:
        return {"error": f"host failed: {type(exc).__name__}: {exc}", "kind": "RuntimeError"}


def _supervise(
    proc: subprocess.Popen,
    job_line: bytes,
    to_child: int,
    from_child: int,
    host: Callable[[Any], Any] | None,
    limits: SandboxLimits,
    start: float,
) -> ExecResult:
    deadline = start + limits.timeout_s
    out = bytearray()
    out_total = 0
    msg_buf = bytearray()
    value: Any = None
    child_error = ""
    layers: tuple[str, ...] = ()
    verdict: tuple[str, str] | None = None  # set when the parent ends the run

    try:
        os.write(to_child, job_line)
    except OSError:
        pass  # the child died at once; its exit status tells why
    os.set_blocking(to_child, False)

    assert proc.stdout is not None
    out_fd = proc.stdout.fileno()
    sel = selectors.DefaultSelector()
    sel.register(out_fd, selectors.EVENT_READ, "out")
    sel.register(from_child, selectors.EVENT_READ, "msg")
    open_streams = 2
    exited_at: float | None = None

    def reply(obj: dict[str, Any]) -> bool:
        try:
            data = (json.dumps(obj) + "\n").encode("utf-8")
        except (TypeError, ValueError) as exc:
            data = (json.dumps({"error": f"host reply not serializable: {exc}"}) + "\n").encode("utf-8")
        try:
            written = os.write(to_child, data)
        except BlockingIOError:
            return False
        except OSError:
            return True  # the child is gone; its exit status tells why
        return written == len(data)

    while verdict is None and open_streams:
        now = time.monotonic()
        if now >= deadline:
            verdict = ("timeout", f"wall-clock limit of {limits.timeout_s:g} s exceeded")
            break
        if exited_at is None and _exited_unreaped(proc.pid):
            exited_at = now
            _kill_group(proc)  # stragglers in the group must not hold the pipes open
        if exited_at is not None and now - exited_at > 1.0:
            break
        events = sel.select(timeout=min(0.1, deadline - now))
        for key, _ in events:
            try:
                chunk = os.read(key.fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                sel.unregister(key.fd)
                open_streams -= 1
                continue
            if key.data == "out":
                out_total += len(chunk)
                room = limits.max_output_bytes - len(out)
                if room > 0:
                    out += chunk[:room]
                if out_total > limits.max_output_bytes:
                    verdict = ("output_limit", f"output exceeded {limits.max_output_bytes} bytes")
                    break
                continue
            msg_buf += chunk
            while verdict is None and b"\n" in msg_buf:
                line, _, rest = msg_buf.partition(b"\n")
                msg_buf = bytearray(rest)
                try:
                    msg = json.loads(line)
                    op = msg["op"]
                    if op == "host":
                        answer = _ask_host(host, msg.get("payload"))
                        if not reply(answer):
                            verdict = ("error", "sandbox protocol violation (host replies not read)")
                    elif op == "result":
                        value = msg.get("value")
                    elif op == "error":
                        child_error = str(msg.get("reason", ""))[:500]
                    elif op == "layers":
                        layers = tuple(str(x) for x in msg["layers"][:16])
                except Exception:  # anything the child sends is untrusted: never crash the caller
                    verdict = ("error", "sandbox protocol violation (malformed message)")
            if verdict is None and len(msg_buf) > _MAX_MESSAGE_BYTES:
                verdict = ("error", "sandbox protocol violation (message too large)")
    sel.close()

    if verdict is None:
        remaining = max(0.0, deadline - time.monotonic())
        try:
            proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            verdict = ("timeout", f"wall-clock limit of {limits.timeout_s:g} s exceeded")
    if verdict is not None:
        _kill_group(proc)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    duration = time.monotonic() - start
    stdout = bytes(out).decode("utf-8", "replace")
    rc = proc.returncode
    common = {"stdout": stdout, "duration_s": duration, "returncode": rc,
              "output_bytes": out_total, "pid": proc.pid, "isolation": ("session",) + layers}
    if verdict is not None:
        return ExecResult(verdict[0], verdict[1], **common)
    if rc == 0:
        return ExecResult("ok", "", value=value, **common)
    if rc is not None and rc < 0:
        sig = -rc
        if sig in (signal.SIGXCPU,):
            return ExecResult("timeout", f"CPU-time limit of {limits.effective_cpu_s()} s exceeded", **common)
        hint = {
            signal.SIGKILL: " (memory, CPU-time or process limit)",
            signal.SIGSEGV: " (crash, e.g. recursion too deep)",
        }.get(sig, "")
        return ExecResult("killed", f"killed by {_signal_name(sig)}{hint}", **common)
    reason = child_error or f"exited with code {rc}"
    return ExecResult("error", reason, **common)


# --------------------------------------------------------------------------- pool


class SandboxPool:
    """Run many sandboxed executions concurrently (each is its own process).

    Threads only wait on child processes, so ``max_workers`` defaults to the
    number of CPUs. Use as a context manager or call :meth:`close`.
    """

    def __init__(self, max_workers: int | None = None, limits: SandboxLimits | None = None) -> None:
        self.max_workers = max(1, max_workers or os.cpu_count() or 1)
        self.limits = limits
        self._executor = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="sandbox")

    def submit(self, code: str, **kwargs: Any) -> Future[ExecResult]:
        """Schedule :func:`run_python` (keyword arguments as there; ``limits`` defaults to the pool's)."""
        kwargs.setdefault("limits", self.limits)
        return self._executor.submit(run_python, code, **kwargs)

    def submit_call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """Schedule any function that runs sandboxes itself (e.g. an environment's evaluator)."""
        return self._executor.submit(fn, *args, **kwargs)

    def map(self, codes: Iterable[str], **kwargs: Any) -> list[ExecResult]:
        """Run each code with the same keyword arguments; results in input order."""
        futures = [self.submit(code, **kwargs) for code in codes]
        return [f.result() for f in futures]

    def map_calls(self, fn: Callable[..., Any], argument_lists: Iterable[tuple[Any, ...]]) -> list[Any]:
        """``[fn(*args) for args in argument_lists]``, concurrently, in input order."""
        futures = [self.submit_call(fn, *args) for args in argument_lists]
        return [f.result() for f in futures]

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "DEFAULT_PRELOAD",
    "PRELOAD_ON_IMPORT",
    "STATUSES",
    "ExecResult",
    "HostError",
    "SandboxLimits",
    "SandboxPool",
    "run_python",
]
