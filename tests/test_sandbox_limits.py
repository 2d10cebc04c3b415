"""The sandbox limits are a strict typed model, and the private directory is bounded in total (issue 22)."""

from __future__ import annotations

import math

import pytest
import yaml
from typer.testing import CliRunner

from turnrl.cli import app
from turnrl.sandbox import SandboxLimits, kernel_sandbox_error, run_python

KERNEL_ERROR = kernel_sandbox_error()
needs_kernel = pytest.mark.skipif(KERNEL_ERROR is not None, reason=f"kernel sandbox unavailable: {KERNEL_ERROR}")

# (field, bad value, what the one-line message must say about what is allowed)
BAD = [
    ("allow_weaker", "false", "true or false"),
    ("allow_weaker", "yes", "true or false"),
    ("allow_weaker", 0, "true or false"),
    ("namespaces", "off", "true or false"),
    ("seccomp", 1, "true or false"),
    ("drop_privileges", "no", "true or false"),
    ("audit", None, "true or false"),
    ("memory_mb", -1, ">= 64"),
    ("memory_mb", 0, ">= 64"),
    ("memory_mb", 10**30, "<= 1048576"),
    ("memory_mb", 512.5, "an integer"),
    ("memory_mb", "1024", "an integer"),
    ("timeout_s", math.nan, "finite"),
    ("timeout_s", math.inf, "finite"),
    ("timeout_s", -math.inf, "finite"),
    ("timeout_s", 0, "> 0"),
    ("timeout_s", -5, "> 0"),
    ("timeout_s", 1e9, "<= 3600"),
    ("timeout_s", "10", "a finite number"),
    ("timeout_s", True, "a finite number"),
    ("cpu_s", 0, ">= 1"),
    ("cpu_s", True, "null or an integer"),
    ("max_output_bytes", -1, ">= 1"),
    ("max_processes", 0, ">= 1"),
    ("max_file_mb", -1, ">= 0"),
    ("max_dir_mb", 0, ">= 1"),
    ("max_dir_mb", 10**6, "<= 65536"),
    ("max_dir_files", 0, ">= 1"),
    ("max_dir_files", -3, ">= 1"),
    ("max_open_files", 3, ">= 16"),
    ("bwrap", "", "non-empty"),
    ("bwrap", 7, "non-empty"),
    ("preload", "math", "list of module names"),
    ("preload", ["math", "os; import x"], "list of module names"),
    ("preload", [1], "list of module names"),
]


@pytest.mark.parametrize(("field", "value", "allowed"), BAD, ids=[f"{f}={v!r}" for f, v, _ in BAD])
def test_bad_value_is_one_line_naming_key_value_and_allowed(field, value, allowed):
    with pytest.raises(ValueError) as err:
        SandboxLimits.from_options({field: value}, "slosh_tank")
    msg = str(err.value)
    assert "\n" not in msg and "slosh_tank option sandbox." + field in msg, msg
    shown = repr(value[-1] if isinstance(value, list) else value)[:40]  # a list names its bad item
    assert shown in msg and "allowed:" in msg and allowed in msg, msg
    with pytest.raises(ValueError) as err:  # the Python API says the same in one line
        SandboxLimits(**{field: value})
    assert "\n" not in str(err.value) and f"SandboxLimits.{field}" in str(err.value)


def test_unknown_field_and_non_mapping_are_refused_naming_the_known_fields():
    with pytest.raises(ValueError, match=r"unknown field 'alow_weaker'; known: timeout_s, .*allow_weaker"):
        SandboxLimits.from_options({"alow_weaker": True}, "slosh_tank")
    with pytest.raises(ValueError, match=r"'sandbox' must be a mapping.*got 'strict'"):
        SandboxLimits.from_options("strict", "slosh_tank")


def test_good_values_are_kept_exactly():
    limits = SandboxLimits.from_options(
        {"timeout_s": 3, "allow_weaker": True, "preload": ["math", "os.path"], "max_dir_mb": 8}, "slosh_tank"
    )
    assert limits.timeout_s == 3.0 and isinstance(limits.timeout_s, float)
    assert limits.allow_weaker is True and limits.preload == ("math", "os.path") and limits.max_dir_mb == 8
    assert SandboxLimits.from_options(None, "x") == SandboxLimits()
    with pytest.raises(ValueError):  # frozen: a run's limits cannot change under it
        limits.allow_weaker = False


@pytest.mark.parametrize(
    ("sandbox", "needle"),
    [
        ({"allow_weaker": "false"}, "sandbox.allow_weaker: 'false'"),
        ({"memory_mb": -1}, "sandbox.memory_mb: -1"),
        ({"timeout_s": math.nan}, "sandbox.timeout_s"),
        ({"max_dir_files": 0}, "sandbox.max_dir_files: 0"),
    ],
)
def test_the_cli_refuses_a_bad_sandbox_limit_in_one_line(tmp_path, sandbox, needle):
    cfg = {
        "run_name": "r",
        "model": {"name": "tiny"},
        "env": {"name": "slosh_tank", "options": {"sandbox": sandbox}},
        "data": {"train_split": "smoke", "num_eval_tasks": 1},
        "eval": {"before": False},
        "tracking": {"backends": ["csv"], "plots": False, "report": False},
        "paths": {"output_dir": str(tmp_path / "runs")},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(app, ["train", str(path)])
    out = " ".join(result.output.split())
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in out and needle in out, out
    assert "allowed:" in out or "must be a finite number" in out, out  # the config's finite rule answers first
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


# ---- the private directory is bounded in total: bytes and entries ---------------------------------


@needs_kernel
def test_private_directory_is_bounded_in_bytes_and_entries():
    limits = SandboxLimits(timeout_s=10.0, max_dir_mb=2, max_dir_files=50, max_file_mb=16, audit=False)
    code = """
import errno, os
def fill(make):
    n = 0
    try:
        while n < 100_000:
            make(n)
            n += 1
    except OSError as e:
        return n, errno.errorcode[e.errno]
    return n, None
def write(name, size):
    fd = os.open(name, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        data = b'x' * size
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)
quarters = fill(lambda i: write('big%d' % i, 1 << 18))
stored = sum(os.stat(p).st_size for p in os.listdir('.'))
for p in os.listdir('.'):
    os.unlink(p)
files = fill(lambda i: os.close(os.open('f%d' % i, os.O_CREAT | os.O_WRONLY, 0o600)))
for p in os.listdir('.'):
    os.unlink(p)
open('a', 'w').close()
links = fill(lambda i: os.link('a', 'l%d' % i))
st = os.statvfs('.')
result = [quarters, stored, files, links, st.f_blocks * st.f_frsize]
"""
    r = run_python(code, limits=limits)
    assert r.status == "ok", (r.reason, r.stdout)
    (quarters, why_bytes), stored, (files, why_files), (links, why_links), size = r.value
    assert "dirquota" in r.isolation
    assert why_bytes == "ENOSPC" and quarters == 8 and (2 << 20) - (1 << 18) < stored <= 2 << 20
    assert (files, why_files) == (50, "ENOSPC")
    assert (links, why_links) == (49, "ENOSPC")  # a hard link takes an entry too ('a' holds one)
    assert size == 2 << 20


@needs_kernel
def test_default_bound_holds_against_twenty_files_of_sixteen_mib():
    """The issue's example: 20 × 16 MiB in one call stops at the 64 MiB default."""
    code = """
import os
n = 0
for i in range(20):
    try:
        with open('f%d' % i, 'wb') as f:
            for _ in range(16):
                f.write(b'x' * (1 << 20))
                n += 1
    except OSError:
        pass
result = n
"""
    r = run_python(code, limits=SandboxLimits(timeout_s=20.0, audit=False))
    assert r.status == "ok", r.reason
    assert SandboxLimits().max_dir_mb == 64 and 60 <= r.value <= 64
