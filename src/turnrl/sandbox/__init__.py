"""Run untrusted, model-written Python in an isolated process with limits.

:func:`run_python` starts a fresh interpreter per call and returns an
:class:`ExecResult`; it never raises because of what the code does (a crash,
hang, fork bomb, memory bomb or flood of output becomes a status).

The default is the **kernel sandbox** (``layers.py``): bubblewrap creates mount,
PID, network, IPC, UTS (and, when not root, user) namespaces around a
read-only view of ``/usr`` and the interpreter (every ``site-packages``
hidden) and a fresh ``/proc``; the child program (``child.py``, shipped as
source) then sets ``setrlimit`` limits, enters its own nested user namespace
when not root (no ptrace-class access to bubblewrap's PID 1), mounts the private
directory (a tmpfs bounded in bytes and entries, the only writable place), drops
to ``nobody`` when the parent is root, clears every capability, sets
no-new-privileges and installs a seccomp filter (libseccomp via ``pyseccomp``)
before any untrusted code runs. :class:`SandboxLimits` is a strict typed model.
When a layer cannot be set up the call raises :class:`SandboxUnavailable`, naming the layer and ``allow_weaker``; with
``SandboxLimits(allow_weaker=True)`` it runs with what is available (process
group, rlimits, best-effort ``unshare``, audit hook) and says so in
``ExecResult.isolation``.

The child talks to the parent over a line-based JSON channel (``channel.py``):
trusted *driver* code in the child may call ``host(payload)``, which the parent
answers with ``host_fn(payload)``. An environment keeps its secret state and
its scoring in the parent this way, so nothing the child reports can forge a
score. Everything the child sends is untrusted.
"""

from turnrl.sandbox.limits import (
    DEFAULT_PRELOAD,
    PRELOAD_ON_IMPORT,
    STATUSES,
    WEAKER_SETTING,
    ExecResult,
    HostError,
    SandboxLimits,
    SandboxUnavailable,
)
from turnrl.sandbox.pool import SandboxPool
from turnrl.sandbox.supervisor import (
    CHILD_SOURCE,
    check_isolation,
    kernel_sandbox_error,
    run_python,
)

__all__ = [
    "CHILD_SOURCE",
    "DEFAULT_PRELOAD",
    "PRELOAD_ON_IMPORT",
    "STATUSES",
    "WEAKER_SETTING",
    "ExecResult",
    "HostError",
    "SandboxLimits",
    "SandboxPool",
    "SandboxUnavailable",
    "check_isolation",
    "kernel_sandbox_error",
    "run_python",
]
