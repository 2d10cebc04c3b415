"""Peak memory of one training step: per-turn decomposition and chunked log-probs vs the alternatives.

Same batch for every variant: B two-turn episodes (prompt, action 1, environment
reply, action 2) on the embedded model with a LoRA adapter. Variants:

- ``single``: one forward/backward over whole episodes (both turns trained in one row);
- ``decomposed``: turn-1 rows, then turn-2 rows (``train.decompose_turns``);
- ``chunked``: turnrl's log-probs from hidden states in chunks, each chunk's logits
  recomputed in backward;
- ``full``: the usual way: one float32 ``[B × span × vocab]`` logits tensor over the
  span from the first trained position to the end (TRL's ``logits_to_keep``), then
  log-softmax and gather.

Each variant runs in its own subprocess; we report the peak resident memory above
the memory held just before the step (model, adapter, batch loaded; the kernel's
peak counter is reset there), and the ratios between variants. The subprocesses run
with ``MALLOC_MMAP_THRESHOLD_=65536`` so glibc returns every freed tensor buffer to
the system: otherwise its adaptive threshold keeps freed buffers of one pass in the
heap and the peak resident size over-counts passes that run one after another. Linux, CPU; run with
``python benchmarks/bench_memory.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

VARIANTS = [("single", "full"), ("decomposed", "full"), ("single", "chunked"), ("decomposed", "chunked")]
CHECKPOINTING = (False, True)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    """Reset the kernel's peak-RSS counter (VmHWM) so model loading does not count."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def run_variant(mode: str, logprobs: str, gc: bool, batch: int, prompt: int, action: int) -> dict:
    import torch
    import torch.nn.functional as F

    from turnrl.config import ModelConfig, parse_config
    from turnrl.models import attach_lora, enable_gradient_checkpointing, load_model
    from turnrl.train import step as step_mod
    from turnrl.train.batch import build_rows
    from turnrl.train.logprobs import _backbone_and_head
    from turnrl.types import Episode, Turn

    torch.manual_seed(0)
    model, _ = load_model(ModelConfig(name="embedded"))
    if gc:
        enable_gradient_checkpointing(model)
    model.train()
    model = attach_lora(model, parse_config({}).model.lora)
    g = torch.Generator().manual_seed(0)
    episodes = []
    for b in range(batch):
        p = torch.randint(100, 40000, (prompt,), generator=g).tolist()
        a1 = torch.randint(100, 40000, (action,), generator=g).tolist()
        env = torch.randint(100, 40000, (32,), generator=g).tolist()
        a2 = torch.randint(100, 40000, (action,), generator=g).tolist()
        turns = [
            Turn(0, p, a1, [-1.0] * action, "", policy_version=0, advantage=0.5 - b % 2),
            Turn(1, p + a1 + env, a2, [-1.0] * action, "", policy_version=0, advantage=0.25 - b % 2),
        ]
        episodes.append(Episode(f"e{b}", "t", turns, 1.0, True, False))
    cfg = parse_config(
        {"train": {"micro_batch_size": batch, "decompose_turns": mode == "decomposed", "shared_prefix": False}}
    )
    rows = build_rows(episodes, per_turn=mode == "decomposed")

    if logprobs == "full":

        def full_logprobs(model, batch_, chunk=256, temperature=1.0, aux_ids=None):
            backbone, head = _backbone_and_head(model)
            hidden = backbone(input_ids=batch_.input_ids, attention_mask=batch_.attention_mask).last_hidden_state
            first = int((batch_.loss_mask > 0).float().argmax(dim=1).min())  # first trained position
            logits = head(hidden[:, first - 1 : -1]).float()  # [B, span, V]
            lp = logits.log_softmax(-1).gather(-1, batch_.input_ids[:, first:, None]).squeeze(-1)
            return F.pad(lp, (first, 0)) * batch_.loss_mask, None

        step_mod.token_logprobs = full_logprobs

    before = _status_kib("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    model.zero_grad()
    step_mod.accumulate_gradients(model, rows, step_mod.StepSettings.from_config(cfg), pad_id=2)
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    return {
        "mode": mode,
        "logprobs": logprobs,
        "peak_above_start_mib": (peak - before) / 1024,
        "seconds": seconds,
        "rows": len(rows),
        "trained_tokens": sum(sum(r.mask) for r in rows),
    }


def main(batch: int = 8, prompt: int = 256, action: int = 192) -> None:
    print(f"batch: {batch} episodes x (prompt {prompt} + action {action} + env 32 + action {action}) tokens")
    for gc in CHECKPOINTING:
        peak = {}
        print(f"\n-- gradient checkpointing {'on' if gc else 'off'}")
        for mode, logprobs in VARIANTS:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--variant",
                    mode,
                    logprobs,
                    str(int(gc)),
                    str(batch),
                    str(prompt),
                    str(action),
                ],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"},
            )
            res = json.loads(out.stdout.strip().splitlines()[-1])
            peak[(mode, logprobs)] = res["peak_above_start_mib"]
            print(
                f"{mode:>10} + {logprobs:<7} log-probs: peak +{res['peak_above_start_mib']:8.1f} MiB "
                f"({res['seconds']:.1f} s, {res['rows']} rows, {res['trained_tokens']} trained tokens)"
            )
        print(f"decomposed / single, full log-probs:    {peak[('decomposed', 'full')] / peak[('single', 'full')]:.2f}")
        print(
            f"decomposed / single, chunked log-probs: {peak[('decomposed', 'chunked')] / peak[('single', 'chunked')]:.2f}"  # noqa: E501
        )
        print(f"chunked / full, single pass:            {peak[('single', 'chunked')] / peak[('single', 'full')]:.2f}")
        print(
            f"chunked / full, decomposed:             {peak[('decomposed', 'chunked')] / peak[('decomposed', 'full')]:.2f}"  # noqa: E501
        )
        print(
            f"decomposed+chunked / single+full:       {peak[('decomposed', 'chunked')] / peak[('single', 'full')]:.2f}"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--variant":
        mode, logprobs, gc, b, p, a = sys.argv[2:8]
        print(json.dumps(run_variant(mode, logprobs, gc == "1", int(b), int(p), int(a))))
    else:
        main()
