"""What the benchmarks share: the machine's yardsticks measured in the same run (load, read bandwidth,
matmul rate) and, for the collection benchmarks, their command line and the main job they collect.

``bench_task_seeds.py`` and ``bench_turn_cache.py`` both collect one training batch of the main job
(``configs/number_guess_cpu.yaml`` unless ``--config``), ``--rounds`` times per variant.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch

from turnrl.chat import ChatTemplate
from turnrl.config import load_config
from turnrl.envs.splits import TaskSource
from turnrl.train.policy import PolicySettings, build_policy

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


def parse_args(doc: str) -> argparse.Namespace:
    """``--config`` (the main job's by default) and ``--rounds`` (2), described by ``doc``'s first line."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs/number_guess_cpu.yaml"))
    ap.add_argument("--rounds", type=int, default=2)
    return ap.parse_args()


def load_main_job(config: str) -> tuple[Any, Any, Any, ChatTemplate, list]:
    """The config, the policy model and tokenizer (fresh adapter, seed 0), the chat template, the train tasks."""
    cfg = load_config(config)
    model, tok = build_policy(PolicySettings.from_config(cfg), None, 0)
    chat = ChatTemplate(tok, cfg.model.chat_template_kwargs, exclude_think=cfg.model.exclude_think)
    tasks = TaskSource.from_config(cfg).tasks("train")
    return cfg, model, tok, chat, tasks
