"""The sandbox contains hostile code: each snippet gets the right status and the parent is unharmed."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from turnrl.sandbox import (
    DEFAULT_PRELOAD,
    ExecResult,
    HostError,
    SandboxLimits,
    SandboxPool,
    run_python,
)

FAST = SandboxLimits(timeout_s=2.0)


def _alive_in_session(sid: int) -> list[int]:
    """Processes (not zombies) whose session id is ``sid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        state, session = fields[0], int(fields[3])
        if session == sid and state != "Z":
            found.append(int(entry.name))
    return found


def _parent_still_works() -> None:
    again = run_python("result = 6 * 7")
    assert again.status == "ok" and again.value == 42


def test_normal_run_returns_output_and_value():
    r = run_python("print('hello')\nresult = {'score': 0.5, 'items': [1, 2]}")
    assert isinstance(r, ExecResult)
    assert r.status == "ok" and r.ok and r.reason == ""
    assert r.stdout == "hello\n"
    assert r.value == {"score": 0.5, "items": [1, 2]}
    assert r.returncode == 0 and 0 < r.duration_s < 5
    assert "session" in r.isolation and "rlimits" in r.isolation and "audit" in r.isolation


@pytest.fixture()
def host_tmp(monkeypatch):
    """A fresh host temp dir for the calls (traversable by ``nobody``, unlike pytest's ``tmp_path``)."""
    path = Path(tempfile.mkdtemp(prefix="turnrl-test-tmp-"))
    path.chmod(0o755)
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    yield path
    monkeypatch.undo()
    shutil.rmtree(path, ignore_errors=True)


def test_private_working_directory_is_writable_fresh_and_removed(host_tmp):
    tmp_path = host_tmp  # any host temp dir of a call lands here
    code = "import os\nopen({!r}, 'w').write('x')\nresult = [os.getcwd(), sorted(os.listdir('.'))]"
    weaker = SandboxLimits(namespaces=False, allow_weaker=True)
    for limits in (None, weaker):
        first = run_python(code.format("one.txt"), limits=limits)
        second = run_python(code.format("two.txt"), limits=limits)
        assert first.status == second.status == "ok", (first.reason, second.reason)
        assert first.value[1] == ["one.txt"] and second.value[1] == ["two.txt"]  # writable; fresh per call
        workdir = second.value[0]
        if "mountns" in second.isolation:
            assert workdir == "/sandbox" and "dirquota" in second.isolation
        else:
            assert workdir.startswith(str(tmp_path / "turnrl-sandbox-")) and "dirquota" not in second.isolation
        assert sorted(tmp_path.iterdir()) == []  # nothing left behind on the host


def test_infinite_loop_times_out():
    start = time.monotonic()
    r = run_python("while True:\n    pass", limits=FAST)
    assert r.status == "timeout"
    assert "wall-clock" in r.reason
    assert time.monotonic() - start < FAST.timeout_s + 3
    _parent_still_works()


def test_sleeping_child_times_out():
    r = run_python("import time\ntime.sleep(60)", limits=FAST)
    assert r.status == "timeout"


def test_fork_bomb_is_contained():
    r = run_python("import os\nwhile True:\n    os.fork()", limits=FAST)
    assert r.status in ("error", "killed", "timeout"), r
    assert not _alive_in_session(r.pid)
    _parent_still_works()


def test_fork_bomb_without_audit_hook_hits_process_limit():
    # Only the kernel limits act here: RLIMIT_NPROC (as nobody when the tests run as root).
    limits = SandboxLimits(timeout_s=5.0, audit=False, max_processes=16)
    r = run_python("import os\nwhile True:\n    os.fork()", limits=limits)
    assert r.status in ("error", "killed", "timeout"), r
    deadline = time.monotonic() + 3
    while _alive_in_session(r.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive_in_session(r.pid)
    _parent_still_works()


def test_memory_bomb_is_refused():
    r = run_python("block = bytearray(20 * 1024 ** 3)\nprint('allocated')", limits=FAST)
    assert r.status in ("error", "killed"), r
    assert "allocated" not in r.stdout
    if r.status == "error":
        assert "MemoryError" in r.reason


def test_write_outside_working_directory_is_blocked():
    target = Path("/tmp") / f"turnrl-escape-{uuid.uuid4().hex}"
    r = run_python(f"open({str(target)!r}, 'w').write('pwned')", limits=FAST)
    try:
        assert r.status == "error"
        assert "PermissionError" in r.reason
        assert not target.exists()
    finally:
        target.unlink(missing_ok=True)


def test_write_into_parent_tree_is_blocked(tmp_path):
    target = tmp_path / "owned.txt"
    r = run_python(f"import pathlib\npathlib.Path({str(target)!r}).write_text('x')", limits=FAST)
    assert r.status == "error"
    assert not target.exists()


@pytest.fixture
def tcp_server():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.2)
    accepted: list[int] = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except (TimeoutError, OSError):
                continue
            accepted.append(1)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join(timeout=2)
    server.close()


def test_network_socket_is_blocked(tcp_server):
    port, accepted = tcp_server
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
    r = run_python(code, limits=FAST)
    assert r.status == "error"
    assert "connected" not in r.stdout
    time.sleep(0.3)
    assert accepted == []


def test_network_namespace_alone_blocks_connections(tcp_server):
    port, accepted = tcp_server
    limits = SandboxLimits(timeout_s=3.0, audit=False, preload=DEFAULT_PRELOAD + ("socket",))
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
    r = run_python(code, limits=limits)
    if "netns" not in r.isolation:
        pytest.skip("network namespaces are not permitted here; only the audit hook blocks sockets")
    assert r.status == "error"
    assert "connected" not in r.stdout
    time.sleep(0.3)
    assert accepted == []


def test_secrets_in_parent_environment_are_not_visible(monkeypatch):
    secret = f"sk-test-{uuid.uuid4().hex}"
    monkeypatch.setenv("TURNRL_FAKE_API_KEY", secret)
    r = run_python("import os\nprint(dict(os.environ))")
    assert r.status == "ok"
    assert secret not in r.stdout and "TURNRL_FAKE_API_KEY" not in r.stdout
    r = run_python("import os\nprint(open('/proc/%d/environ' % os.getppid(), 'rb').read())", limits=FAST)
    assert r.status == "error"
    assert secret not in r.stdout


def test_killing_the_parent_fails():
    r = run_python("import os\nos.kill(os.getppid(), 9)\nprint('sent')", limits=FAST)
    assert r.status == "error"
    assert "sent" not in r.stdout
    # Without the audit hook the kernel must refuse: the child runs as another uid, or the
    # parent is outside its PID namespace. Only try it when one of those layers is active.
    no_audit = SandboxLimits(timeout_s=2.0, audit=False)
    layers = run_python("pass", limits=no_audit).isolation
    if not any(x == "pidns" or x.startswith("uid:") for x in layers):
        pytest.skip(f"only the audit hook protects the parent here (layers: {layers})")
    r = run_python(
        "import os\ntry:\n    os.kill(os.getppid(), 9)\nexcept OSError as e:\n    print(e)",
        limits=no_audit,
    )
    assert r.status in ("ok", "error")
    _parent_still_works()


def test_huge_output_is_cut():
    limits = SandboxLimits(timeout_s=10.0, max_output_bytes=100_000)
    start = time.monotonic()
    r = run_python(
        "import sys\nchunk = 'x' * 1_000_000\nfor _ in range(100):\n    sys.stdout.write(chunk)",
        limits=limits,
    )
    assert r.status == "output_limit"
    assert len(r.stdout) <= 100_000
    assert time.monotonic() - start < 8


def test_missing_module():
    r = run_python("import turnrl_no_such_module_xyz", limits=FAST)
    assert r.status == "error"
    assert "ModuleNotFoundError" in r.reason and "line 1" in r.reason


def test_sys_exit_code():
    r = run_python("import sys\nprint('bye')\nsys.exit(3)", limits=FAST)
    assert r.status == "error"
    assert r.returncode == 3
    assert "code 3" in r.reason
    assert "bye" in r.stdout
    assert run_python("import sys\nsys.exit(0)", limits=FAST).status == "ok"


def test_recursion_overflow():
    r = run_python("def f(n):\n    return f(n + 1)\nf(0)", limits=FAST)
    assert r.status == "error"
    assert "RecursionError" in r.reason
    assert 'File "<model>", line 2' in r.stdout


def test_syntax_error():
    r = run_python("def f(:\n    pass", limits=FAST)
    assert r.status == "error"
    assert r.reason.startswith("SyntaxError") and "line 1" in r.reason


def test_runtime_error_traceback_shows_only_model_frames():
    r = run_python("x = 1\ny = x / 0", limits=FAST)
    assert r.status == "error"
    assert r.reason == "ZeroDivisionError: division by zero (line 2)"
    assert "<driver>" not in r.stdout and "_boot" not in r.stdout


def test_host_round_trip_and_errors():
    calls = []

    def host(payload):
        calls.append(payload)
        if payload == "bad":
            raise HostError("no such thing", "ValueError")
        return {"echo": payload}

    driver = (
        "out = [host(x)['echo'] for x in inputs]\n"
        "try:\n    host('bad')\nexcept ValueError as e:\n    out.append(str(e))\n"
        "out.append(user['f'](2))\nset_result(out)\n"
    )
    r = run_python("def f(x):\n    return x * 10", driver=driver, inputs=[1, "a"], host=host, limits=FAST)
    assert r.status == "ok", r.reason
    assert r.value == [1, "a", "no such thing", 20]
    assert calls == [1, "a", "bad"]


def test_protocol_garbage_is_an_error_not_a_crash():
    code = "import os, sys\nos.write(int(sys.argv[2]), b'this is not json\\n')\nimport time\ntime.sleep(5)"
    r = run_python(code, limits=FAST)
    assert r.status == "error"
    assert "protocol" in r.reason


def test_pool_runs_concurrently_and_keeps_order():
    with SandboxPool(max_workers=4, limits=SandboxLimits(timeout_s=10.0)) as pool:
        start = time.monotonic()
        results = pool.map([f"import time\ntime.sleep(1.0)\nresult = {i}" for i in range(4)])
        elapsed = time.monotonic() - start
        assert [r.value for r in results] == [0, 1, 2, 3]
        assert all(r.ok for r in results)
        assert elapsed < 3.5  # one at a time would take more than 4 s
        assert pool.submit("result = 'x'").result().value == "x"
        assert pool.submit_call(lambda a, b: a + b, 2, 3).result() == 5


def test_setup_failure_is_reported(monkeypatch):
    import turnrl.sandbox.supervisor as sandbox

    if os.geteuid() != 0:
        pytest.skip("privileges are dropped only when running as root")
    sandbox.check_isolation()  # probe (cached) with the real uid first
    monkeypatch.setattr(sandbox, "_nobody", lambda: (2**32 - 1, 2**32 - 1))  # no such uid: the setup fails
    r = run_python("print('ran')", limits=FAST)
    assert r.status == "error"
    # the first step that uses the uid fails: the private tmpfs owned by it (then the drop to it)
    assert r.reason.startswith("sandbox setup failed") and "uid=4294967295" in r.reason, r.reason
    assert "ran" not in r.stdout


def test_cpu_time_limit_is_a_timeout():
    r = run_python("while True:\n    pass", limits=SandboxLimits(timeout_s=8.0, cpu_s=1))
    assert r.status == "timeout"
    assert "CPU-time" in r.reason
    assert r.duration_s < 6
