"""The two-turn slosh-tank environment: probe (or draft), then commit a policy.

Layout: ``extract.py`` finds the code in a reply, ``drivers.py`` is the code
that runs in the sandbox next to it (shipped as source), ``runner.py`` the
trusted side (real tank, budget, score), this module the :class:`Env`.

Turn 1: if the reply defines ``def main(env):`` it runs in the sandbox against
the task's tank; what it prints becomes the turn-2 observation. Turn 2: the
reply must define ``def policy(state) -> float``; it runs in the sandbox for a
full episode and is scored.

The physics and the scoring stay in this (parent) process: the sandboxed code
only receives states and returns actions over a pipe (``host`` calls), so the
hidden κ never enters the sandbox and nothing the code prints or reports can
change its score.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from turnrl.envs.base import Env, EnvOptions, Message, StepResult, StopReason, Task
from turnrl.envs.slosh_tank import physics, prompts, tasks
from turnrl.envs.slosh_tank.controllers import SCRIPTED_POLICIES
from turnrl.envs.slosh_tank.extract import extract_code, has_code
from turnrl.envs.slosh_tank.runner import PolicyOutcome, ProbeOutcome, evaluate_policy, run_probe
from turnrl.sandbox import SandboxLimits, SandboxPool, check_isolation

_POOL: SandboxPool | None = None
_POOL_LOCK = threading.Lock()


def _sandbox_pool() -> SandboxPool:
    """The process's pool for sandboxed policy evaluations (episodes already step concurrently)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = SandboxPool()
        return _POOL


__all__ = [
    "PolicyOutcome",
    "ProbeOutcome",
    "SloshTankEnv",
    "evaluate_policy",
    "extract_code",
    "run_probe",
]

# --------------------------------------------------------------------------- environment


@dataclass
class _Progress:
    turn: int = 0
    done: bool = False
    probe_ran: bool = False
    probe: ProbeOutcome | None = None
    outcomes: list[PolicyOutcome] = field(default_factory=list)


class SloshTankOptions(EnvOptions):
    probe_steps: int = Field(prompts.PROBE_STEP_LIMIT, ge=1, le=100_000)
    """Most ``env.step`` calls a probe may make."""
    observation_chars: int = Field(prompts.OBSERVATION_CHARS, ge=1, le=1_000_000)
    """Most characters of the probe's output shown to the model."""
    sandbox: Any = None
    """A :class:`SandboxLimits` or a mapping of its fields, validated by ``SandboxLimits.from_options``."""
    system_prompt: str | None = Field(None, max_length=100_000)
    check_env_code: bool = True
    """The task's ``env_code`` must equal the installed physics source."""


class SloshTankEnv(Env):
    """Slosh tank, two turns: probe (``main(env)``) or draft, then ``policy(state)``.

    Options: ``probe_steps`` (50), ``observation_chars`` (2,000), ``sandbox``
    (a :class:`SandboxLimits` or a dict of its fields; default 10 s, 1 GiB),
    ``system_prompt`` (None: no system message), ``check_env_code`` (True:
    the task's env_code must equal the installed physics source).

    Rewards: turn 1 → 0.0; turn 2 → the score (mean over the task's scenarios).
    Stop reasons: ``success`` (score 1), ``failure``, ``error`` (the policy
    crashed, timed out or returned a non-number), ``malformed`` (no
    ``def policy`` in the reply).
    """

    name = "slosh_tank"
    max_turns = 2
    Options = SloshTankOptions
    options: SloshTankOptions

    def __init__(self, task: Task, **options: Any) -> None:
        super().__init__(task, **options)
        opts = self.options
        self.scenarios = tasks.validate_params(
            task.params, f"task {task.task_id!r}", check_env_code=opts.check_env_code
        )
        self.probe_steps = opts.probe_steps
        self.observation_chars = opts.observation_chars
        self.limits = SandboxLimits.from_options(opts.sandbox, self.name)
        check_isolation(self.limits)  # refuse now, naming the missing layer, rather than per call
        self.system_prompt = opts.system_prompt
        self.progress = _Progress()

    # -- protocol -------------------------------------------------------

    def initial_messages(self) -> list[Message]:
        p = self.task.params
        text = prompts.initial_prompt(
            p["env_code"],
            p["state_spec"],
            p["action_spec"],
            p["goal"],
            probe_steps=self.probe_steps,
            observation_chars=self.observation_chars,
        )
        messages: list[Message] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": text})
        return messages

    def step(self, action_text: str) -> StepResult:
        if self.progress.done:
            raise RuntimeError(f"slosh_tank episode for task {self.task.task_id!r} is over")
        if self.progress.turn == 0:
            self.progress.turn = 1
            return self._probe_turn(action_text)
        self.progress.turn = 2
        self.progress.done = True
        return self._policy_turn(action_text)

    def _probe_turn(self, text: str) -> StepResult:
        code = extract_code(text, "main")
        if code is None:
            reason = (
                "your reply did not define `def main(env):`."
                if not has_code(text)
                else "your reply had code but no `def main(env):`."
            )
            obs = prompts.no_probe_observation(reason)
            return StepResult(
                [{"role": "user", "content": obs}],
                reward=0.0,
                metrics={"probe_ran": 0.0, "probe_ok": 0.0, "probe_steps": 0.0},
            )
        sc = self.scenarios[0]
        probe = run_probe(code, sc["seed"], sc["kappa"], self.probe_steps, self.limits)
        self.progress.probe_ran = True
        self.progress.probe = probe
        r = probe.exec
        obs = prompts.probe_observation(
            r.stdout, r.status, r.reason, probe.steps_used, self.probe_steps, self.observation_chars
        )
        metrics = {
            "probe_ran": 1.0,
            "probe_ok": float(r.ok),
            "probe_steps": float(probe.steps_used),
            "probe_s": r.duration_s,
        }
        return StepResult([{"role": "user", "content": obs}], reward=0.0, metrics=metrics)

    def _policy_turn(self, text: str) -> StepResult:
        probe_ran = float(self.progress.probe_ran)
        code = extract_code(text, "policy")
        if code is None:
            return StepResult(
                [],
                reward=0.0,
                terminated=True,
                stop_reason=StopReason.MALFORMED,
                metrics={
                    "score": 0.0,
                    "success": 0.0,
                    "spill": 0.0,
                    "probe_ran": probe_ran,
                    "policy_found": 0.0,
                    "policy_error": 0.0,
                    "policy_timeout": 0.0,
                    "sandbox_ok": 0.0,
                    "policy_steps": 0.0,
                    "policy_s": 0.0,
                },
            )
        outcomes = _sandbox_pool().map_calls(  # the scenarios run at once, each its own sandbox
            evaluate_policy, [(code, sc["seed"], sc["kappa"], self.limits) for sc in self.scenarios]
        )
        self.progress.outcomes = outcomes
        score = sum(o.score for o in outcomes) / len(outcomes)
        crashed = any(o.crashed for o in outcomes)
        if crashed:
            stop = StopReason.ERROR
        elif all(o.success for o in outcomes):
            stop = StopReason.SUCCESS
        else:
            stop = StopReason.FAILURE
        last = outcomes[-1].final
        metrics = {
            "score": score,
            "success": float(stop == StopReason.SUCCESS),
            "spill": float(any(o.spilled for o in outcomes)),
            "probe_ran": probe_ran,
            "policy_found": 1.0,
            "policy_error": float(crashed),
            "policy_timeout": float(any(o.exec.status == "timeout" for o in outcomes)),
            "sandbox_ok": float(all(o.exec.ok for o in outcomes)),
            "final_pos_error": abs(last["x"] - last["goal"]),
            "final_slosh": physics.slosh_amplitude(last["theta"], last["omega"]),
            "policy_steps": float(sum(o.steps for o in outcomes)),
            "policy_s": sum(o.exec.duration_s for o in outcomes),
        }
        return StepResult([], reward=score, terminated=True, stop_reason=stop, metrics=metrics)

    # -- reporting ------------------------------------------------------

    def summary(self) -> str:
        """A one-paragraph account of the episode so far (for reports; not shown to the model)."""
        p = self.progress
        parts = [f"task {self.task.task_id}:"]
        if p.probe is not None:
            parts.append(f"probe {p.probe.exec.status} ({p.probe.steps_used} steps)")
        elif p.turn >= 1:
            parts.append("no probe")
        for o in p.outcomes:
            state = "success" if o.success else ("spilled" if o.spilled else "failed")
            if o.crashed:
                state = f"error ({o.error})"
            parts.append(f"policy {state}, score {o.score:.3f}")
        return " ".join(parts)

    @classmethod
    def default_tasks(cls, split: str, **options: Any) -> list[Task]:
        """The shipped tasks of ``train`` (24), ``eval`` (12) or ``smoke`` (2)."""
        SandboxLimits.from_options(cls.parse_options(options).sandbox, cls.name)
        return tasks.shipped_tasks(split)

    @classmethod
    def scripted_policies(cls):
        return dict(SCRIPTED_POLICIES)

    @classmethod
    def load_tasks(cls, path: str, split: str | None = None) -> list[Task]:
        """Read and validate a slosh task file (errors name the file, line and field)."""
        return tasks.load_tasks(path, split)
