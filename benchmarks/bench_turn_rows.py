"""Per-turn rows at two micro-batch sizes against episode rows: the training half of a step, interleaved.

The rows are synthetic but shaped as one training batch of ``configs/decisions_d4_word_cpu.yaml``
(results §17's word cell): the environment's real opening prompt (system prompt and worked examples
through the chat template), ``--groups`` groups × 8 episodes × 4 turns, each turn ``--action`` sampled
tokens followed by a ``--reply``-token environment reply, random advantages. Three variants of the same
batch, each one ``accumulate_gradients`` (forward + backward of every micro-batch, shared prefixes packed):

* ``episode/8``: one row per episode, 8 per micro-batch (group_mean's rows, the specs' setting);
* ``turn/8``: one row per turn, 8 per micro-batch (stepwise's rows at the specs' setting: a group's 32
  turn rows in 4 packs, each re-running the group's prompt);
* ``turn/32``: one row per turn, 32 per micro-batch (a group per pack).

Order: the three in turn, ``--rounds`` times, in one process (embedded model + a fresh LoRA, the gradients
zeroed between calls). Prints the median seconds, the ratios and the load. The gradient does not depend on
the split with ``norm: token_sum`` (tests/test_distributed.py checks micro-batching against one batch).
Run: ``PYTHONPATH=src python benchmarks/bench_turn_rows.py [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import load  # the script's directory is on sys.path

from turnrl.chat import ChatTemplate
from turnrl.config import ModelConfig, parse_config
from turnrl.envs.decisions import DecisionsEnv
from turnrl.models import attach_lora, load_model
from turnrl.train.batch import build_rows
from turnrl.train.step import StepSettings, accumulate_gradients
from turnrl.types import Episode, Turn

GROUP, TURNS = 8, 4


def episodes(tok, groups: int, action: int, reply: int) -> list[Episode]:
    env = DecisionsEnv(DecisionsEnv.default_tasks("train")[0], rule="word", decisions=TURNS)
    prompt = ChatTemplate(tok).initial(env.initial_messages())
    g = torch.Generator().manual_seed(0)

    def rand(n: int) -> list[int]:
        return torch.randint(100, 40000, (n,), generator=g).tolist()

    out = []
    for gi in range(groups):
        for e in range(GROUP):
            context, turns = list(prompt), []
            for t in range(TURNS):
                act = rand(action)
                turn = Turn(t, list(context), act, [-1.0] * action, "", policy_version=0)
                turn.advantage = float(torch.randn(1, generator=g))
                turns.append(turn)
                context += act + rand(reply)
            out.append(Episode(f"g{gi}e{e}", "t", turns, 0.0, True, False, group_id=f"g{gi}"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--action", type=int, default=2, help="tokens per reply (a bare word and the end token)")
    ap.add_argument("--reply", type=int, default=20, help="tokens of the environment's next question")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    model, tok = load_model(ModelConfig(name="embedded"))
    model.train()
    model = attach_lora(model, parse_config({}).model.lora)
    eps = episodes(tok, args.groups, args.action, args.reply)
    variants = {
        "episode/8": (build_rows(eps, per_turn=False), 8),
        "turn/8": (build_rows(eps, per_turn=True), 8),
        "turn/32": (build_rows(eps, per_turn=True), 32),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.rounds):
        for name, (rows, micro) in variants.items():
            settings = StepSettings.from_config(parse_config({"train": {"micro_batch_size": micro}}))
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            accumulate_gradients(model, rows, settings, pad_id=tok.pad_token_id)
            times[name].append(time.perf_counter() - t0)
            print(f"round {r}: {name:10s} {len(rows):3d} rows  {times[name][-1]:6.2f} s  {load()}", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{args.groups} groups x {GROUP} episodes x {TURNS} turns, {torch.get_num_threads()} threads")
    print("median seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()))
    print(
        f"turn/8 / turn/32 = {med['turn/8'] / med['turn/32']:.2f}x; "
        f"turn/8 / episode/8 = {med['turn/8'] / med['episode/8']:.2f}x; "
        f"turn/32 / episode/8 = {med['turn/32'] / med['episode/8']:.2f}x"
    )


if __name__ == "__main__":
    main()
