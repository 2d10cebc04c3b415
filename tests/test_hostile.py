"""Hostile model code (issue 12): contained, and scored exactly as its honest actions would be.

Cases live in ``tests/hostile/cases.py`` and ``tests/hostile/sandbox_cases.py`` (one
policy or probe each); they need the kernel sandbox (bubblewrap + seccomp) and are
skipped, with the reason, where it cannot be set up. ``tests/test_unprivileged.py``
runs this file again as an ordinary user (created there when the tests run as root).
"""

from __future__ import annotations

import os

import pytest

from hostile import cases as hostile
from hostile import sandbox_cases
from turnrl.envs.slosh_tank import BEST_BLIND, evaluate_policy, scenario_dicts
from turnrl.sandbox import (
    SandboxLimits,
    SandboxPool,
    SandboxUnavailable,
    kernel_sandbox_error,
    run_python,
)

KERNEL_ERROR = kernel_sandbox_error()
ALL_CASES = hostile.CASES + sandbox_cases.CASES
needs_kernel = pytest.mark.skipif(KERNEL_ERROR is not None, reason=f"kernel sandbox unavailable: {KERNEL_ERROR}")


@pytest.fixture(scope="module")
def canaries():
    c = hostile.Canaries()
    yield c
    c.close()


def test_the_hostile_set_covers_every_class():
    names = {c.name for c in ALL_CASES} | {
        "concurrent_sandboxes",
        "no_probe_leak_on_every_task",
    }
    assert len(names) == len(ALL_CASES) + 2 >= 64
    assert {c.cls for c in ALL_CASES} == {"reward", "containment"}


@needs_kernel
@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.name)
def test_hostile_case(case, canaries):
    assert hostile.run_case(case, canaries) is None


@needs_kernel
def test_concurrent_sandboxes_cannot_see_each_other(canaries):
    assert hostile.run_concurrent_pair(canaries) is None


@needs_kernel
def test_no_probe_leak_on_every_task(canaries):
    """All κ-leak attempts in one policy, on every task: it never beats the best blind controller."""
    leaks = [c for c in hostile.CASES if c.task == hostile.LEAK_TASK]
    attack = "\n".join(f"try:\n{hostile._ind(c.attack)}\nexcept BaseException:\n    pass" for c in leaks)
    scenarios = scenario_dicts("train") + scenario_dicts("eval")
    jobs = []
    for sc in scenarios:
        code = hostile.policy_code(hostile.Case("all_leaks", "reward", attack), canaries.ctx("all", sc["seed"]))
        jobs.append((code, sc["seed"], sc["kappa"], hostile.LIMITS))
        jobs.append((BEST_BLIND.source(None), sc["seed"], sc["kappa"], hostile.LIMITS))
    with SandboxPool(max_workers=2) as pool:
        outs = pool.map_calls(evaluate_policy, jobs)
    for sc, attacked, blind in zip(scenarios, outs[::2], outs[1::2], strict=True):
        assert attacked.score <= blind.score, (sc, attacked.score, blind.score)


def test_missing_layer_is_refused_naming_it_and_the_setting():
    limits = SandboxLimits(bwrap="/nonexistent/bwrap", timeout_s=5.0)
    with pytest.raises(SandboxUnavailable) as err:
        run_python("print('ran')", limits=limits)
    assert err.value.layer == "namespaces"
    assert "bubblewrap" in str(err.value) and "allow_weaker" in str(err.value)
    with pytest.raises(SandboxUnavailable, match="seccomp.*allow_weaker"):
        run_python("print('ran')", limits=SandboxLimits(seccomp=False))
    weaker = run_python("print('ran')", limits=SandboxLimits(bwrap="/nonexistent/bwrap", allow_weaker=True))
    assert weaker.status == "ok" and "mountns" not in weaker.isolation  # says what it was


@needs_kernel
def test_isolation_reported_by_the_parent():
    r = run_python("result = 1")
    assert {"mountns", "pidns", "netns", "nnp", "seccomp", "rlimits", "dirquota"} <= set(r.isolation)
    assert ("uid:65534" in r.isolation) == (os.geteuid() == 0)
    assert ("userns" in r.isolation) == ("subuserns" in r.isolation) == (os.geteuid() != 0)
