"""The sandbox's tests again as an ordinary user (issue 22): the non-root sandbox must hold as root's does.

As an ordinary user the kernel sandbox differs (a user namespace instead of the drop to
``nobody``; bubblewrap's PID 1 has the model code's uid), so ``tests/test_sandbox.py``,
``tests/test_hostile.py`` and ``tests/test_sandbox_limits.py`` run a second time as one. When
the tests run as root (CI: ``make test``), this test creates that user (``useradd``) and runs
them through ``runuser`` with the same interpreter and packages. A root-only directory above
them (e.g. pyenv under ``/root``) is made traversable for that run alone: in a private mount
namespace (``unshare --mount``) it is covered by an empty tmpfs into which the needed entries
are bound back, so the host is not changed and nothing else under it becomes visible.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

USER = "turnrl-hostile"
REPO = Path(__file__).resolve().parents[1]
SUITES = [
    "tests/test_sandbox.py",
    "tests/test_hostile.py",
    "tests/test_sandbox_limits.py",
    "tests/test_hostile_input_cases.py",
    "tests/test_hostile_paths.py",
    "tests/test_report_browser.py",
]
INNER = "TURNRL_UNPRIVILEGED_RUN"


def _tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")


def _needed_paths() -> list[Path]:
    """What the other user must reach: the interpreter's prefix, the venv, the packages, the checkout."""
    paths = {Path(sys.base_prefix), Path(sys.prefix), Path(sys.executable).parent, REPO}
    paths |= {Path(p) for p in sys.path if p and Path(p).is_dir()}
    return sorted({Path(os.path.realpath(p)) for p in paths} | {Path(sys.executable).resolve().parent})


def _blocked_ancestors(paths: list[Path]) -> dict[Path, set[str]]:
    """Root-only directories above the needed paths -> the entries below them that are needed."""
    blocked: dict[Path, set[str]] = {}
    for p in paths:
        for parent, child in zip(p.parents, [p, *p.parents], strict=False):
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                blocked.setdefault(parent, set()).add(child.name)
    return blocked


def _mount_script(blocked: dict[Path, set[str]], staging: Path) -> list[str]:
    """Shell lines (run as root in a private mount namespace) that make ``blocked`` traversable."""
    lines = []
    for i, (d, children) in enumerate(sorted(blocked.items(), key=lambda kv: len(kv[0].parts))):
        s = staging / str(i)
        lines += [f"mkdir -p {s}", f"mount --rbind {shlex.quote(str(d))} {s}"]
        lines.append(f"mount -t tmpfs -o mode=0755,size=1m turnrl-unprivileged {shlex.quote(str(d))}")
        for c in sorted(children):
            src, dst = shlex.quote(str(s / c)), shlex.quote(str(d / c))
            lines.append(f"if [ -d {src} ]; then mkdir {dst}; else touch {dst}; fi; mount --rbind {src} {dst}")
    return lines


def test_sandbox_suites_pass_as_an_ordinary_user():
    if os.environ.get(INNER):
        pytest.skip("this is the ordinary user's run already")
    if os.geteuid() != 0:
        pytest.skip("not root: the sandbox tests in this run are already an ordinary user's (as root, this test "
                    "creates one and reruns them)")  # fmt: skip
    tools = {n: _tool(n) for n in ("useradd", "runuser", "unshare", "mount")}
    if None in tools.values():
        pytest.skip(f"cannot create and switch to an ordinary user: {[n for n, t in tools.items() if not t]} missing")
    if subprocess.run(["id", USER], capture_output=True).returncode != 0:
        made = subprocess.run([tools["useradd"], "--create-home", "--shell", "/bin/sh", USER], capture_output=True)
        if made.returncode != 0:
            pytest.skip(f"useradd {USER} failed: {made.stderr.decode(errors='replace').strip()}")
    home = Path("/home") / USER
    if not home.is_dir():
        home = Path(subprocess.run(["sh", "-c", f"getent passwd {USER} | cut -d: -f6"], capture_output=True,
                                   text=True).stdout.strip())  # fmt: skip
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "PYTHONPATH": str(REPO / "src"),
        "PYTHONDONTWRITEBYTECODE": "1",
        INNER: "1",
    }
    pytest_cmd = [sys.executable, "-B", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *SUITES]
    inner = [tools["runuser"], "-u", USER, "--", "env", "-i", *(f"{k}={v}" for k, v in env.items()), *pytest_cmd]
    staging = Path(tempfile.mkdtemp(prefix="turnrl-unprivileged-"))  # root-only (0700): the user cannot enter
    try:
        lines = _mount_script(_blocked_ancestors(_needed_paths()), staging)
        script = "\n".join(["set -e", *lines, "exec " + shlex.join(inner)])
        cmd = [tools["unshare"], "--mount", "--propagation", "private", "sh", "-c", script]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # empty mount points only, outside that namespace
    out = proc.stdout + proc.stderr
    tail = out[-4000:]
    print(f"as {USER}:", out.strip().splitlines()[-1] if out.strip() else "(no output)")  # shown with -s
    assert proc.returncode == 0, tail
    assert "kernel sandbox unavailable" not in out, tail  # the hostile set ran, it was not skipped
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= 100, tail
