"""turnrl inside TRL's GRPOTrainer (turnrl.integrations.trl): one training step each, on the tiny model.

* flat credit: the advantages are TRL's own, and the loss and gradient equal a plain GRPOTrainer's
  fed the same episodes (from the records the first trainer wrote);
* per-turn credit (branched trees, stepwise): the advantages are turnrl's own for the same episodes,
  and TRL's gradient over whole episodes equals turnrl's over per-turn rows, turn by turn
  (``decompose_turns``): the exact per-turn decomposition;
* the audit runs from the records TRL's rollouts wrote.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("trl", reason="TRL is not installed (pip install 'turnrl[trl]'; the dev extra has it)")

from typer.testing import CliRunner  # noqa: E402

from factories import perturb_lora  # noqa: E402
from toy_envs import CountEnv, ForkEnv, fork_policy  # noqa: E402
from turnrl.config import ModelConfig, parse_config  # noqa: E402
from turnrl.credit import CreditSettings, assign_credit  # noqa: E402
from turnrl.envs import register_env  # noqa: E402
from turnrl.integrations.trl import TurnrlGRPOTrainer, TurnrlRollout, episode_reward, task_dataset  # noqa: E402
from turnrl.models import attach_lora, load_model, load_tokenizer  # noqa: E402
from turnrl.records import read_records  # noqa: E402
from turnrl.train.batch import build_rows  # noqa: E402
from turnrl.train.step import StepSettings, accumulate_gradients  # noqa: E402


@pytest.fixture(autouse=True)
def _toy_envs():
    register_env("count", CountEnv)
    register_env("fork", ForkEnv)


def _policy():
    """The tiny model with LoRA whose B matrices left zero (so every LoRA weight has a gradient), the same
    weights every call."""
    model, tok = load_model(ModelConfig(name="tiny"), seed=0)
    with torch.random.fork_rng():
        torch.manual_seed(0)  # peft draws the LoRA A matrices from the global generator
        policy = attach_lora(model, parse_config({}).model.lora)
    perturb_lora(policy, seed=3)
    return policy, tok


def _args(tmp_path, batch: int, group: int, **kw):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=batch,
        num_generations=group,
        max_completion_length=5,
        loss_type="dapo",
        beta=0.0,
        learning_rate=1e-3,
        max_steps=1,
        max_grad_norm=0.0,  # no clipping: the gradients compared are the loss's own
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        shuffle_dataset=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        gradient_checkpointing=False,
        seed=0,
        **kw,
    )


class Grads:
    """A callback keeping the LoRA gradients of the step (before the optimizer moves anything)."""

    def __new__(cls):
        from transformers import TrainerCallback

        class _Grads(TrainerCallback):
            grads: dict[str, torch.Tensor] = {}

            def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
                self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

        return _Grads()


def _dataset(tasks):
    from datasets import Dataset

    return Dataset.from_list(task_dataset(tasks))


def _train(tmp_path, rollout: TurnrlRollout, batch: int, group: int, env: str = "count"):
    model, tok = _policy()
    tasks = (CountEnv if env == "count" else ForkEnv).default_tasks("train")[: batch // group]
    grads = Grads()
    trainer = TurnrlGRPOTrainer(
        model,
        args=_args(tmp_path, batch, group),
        train_dataset=_dataset(tasks),
        processing_class=tok,
        turnrl=rollout,
        callbacks=[grads],
    )
    trainer.train()
    return trainer, grads.grads


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float = 1e-4) -> float:
    assert a.keys() == b.keys() and a
    worst = max(float((a[k] - b[k]).norm() / (b[k].norm() + 1e-12)) for k in a)
    assert worst < rtol, worst
    return worst


def test_flat_credit_is_trls_own_advantage_loss_and_gradient(tmp_path):
    records = tmp_path / "trl.jsonl"
    rollout = TurnrlRollout(estimator="group_mean", max_turns=3, records=records)
    trainer, grads = _train(tmp_path / "a", rollout, batch=8, group=4)
    samples = rollout.last_samples
    trl_adv = list(trainer._logs["advantages"])  # TRL's own group advantages of the same rewards, before the override
    ours = [next(a for a, m in zip(s.advantages, s.env_mask, strict=True) if m) for s in samples]
    assert len({round(x, 6) for x in ours}) > 1  # the rewards vary: a real comparison
    assert ours == pytest.approx(trl_adv, abs=1e-5)
    for s, a in zip(samples, ours, strict=True):  # flat: every trained token carries its episode's advantage
        assert {x for x, m in zip(s.advantages, s.env_mask, strict=True) if m} == {a}

    # the records hold what was trained, and credit recomputed from them is turnrl's own
    episodes = read_records(records)
    recorded = [[t.advantage for t in e.turns] for e in episodes]
    for e in episodes:
        for t in e.turns:
            t.advantage = None
    assign_credit(episodes, CreditSettings("group_mean", rollout.credit("group").params))
    assert [[t.advantage for t in e.turns] for e in episodes] == recorded

    # a plain GRPOTrainer fed the same episodes: the same loss and gradient
    from trl import GRPOTrainer

    def replay(prompts, trl):
        return {
            "prompt_ids": [s.prompt_ids for s in samples],
            "completion_ids": [s.completion_ids for s in samples],
            "logprobs": [s.logprobs for s in samples],
            "env_mask": [s.env_mask for s in samples],
            "turnrl_reward": [e.reward for e in episodes],
        }

    model, tok = _policy()
    plain_grads = Grads()
    plain = GRPOTrainer(
        model,
        [episode_reward],
        args=_args(tmp_path / "b", 8, 4),
        train_dataset=_dataset(CountEnv.default_tasks("train")[:2]),
        processing_class=tok,
        rollout_func=replay,
        callbacks=[plain_grads],
    )
    plain.train()
    assert trainer.state.log_history[0]["loss"] == pytest.approx(plain.state.log_history[0]["loss"], abs=1e-7)
    _close(grads, plain_grads.grads, rtol=1e-5)


@pytest.mark.parametrize(
    ("estimator", "branching", "params"),
    [("branched", [2, 2], {}), ("stepwise", None, {"gamma": 0.5})],
    ids=["branched-2x2", "stepwise"],
)
def test_per_turn_credit_is_turnrls_and_the_loss_decomposes_exactly_over_turns(tmp_path, estimator, branching, params):
    rollout = TurnrlRollout(estimator=estimator, params=params, branching=branching, max_turns=3)
    trainer, grads = _train(tmp_path, rollout, batch=8, group=4)
    episodes = rollout.last_episodes
    assert len(episodes) == 8 and all(e.num_turns == 3 for e in episodes)
    # the advantages TRL trained with are turnrl's own for these episodes
    trained = [[t.advantage for t in e.turns] for e in episodes]
    for e in episodes:
        for t in e.turns:
            t.advantage = None
    assign_credit(episodes, CreditSettings(estimator, rollout.credit("group").params))
    assert [[t.advantage for t in e.turns] for e in episodes] == trained
    per_turn = [a for row in trained for a in row if a is not None]
    assert len({round(a, 6) for a in per_turn}) > 2  # turns of one episode differ: per-turn credit
    if branching:  # a tree's shared first turn is trained in one leaf only
        assert sum(a is None for row in trained for a in row) == 2 * 2 * (2 - 1)

    # turnrl's per-turn rows, one pass per turn index, on the same initial weights
    model, tok = _policy()
    settings = StepSettings.from_config(
        parse_config({"loss": {"type": "clip", "eps_lo": 0.2, "eps_hi": 0.28}, "train": {"decompose_turns": True}})
    )
    rows = build_rows(episodes, per_turn=True)
    assert {r.turn for r in rows} == {0, 1, 2}
    accumulate_gradients(model, rows, settings, pad_id=tok.pad_token_id)
    ours = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    _close(grads, ours)


def test_the_audit_runs_from_records_that_trls_rollouts_wrote(tmp_path):
    from turnrl.cli import app
    from turnrl.sampling.scripted import ScriptedSampler

    records = tmp_path / "fork.jsonl"
    tok = load_tokenizer("tiny")
    rollout = TurnrlRollout(sampler=ScriptedSampler(fork_policy(1), tok), max_turns=2, records=records)
    _train(tmp_path, rollout, batch=4, group=4, env="fork")
    lines = [json.loads(x) for x in records.read_text().splitlines()]
    assert len(lines) == 4 and {x["source"] for x in lines} == {"trl"}

    cfg = tmp_path / "fork.yaml"
    cfg.write_text("model: {name: tiny}\nenv: {name: fork}\nsampler: {max_tokens: 4}\n")
    out = tmp_path / "audit"
    args = ["credit-audit", str(cfg), "--records", str(records), "--scripted", "random", "--episodes", "3"]
    result = CliRunner().invoke(
        app, [*args, "--continuations", "4", "--leaves", "4", "--repeats", "1", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "credit_audit.json").read_text())
    assert report["records"] == str(records)
    turns = report["ground_truth"]["turns"]
    assert len(turns) == 3 * 2  # the file's first 3 episodes, 2 turns each
    assert report["ground_truth"]["replay_exact_frac"] == 1.0  # the recorded contexts re-render exactly
    assert [e.reward for e in read_records(records)[:3]] == [x["reward"] for x in lines[:3]]

    wrong = tmp_path / "count.yaml"
    wrong.write_text("model: {name: tiny}\nenv: {name: count}\nsampler: {max_tokens: 4}\n")
    bad = CliRunner().invoke(app, ["credit-audit", str(wrong), "--records", str(records), "--scripted", "x"])
    assert bad.exit_code == 2 and f"{records}:1: task_id: 'fork-train-0' is not one of the 4 tasks" in bad.output


def test_trainer_refuses_what_it_cannot_honour(tmp_path):
    model, tok = _policy()
    data = _dataset(CountEnv.default_tasks("train")[:1])
    with pytest.raises(ValueError, match="reward_funcs may only be episode_reward"):
        TurnrlGRPOTrainer(model, [lambda **kw: [0.0]], args=_args(tmp_path, 4, 4), train_dataset=data)
    with pytest.raises(ValueError, match="brings its own rollout_func"):
        TurnrlGRPOTrainer(model, args=_args(tmp_path, 4, 4), train_dataset=data, rollout_func=lambda p, t: {})
    rollout = TurnrlRollout(estimator="branched", branching=[2, 3])
    trainer = TurnrlGRPOTrainer(
        model, args=_args(tmp_path, 4, 4), train_dataset=data, processing_class=tok, turnrl=rollout
    )
    with pytest.raises(ValueError, match=r"branching \[2, 3\] has 6 leaves; num_generations is 4"):
        trainer.train()


@pytest.mark.slow
def test_one_training_step_on_the_embedded_model(tmp_path):
    """The embedded model (SmolLM2-135M) on number guessing, 2 x 2 trees, one TRL step: it trains, with
    turnrl's advantages."""
    from turnrl.envs import get_env_class

    model, tok = load_model(ModelConfig(name="embedded"), seed=0)
    policy = attach_lora(model, parse_config({}).model.lora)
    tasks = get_env_class("number_guess").default_tasks("train")[:2]
    rollout = TurnrlRollout(estimator="branched", branching=[2, 2], max_turns=3, max_tokens=24)
    before = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
    trainer = TurnrlGRPOTrainer(
        policy, args=_args(tmp_path, 8, 4), train_dataset=_dataset(tasks), processing_class=tok, turnrl=rollout
    )
    trainer.train()
    assert trainer.state.global_step == 1 and np.isfinite(trainer.state.log_history[0]["loss"])
    episodes = rollout.last_episodes
    trained = [[t.advantage for t in e.turns] for e in episodes]
    for e in episodes:
        for t in e.turns:
            t.advantage = None
    assign_credit(episodes, CreditSettings("branched", rollout.credit("group").params))
    assert [[t.advantage for t in e.turns] for e in episodes] == trained
    moved = sum(not torch.equal(p, before[n]) for n, p in policy.named_parameters() if p.requires_grad)
    if any(a for row in trained for a in row if a):  # a group with reward variance: the step moves the LoRA
        assert moved > 0
