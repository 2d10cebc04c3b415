"""Shared builders for tests: turns, episodes, flat groups, trees, and advantages."""

from __future__ import annotations

import os
import time
import urllib.request
from collections.abc import Callable

import pytest
import torch

from turnrl.train.batch import Row
from turnrl.types import Episode, StopReason, Turn


def make_turn(index: int, prompt_ids: list[int], action_ids: list[int], *, logprob: float = -1.0, **kw) -> Turn:
    """A turn whose every action token has behaviour log-prob ``logprob``."""
    kw.setdefault("policy_version", 0)
    return Turn(index, list(prompt_ids), list(action_ids), [logprob] * len(action_ids), kw.pop("text", ""), **kw)


def random_episode(eid: str, seed: int, branch=(), group_id: str = "g", task_id: str = "t") -> Episode:
    """A two-turn episode of random tokens whose second context extends the first turn."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(5, 1000, (7,), generator=g).tolist()
    a1 = torch.randint(5, 1000, (5,), generator=g).tolist()
    env = torch.randint(5, 1000, (4,), generator=g).tolist()
    a2 = torch.randint(5, 1000, (6,), generator=g).tolist()
    turns = [
        Turn(0, prompt, a1, [-1.0 - 0.1 * k for k in range(5)], "a1", policy_version=0),
        Turn(1, prompt + a1 + env, a2, [-0.5 - 0.1 * k for k in range(6)], "a2", policy_version=0),
    ]
    return Episode(
        eid,
        task_id,
        turns,
        reward=float(seed % 2),
        terminated=True,
        truncated=False,
        group_id=group_id,
        branch=list(branch),
        stop_reason=StopReason.SUCCESS if seed % 2 else StopReason.FAILURE,
    )


def set_advantages(episodes: list[Episode], advantages: dict[str, list[float | None]]) -> list[Episode]:
    """Write ``advantages[episode_id]`` into the turns (what credit assignment does); returns the episodes."""
    for ep in episodes:
        for turn, adv in zip(ep.turns, advantages[ep.episode_id], strict=True):
            turn.advantage = adv
    return episodes


def advantages_of(episodes: list[Episode]) -> dict[str, list[float | None]]:
    """``{episode_id: [turn.advantage, ...]}`` after credit assignment."""
    return {ep.episode_id: [t.advantage for t in ep.turns] for ep in episodes}


def tiny_run_config(output_dir, name: str, env: str = "count", **sections):
    """A one-step run config on the tiny model (plots and report off); ``sections`` update the defaults."""
    from turnrl.config import parse_config

    data = {
        "run_name": name,
        "model": {"name": "tiny"},
        "env": {"name": env},
        "sampler": {"max_tokens": 6},
        "rollout": {"tasks_per_step": 2, "group_size": 2},
        "train": {"steps": 1, "lr": 1e-2, "micro_batch_size": 4},
        "eval": {"before": False},
        "data": {"num_eval_tasks": 1},
        "tracking": {"backends": ["csv"], "plots": False, "report": False},
        "paths": {"output_dir": str(output_dir)},
    }
    for key, value in sections.items():
        data.setdefault(key, {}).update(value)
    return parse_config(data)


def perturb_lora(policy, seed: int) -> dict[str, torch.Tensor]:
    """What an optimizer step does: the LoRA B matrices leave zero. Returns the trainable tensors."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.01)
    return {n: p.detach() for n, p in policy.named_parameters() if p.requires_grad}


def sample_rows(contexts: list[list[int]], samples) -> list[Row]:
    """One training row per (context, sample): the sampled tokens trained, advantage 1, behaviour log-probs."""
    return [
        Row(
            c + s.ids,
            [0] * len(c) + [1] * len(s.ids),
            [1.0] * (len(c) + len(s.ids)),
            [0.0] * len(c) + s.logprobs,
            0,
            str(k),
        )
        for k, (c, s) in enumerate(zip(contexts, samples, strict=True))
    ]


def chat_prompts(tok) -> list[list[int]]:
    """Four one-question chats rendered with the generation prompt (the real-server samplers' prompts)."""
    from turnrl.chat import ChatTemplate

    chat = ChatTemplate(tok)
    questions = [
        "What is the capital of France?",
        "Name three primary colors.",
        "Write one sentence about the sea.",
        "What is 7 times 8?",
    ]
    return [chat.initial([{"role": "user", "content": q}]) for q in questions]


def teacher_logprobs(model, context: list[int], ids: list[int], temperature: float) -> list[float]:
    """Log-probs of ``ids`` after ``context`` under the HF model at ``temperature`` (1 for greedy)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([context + ids])).logits[0, len(context) - 1 : -1].float()
    lp = (logits / (temperature or 1.0)).log_softmax(-1)
    return lp.gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1).tolist()


def wait_until_healthy(
    proc, health_url: str, timeout_s: float, name: str, log: Callable[[], str], poll_s: float
) -> None:
    """Poll ``health_url`` until it answers 200; fail the test, with the server's log tail, if ``proc``
    exits first or ``timeout_s`` passes (the llama.cpp and ``vllm serve`` fixtures)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            pytest.fail(f"{name} exited with {proc.returncode}: {log()}")
        try:
            with urllib.request.urlopen(health_url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"{name} was not healthy within {timeout_s} s: {log()}")
        time.sleep(poll_s)


def join_gloo(rank: int, world: int, port: int) -> None:
    """In a spawned test worker: the launcher's rendezvous variables for ``rank`` of ``world`` on
    127.0.0.1:``port``, one torch thread, then the project's process-group set-up (gloo on CPU)."""
    from turnrl.train import distributed

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    distributed.setup()
