"""Collection with and without the HF sampler's kept keys/values of earlier turns, same process, interleaved.

One training batch of the main job (``configs/number_guess_cpu.yaml``: 4 tasks × 8 games
of number guessing, 3 × 8 when it was measured; up to 7 turns, the embedded model with its fresh
LoRA) is collected by ``HFSampler`` with ``reuse_kv_gib`` 2 (each turn feeds only its new tokens) and 0
(each turn reruns the episode's earlier turns after the shared prompt), alternating,
``--rounds`` times each. Prints the median seconds, the ratio, the context tokens
reused, and whether both collected the same episodes token for token (same seeds).
Run: ``python benchmarks/bench_turn_cache.py [--rounds 2]``.
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
    times: dict[float, list[float]] = {2.0: [], 0.0: []}
    episodes, reused = {}, {}
    for _ in range(args.rounds):
        for gib in (2.0, 0.0):
            sampler = HFSampler(model, tok, batch_size=cfg.sampler.batch_size, reuse_kv_gib=gib)
            counted = []
            sample = sampler.sample

            def counting(*a, _sample=sample, _sampler=sampler, _counted=counted, **k):
                out = _sample(*a, **k)
                _counted.append(_sampler.reused_tokens)
                return out

            sampler.sample = counting
            torch.manual_seed(0)
            t0 = time.perf_counter()
            eps, _ = collect_batch(RunSettings.from_config(cfg), tasks, RunState(), sampler, chat)
            times[gib].append(time.perf_counter() - t0)
            episodes[gib] = [[t.action_ids for t in ep.turns] for ep in eps]
            reused[gib] = sum(counted)
    on, off = statistics.median(times[2.0]), statistics.median(times[0.0])
    turns = sum(len(e) for e in episodes[2.0])
    print(f"{len(episodes[2.0])} episodes, {turns} turns (embedded model, CPU, {torch.get_num_threads()} threads)")
    print(f"kept keys/values: {on:.1f} s   rerun earlier turns: {off:.1f} s   speed-up: {off / on:.2f}x")
    print(f"context tokens taken from kept keys/values: {reused[2.0]}")
    print(f"same episodes token for token: {episodes[2.0] == episodes[0.0]}")


if __name__ == "__main__":
    main()
