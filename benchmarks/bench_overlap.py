"""Overlapped collection (``sampler.max_staleness: 1``) against the synchronous loop, with a slow environment.

Workload: the main job (``configs/number_guess_cpu.yaml``: SmolLM2-135M + LoRA, 4 tasks × G8, ≤ 16 new
tokens, DAPO) on an environment that waits ``--latency`` seconds in every step (a sandboxed program, a tool
call: the slosh tank's kernel sandbox costs ~140 ms a call). The environments of a turn step together (a
thread pool), so a turn costs one latency, not one per episode. Per round, interleaved: a synchronous run
and an overlapped run of ``--steps`` steps from the same start (no evaluation). Measured: each step's loop
time (``time/collect_s + time/train_s`` in train.csv: for the overlapped loop, the wait for its batch and
the update), its first step left out (collected in place in both loops); the collector's own time per
batch (``time/collect_ahead_s``) says how much collection was hidden behind the update.

Run: ``PYTHONPATH=src python benchmarks/bench_overlap.py [--latency 0.2] [--steps 5] [--rounds 2]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import ROOT, load

from turnrl.config import load_config
from turnrl.envs import register_env
from turnrl.envs.number_guess import NumberGuessEnv
from turnrl.tracking import read_csv
from turnrl.train.loop import train

LATENCY = [0.2]


class SlowNumberGuess(NumberGuessEnv):
    """Number guessing whose every step waits ``LATENCY[0]`` seconds first (an environment's own latency)."""

    name = "slow_number_guess"

    def step(self, action_text: str):
        time.sleep(LATENCY[0])
        return super().step(action_text)


def one_run(config: Path, out: str, name: str, staleness: int, steps: int) -> list[dict]:
    cfg = load_config(
        config,
        [
            f"run_name={name}",
            "env.name=slow_number_guess",
            f"sampler.max_staleness={staleness}",
            f"train.steps={steps}",
            "eval.before=false",
            "data.num_eval_tasks=1",
            "eval.samples_per_task=0",
            "tracking.plots=false",
            "tracking.report=false",
            f"paths.output_dir={out}",
        ],
    )
    train(cfg)
    return read_csv(Path(out) / name / "progress" / "train.csv")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs/number_guess_cpu.yaml"))
    ap.add_argument("--latency", type=float, default=0.2, help="seconds each environment step waits")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    LATENCY[0] = args.latency
    register_env("slow_number_guess", SlowNumberGuess)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {load()}; latency {args.latency} s a step")
    step_s: dict[str, list[float]] = {"sync": [], "overlap": []}
    hidden: list[float] = []
    with tempfile.TemporaryDirectory() as out:
        for r in range(args.rounds):
            for mode, staleness in (("sync", 0), ("overlap", 1)):
                rows = one_run(Path(args.config), out, f"{mode}{r}", staleness, args.steps)
                times = [row["time/collect_s"] + row["time/train_s"] for row in rows[1:]]
                step_s[mode] += times
                extra = ""
                if mode == "overlap":
                    ahead = [row["time/collect_ahead_s"] for row in rows[1:]]
                    waited = [row["time/collect_s"] for row in rows[1:]]
                    hidden += [a - w for a, w in zip(ahead, waited, strict=True)]
                    extra = f"; collector {statistics.mean(ahead):.2f} s/batch, waited {statistics.mean(waited):.2f} s"
                else:
                    extra = f"; collect {statistics.mean(row['time/collect_s'] for row in rows[1:]):.2f} s"
                mean = statistics.mean(times)
                print(f"round {r} {mode:7s} {mean:.2f} s/step over {len(times)} steps{extra}", flush=True)
    sync, over = statistics.mean(step_s["sync"]), statistics.mean(step_s["overlap"])
    print(
        f"\nsync {sync:.2f} s/step, overlapped {over:.2f} s/step: throughput x{sync / over:.2f};"
        f" collection hidden behind the update {statistics.mean(hidden):.2f} s/step ({load()})"
    )


if __name__ == "__main__":
    sys.exit(main())
