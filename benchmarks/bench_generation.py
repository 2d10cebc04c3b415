"""The main job's collection with the HF sampler as it was, the improved HF sampler, and vLLM's engine; interleaved.

Workload: one training batch of ``configs/number_guess_cpu.yaml`` (4 tasks × 8 games of number
guessing, 3 × 8 in docs/results.md §4's earlier tables; ≤ 6 turns, ≤ 16 new tokens a turn, the embedded
SmolLM2-135M with its fresh LoRA), collected by ``turnrl.train.loop.collect_batch`` with the step-0
seeds, a fresh sampler each time:

- ``grow``: ``HFSampler(preallocate_kv=False, merge_lora=False)`` drawing with ``torch.multinomial``:
  transformers' growing cache (a ``cat`` of the whole cache per layer at every decode step), peft's LoRA
  forward and multinomial's draw (one exponential per vocabulary entry and row), the sampler before issue 21;
- ``prealloc``: the same with ``preallocate_kv=True``: keys/values written in place into buffers allocated
  once per call, and logits only at the last position of the shared-prefix forward;
- ``merged``: ``prealloc`` with the LoRA merged into the base weights while generating (``merge_lora``), still
  drawing with multinomial: the same draws as ``prealloc`` wherever the rounding of the merge moves no token
  across a draw's threshold, so nearly the same episodes (how many are the same is printed);
- ``fast``: ``HFSampler()`` as it is now by default: ``prealloc`` plus the inverse-CDF draw (one uniform per
  row) and the LoRA merged into the base weights while generating (``merge_lora``); exact in distribution,
  its own draws (so its episodes are not grow's: their tokens and turns are counted);
- ``vllm``: ``sampler.backend: vllm`` (the CPU build), only where ``vllm`` imports in this interpreter
  (``/work/main/.venv-vllm/bin/python``); its engine start is timed separately, outside the rounds.

The arms run alternately (grow, prealloc, [vllm], grow, prealloc, ...) ``--rounds`` times; the
medians and ratios are printed, and whether the HF arms collected the same episodes token for token
with the same log-probs (they must: same logits bit for bit, same draws). vLLM samples with its own
generator, so its episodes are not the same (its tokens and turns are counted).

Decode against the memory-bandwidth bound: the machine's read bandwidth is measured here (sum of a
1 GiB tensor, best of 3); a decode step must read every weight once (the parameters' bytes; the
tied embedding is read once, as the output head), so ``bytes / bandwidth`` is the least a decode step
can take. The HF arms' decode steps (forwards of one new token per row) are timed by wrapping the
base model's ``forward``.

The floor of a collection (printed per arm): at the matmul rate measured here (a float32 matmul of the
model's MLP shape), each decode step takes at least the slower of the weights' read and its rows'
matmuls through the trunk and the output head, each prefill token (padding included) at least its
matmuls through the trunk. What is above the floor is what a faster implementation could remove;
the issue's "collection ≥ 2× faster than ``grow``" is reachable only if ``grow``'s time is at least
twice the floor of the arm that would reach it.

Run (under the machine's lock, ~4-6 min for 2 rounds with 1 thread):
``PYTHONPATH=src python benchmarks/bench_generation.py [--rounds 2] [--threads 1]``; with the vLLM arm:
``PYTHONPATH=src /work/main/.venv-vllm/bin/python benchmarks/bench_generation.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from pathlib import Path

import torch

from turnrl.chat import ChatTemplate
from turnrl.config import load_config
from turnrl.envs.splits import TaskSource
from turnrl.sampling import SamplerSettings, make_sampler
from turnrl.sampling.draws import InverseCDFDraws
from turnrl.sampling.hf import HFSampler
from turnrl.train.checkpoint import RunState
from turnrl.train.loop import collect_batch
from turnrl.train.policy import PolicySettings, build_policy
from turnrl.train.run import RunSettings

ROOT = Path(__file__).resolve().parents[1]


def load() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def read_bandwidth(gib: float = 1.0, repeats: int = 3) -> float:
    """Bytes per second of summing a ``gib`` GiB float32 tensor (best of ``repeats``)."""
    x = torch.ones(int(gib * 2**30) // 4)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def matmul_rate(repeats: int = 5) -> float:
    """FLOP/s of a float32 ``[4096, 576] @ [576, 1536]`` matmul (the model's MLP shape; best of ``repeats``)."""
    a, b = torch.randn(4096, 576), torch.randn(576, 1536)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * 4096 * 576 * 1536 / best


class DecodeTimer:
    """Times the base model's forwards that feed one token per row (decode steps) and counts the tokens
    of the others (prefill: prompts and each turn's new context, padding included)."""

    def __init__(self, base) -> None:
        self.reset()
        forward = base.forward

        def timed(*args, **kwargs):
            ids = kwargs.get("input_ids")
            t = time.perf_counter()
            out = forward(*args, **kwargs)
            if ids is not None and ids.shape[1] == 1:
                self.steps += 1
                self.seconds += time.perf_counter() - t
                self.rows += ids.shape[0]
            elif ids is not None:
                self.prefill_tokens += ids.numel()
            return out

        base.forward = timed

    def reset(self) -> None:
        self.steps, self.seconds, self.rows, self.prefill_tokens = 0, 0.0, 0, 0

    def floor(self, step_bound: float, flop_per_token: float, head_flop: float, rate: float) -> float:
        """The least this collection's forwards can take at the measured rates: each decode step the slower
        of reading the weights and its matmuls (every row through the trunk and the output head), each
        prefill token through the trunk (its logits are not needed)."""
        rows = self.rows / max(self.steps, 1)
        decode = self.steps * max(step_bound, rows * (flop_per_token + head_flop) / rate)
        return decode + self.prefill_tokens * flop_per_token / rate


class MultinomialDraws(InverseCDFDraws):
    """The draw of transformers' ``do_sample`` (``torch.multinomial`` over softmax(scores)), from the call's
    generator: what the HF sampler drew with before its inverse-CDF draw, for the ``grow``/``prealloc`` arms."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.scores.append(scores)
        token = torch.multinomial(scores.float().softmax(-1), 1, generator=self.generators[0])
        return torch.full_like(scores, float("-inf")).scatter_(-1, token, 0.0)


class OldDrawSampler(HFSampler):
    """An ``HFSampler`` drawing with :class:`MultinomialDraws`."""

    DRAWS = MultinomialDraws


def collect(cfg, tasks, sampler, chat):
    torch.manual_seed(0)
    t = time.perf_counter()
    episodes, _ = collect_batch(RunSettings.from_config(cfg), tasks, RunState(), sampler, chat)
    return time.perf_counter() - t, episodes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs/number_guess_cpu.yaml"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--no-vllm", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    model, tok = build_policy(PolicySettings.from_config(cfg), None, 0)
    chat = ChatTemplate(tok, cfg.model.chat_template_kwargs, exclude_think=cfg.credit.exclude_think)
    tasks = TaskSource.from_config(cfg).tasks("train")
    bw = read_bandwidth()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bound = weight_bytes / bw
    rate = matmul_rate()
    head = model.get_output_embeddings().weight.numel()
    flop_per_token = 2 * (sum(p.numel() for p in model.parameters()) - head)  # the trunk's matmuls, LoRA included
    head_flop = 2 * head
    print(f"threads {torch.get_num_threads()}  {load()}")
    print(
        f"read bandwidth {bw / 1e9:.1f} GB/s; weights {weight_bytes / 1e6:.0f} MB -> a decode step reads them once:"
        f" >= {bound * 1e3:.0f} ms a step"
    )
    print(
        f"matmul rate {rate / 1e9:.0f} GFLOP/s; a token through the trunk {flop_per_token / 1e6:.0f} MFLOP,"
        f" through the output head {head_flop / 1e6:.0f} MFLOP"
    )
    timer = DecodeTimer(model.get_base_model())

    vllm_sampler = None
    if not args.no_vllm and importlib.util.find_spec("vllm") is not None:
        vcfg = load_config(args.config, ["sampler.backend=vllm"])
        vllm_sampler = make_sampler(SamplerSettings.from_config(vcfg.sampler), model, tok)
        t = time.perf_counter()
        collect(cfg, tasks, vllm_sampler, chat)  # the first collection starts the engine
        print(f"vllm: engine start + first collection {time.perf_counter() - t:.1f} s  {load()}")
    elif not args.no_vllm:
        print("vllm: skipped (not importable here); run this script with /work/main/.venv-vllm/bin/python for that arm")

    batch = cfg.sampler.batch_size
    arms = {
        "grow": lambda: OldDrawSampler(model, tok, batch_size=batch, preallocate_kv=False, merge_lora=False),
        "prealloc": lambda: OldDrawSampler(model, tok, batch_size=batch, preallocate_kv=True, merge_lora=False),
        "merged": lambda: OldDrawSampler(model, tok, batch_size=batch),
        "fast": lambda: HFSampler(model, tok, batch_size=batch),
    }
    if vllm_sampler is not None:
        arms["vllm"] = lambda: vllm_sampler
    times: dict[str, list[float]] = {k: [] for k in arms}
    decode: dict[str, list[float]] = {k: [] for k in arms}
    floor: dict[str, list[float]] = {k: [] for k in arms}
    got: dict[str, list] = {}
    for r in range(args.rounds):
        for name, make in arms.items():
            timer.reset()
            sec, episodes = collect(cfg, tasks, make(), chat)
            times[name].append(sec)
            if timer.steps:
                decode[name].append(timer.seconds / timer.steps)
                floor[name].append(timer.floor(bound, flop_per_token, head_flop, rate))
            got[name] = [[(t.action_ids, t.action_logprobs) for t in ep.turns] for ep in episodes]
            turns = sum(len(e) for e in got[name])
            tokens = sum(len(ids) for e in got[name] for ids, _ in e)
            extra = (
                f", {timer.steps} decode steps of {timer.rows / timer.steps:.1f} rows, "
                f"{timer.seconds / timer.steps * 1e3:.0f} ms each, {timer.prefill_tokens} prefill tokens;"
                f" floor {floor[name][-1]:.2f} s"
                if timer.steps
                else ""
            )
            print(
                f"  round {r + 1} {name:8s} {sec:6.2f} s  ({turns} turns, {tokens} tokens{extra})  {load()}", flush=True
            )

    print(f"\nmedians over {args.rounds} rounds ({load()}):")
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        dec = ""
        if decode[k]:
            d = statistics.median(decode[k])
            dec = (
                f"; decode step {d * 1e3:.0f} ms = {bound / d:.0%} of the bandwidth bound;"
                f" its forwards' floor {statistics.median(floor[k]):.2f} s = {statistics.median(floor[k]) / v:.0%}"
                " of the collection"
            )
        print(f"  {k:8s} {v:6.2f} s{dec}")
    print(
        f"  grow / prealloc {med['grow'] / med['prealloc']:.2f}x   grow / merged {med['grow'] / med['merged']:.2f}x"
        f"   grow / fast {med['grow'] / med['fast']:.2f}x (fast: its own draws)"
    )
    if "vllm" in med:
        print(f"  grow / vllm {med['grow'] / med['vllm']:.2f}x   prealloc / vllm {med['prealloc'] / med['vllm']:.2f}x")
    print(f"same episodes, tokens and log-probs (grow vs prealloc): {got['grow'] == got['prealloc']}")
    same = sum(
        [ids for ids, _ in a] == [ids for ids, _ in b] for a, b in zip(got["prealloc"], got["merged"], strict=True)
    )
    print(f"episodes with the same tokens (prealloc vs merged): {same} of {len(got['merged'])}")


if __name__ == "__main__":
    main()
