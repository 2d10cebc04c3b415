"""The application layer: settings resolved once, the run object, the typed checkpoint, the one adapter
list, the diagnostics in steps.jsonl, one StopReason type, and moved config keys refused by name."""

from __future__ import annotations

import json
import math

import pytest
import torch
from rich.console import Console

from factories import tiny_run_config
from toy_envs import CountEnv
from turnrl import losses
from turnrl.chat import ChatTemplate
from turnrl.config import ConfigError, LossConfig, parse_config
from turnrl.export import export
from turnrl.losses import LOSSES, LossInputs, LossPlan, LossSpec, finalize_metrics, per_token_loss
from turnrl.rollout.collect import collect
from turnrl.rundir import MissingAdapterError, RunDir, read_jsonl
from turnrl.sampling.scripted import ScriptedSampler
from turnrl.train.checkpoint import Checkpoint, ResumeError, RunState, load_checkpoint
from turnrl.train.loop import train
from turnrl.train.policy import PolicySettings, build_policy
from turnrl.train.settings import RunSettings
from turnrl.train.standalone import run_eval
from turnrl.train.summary import Summary
from turnrl.types import SamplingParams, StopReason, Task

LOG = math.log


class ScriptedCount(CountEnv):
    @classmethod
    def scripted_policies(cls):
        return {"say": lambda messages: "abcde"}


@pytest.fixture(autouse=True)
def _count_env():
    from turnrl.envs import ENV_REGISTRY, register_env

    before = dict(ENV_REGISTRY)
    register_env("count", ScriptedCount)
    yield
    ENV_REGISTRY.clear()
    ENV_REGISTRY.update(before)


def _t(x):
    return torch.tensor(x, dtype=torch.float64)


# ---- diagnostics -------------------------------------------------------------------------


def test_entropy_and_approx_kl_by_hand():
    # two trained tokens and one masked: π(y) = .5, .25 now; .25, .25 at the batch's first pass
    logp = _t([[LOG(0.5), LOG(0.25), -9.0]])
    old = _t([[LOG(0.25), LOG(0.25), 3.0]])
    mask = _t([[1.0, 1.0, 0.0]])
    _, sums = per_token_loss(LossPlan.from_config(LossConfig()), logp, old, None, _t([1.0]), mask)
    out = finalize_metrics(sums)
    assert out["entropy"] == pytest.approx((LOG(2) + LOG(4)) / 2)  # mean −log π(y_t)
    # ρ = 2, 1: ((ρ − 1) − log ρ) averaged over the two tokens
    assert out["approx_kl"] == pytest.approx(((2 - 1) - LOG(2) + 0.0) / 2)
    on_policy = finalize_metrics(
        per_token_loss(LossPlan.from_config(LossConfig()), logp, None, None, _t([1.0]), mask)[1]
    )
    assert on_policy["approx_kl"] == 0.0


def test_a_registered_losss_own_metrics_are_finalised():
    def metrics(ratio, adv, params, token_sum):
        return {"mine/positive_adv": token_sum(adv > 0)}

    LOSSES["mine"] = LossSpec(lambda x, p: -x.advantages * x.logp, metrics=metrics)
    try:
        plan = LossPlan.from_config(LossConfig(type="mine"))
        _, sums = per_token_loss(plan, _t([[-1.0, -1.0]]), None, None, _t([[1.0, -1.0]]), _t([[1.0, 1.0]]))
        assert finalize_metrics(sums)["mine/positive_adv"] == 0.5
        assert "loss" not in finalize_metrics({"loss": 3.0, "trained_tokens": 1.0}, exclude=("loss",))
    finally:
        del LOSSES["mine"]


def test_a_tiny_runs_steps_carry_the_diagnostics_and_a_losss_own_metric(tmp_path):
    def plain_pg(x: LossInputs, params) -> torch.Tensor:
        return -x.advantages * x.logp

    def metrics(ratio, adv, params, token_sum):
        return {"plain_pg/adv_abs": token_sum(adv.abs())}

    losses.register_loss("plain_pg", LossSpec(plain_pg, metrics=metrics))
    try:
        cfg = tiny_run_config(tmp_path, "diag", loss={"type": "plain_pg"}, train={"steps": 2, "num_iterations": 2})
        train(cfg, console=Console(quiet=True))
    finally:
        del LOSSES["plain_pg"]
    rows = [json.loads(line) for line in (tmp_path / "diag/progress/steps.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["entropy"] > 0 and math.isfinite(row["entropy"])
        assert row["approx_kl"] >= 0  # the second pass's KL(π_old ‖ π) after one update
        assert "plain_pg/adv_abs" in row


# ---- settings and moved keys ----------------------------------------------------------------


@pytest.mark.parametrize(
    "section, key, new",
    [
        ("credit", "shaping", "rollout.shaping"),
        ("credit", "shaping_gamma", "rollout.shaping_gamma"),
        ("train", "truncated_completion_reward", "rollout.truncated_completion_reward"),
    ],
)
def test_a_moved_key_is_refused_naming_the_new_one(section, key, new):
    with pytest.raises(ConfigError, match=rf"{section}\.{key} moved to {new}"):
        parse_config({section: {key: 0.5 if "gamma" in key or "reward" in key else True}})


def test_run_settings_resolve_each_stage_from_its_keys():
    cfg = parse_config(
        {
            "rollout": {"group_size": 3, "shaping": True, "shaping_gamma": 0.9, "truncated_completion_reward": -1.0},
            "env": {"options": {"few_shot": True}},
            "sampler": {"temperature": 0.0, "max_tokens": 7},
            "train": {"steps": 4, "num_iterations": 2},
            "loss": {"type": "cispo", "eps_max": 3.0},
        }
    )
    s = RunSettings.from_config(cfg)
    assert s.rollout.shape == (3,) and s.rollout.shaping_gamma == 0.9 and s.rollout.truncated_reward == -1.0
    assert dict(s.rollout.env_options) == {"few_shot": True}
    assert s.eval.rollout.shaping_gamma is None and s.eval.rollout.truncated_reward is None  # training-only
    assert s.step.temperature == 1.0 and s.step.max_tokens_per_turn == 7 and s.step.schedule_steps == 8
    assert s.step.loss.type == "cispo" and s.step.loss.params.eps_max == 3.0
    with pytest.raises(AttributeError):
        s.step.lr = 1.0  # frozen: resolved once


# ---- one StopReason type -------------------------------------------------------------------


def test_collected_and_reloaded_episodes_carry_a_stop_reason(tmp_path, tokenizer):
    (ep,) = collect(
        [Task("count-train-0", "count", {"k": 0})],
        ScriptedSampler(lambda m: "ab", tokenizer),
        ChatTemplate(tokenizer),
        SamplingParams(max_tokens=4),
        [1],
    )
    assert type(ep.stop_reason) is StopReason and ep.stop_reason == StopReason.SUCCESS
    from turnrl.rundir import write_jsonl

    write_jsonl(tmp_path / "e.jsonl", [ep])
    (back,) = read_jsonl(tmp_path / "e.jsonl")
    assert type(back.stop_reason) is StopReason and back.stop_reason == ep.stop_reason


# ---- the typed checkpoint ------------------------------------------------------------------


def test_checkpoint_round_trips_and_a_foreign_file_is_refused(tmp_path):
    summary = Summary("abc", {"success_rate": 0.5}, [{"success_rate": 0.75}], complete=True)
    ckpt = Checkpoint(RunState(step=3, cursor=6), summary, {"a": 1}, {"b": 2}, {}, {"x": 4})
    again = Checkpoint.from_payload(ckpt.to_payload())
    assert again == ckpt and isinstance(again.state, RunState) and isinstance(again.summary, Summary)
    run = RunDir(tmp_path / "r")
    run.checkpoint_dir.mkdir(parents=True)
    torch.save({"state": {"step": 1}}, run.checkpoint)
    with pytest.raises(ResumeError, match="not a turnrl checkpoint"):
        load_checkpoint(run)


# ---- one adapter list; run_eval leaves the config alone ------------------------------------


def test_every_reader_of_a_runs_adapters_names_the_missing_one(tmp_path):
    cfg = tiny_run_config(tmp_path, "ad")
    train(cfg, console=Console(quiet=True))
    run = RunDir(tmp_path / "ad")
    assert run.adapters_through(0) == [run.adapter(0)] and run.adapters_through(-1) == []
    (run.adapter(1)).mkdir()  # a directory without adapter_config.json is not a saved adapter
    message = r"no adapter iter_001 \(adapters there: iter_000, iter_001\)"
    with pytest.raises(MissingAdapterError, match=message):
        build_policy(PolicySettings.from_config(cfg), run, 2)
    with pytest.raises(MissingAdapterError, match=message):
        export(run.root, 1, tmp_path / "out")
    with pytest.raises(MissingAdapterError, match=message):
        run_eval(cfg, Console(quiet=True), run_dir=run.root, iteration=1)


def test_run_eval_does_not_change_its_callers_config(tmp_path):
    cfg = tiny_run_config(tmp_path, "ev")
    before = cfg.model_dump()
    metrics = run_eval(cfg, Console(quiet=True), scripted="say", max_turns=1)
    assert metrics["mean_turns"] == 1.0  # the override applied ...
    assert cfg.model_dump() == before  # ... to this evaluation only
