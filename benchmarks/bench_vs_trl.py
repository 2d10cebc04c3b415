"""turnrl vs TRL's GRPOTrainer on one GRPO step, interleaved in one process; plus packing scaling.

Workload (issue 10): SmolLM2-135M (embedded) + LoRA r16 on q/k/v/o, 4 prompts × group 4,
≤ 16 new tokens, a ~150-token number-guess prompt (the env's system prompt and opening
in the chat template; ``--prompt-tokens`` pads the system prompt), DAPO loss (clip
0.2/0.28, token_sum normalisation), β 0, one optimizer step per batch, CPU, two threads.

What is compared, exactly:

1. **Training part on identical tokens.** The 16 completions are sampled once with
   turnrl's HF sampler. TRL gets them through its ``rollout_func`` hook (so TRL's step
   is its scoring, advantages, loss, backward and AdamW step — no generation); turnrl
   trains the same prompt+completion tokens with the same advantages (TRL's group
   formula on the same rewards) through ``turnrl.train.step.update`` (``LocalTrainer``), once with
   per-row log-probs (``token_logprobs``) and once with shared-prefix packing
   (``packed_token_logprobs``). Order per round: TRL, per-row, packed.
2. **Whole step with generation** (``--full-steps``, default 2): TRL generating its own 16
   completions (``transformers.generate``, max 16 new tokens, temperature 1) vs turnrl's
   HF sampler + packed training. The generated tokens are *not* the same (both sample);
   their counts are printed.
3. **Scaling** of turnrl's training part (per-row vs packed, random 16-token completions):
   group 4/8/16 at the base prompt, prompt 150/600/1,200 at group 4.

FLOP bound: per step, 4·P·tokens for the linear layers (forward + activation gradients;
the base is frozen, LoRA weight gradients are negligible) plus 12·d·layers per attended
(query, key) pair (forward 4·d, backward 8·d), plus 6·V·d per trained token for the
head; once over every row token (per-row) and once over the unique trie tokens
(each attending to its ancestors). The machine's fp32 matmul rate is measured in the
same run (best of 5, a [2048×576]·[576×1536] matmul, same threads).

Run: ``PYTHONPATH=src python benchmarks/bench_vs_trl.py [--rounds 3] [--full-steps 2]``
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time

import torch

from turnrl.chat import ChatTemplate
from turnrl.config import ModelConfig, parse_config
from turnrl.envs.base import Task
from turnrl.envs.number_guess import NumberGuessEnv
from turnrl.models import attach_lora, load_model
from turnrl.sampling.hf import HFSampler
from turnrl.train import step as step_mod
from turnrl.train.batch import Row
from turnrl.train.packing import row_stats
from turnrl.types import SamplingParams


def load() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def matmul_gflops(repeats: int = 5) -> float:
    a, b = torch.randn(2048, 576), torch.randn(576, 1536)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(10):
            a @ b
        best = min(best, (time.perf_counter() - t) / 10)
    return 2 * 2048 * 576 * 1536 / best / 1e9


def prompts(tok, n: int, target_tokens: int) -> list[list[int]]:
    chat = ChatTemplate(tok)
    out = []
    for k in range(n):
        env = NumberGuessEnv(Task(f"t{k}", "number_guess", {"target": 2 * k + 1}))
        messages = env.initial_messages()
        messages[-1]["content"] = f"Game {k + 1}. " + messages[-1]["content"]
        filler = 0
        ids = chat.initial(messages)
        while len(ids) < target_tokens - 8:
            filler += 1
            messages[0]["content"] += f" Rule {filler}: every guess is one whole number."
            ids = chat.initial(messages)
        out.append(ids)
    return out


def reward(text: str) -> float:
    return 1.0 if "<answer>" in text else (len(text) % 5) / 4


def group_advantages(rewards: list[float], group: int) -> list[float]:
    """TRL's default: (r - group mean) / (group std + 1e-4), std unbiased."""
    r = torch.tensor(rewards).view(-1, group)
    a = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)
    return a.flatten().tolist()


def make_rows(
    prompt_ids: list[list[int]],
    completions: list[list[int]],
    lps: list[list[float]],
    advantages: list[float],
    group: int,
) -> list[Row]:
    rows = []
    for i, (comp, lp, adv) in enumerate(zip(completions, lps, advantages, strict=True)):
        p = prompt_ids[i // group]
        rows.append(
            Row(
                p + comp,
                [0] * len(p) + [1] * len(comp),
                [adv] * (len(p) + len(comp)),
                [0.0] * len(p) + list(lp),
                0,
                f"e{i}",
            )
        )
    return rows


def flops(rows: list[Row], cfg, unique: bool) -> float:
    """Training FLOPs of one step over ``rows`` (see the module docstring)."""
    d, layers, v = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    ff, kv = cfg.intermediate_size, cfg.num_key_value_heads * (d // cfg.num_attention_heads)
    p = layers * (2 * d * d + 2 * d * kv + 3 * d * ff)
    trained = sum(sum(r.mask) for r in rows)
    if unique:
        from turnrl.train.packing import plan_packs

        plan = plan_packs([r.ids for r in rows])
        tokens = plan.stats.unique_tokens
        pairs = sum(dep + 1 for pk in plan.packs for dep in pk.depths)
    else:
        tokens = sum(len(r.ids) for r in rows)
        pairs = sum(len(r.ids) * (len(r.ids) + 1) // 2 for r in rows)
    return 4 * p * tokens + 12 * d * layers * pairs + 6 * v * d * trained


def new_model():
    torch.manual_seed(0)
    model, tok = load_model(ModelConfig(name="embedded"))
    model.train()
    return attach_lora(model, parse_config({}).model.lora), tok


class TurnrlTrainer:
    def __init__(self, lr: float):
        self.model, self.tok = new_model()
        self.cfg = parse_config(
            {
                "loss": {"type": "clip", "eps_lo": 0.2, "eps_hi": 0.28, "norm": "token_sum"},
                "train": {"micro_batch_size": 64, "lr": lr},
                "sampler": {"max_tokens": 16},
            }
        )
        self.trainer = step_mod.LocalTrainer(
            self.model, step_mod.StepSettings.from_config(self.cfg), pad_id=self.tok.pad_token_id
        )

    def step(self, rows: list[Row], packed: bool) -> tuple[float, float]:
        # the config switch train.shared_prefix: packed (default) or per-row
        self.trainer.settings = dataclasses.replace(self.trainer.settings, shared_prefix=packed)
        t, c = time.perf_counter(), time.process_time()
        step_mod.update(self.trainer, rows, self.trainer.settings)
        return time.perf_counter() - t, time.process_time() - c


def trl_trainer(tok, prompt_ids, steps: int, rollout, on_step, lr: float):
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    texts = [tok.decode(p) for p in prompt_ids]

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t, self.c = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            on_step(time.perf_counter() - self.t, time.process_time() - self.c)

    group = 4
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_trl_"),
        per_device_train_batch_size=len(texts) * group,
        num_generations=group,
        max_completion_length=16,
        loss_type="dapo",
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        learning_rate=lr,
        weight_decay=0.0,
        max_steps=steps,
        logging_steps=10_000,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        temperature=1.0,
        top_p=1.0,
        dataloader_num_workers=0,
        shuffle_dataset=False,
        disable_tqdm=True,
    )
    model, _ = new_model()
    dataset = Dataset.from_dict({"prompt": texts * steps})
    return GRPOTrainer(
        model=model,
        reward_funcs=[lambda completions, **kw: [reward(c) for c in completions]],
        args=cfg,
        train_dataset=dataset,
        processing_class=tok,
        rollout_func=rollout,
        callbacks=[Timer()],
    )


def summary(name: str, secs: list[float], cpus: list[float]) -> float:
    med = statistics.median(secs)
    print(
        f"  {name:28s} min {min(secs):7.2f} s  median {med:7.2f} s  cpu/step {statistics.median(cpus):7.2f} s"
        f"  (n={len(secs)})"
    )
    return med


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the first is a warm-up")
    ap.add_argument("--full-steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=150)
    ap.add_argument("--no-scaling", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lr, group, n_prompts = 1e-6, 4, 4
    print(f"threads {torch.get_num_threads()}  {load()}")
    gflops = matmul_gflops()
    print(f"fp32 matmul rate: {gflops:.0f} GFLOP/s")

    ours = TurnrlTrainer(lr)
    tok = ours.tok
    prompt_ids = prompts(tok, n_prompts, args.prompt_tokens)
    contexts = [p for p in prompt_ids for _ in range(group)]
    samples = HFSampler(ours.model, tok).sample(contexts, SamplingParams(temperature=1.0, max_tokens=16, seed=0))
    completions = [s.ids for s in samples]
    lps = [s.logprobs for s in samples]
    texts = tok.batch_decode(completions, skip_special_tokens=True)
    advantages = group_advantages([reward(t) for t in texts], group)
    rows = make_rows(prompt_ids, completions, lps, advantages, group)
    stats = row_stats(rows)
    print(
        f"prompts {[len(p) for p in prompt_ids]} tokens; {len(rows)} completions, "
        f"{sum(map(len, completions))} generated tokens; rows: {stats.total_tokens} tokens, "
        f"{stats.unique_tokens} unique"
    )

    # -- 1. training part on identical completions, interleaved TRL / per-row / packed
    by_text = {tok.decode(p): k for k, p in enumerate(prompt_ids)}

    def fixed_rollout(batch_prompts, trainer):
        seen: dict[int, int] = {}
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for text in batch_prompts:
            k = by_text[text]
            j = seen.get(k, 0)
            seen[k] = j + 1
            out["prompt_ids"].append(prompt_ids[k])
            out["completion_ids"].append(completions[k * group + j])
            out["logprobs"].append(lps[k * group + j])
        return out

    times: dict[str, list[tuple[float, float]]] = {"trl": [], "per_row": [], "packed": []}

    def after_trl_step(sec: float, cpu: float) -> None:
        times["trl"].append((sec, cpu))
        times["per_row"].append(ours.step(rows, packed=False))
        times["packed"].append(ours.step(rows, packed=True))
        print(
            f"  round {len(times['trl'])}: trl {sec:.2f} s, per-row {times['per_row'][-1][0]:.2f} s, "
            f"packed {times['packed'][-1][0]:.2f} s  {load()}",
            flush=True,
        )

    trainer = trl_trainer(tok, prompt_ids, args.rounds, fixed_rollout, after_trl_step, lr)
    trainer.train()
    print(f"\n1. training part on identical tokens ({args.rounds - 1} rounds after a warm-up), {load()}")
    med = {}
    for k, name in (
        ("trl", "TRL GRPOTrainer (no gen)"),
        ("per_row", "turnrl per-row"),
        ("packed", "turnrl packed"),
    ):
        kept = times[k][1:] or times[k]
        med[k] = summary(name, [s for s, _ in kept], [c for _, c in kept])
    print(
        f"  TRL / per-row {med['trl'] / med['per_row']:.2f}x   TRL / packed {med['trl'] / med['packed']:.2f}x   "
        f"per-row / packed {med['per_row'] / med['packed']:.2f}x"
    )
    mcfg = ours.model.get_base_model().config
    f_all, f_uni = flops(rows, mcfg, False), flops(rows, mcfg, True)
    print(f"  FLOPs/step: every token {f_all / 1e12:.3f} TFLOP, unique tokens {f_uni / 1e12:.3f} TFLOP")
    print(
        f"  bound at {gflops:.0f} GFLOP/s: every token {f_all / gflops / 1e9:.2f} s, unique {f_uni / gflops / 1e9:.2f} s"  # noqa: E501
    )
    for k in ("per_row", "packed", "trl"):
        print(
            f"  {k}: {f_uni / gflops / 1e9 / med[k]:.0%} of the unique-token bound, "
            f"{f_all / gflops / 1e9 / med[k]:.0%} of the every-token bound"
        )

    # -- 2. whole step with generation
    if args.full_steps:
        full: dict[str, list[tuple[float, float]]] = {"trl": [], "turnrl": []}
        gen_tokens: dict[str, list[int]] = {"trl": [], "turnrl": []}
        sampler = HFSampler(ours.model, tok)

        def own_rollout(batch_prompts, trainer):  # TRL's own generation, counted
            from trl.trainer.grpo_trainer import GRPOTrainer

            ids = [tok(t, add_special_tokens=False).input_ids for t in batch_prompts]
            comp, lp = GRPOTrainer._generate_single_turn(trainer, ids, None, {}, trainer.num_generations)
            gen_tokens["trl"].append(sum(map(len, comp)))
            return {"prompt_ids": ids, "completion_ids": comp, "logprobs": lp}

        def after_full_trl(sec: float, cpu: float) -> None:
            full["trl"].append((sec, cpu))
            t, c = time.perf_counter(), time.process_time()
            s = sampler.sample(contexts, SamplingParams(temperature=1.0, max_tokens=16, seed=len(full["trl"])))
            comp = [x.ids for x in s]
            adv = group_advantages([reward(x) for x in tok.batch_decode(comp, skip_special_tokens=True)], group)
            r = make_rows(prompt_ids, comp, [x.logprobs for x in s], adv, group)
            sec2, cpu2 = ours.step(r, packed=True)
            full["turnrl"].append((time.perf_counter() - t, time.process_time() - c))
            gen_tokens["turnrl"].append(sum(map(len, comp)))
            print(
                f"  full step {len(full['trl'])}: trl {sec:.2f} s, turnrl {full['turnrl'][-1][0]:.2f} s "
                f"(training {sec2:.2f} s)  {load()}",
                flush=True,
            )

        trl_trainer(tok, prompt_ids, args.full_steps, own_rollout, after_full_trl, lr).train()
        print(
            f"\n2. whole step with generation (different samples; generated tokens trl {gen_tokens['trl']}, "
            f"turnrl {gen_tokens['turnrl']}), {load()}"
        )
        mt = summary("TRL GRPOTrainer", [s for s, _ in full["trl"]], [c for _, c in full["trl"]])
        mo = summary(
            "turnrl (sampler + packed)",
            [s for s, _ in full["turnrl"]],
            [c for _, c in full["turnrl"]],
        )
        print(f"  TRL / turnrl {mt / mo:.2f}x")

    # -- 3. scaling of turnrl's training part
    if not args.no_scaling:
        print(f"\n3. training-part scaling (random 16-token completions), {load()}")
        g = torch.Generator().manual_seed(0)
        for grp, plen in ((4, 150), (8, 150), (16, 150), (4, 600), (4, 1200)):
            p_ids = prompts(tok, n_prompts, plen)
            comp = [torch.randint(100, 40000, (16,), generator=g).tolist() for _ in range(n_prompts * grp)]
            adv = torch.randn(len(comp), generator=g).tolist()
            r = make_rows(p_ids, comp, [[-1.0] * 16] * len(comp), adv, grp)
            st = row_stats(r)
            a = ours.step(r, packed=False)[0]
            b = ours.step(r, packed=True)[0]
            print(
                f"  group {grp:2d} prompt {len(p_ids[0]):5d}: tokens {st.total_tokens:6d} / unique "
                f"{st.unique_tokens:5d}; per-row {a:7.2f} s, packed {b:7.2f} s, {a / b:5.2f}x  {load()}",
                flush=True,
            )


if __name__ == "__main__":
    main()
