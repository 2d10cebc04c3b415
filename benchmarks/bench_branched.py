"""One slosh-like branched training step with shared-prefix packing on vs off, time and peak memory.

The rows are synthetic but shaped as a slosh branched batch: the slosh smoke task's
real first prompt (the environment source, ~3,000 tokens with the chat template), G1
first turns of ``--action`` tokens, an environment reply of ``--reply`` tokens, and
G2 second turns below each first turn (G1 × G2 leaves). Rows are per turn
(``build_rows(per_turn=True)``), as the branched estimator trains them: G1 turn-1 rows
and G1 × G2 turn-2 rows, each repeating the prompt (and turn-2 rows the first turn).

Each variant runs in its own subprocess (embedded model + LoRA r16 q/k/v/o, two
threads); the step is ``accumulate_gradients`` (forward + backward of every
micro-batch) with ``token_logprobs`` (per-row) or ``packed_token_logprobs``
(packed). Peak resident memory is measured above the memory held just before the
step, as in ``bench_memory.py``. Order: packed, per-row, packed, per-row, ...
(``--repeats``). ``--prompt-tokens N`` truncates the prompt to N tokens (the per-row
side at the full length takes very long on two shared cores).

Run: ``PYTHONPATH=src python benchmarks/bench_branched.py [--prompt-tokens 3000] [--repeats 1]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench_memory import _reset_peak, _status_kib  # the script's directory is on sys.path


def slosh_rows(tok, g1: int, g2: int, action: int, reply: int, prompt_tokens: int | None):
    import copy

    import torch

    from turnrl.chat import ChatTemplate
    from turnrl.envs.slosh_tank import SloshTankEnv
    from turnrl.envs.slosh_tank.tasks import shipped_tasks
    from turnrl.train.batch import build_rows
    from turnrl.types import Episode, Turn

    env = SloshTankEnv(shipped_tasks("smoke")[0])
    prompt = ChatTemplate(tok).initial(env.initial_messages())
    if prompt_tokens is not None:
        prompt = prompt[:prompt_tokens]
    g = torch.Generator().manual_seed(0)

    def rand(n: int) -> list[int]:
        return torch.randint(100, 40000, (n,), generator=g).tolist()

    episodes = []
    for i in range(g1):
        first = Turn(0, prompt, rand(action), [-1.0] * action, "", policy_version=0)
        context = prompt + first.action_ids + rand(reply)
        for j in range(g2):
            second = Turn(1, context, rand(action), [-1.0] * action, "", policy_version=0)
            mine = copy.deepcopy(first)  # each leaf holds its own record of the shared first turn
            mine.advantage = 0.3 * (i - 1.5) if j == 0 else None  # the prefix is trained once
            second.advantage = 0.2 * (j - 1.5)
            episodes.append(Episode(f"e{i}{j}", "t", [mine, second], 0.0, True, False, group_id="g", branch=[i, j]))
    return build_rows(episodes, per_turn=True), len(prompt)


def run_variant(packed: bool, args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from turnrl.config import ModelConfig, parse_config
    from turnrl.models import attach_lora, load_model
    from turnrl.train import step as step_mod
    from turnrl.train.packing import row_stats

    torch.manual_seed(0)
    model, tok = load_model(ModelConfig(name="embedded"))
    model.train()
    model = attach_lora(model, parse_config({}).model.lora)
    rows, prompt_len = slosh_rows(tok, args.g1, args.g2, args.action, args.reply, args.prompt_tokens)
    micro = args.micro_batch if packed else (args.per_row_micro_batch or args.micro_batch)
    cfg = parse_config({"train": {"micro_batch_size": micro, "shared_prefix": packed}})
    stats = [row_stats(rows[s : s + args.micro_batch]) for s in range(0, len(rows), args.micro_batch)]
    _reset_peak()
    before = _status_kib("VmRSS")
    t0, c0 = time.perf_counter(), time.process_time()
    step_mod.accumulate_gradients(model, rows, step_mod.StepSettings.from_config(cfg), pad_id=tok.pad_token_id)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "peak_mib": (_status_kib("VmHWM") - before) / 1024,
        "rows": len(rows),
        "prompt_tokens": prompt_len,
        "total_tokens": sum(s.total_tokens for s in stats),
        "padded_tokens": sum(s.padded_tokens for s in stats),
        "unique_tokens": sum(s.unique_tokens for s in stats),
        "load": os.getloadavg(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--g1", type=int, default=4)
    ap.add_argument("--g2", type=int, default=4)
    ap.add_argument("--action", type=int, default=24, help="tokens per turn")
    ap.add_argument("--reply", type=int, default=40, help="environment reply tokens")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="truncate the slosh prompt")
    ap.add_argument("--micro-batch", type=int, default=32, help="rows per micro-batch (sharing is within one)")
    ap.add_argument(
        "--per-row-micro-batch",
        type=int,
        default=None,
        help="rows per micro-batch of the per-row side (default --micro-batch; it gains nothing from more, "
        "and at the full prompt 20 padded rows in one micro-batch exceed this machine's memory)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--variant", choices=["packed", "per_row"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant == "packed", args)))
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(args.threads))
    results: dict[str, list[dict]] = {"packed": [], "per_row": []}
    passthrough = [a for a in sys.argv[1:]]
    for _ in range(args.repeats):
        for variant in ("packed", "per_row"):
            out = subprocess.run(
                [sys.executable, __file__, *passthrough, "--variant", variant],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results[variant].append(r)
            print(
                f"{variant:8s} {r['seconds']:8.1f} s  cpu {r['cpu_seconds']:8.1f} s  peak {r['peak_mib']:7.0f} MiB  "
                f"load {tuple(round(x, 2) for x in r['load'])}",
                flush=True,
            )
    r = results["packed"][0]
    print(
        f"\nslosh-like branched step: G1={args.g1} G2={args.g2}, prompt {r['prompt_tokens']} tokens, "
        f"{r['rows']} per-turn rows, micro-batch {args.micro_batch} (per-row side "
        f"{args.per_row_micro_batch or args.micro_batch}), {args.threads} threads"
    )
    print(
        f"tokens: per-row {r['total_tokens']} ({r['padded_tokens']} padded), packed {r['unique_tokens']} unique "
        f"({r['total_tokens'] / r['unique_tokens']:.1f}x fewer)"
    )
    best = {k: min(x["seconds"] for x in v) for k, v in results.items()}
    peak = {k: max(x["peak_mib"] for x in v) for k, v in results.items()}
    print(
        f"seconds (min): per-row {best['per_row']:.1f}, packed {best['packed']:.1f}, "
        f"speed-up {best['per_row'] / best['packed']:.2f}x"
    )
    print(f"peak MiB above baseline: per-row {peak['per_row']:.0f}, packed {peak['packed']:.0f}")


if __name__ == "__main__":
    main()
