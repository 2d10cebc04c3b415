"""What the collection benchmarks share: their command line and the main job they collect.

``bench_task_seeds.py`` and ``bench_turn_cache.py`` both collect one training batch of the main job
(``configs/number_guess_cpu.yaml`` unless ``--config``), ``--rounds`` times per variant.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from turnrl.chat import ChatTemplate
from turnrl.config import load_config
from turnrl.envs.splits import TaskSource
from turnrl.train.policy import PolicySettings, build_policy

ROOT = Path(__file__).resolve().parents[1]


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
