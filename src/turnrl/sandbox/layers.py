"""The kernel layers, set up by the parent: bubblewrap's command line and the seccomp program.

Chosen mechanisms (see docs/slosh_tank.md, "Threat model"):

- **bubblewrap** (``bwrap``, from the distribution) creates the mount, PID,
  network, IPC, UTS (and, when not root, user) namespaces, a read-only view of
  ``/usr`` and the interpreter's prefix with every ``site-packages`` hidden,
  a fresh ``/proc`` of the new PID namespace, a minimal ``/dev`` and the mount
  point ``/sandbox``, where the child mounts its bounded private tmpfs (the only
  writable place); ``--die-with-parent`` and
  ``--new-session``; its PID 1 takes every process of the namespace down when
  the child exits. No hand-written namespace code in the default path.
- **seccomp** through libseccomp's Python binding (``pyseccomp``): the parent
  compiles a filter (default allow; deny exec, new processes, non-Unix
  sockets, ptrace, mount, namespace and kernel-module calls, ...) to BPF; the
  child installs it with ``PR_SET_NO_NEW_PRIVS`` before any untrusted code.
"""

from __future__ import annotations

import functools
import glob
import os
import shutil
import sys
import sysconfig
from pathlib import Path

SANDBOX_DIR = "/sandbox"
"""Where the private directory appears inside the kernel sandbox (also ``HOME`` and ``TMPDIR``)."""

DENIED_SYSCALLS = (
    "execve", "execveat", "fork", "vfork", "ptrace", "process_vm_readv", "process_vm_writev",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "move_mount", "open_tree",
    "fsopen", "fsmount", "fspick", "mount_setattr", "keyctl", "add_key", "request_key", "bpf",
    "perf_event_open", "kexec_load", "kexec_file_load", "init_module", "finit_module",
    "delete_module", "reboot", "swapon", "swapoff", "acct", "userfaultfd", "io_uring_setup",
    "io_uring_enter", "io_uring_register", "name_to_handle_at", "open_by_handle_at", "mknod",
    "mknodat", "personality", "quotactl", "syslog", "lookup_dcookie", "kcmp",
    "pidfd_open", "pidfd_getfd", "pidfd_send_signal", "process_madvise", "process_mrelease",
    "memfd_create", "memfd_secret",
)  # fmt: skip
"""Denied with EPERM. ``clone`` without ``CLONE_THREAD`` (a new process) is denied too, ``clone3``
gets ENOSYS (glibc then falls back to ``clone``), sockets other than ``AF_UNIX`` get EPERM,
``prlimit64`` on another process gets EPERM, and system calls of other architectures (i386/x32
entry points) kill the process. Every call that acts on another process through a pid or a pidfd
(ptrace, process_vm_*, kcmp, the pidfd calls, process_madvise/mrelease, prlimit64) is denied;
``memfd_create`` too, so that the private tmpfs is the only writable storage."""


def seccomp_program() -> bytes:
    """The raw BPF program of the filter (raises ImportError/OSError when libseccomp is missing)."""
    return _seccomp_program()


@functools.lru_cache(maxsize=1)
def _seccomp_program() -> bytes:
    import pyseccomp as sc

    errno_eperm, errno_enosys = 1, 38
    clone_thread, af_unix = 0x00010000, 1
    f = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED_SYSCALLS:
        try:
            f.add_rule(sc.ERRNO(errno_eperm), name)
        except (OSError, ValueError, RuntimeError):
            pass  # not a system call on this architecture
    f.add_rule(sc.ERRNO(errno_eperm), "clone", sc.Arg(0, sc.MASKED_EQ, clone_thread, 0))
    f.add_rule(sc.ERRNO(errno_enosys), "clone3")
    f.add_rule(sc.ERRNO(errno_eperm), "socket", sc.Arg(0, sc.NE, af_unix))
    f.add_rule(sc.ERRNO(errno_eperm), "socketpair", sc.Arg(0, sc.NE, af_unix))
    f.add_rule(sc.ERRNO(errno_eperm), "prlimit64", sc.Arg(0, sc.NE, 0))  # another process's limits
    r, w = os.pipe()
    try:
        with os.fdopen(w, "wb", closefd=True) as out:
            f.export_bpf(out)
        with os.fdopen(r, "rb", closefd=False) as inp:
            data = inp.read()
    finally:
        os.close(r)
    if not data or len(data) % 8:
        raise OSError("libseccomp produced no program")
    return data


def find_bwrap(name: str) -> str | None:
    return shutil.which(name) if os.sep not in name else (name if os.access(name, os.X_OK) else None)


def interpreter(python: str | None) -> tuple[str, str]:
    """(real executable, prefix) of the interpreter the child runs (venvs resolve to their base)."""
    if python is None:
        return os.path.realpath(sys.executable), sys.base_prefix
    exe = os.path.realpath(python)
    return exe, str(Path(exe).parents[1])


def _under(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _site_dirs(prefix: str) -> set[str]:
    found: set[str] = set()
    vars_ = {
        "base": prefix,
        "platbase": prefix,
        "installed_base": prefix,
        "installed_platbase": prefix,
    }
    for key in ("purelib", "platlib"):
        found.add(sysconfig.get_paths(vars=vars_)[key])
    for pattern in (
        "lib*/python3*/site-packages",
        "lib*/python3*/dist-packages",
        "lib*/python3/dist-packages",
    ):
        for root in {prefix, "/usr", "/usr/local"}:
            found.update(glob.glob(os.path.join(root, pattern)))
    return {os.path.realpath(p) for p in found if os.path.isdir(p)}


def mount_plan(python: str | None) -> tuple[list[str], list[str], list[str]]:
    """(bwrap filesystem arguments, read-only roots, hidden dirs) for one run."""
    exe, prefix = interpreter(python)
    prefix = os.path.realpath(prefix)
    roots = ["/usr"]
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        p = "/" + name
        if os.path.islink(p):
            args += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            args += ["--ro-bind", p, p]
            roots.append(p)
    if not _under(prefix, roots):
        for parent in reversed(Path(prefix).parents[:-1]):  # traversable by the child's user
            args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", prefix, prefix]
        roots.append(prefix)
    if not _under(exe, roots):
        raise RuntimeError(f"the interpreter {exe} is outside its prefix {prefix}")
    args += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    hidden = sorted(d for d in _site_dirs(prefix) if _under(d, roots))
    package_root = str(Path(__file__).resolve().parents[2])  # the directory holding turnrl/
    if _under(package_root, roots) and not _under(package_root, hidden):
        hidden.append(package_root)
    for d in hidden:
        args += ["--tmpfs", d]
    # /sandbox: a mount point only; the child mounts its bounded private tmpfs there (child.py)
    args += ["--proc", "/proc", "--dev", "/dev", "--perms", "0755", "--dir", SANDBOX_DIR]
    args += [
        "--remount-ro",
        "/dev",
        "--remount-ro",
        "/",
        "--chdir",
        "/",
    ]  # read-only, even to the userns owner
    return args, roots, hidden


def visible_secrets(roots: list[str], hidden: list[str]) -> list[str]:
    """Paths that must not be visible in the sandbox but would be (empty when the plan is sound)."""
    import tempfile

    must_hide = {str(Path(__file__).resolve().parents[1]), os.getcwd(), tempfile.gettempdir()}
    for var in ("HOME",):
        if os.environ.get(var):
            must_hide.add(os.environ[var])
    bad = []
    for p in sorted(must_hide):
        rp = os.path.realpath(p)
        if rp in ("/", ""):
            continue
        if _under(rp, roots) and not _under(rp, hidden):
            bad.append(rp)
    return bad


def bwrap_command(bwrap: str, python: str | None, as_root: bool) -> tuple[list[str], list[str]]:
    """(the argument vector up to the interpreter, the namespace layers it creates)."""
    fs, roots, hidden = mount_plan(python)
    bad = visible_secrets(roots, hidden)
    if bad:
        raise RuntimeError(f"the read-only view would show {', '.join(bad)}")
    ns = [
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
    ]
    layers = ["mountns", "pidns", "netns", "ipcns", "utsns"]
    if as_root:  # no user namespace: the child mounts /sandbox, then drops to nobody (RLIMIT_NPROC exempts uid 0)
        caps = ["--cap-drop", "ALL"] + [x for c in ("SETUID", "SETGID", "SYS_ADMIN") for x in ("--cap-add", "CAP_" + c)]
    else:
        ns.insert(0, "--unshare-user")
        layers.append("userns")
        caps = ["--cap-drop", "ALL"]
    argv = [bwrap, *ns, "--die-with-parent", "--new-session", "--hostname", "sandbox", *caps, *fs]
    return argv, layers


__all__ = [
    "DENIED_SYSCALLS",
    "SANDBOX_DIR",
    "bwrap_command",
    "find_bwrap",
    "interpreter",
    "seccomp_program",
]
