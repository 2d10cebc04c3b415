"""`turnrl` on the tiny model with the toy env, killing itself with SIGKILL at a chosen point.

KILL_AT=event:n picks the n-th occurrence of: checkpoint (mid-write of checkpoint/state.pt),
step (right after a step's metrics are logged), eval (after an evaluation row), adapter
(mid-write of an adapter directory), rollouts (mid-write of a rollouts line). READY_FILE and
START_WHEN start several of them at one moment (see :func:`_start_together`).
"""

from __future__ import annotations

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

import turnrl.models as models  # noqa: E402
import turnrl.train.run as run_mod  # noqa: E402
from toy_envs import CountEnv  # noqa: E402
from turnrl.envs import register_env  # noqa: E402
from turnrl.tracking import MultiSink  # noqa: E402

register_env("count", CountEnv)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _install(event: str, n: int) -> None:
    seen = {"k": 0}

    def hit() -> bool:
        seen["k"] += 1
        return seen["k"] == n

    if event == "checkpoint":
        real = torch.save

        def save(obj, path, *a, **kw):
            if hit():
                if hasattr(path, "write"):  # the checkpoint's temp file, already open
                    path.write(b"half a checkpoint")
                    path.flush()
                else:
                    with open(path, "wb") as fh:
                        fh.write(b"half a checkpoint")
                _die()
            return real(obj, path, *a, **kw)

        torch.save = save
    elif event in ("step", "eval"):
        name = f"log_{event}"
        real_log = getattr(MultiSink, name)

        def log(self, *a, **kw):
            real_log(self, *a, **kw)
            if hit():
                _die()

        setattr(MultiSink, name, log)
    elif event == "adapter":
        real_adapter = models.save_adapter

        def save_adapter(model, path):
            if hit():
                path.parent.mkdir(parents=True, exist_ok=True)
                (path.parent / f".{path.name}.partial").mkdir(exist_ok=True)
                _die()
            return real_adapter(model, path)

        models.save_adapter = save_adapter
    elif event == "rollouts":
        real_write = run_mod.write_jsonl

        def write_jsonl(path, records, append=False):
            if append and hit():
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "a") as fh:
                    fh.write('{"episode_id": "torn')
                _die()
            return real_write(path, records, append=append)

        run_mod.write_jsonl = write_jsonl
    else:
        raise SystemExit(f"unknown KILL_AT event {event}")


def _start_together() -> None:
    """READY_FILE / START_WHEN: say this process has imported everything, then wait for the go file
    (two trainers started at the same moment)."""
    if os.environ.get("READY_FILE"):
        import time

        import turnrl.train.loop  # noqa: F401 - imported before the start, as the other process does

        open(os.environ["READY_FILE"], "w").close()
        while not os.path.exists(os.environ["START_WHEN"]):
            time.sleep(0.01)


if __name__ == "__main__":
    if os.environ.get("KILL_AT"):
        event, count = os.environ["KILL_AT"].split(":")
        _install(event, int(count))
    from turnrl.cli import app

    _start_together()
    app()
