"""Training controls: context limit, truncation masking and its reward variant, LR schedule,
stale-sampler correction on by default, and TRL's reward-metric semantics."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from factories import tiny_run_config
from toy_envs import CountEnv
from turnrl import sampling
from turnrl.chat import ChatTemplate
from turnrl.config import LoraConfig, parse_config
from turnrl.credit import reward_metrics
from turnrl.envs import ENV_REGISTRY, register_env
from turnrl.losses import MismatchCorrection, mismatch_weights
from turnrl.models import attach_lora
from turnrl.rollout.collect import RolloutSettings, collect
from turnrl.rundir import RunDir, read_jsonl
from turnrl.sampling import SamplerSpec
from turnrl.sampling.scripted import ScriptedSampler
from turnrl.tracking import read_csv
from turnrl.train.batch import mask_truncated_turns
from turnrl.train.loop import train
from turnrl.train.step import LocalTrainer, StepSettings, make_scheduler
from turnrl.types import Episode, Sample, SamplingParams, StopReason, Task

PARAMS = SamplingParams(temperature=1.0, max_tokens=6, seed=0)


@pytest.fixture(autouse=True)
def _count_env():
    register_env("count", CountEnv)
    yield
    ENV_REGISTRY.pop("count", None)


def _base(tmp_path, name, **sections):
    return tiny_run_config(tmp_path, name, **sections)


def _opening_len(tokenizer) -> int:
    env = CountEnv(Task("count-train-0", "count", {"k": 0}))
    return len(ChatTemplate(tokenizer).initial(env.initial_messages()))


def test_run_past_the_context_limit_completes_with_truncated_untrained_turns(tmp_path, tokenizer):
    limit = _opening_len(tokenizer) + 20  # turn 1 fits; its reply leaves a few tokens: turn 2 is cut
    runs = {}
    for name, mask in [("plain", False), ("masked", True)]:
        train(_base(tmp_path, name, rollout={"max_context_tokens": limit}, train={"mask_truncated_completions": mask}))
        (row,) = read_csv(tmp_path / name / "progress" / "train.csv")
        runs[name] = (row, read_jsonl(RunDir(tmp_path / name).train_rollouts(0)))
    for _row, episodes in runs.values():
        assert len(episodes) == 4
        for ep in episodes:
            assert ep.truncated and not ep.terminated and ep.stop_reason == StopReason.CONTEXT_LIMIT
            assert len(ep.turns[-1].sequence_ids) <= limit
            assert ep.validate() == []
    plain_row, plain_eps = runs["plain"]
    masked_row, masked_eps = runs["masked"]
    # same seed, same episodes; the masked run trains only the turns that were not cut
    assert [t.action_ids for e in plain_eps for t in e.turns] == [t.action_ids for e in masked_eps for t in e.turns]
    cut = [t for e in masked_eps for t in e.turns if t.finish_reason == "length"]
    assert cut and all(t.advantage is None for t in cut)
    kept = sum(len(t.action_ids) for e in masked_eps for t in e.turns if t.advantage is not None)
    assert masked_row["num_tokens"] == kept < plain_row["num_tokens"]
    assert masked_row["completions/masked_truncated"] == pytest.approx(len(cut) / sum(e.num_turns for e in masked_eps))


class ScriptedWithLength(ScriptedSampler):
    """Replies "long ..." come back as cut by the token limit."""

    def sample(self, contexts, params, messages=None):
        out = super().sample(contexts, params, messages)
        return [Sample(s.ids, s.logprobs, "length" if s.text.startswith("long") else "stop", text=s.text) for s in out]


def test_context_limit_cuts_the_action_and_skips_the_env(tokenizer):
    chat = ChatTemplate(tokenizer)
    n0 = _opening_len(tokenizer)
    reply = "one two three four five six seven eight"
    n_reply = len(chat.encode_reply(reply))
    (ep,) = collect(
        [Task("count-train-0", "count", {"k": 0})],
        ScriptedSampler(lambda m: reply, tokenizer),
        chat,
        PARAMS,
        [1],
        RolloutSettings(max_context_tokens=n0 + n_reply - 3),
    )
    (turn,) = ep.turns
    assert len(turn.action_ids) == n_reply - 3 and turn.finish_reason == "length" and turn.reward == 0.0
    assert turn.observation is None and ep.stop_reason == StopReason.CONTEXT_LIMIT and ep.truncated
    with pytest.raises(ValueError, match="raise rollout.max_context_tokens"):
        collect(
            [Task("count-train-0", "count", {"k": 0})],
            ScriptedSampler(lambda m: reply, tokenizer),
            chat,
            PARAMS,
            [1],
            RolloutSettings(max_context_tokens=n0),
        )


def test_truncated_completion_reward_and_mask(tokenizer):
    replies = iter(["long a", "short", "b", "c", "d", "e"])
    eps = collect(
        [Task("count-train-0", "count", {"k": 0})],
        ScriptedWithLength(lambda m: next(replies), tokenizer),
        ChatTemplate(tokenizer),
        PARAMS,
        [2],
        RolloutSettings(truncated_reward=-1.0),
    )
    # episode 0 had a length-cut turn: its reward is replaced (on the last turn); episode 1 keeps its own
    assert eps[0].reward == -1.0 and [t.reward for t in eps[0].turns] == [0.0, 0.0, -1.0]
    assert eps[1].reward == float(len("e") % 3) and "truncated_reward" not in eps[1].metrics
    for e in eps:
        for t in e.turns:
            t.advantage = 1.0
    assert mask_truncated_turns(eps) == {"completions/masked_truncated": 1 / 6}
    assert eps[0].turns[0].advantage is None and eps[0].turns[1].advantage == 1.0


def test_control_fields_are_validated(tmp_path):
    from turnrl.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.max_context_tokens"):
        _base(tmp_path, "x", rollout={"max_context_tokens": 1})
    with pytest.raises(ConfigError, match="train.lr_scheduler"):
        _base(tmp_path, "x", train={"lr_scheduler": "exponential"})


# ---- learning-rate schedule ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, expected",
    [
        ("linear", [0.0, 0.5, 1.0, 0.75, 0.5, 0.25]),
        ("cosine", [0.0, 0.5, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4))]),
        ("constant", [0.0, 0.5, 1.0, 1.0, 1.0, 1.0]),
    ],
)
def test_lr_schedule_with_warmup_by_hand(tmp_path, name, expected):
    cfg = _base(tmp_path, "lr", train={"lr": 1.0, "steps": 6, "warmup_steps": 2, "lr_scheduler": name})
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.train.lr)
    sched = make_scheduler(opt, StepSettings.from_config(cfg))
    used = []
    for _ in range(6):
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert used == pytest.approx(expected)


def test_local_trainer_steps_and_restores_the_schedule(tmp_path, tiny_model):
    cfg = _base(tmp_path, "lr", train={"lr": 1.0, "steps": 6, "warmup_steps": 2, "lr_scheduler": "linear"})
    model = attach_lora(tiny_model, LoraConfig(r=2, alpha=4))
    trainer = LocalTrainer(model, StepSettings.from_config(cfg), pad_id=0)
    for _ in range(3):
        trainer.optim_step()
    assert trainer.last_lr == 1.0  # the lr of step 3 (0, 0.5, 1.0)
    state = trainer.state_dict()
    again = LocalTrainer(model, StepSettings.from_config(cfg), pad_id=0)
    again.load_state_dict(state)
    again.optim_step()
    assert again.last_lr == pytest.approx(0.75)


# ---- stale-sampler correction on by default -------------------------------------------------------
def test_mismatch_auto_resolves_to_trl_default_when_the_sampler_can_differ():
    assert parse_config({}).loss.mismatch.mode == "none"  # a fresh sampler that is the trainer
    stale = parse_config({"sampler": {"refresh_every": 2}}).loss.mismatch
    assert (stale.mode, stale.level, stale.c_min, stale.c_max) == ("mask", "sequence", 0.0, 3.0)
    sampling.register_sampler("own_copy", SamplerSpec("turnrl.sampling.hf:HFSampler.from_config", shares_weights=False))
    try:
        assert parse_config({"sampler": {"backend": "own_copy"}}).loss.mismatch.mode == "mask"
    finally:
        del sampling.SAMPLERS["own_copy"]
    assert (
        parse_config({"sampler": {"refresh_every": 2}, "loss": {"mismatch": {"c_max": 5.0}}}).loss.mismatch.c_max == 5.0
    )
    # a loss that corrects against the sampler itself gets no second correction
    assert (
        parse_config({"sampler": {"refresh_every": 2}, "loss": {"type": "importance_sampling"}}).loss.mismatch.mode
        == "none"
    )


def test_turning_the_correction_off_warns():
    with pytest.warns(UserWarning, match="loss.mismatch.mode: none with a sampler that can differ"):
        parse_config({"sampler": {"refresh_every": 4}, "loss": {"mismatch": {"mode": "none"}}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_config({"loss": {"mismatch": {"mode": "none"}}})  # fresh shared sampler: nothing to warn about


def test_auto_correction_is_trls_sequence_mask():
    """TRL: ratio = exp(Σ_t m_t (old_t − sampling_t)) per sequence; ratio.masked_fill(ratio > 3, 0)."""
    cfg = MismatchCorrection.from_config(parse_config({"sampler": {"refresh_every": 2}}).loss.mismatch)
    old = torch.tensor([[-1.0, -1.0, -2.0], [-1.0, -0.5, -1.0], [-1.0, -1.0, -1.0]])
    sampling_lp = torch.tensor([[-1.5, -1.5, -9.0], [-1.0, -1.0, -1.0], [-3.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    w, _ = mismatch_weights(old, sampling_lp, mask, cfg)
    ratio = torch.exp(((old - sampling_lp) * mask).sum(-1, keepdim=True))  # e^1, e^0.5, e^2
    trl = ratio.masked_fill(ratio > 3.0, 0.0).expand_as(old) * mask
    assert torch.allclose(w, trl)
    assert w[0, 0] == pytest.approx(math.e) and w[2, 0] == 0.0  # e^2 > 3 is masked


# ---- reward metrics as TRL defines them ---------------------------------------------------------
def _trl_metrics(rewards: torch.Tensor, G: int, scale: str) -> dict[str, float]:
    """TRL GRPOTrainer's reward logging (rewards.std(); is_std_zero from the std of the scale in use)."""
    group_std = rewards.view(-1, G).std(dim=1).repeat_interleave(G)
    std_rewards = rewards.std().expand_as(rewards) if scale == "batch" else group_std
    is_std_zero = std_rewards.abs() < 1e-8
    return {
        "reward": rewards.mean().item(),
        "reward_std": rewards.std().item(),
        "frac_reward_zero_std": is_std_zero.float().mean().item(),
        "reward_std/group": group_std.mean().item(),
    }


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_reward_metrics_equal_trls_formula(scale):
    values = [1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0, -1.0, 3.0, 0.0, 1.0]
    eps = [
        Episode(f"e{i}", "t", [], reward=r, terminated=True, truncated=False, group_id=f"g{i // 4}")
        for i, r in enumerate(values)
    ]
    ours = reward_metrics(eps, scale)
    trl = _trl_metrics(torch.tensor(values, dtype=torch.float64), 4, scale)
    for key, value in trl.items():
        assert ours[key] == pytest.approx(value), key
    assert ours["frac_groups_zero_std"] == pytest.approx(1 / 3)
    same = [
        Episode(f"s{i}", "t", [], reward=1.0, terminated=True, truncated=False, group_id=f"g{i // 2}") for i in range(4)
    ]
    assert reward_metrics(same, scale)["frac_reward_zero_std"] == 1.0
