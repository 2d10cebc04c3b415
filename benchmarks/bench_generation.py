"""The main job's collection with the HF sampler's decode paths, and vLLM's engine; interleaved.

Workload: one training batch of ``configs/number_guess_cpu.yaml`` (4 tasks × 8 games of number
guessing, 3 × 8 in docs/results.md §4's earlier tables; ≤ 6 turns, ≤ 16 new tokens a turn, the embedded
SmolLM2-135M with its fresh LoRA), collected by ``turnrl.train.loop.collect_batch`` with the step-0
seeds, a fresh sampler each time. Arms (``--arms``, default ``generate,packed``):

- ``grow``: ``HFSampler(fast_decode=False, preallocate_kv=False, merge_lora=False)`` drawing with
  ``torch.multinomial``: transformers' ``generate`` with its growing cache (a ``cat`` of the whole cache per layer
  at every decode step), peft's LoRA forward and multinomial's draw, the sampler before issue 21;
- ``prealloc``: the same with ``preallocate_kv=True``: keys/values written in place into buffers allocated
  once per call, and logits only at the last position of the shared-prefix forward;
- ``merged``: ``prealloc`` with the LoRA merged into the base weights while generating (``merge_lora``), still
  drawing with multinomial;
- ``generate``: ``HFSampler(fast_decode=False)``, the default before issue 32: ``merged`` with the inverse-CDF
  draw (one uniform per row);
- ``packed``: ``HFSampler()`` as it is now by default (``sampler.fast_decode``): the packed decoder
  (``turnrl.sampling.packed``: weights packed for oneDNN once per version, q/k/v and gate/up fused, a
  hand-written loop over the layers, the shared prefix's keys/values once for all rows, a group's identical
  contexts run once) with the same draws as ``generate``: the same episodes wherever float rounding moves no
  token across a draw's threshold (how many are the same is printed);
- ``packed_bf16``: ``packed`` with ``sampler.decode_dtype: bfloat16`` (its log-probs are not the trainer's);
- ``vllm``: ``sampler.backend: vllm`` (the CPU build), only where ``vllm`` imports in this interpreter
  (``/work/main/.venv-vllm/bin/python``); its engine start is timed separately, outside the rounds.

The arms run alternately ``--rounds`` times; the medians, the spread over the rounds and the ratios against
``generate`` are printed, and how many episodes each HF arm collected with the same tokens as ``generate``.

Decode against the machine's floors, measured in this run (before and after the rounds): the read
bandwidth (sum of a 1 GiB tensor, best of 3) and the float32 matmul rate (``[4096, 576] @ [576, 1536]``, the
model's MLP shape, best of 5). A decode step of R rows must read every weight once (the parameters' bytes;
the tied embedding once, as the output head) and do R rows of matmuls through the trunk and the head: its
floor is the slower of ``bytes / bandwidth`` and ``R × FLOP per token / rate``. Each arm's decode steps
(forwards of one new token per row: transformers' forward, or the packed decoder's) are timed by wrapping
them; printed: the mean step, its rows, its ratio to the compute floor at those rows and the weights'
streaming rate (bytes / step). The floor of a collection (per arm): each decode step its floor, each
prefill token (padding included) its trunk matmuls.

Run (under the machine's lock, ~3-5 min for 2 rounds of the two default arms):
``PYTHONPATH=src python benchmarks/bench_generation.py [--rounds 2] [--threads 2] [--arms generate,packed]``;
with the vLLM arm: ``PYTHONPATH=src /work/main/.venv-vllm/bin/python benchmarks/bench_generation.py
--arms generate,packed,vllm``.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch
from _common import load, matmul_rate, read_bandwidth  # the script's directory is on sys.path

from turnrl.chat import ChatTemplate
from turnrl.config import load_config
from turnrl.envs.splits import TaskSource
from turnrl.sampling import SamplerSettings, make_sampler
from turnrl.sampling.draws import InverseCDFDraws
from turnrl.sampling.hf import HFSampler
from turnrl.sampling.packed import PackedDecoder
from turnrl.train.checkpoint import RunState
from turnrl.train.loop import collect_batch
from turnrl.train.policy import PolicySettings, build_policy
from turnrl.train.settings import RunSettings

ROOT = Path(__file__).resolve().parents[1]


class DecodeTimer:
    """Times the forwards that feed one token per row (decode steps), transformers' (the base model's
    ``forward``) and the packed decoder's, and counts the tokens of the others (prefill: prompts and each
    turn's new context, padding included)."""

    def __init__(self, base) -> None:
        self.reset()
        base.forward = self._timed(base.forward, lambda args, kwargs: kwargs.get("input_ids"))
        packed = PackedDecoder.forward
        timed = self._timed(packed, lambda args, kwargs: args[1])
        PackedDecoder.forward = lambda *args, **kwargs: timed(*args, **kwargs)

    def _timed(self, forward, ids_of):
        def timed(*args, **kwargs):
            ids = ids_of(args, kwargs)
            t = time.perf_counter()
            out = forward(*args, **kwargs)
            if ids is not None and ids.shape[1] == 1:
                self.steps += 1
                self.seconds += time.perf_counter() - t
                self.rows += ids.shape[0]
            elif ids is not None:
                self.prefill_tokens += ids.numel()
            return out

        return timed

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

    def token(self, scores: torch.Tensor) -> torch.Tensor:
        self.scores.append(scores)
        return torch.multinomial(scores.float().softmax(-1), 1, generator=self.generators[0]).squeeze(-1)


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
    ap.add_argument("--arms", default="generate,packed", help="comma-separated, of: " + ", ".join(ARMS))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.arms.split(",")
    if unknown := [n for n in names if n not in ARMS]:
        ap.error(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    cfg = load_config(args.config)
    model, tok = build_policy(PolicySettings.from_config(cfg), None, 0)
    chat = ChatTemplate(tok, cfg.model.chat_template_kwargs, exclude_think=cfg.model.exclude_think)
    tasks = TaskSource.from_config(cfg).tasks("train")
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" not in n)
    head = model.get_output_embeddings().weight.numel()
    params = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    flop_per_token = 2 * (params - head)  # the trunk's matmuls (the LoRA merged into them)
    head_flop = 2 * head
    bw, rate = read_bandwidth(), matmul_rate()
    print(f"threads {torch.get_num_threads()}  {load()}")
    print(
        f"read bandwidth {bw / 1e9:.1f} GB/s; weights {weight_bytes / 1e6:.0f} MB -> a decode step reads them once:"
        f" >= {weight_bytes / bw * 1e3:.0f} ms a step"
    )
    floor16 = 16 * (flop_per_token + head_flop) / rate
    print(
        f"matmul rate {rate / 1e9:.0f} GFLOP/s; a token through the trunk {flop_per_token / 1e6:.0f} MFLOP,"
        f" through the output head {head_flop / 1e6:.0f} MFLOP: 16 rows >= {floor16 * 1e3:.0f} ms a step"
    )
    timer = DecodeTimer(model.get_base_model())

    batch = cfg.sampler.batch_size
    makers = {
        "grow": lambda: OldDrawSampler(
            model, tok, batch_size=batch, preallocate_kv=False, merge_lora=False, fast_decode=False
        ),
        "prealloc": lambda: OldDrawSampler(model, tok, batch_size=batch, merge_lora=False, fast_decode=False),
        "merged": lambda: OldDrawSampler(model, tok, batch_size=batch, fast_decode=False),
        "generate": lambda: HFSampler(model, tok, batch_size=batch, fast_decode=False),
        "packed": lambda: HFSampler(model, tok, batch_size=batch),
        "packed_bf16": lambda: HFSampler(model, tok, batch_size=batch, decode_dtype="bfloat16"),
    }
    if "vllm" in names:
        if importlib.util.find_spec("vllm") is None:
            print("vllm: skipped (not importable here); run this script with /work/main/.venv-vllm/bin/python")
            names.remove("vllm")
        else:
            vcfg = load_config(args.config, ["sampler.backend=vllm"])
            vllm_sampler = make_sampler(SamplerSettings.from_config(vcfg.sampler), model, tok)
            t = time.perf_counter()
            collect(cfg, tasks, vllm_sampler, chat)  # the first collection starts the engine
            print(f"vllm: engine start + first collection {time.perf_counter() - t:.1f} s  {load()}")
            makers["vllm"] = lambda: vllm_sampler
    times: dict[str, list[float]] = {k: [] for k in names}
    steps: dict[str, list[tuple[float, float]]] = {k: [] for k in names}
    floor: dict[str, list[float]] = {k: [] for k in names}
    got: dict[str, list] = {}
    for r in range(args.rounds):
        for name in names:
            timer.reset()
            sec, episodes = collect(cfg, tasks, makers[name](), chat)
            times[name].append(sec)
            extra = ""
            if timer.steps:
                steps[name].append((timer.seconds / timer.steps, timer.rows / timer.steps))
                floor[name].append(timer.floor(weight_bytes / bw, flop_per_token, head_flop, rate))
                extra = (
                    f", {timer.steps} decode steps of {timer.rows / timer.steps:.1f} rows, "
                    f"{timer.seconds / timer.steps * 1e3:.0f} ms each, {timer.prefill_tokens} prefill tokens;"
                    f" floor {floor[name][-1]:.2f} s"
                )
            got[name] = [[(t.action_ids, t.action_logprobs) for t in ep.turns] for ep in episodes]
            turns = sum(len(e) for e in got[name])
            tokens = sum(len(ids) for e in got[name] for ids, _ in e)
            print(
                f"  round {r + 1} {name:11s} {sec:6.2f} s  ({turns} turns, {tokens} tokens{extra})  {load()}",
                flush=True,
            )
    bw2, rate2 = read_bandwidth(), matmul_rate()
    print(f"\nafter the rounds: read bandwidth {bw2 / 1e9:.1f} GB/s, matmul rate {rate2 / 1e9:.0f} GFLOP/s  {load()}")
    bw, rate = max(bw, bw2), max(rate, rate2)  # the floors: the machine's best in this run
    print(
        f"medians over {args.rounds} rounds (spread: min-max), floors at {bw / 1e9:.1f} GB/s, {rate / 1e9:.0f} GFLOP/s:"
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        dec = ""
        if steps[k]:
            step = statistics.median(s for s, _ in steps[k])
            rows = statistics.median(r for _, r in steps[k])
            compute = rows * (flop_per_token + head_flop) / rate
            stream = weight_bytes / (2 if k == "packed_bf16" else 1) / step
            dec = (
                f"; decode step {step * 1e3:.0f} ms at {rows:.1f} rows = {step / compute:.2f}x its fp32 compute floor"
                f" ({compute * 1e3:.0f} ms), weights streamed at {stream / 1e9:.1f} GB/s;"
                f" forwards' floor {statistics.median(floor[k]):.2f} s = {statistics.median(floor[k]) / v:.0%}"
            )
        print(f"  {k:11s} {v:6.2f} s ({min(times[k]):.2f}-{max(times[k]):.2f}){dec}")
    if "generate" in med:
        print("  " + "   ".join(f"generate / {k} {med['generate'] / med[k]:.2f}x" for k in med if k != "generate"))
        for k in got:
            if k not in ("generate", "vllm"):
                same = sum([i for i, _ in a] == [i for i, _ in b] for a, b in zip(got["generate"], got[k], strict=True))
                print(f"  episodes with generate's tokens: {k} {same} of {len(got[k])}")


ARMS = ("grow", "prealloc", "merged", "generate", "packed", "packed_bf16", "vllm")


if __name__ == "__main__":
    main()
