"""The sandbox's child program: it runs inside the sandbox, in a fresh interpreter.

This file is trusted code, but it is never imported by the package in the
child: :mod:`turnrl.sandbox.supervisor` reads it as source and starts
``python -I -S -B -c <this source> RFD WFD`` (inside bubblewrap for the
kernel sandbox). Only the standard library may be used here, and everything
must be set up before the untrusted code runs:

1. read the job (one JSON line) from fd ``RFD``; preload modules;
2. weaker sandbox only: best-effort ``unshare`` of network/PID namespaces;
3. ``setrlimit`` (CPU, memory, file size, open files, processes, no core);
4. kernel sandbox, not root: enter its own user (and mount) namespace, nested in
   bubblewrap's, so that it holds no capability over bubblewrap's PID 1 (same
   uid): no ptrace-class access (``/proc/1/fd``, ``/proc/1/mem``, ``pidfd_getfd``)
   to the process that reports its exit status;
5. kernel sandbox: mount the private directory, a tmpfs of ``max_dir_mb`` and
   ``max_dir_files`` entries, over ``/sandbox``;
6. as root: drop to ``nobody`` with no groups (caps are cleared with it); then
   clear every capability left (all of the nested namespace's when not root)
   and check that none is;
7. ``PR_SET_NO_NEW_PRIVS`` and the seccomp filter (BPF built by the parent);
8. the audit hook (clear Python-level errors; not a security boundary);
9. send ``{"op": "ready", "layers": [...]}`` -- the only layer report the
   parent accepts, sent before any untrusted code exists -- then run the
   prelude, the code and the driver.

Any setup step that was asked for and fails ends the child before step 7.
"""

import os
import sys


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
        layers = _setup(job)
    except BaseException as exc:  # the sandbox itself could not be set up
        try:
            send(
                {
                    "op": "setup_error",
                    "reason": f"sandbox setup failed: {type(exc).__name__}: {exc}",
                }
            )
        finally:
            os._exit(1)
    _run(job, rd, send, layers)


def _setlim(resource, which, soft, hard=None):
    hard = soft if hard is None else hard
    _, cur = resource.getrlimit(which)
    if cur != resource.RLIM_INFINITY:  # cannot raise a hard limit: clamp to it
        soft, hard = min(soft, cur), min(hard, cur)
    resource.setrlimit(which, (soft, hard))


def _weak_namespaces(job, libc, layers):
    """Best-effort unshare for the weaker sandbox; returns True when in a new PID namespace."""
    import signal

    NEWNET, NEWPID, NEWUSER = 0x40000000, 0x20000000, 0x10000000
    tries = [NEWNET | NEWPID, NEWNET] if os.geteuid() == 0 else [NEWUSER | NEWNET | NEWPID, NEWUSER | NEWNET]
    flags = next((f for f in tries if libc.unshare(f) == 0), 0)
    if not flags:
        return False
    layers.append("netns")
    if flags & NEWUSER:
        layers.append("userns")
    if not flags & NEWPID:
        return False
    pid = os.fork()
    if pid:  # outside the namespace: wait, then mirror the child's end
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
    return True


def _load_seccomp(ctypes, libc, bpf):
    """Install a classic-BPF seccomp filter (``bpf``: the raw program, 8 bytes per instruction)."""

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    if len(bpf) % 8 or not bpf:
        raise RuntimeError("malformed seccomp program")
    prog = SockFprog(len(bpf) // 8, bpf)
    PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed: " + os.strerror(ctypes.get_errno()))


def _own_user_namespace(ctypes, libc):
    """Enter a new user + mount namespace, mapping the same uid/gid (class 6 of issue 22).

    Bubblewrap's PID 1 runs as the same uid; in its user namespace the child could
    ptrace-access it (``pidfd_getfd``, ``/proc/1/fd``, ``/proc/1/mem``) and forge the
    exit status it reports. The kernel grants ptrace-class access to a process of
    another user namespace only with CAP_SYS_PTRACE *in that namespace*, which a
    process of a nested namespace never has: every such path is closed at once.
    """
    uid, gid = os.getuid(), os.getgid()
    NEWUSER, NEWNS = 0x10000000, 0x00020000
    if libc.unshare(NEWUSER | NEWNS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, "unshare(user + mount namespace) failed: " + os.strerror(err))
    for name, text in (("uid_map", f"{uid} {uid} 1\n"), ("setgroups", "deny\n"), ("gid_map", f"{gid} {gid} 1\n")):
        with open("/proc/self/" + name, "w") as f:
            f.write(text)


def _private_tmpfs(ctypes, libc, job):
    """Mount the private directory: a tmpfs bounded in bytes and in entries (inodes, hard links too)."""
    lim = job["limits"]
    opts = "size={},nr_inodes={},mode=0700".format(lim["max_dir_mb"] << 20, lim["max_dir_files"] + 1)
    if job["uid"] is not None:  # root: mounted before the drop, owned by the uid the child becomes
        opts += ",uid={},gid={}".format(job["uid"], job["gid"])
    MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    target = job["workdir"].encode()
    if libc.mount(b"tmpfs", target, b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, opts.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount of the private tmpfs ({opts}) failed: {os.strerror(err)}")


def _drop_capabilities(ctypes, libc):
    """Clear every capability (bounding where allowed, ambient, effective, permitted, inheritable)."""
    PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    cap = 0
    while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:  # EINVAL past the last capability
        cap += 1
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()
    if libc.capset(header, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, "capset failed: " + os.strerror(err))


def _check_no_capabilities():
    with open("/proc/self/status") as f:
        caps = {k: v.strip() for k, _, v in (line.partition(":") for line in f) if k.startswith("Cap")}
    held = {k: v for k, v in caps.items() if k in ("CapEff", "CapPrm", "CapInh", "CapAmb") and int(v, 16)}
    if held:
        raise RuntimeError(f"capabilities left after the drop: {held}")


def _setup(job):
    import base64
    import linecache  # noqa: F401  (needed by _run; imported while the library is surely readable)
    import random  # noqa: F401
    import resource
    import traceback  # noqa: F401

    for name in job["preload"]:
        try:
            __import__(name)
        except Exception:
            pass
    layers = []
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
    libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)  # SIGKILL: die with the supervising parent
    if not job["kernel"] and os.getppid() != job["parent"]:
        os._exit(1)
    if not job["kernel"] and job["namespaces"]:
        _weak_namespaces(job, libc, layers)
    lim = job["limits"]
    _setlim(resource, resource.RLIMIT_CPU, lim["cpu_s"], lim["cpu_s"] + 1)
    _setlim(resource, resource.RLIMIT_AS, lim["memory_mb"] << 20)
    _setlim(resource, resource.RLIMIT_FSIZE, lim["max_file_mb"] << 20)
    _setlim(resource, resource.RLIMIT_NOFILE, lim["max_open_files"])
    _setlim(resource, resource.RLIMIT_NPROC, lim["max_processes"])
    _setlim(resource, resource.RLIMIT_CORE, 0)
    layers.append("rlimits")
    if job["kernel"]:
        if job["uid"] is None:
            _own_user_namespace(ctypes, libc)
            layers.append("subuserns")
        _private_tmpfs(ctypes, libc, job)
        layers.append("dirquota")
    if job["uid"] is not None:
        try:
            os.setgroups([])
            os.setgid(job["gid"])
            os.setuid(job["uid"])
        except (OSError, OverflowError) as exc:
            raise RuntimeError("could not drop privileges to uid {} ({})".format(job["uid"], exc)) from None
        if os.getuid() != job["uid"] or os.geteuid() != job["uid"]:
            raise RuntimeError("uid did not change")
        layers.append(f"uid:{job['uid']}")
        libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)  # setuid clears it
    if job["kernel"]:
        _drop_capabilities(ctypes, libc)  # as root the drop cleared all but the inheritable set
        _check_no_capabilities()
    os.chdir(job["workdir"])  # after the drop: the directory belongs to the child's user
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    layers.append("nnp")
    if job["seccomp"]:
        _load_seccomp(ctypes, libc, base64.b64decode(job["seccomp"]))
        layers.append("seccomp")
    del libc, ctypes
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]
    if job["audit"]:
        _install_audit(job["workdir"])
        layers.append("audit")
    return layers


def _run(job, rd, send, layers):
    import json
    import linecache
    import random
    import traceback

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

    user_files = (job["filename"], "<prelude>", "<driver>")

    def report(exc):
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename in user_files]
        lines = ["Traceback (most recent call last):\n"] if frames else []
        lines += traceback.format_list(frames)
        lines += traceback.format_exception_only(type(exc), exc)
        sys.stdout.flush()
        sys.stderr.write("".join(lines))
        sys.stderr.flush()
        where = ""
        if frames and frames[-1].filename == job["filename"]:
            where = f" (line {frames[-1].lineno})"
        elif isinstance(exc, SyntaxError) and exc.lineno:
            where = f" (line {exc.lineno})"
        msg = exc.msg if isinstance(exc, SyntaxError) else str(exc)
        if len(msg) > 300:
            msg = msg[:300] + "..."
        send({"op": "error", "reason": type(exc).__name__ + (": " + msg if msg else "") + where})

    send({"op": "ready", "layers": layers})
    user = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        for src, fname in ((job["prelude"], "<prelude>"), (job["code"], job["filename"])):
            if src:
                linecache.cache[fname] = (len(src), None, src.splitlines(True), fname)
                exec(compile(src, fname, "exec"), user)
        if job["driver"]:
            scope = {
                "__name__": "__driver__",
                "__builtins__": __builtins__,
                "user": user,
                "host": host,
                "inputs": job["inputs"],
                "set_result": set_result,
                "report": report,
            }
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
        send({"op": "error", "reason": f"exited with code {code} (sys.exit)"})
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
    """Python-level checks with clear messages; the kernel layers are what hold."""
    real = os.path.realpath
    root = real(workdir)
    me = str(os.getpid())
    blocked = {
        "socket.__new__",
        "socket.connect",
        "socket.bind",
        "socket.getaddrinfo",
        "socket.gethostbyname",
        "socket.sendto",
        "subprocess.Popen",
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "os.killpg",
        "ctypes.dlopen",
        "ctypes.dlsym",
        "ctypes.cdata",
        "ctypes.call_function",
        "resource.setrlimit",
        "resource.prlimit",
        "os.chown",
        "os.link",
        "os.symlink",
    }
    blocked_modules = {
        "socket",
        "_socket",
        "ssl",
        "_ssl",
        "subprocess",
        "_posixsubprocess",
        "multiprocessing",
        "_multiprocessing",
        "ctypes",
        "_ctypes",
        "pty",
    }
    modifying = {
        "os.remove",
        "os.rename",
        "os.rmdir",
        "os.mkdir",
        "os.chmod",
        "os.truncate",
        "os.utime",
        "shutil.rmtree",
    }
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
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import":
            if str(args[0]).split(".")[0] in blocked_modules:
                raise ImportError(f"sandbox: module {args[0]!r} is not available")
        elif event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags
            )
            if writing and not inside(path):
                raise PermissionError(f"sandbox: writing outside the working directory is not allowed: {path!r}")
            if isinstance(path, (str, bytes)):
                p = path.decode("utf-8", "replace") if isinstance(path, bytes) else path
                if p.startswith("/proc/"):
                    head = p[6:].split("/", 1)[0]
                    if head not in ("self", "thread-self", me):
                        raise PermissionError("sandbox: reading other processes is not allowed")
        elif event in modifying:
            for p in args[:2]:
                if isinstance(p, (str, bytes)) and not inside(p):
                    raise PermissionError(f"sandbox: {event} outside the working directory is not allowed")
        elif event == "os.kill":
            if args[0] != os.getpid():
                raise PermissionError("sandbox: signalling other processes is not allowed")

    sys.addaudithook(hook)


if __name__ == "__main__":
    _boot()
