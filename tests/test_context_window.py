"""``rollout.context``: a 50-turn episode in bounded context, each turn trained on exactly the tokens it saw."""

from __future__ import annotations

import pytest
import torch

from factories import tiny_run_config
from turnrl.chat import ChatTemplate
from turnrl.envs import Env, StepResult, StopReason, Task, register_env
from turnrl.rollout.collect import RolloutSettings, collect
from turnrl.rollout.context import SUMMARY_HEADER, windowed
from turnrl.rundir import RunDir, read_jsonl
from turnrl.sampling.hf import HFSampler
from turnrl.train.batch import build_rows, collate
from turnrl.train.logprobs import token_logprobs
from turnrl.types import SamplingParams, new_prompt_lengths

HORIZON = 50


class WalkEnv(Env):
    """A 50-step corridor: every reply moves one step; the reward comes at the end."""

    name = "walk"
    max_turns = HORIZON

    def __init__(self, task: Task, **options) -> None:
        super().__init__(task, **options)
        self.at = 0

    @classmethod
    def default_tasks(cls, split: str, **options) -> list[Task]:
        return [Task(f"walk-{split}-{k}", "walk", {"k": k}, split) for k in range(2)]

    def initial_messages(self):
        return [
            {"role": "system", "content": "Walk."},
            {"role": "user", "content": f"Corridor {self.task.params['k']}"},
        ]

    def step(self, action_text: str) -> StepResult:
        self.at += 1
        if self.at < HORIZON:
            return StepResult([{"role": "user", "content": f"at {self.at}"}], reward=0.0)
        return StepResult([], reward=1.0, terminated=True, stop_reason=StopReason.SUCCESS)

    def state_key(self):
        return self.at

    def context_summary(self) -> str | None:
        return f"walked {self.at} steps"


class NoSummary(WalkEnv):
    name = "walk_plain"

    def context_summary(self) -> str | None:
        return None


@pytest.fixture(autouse=True)
def _register():
    register_env("walk", WalkEnv)
    register_env("walk_plain", NoSummary)


def _m(role: str, text: str) -> dict:
    return {"role": role, "content": text}


def test_the_window_keeps_the_task_and_the_last_turns_by_hand():
    opening = [_m("system", "S"), _m("user", "task")]
    turns = [[_m("assistant", f"a{k}"), _m("user", f"o{k}")] for k in range(4)]
    history = opening + [m for t in turns for m in t]
    assert windowed(history, 2, 2, "full") is None
    assert windowed(opening + turns[0] + turns[1], 2, 2, "window") is None  # nothing left out yet
    assert windowed(history, 2, 2, "window") == opening + turns[2] + turns[3]
    assert windowed(history, 2, 1, "window") == opening + turns[3]
    summary = _m("user", f"{SUMMARY_HEADER}\nat 4")
    assert windowed(history, 2, 3, "summary", "at 4") == opening + [summary] + turns[1] + turns[2] + turns[3]
    with pytest.raises(ValueError, match="rollout.context: window"):
        windowed(history, 2, 3, "summary", None)
    tool_turn = [_m("assistant", "call"), _m("tool", "r1"), _m("tool", "r2")]  # a turn of several replies
    assert windowed(history + tool_turn, 2, 1, "window") == opening + tool_turn


@pytest.mark.parametrize("mode", ["window", "summary"])
def test_a_50_turn_episode_stays_in_bounded_context_and_trains_on_what_the_sampler_saw(tiny_model, tokenizer, mode):
    chat = ChatTemplate(tokenizer)
    settings = RolloutSettings(shape=(2,), context=mode, context_turns=2)
    sampler = HFSampler(tiny_model, tokenizer)
    tasks = WalkEnv.default_tasks("train")[:1]
    (ep, _) = collect(tasks, sampler, chat, SamplingParams(max_tokens=3, seed=1), [2], settings)
    full = collect(tasks, sampler, chat, SamplingParams(max_tokens=3, seed=1), [1])[0]
    assert ep.num_turns == HORIZON and ep.validate() == [] and ep.success
    lengths = [len(t.prompt_ids) for t in ep.turns]
    # bounded: the task, (the summary,) two turns of at most 3 + 4 tokens and the template's framing
    assert max(lengths) <= lengths[2] + 40 < max(len(t.prompt_ids) for t in full.turns) / 4
    shown = tokenizer.decode(ep.turns[-1].prompt_ids)
    assert "Corridor 0" in shown and "at 49" in shown and "at 48" in shown and "at 47" not in shown
    assert (SUMMARY_HEADER in shown and "walked 49 steps" in shown) == (mode == "summary")
    assert [t.state_key for t in ep.turns] == [str(k) for k in range(HORIZON)]  # keyed on the state, not the text
    with pytest.raises(ValueError):  # the contexts no longer extend each other: one row per turn
        new_prompt_lengths(ep)
    assert (
        sum(s is not None and sum(n for _, n in s) == len(t.prompt_ids) for t in ep.turns for s in [t.prompt_sources])
        == HORIZON
    )  # provenance covers every rebuilt context

    for turn in ep.turns:
        turn.advantage = 1.0
    rows = build_rows([ep], per_turn=True)
    batch = collate(rows, chat.pad_id)
    with torch.no_grad():
        logp, _ = token_logprobs(tiny_model, batch)
    trainer = [logp[i][batch.loss_mask[i].bool()].tolist() for i in range(len(rows))]
    for turn, theirs in zip(ep.turns, trainer, strict=True):
        assert theirs == pytest.approx(turn.action_logprobs, abs=1e-4)


def test_summary_needs_an_environment_that_gives_one(tiny_model, tokenizer):
    settings = RolloutSettings(shape=(1,), context="summary", context_turns=1)
    tasks = [Task("w", "walk_plain", {"k": 0}, "train")]
    with pytest.raises(ValueError, match="context_summary"):
        collect(
            tasks,
            HFSampler(tiny_model, tokenizer),
            ChatTemplate(tokenizer),
            SamplingParams(max_tokens=2),
            [1],
            settings,
        )


def test_a_windowed_run_trains_per_turn_rows_end_to_end(tmp_path):
    from turnrl.train.loop import train

    cfg = tiny_run_config(
        tmp_path,
        "walk",
        env="walk",
        sampler={"max_tokens": 3},
        rollout={"context": "window", "context_turns": 3, "tasks_per_step": 1, "group_size": 2},
        train={"micro_batch_size": 64},
    )
    assert cfg.per_turn_rows
    assert train(cfg).complete
    episodes = read_jsonl(RunDir(tmp_path / "walk").train_rollouts(0))
    assert len(episodes) == 2 and all(ep.num_turns == HORIZON for ep in episodes)
    assert max(len(t.prompt_ids) for ep in episodes for t in ep.turns) < 150  # the window, not 50 turns
    with pytest.raises(ValueError, match="context_turns"):
        tiny_run_config(tmp_path, "bad", env="walk", rollout={"context_turns": 0})
