"""One process's collection with per-call seeds (its default) and with task seeds (what sharded collection
uses), same process, interleaved.

One training batch of the main job (``configs/number_guess_cpu.yaml``) is collected by the HF
sampler with ``rollout.task_seeds`` false (one generator per sampler call and batch chunk) and true
(each row's uniforms from its own generator), both with the sampler's inverse-CDF draw
(``turnrl.sampling.draws``), alternating, ``--rounds`` times each.
Prints the median seconds and the ratio: the cost of making a task's draws independent of the
process that collects it. (The speed-up of N processes needs N devices; on this machine's 2 shared
cores it is not measured.) Run: ``python benchmarks/bench_task_seeds.py [--rounds 2]``.
"""

from __future__ import annotations

import statistics
import time

import torch
from _common import load_main_job, parse_args  # the script's directory is on sys.path

from turnrl.sampling.hf import HFSampler
from turnrl.train.checkpoint import RunState
from turnrl.train.loop import collect_batch
from turnrl.train.settings import RunSettings


def main() -> None:
    args = parse_args(__doc__)
    cfg, model, tok, chat, tasks = load_main_job(args.config)
    times: dict[bool, list[float]] = {False: [], True: []}
    tokens: dict[bool, int] = {}
    for _ in range(args.rounds):
        for on in (False, True):
            cfg.rollout.task_seeds = on
            sampler = HFSampler(model, tok, batch_size=cfg.sampler.batch_size)
            t0 = time.perf_counter()
            eps, _ = collect_batch(RunSettings.from_config(cfg), tasks, RunState(), sampler, chat)
            times[on].append(time.perf_counter() - t0)
            print(f"task_seeds {on}: {times[on][-1]:.2f} s", flush=True)
            tokens[on] = sum(len(t.action_ids) for ep in eps for t in ep.turns)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"main job batch, embedded model, CPU, {torch.get_num_threads()} threads, {args.rounds} rounds")
    print(f"per-call seeds: {off:.2f} s ({tokens[False]} sampled tokens)")
    print(f"task seeds:     {on:.2f} s ({tokens[True]} sampled tokens)")
    print(f"time per sampled token, task seeds / per-call seeds: {(on / tokens[True]) / (off / tokens[False]):.2f}x")


if __name__ == "__main__":
    main()
