"""Multi-turn collection: token provenance, trees, limits, shaping."""

from __future__ import annotations

import pytest

from toy_envs import CountEnv, EarlyEndEnv
from turnrl.chat import ChatTemplate, render_ids
from turnrl.config import LoraConfig
from turnrl.envs import StopReason, register_env
from turnrl.models import attach_lora
from turnrl.rollout.collect import RolloutSettings, collect
from turnrl.sampling.hf import HFSampler
from turnrl.types import SamplingParams, loss_mask


@pytest.fixture(autouse=True)
def _register():
    register_env("count", CountEnv)
    register_env("early", EarlyEndEnv)


class Recording:
    """Wraps a sampler and remembers every sample it returned."""

    def __init__(self, inner):
        self.inner, self.samples, self.contexts = inner, [], []
        self.policy_version = 0

    def sample(self, contexts, params, messages=None):
        out = self.inner.sample(contexts, params, messages)
        self.samples += out
        self.contexts += contexts
        return out


def _tasks(env="count", n=2):
    return (
        CountEnv.default_tasks("train")[:n]
        if env == "count"
        else [t.__class__(t.task_id, "early", t.params, t.split) for t in CountEnv.default_tasks("train")[:n]]
    )


def test_token_provenance_three_turns(tiny_model, tokenizer):
    sampler = Recording(HFSampler(tiny_model, tokenizer))
    chat = ChatTemplate(tokenizer)
    episodes = collect(_tasks(), sampler, chat, SamplingParams(max_tokens=6, seed=3), [2])
    assert len(episodes) == 4
    sampled = [(c, s.ids, s.logprobs) for c, s in zip(sampler.contexts, sampler.samples, strict=True)]
    assert len(sampled) == sum(ep.num_turns for ep in episodes)
    for ep in episodes:
        assert ep.validate() == []
        assert ep.num_turns == 3
        for turn in ep.turns:
            # model tokens are exactly the sampled ids, with their log-probs
            assert (turn.prompt_ids, turn.action_ids, turn.action_logprobs) in sampled
        ids, mask = loss_mask(ep)
        assert ids == ep.turns[-1].prompt_ids + ep.turns[-1].action_ids
        # mask is 1 exactly on the action spans
        expect = []
        for turn in ep.turns:
            expect += [0] * (len(turn.prompt_ids) - len(expect)) + [1] * len(turn.action_ids)
        assert mask == expect
        # the environment tokens between turns are the chat template's rendering of the reply
        for k in (1, 2):
            prev = ep.turns[k - 1]
            env_tokens = ep.turns[k].prompt_ids[len(prev.prompt_ids) + len(prev.action_ids) :]
            text = tokenizer.decode(env_tokens)
            close = "" if prev.finish_reason == "stop" else "<|im_end|>"
            assert text == f"{close}\n<|im_start|>user\nobs {k}<|im_end|>\n<|im_start|>assistant\n"
        # the first context is the template's rendering of the opening messages
        assert ep.turns[0].prompt_ids == render_ids(
            tokenizer,
            CountEnv(_tasks()[0]).initial_messages()
            if ep.task_id == "count-train-0"
            else CountEnv(_tasks()[1]).initial_messages(),
            True,
        )


def test_length_cut_turns_are_closed_with_an_untrained_end_token(tiny_model, tokenizer):
    episodes = collect(
        _tasks(n=1),
        HFSampler(tiny_model, tokenizer),
        ChatTemplate(tokenizer),
        SamplingParams(max_tokens=2, seed=0),
        [1],
    )
    turn0, turn1 = episodes[0].turns[:2]
    if turn0.finish_reason == "length":
        gap = turn1.prompt_ids[len(turn0.prompt_ids) + len(turn0.action_ids)]
        assert gap == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_branched_tree_shares_prefix_and_observation(tiny_model, tokenizer):
    episodes = collect(
        _tasks(n=2),
        HFSampler(tiny_model, tokenizer),
        ChatTemplate(tokenizer),
        SamplingParams(max_tokens=5, seed=1),
        [2, 3],
    )
    assert len(episodes) == 12
    by_group: dict[str, list] = {}
    for ep in episodes:
        by_group.setdefault(ep.group_id, []).append(ep)
    for leaves in by_group.values():
        assert sorted(tuple(e.branch) for e in leaves) == [(i, j) for i in range(2) for j in range(3)]
        for i in range(2):
            variant = [e for e in leaves if e.branch[0] == i]
            assert all(e.parent == str(i) for e in variant)
            first = variant[0].turns[0]
            for e in variant[1:]:
                assert e.turns[0].action_ids == first.action_ids
                assert e.turns[0].observation == first.observation  # byte-identical reply
                assert e.turns[1].prompt_ids == variant[0].turns[1].prompt_ids


def test_episode_ended_before_branch_point_is_replicated(tiny_model, tokenizer):
    episodes = collect(
        _tasks("early", n=3),
        HFSampler(tiny_model, tokenizer),
        ChatTemplate(tokenizer),
        SamplingParams(max_tokens=5, seed=2),
        [2, 2],
    )
    assert len(episodes) == 12
    short = [e for e in episodes if e.num_turns == 1]
    for e in short:
        twin = [o for o in episodes if o.group_id == e.group_id and o.branch[0] == e.branch[0]]
        assert len(twin) == 2 and all(o.num_turns == 1 and o.reward == e.reward for o in twin)


def test_collector_limit_truncates(tiny_model, tokenizer):
    episodes = collect(
        _tasks(n=1),
        HFSampler(tiny_model, tokenizer),
        ChatTemplate(tokenizer),
        SamplingParams(max_tokens=3),
        [2],
        RolloutSettings(max_turns=2),
    )
    for ep in episodes:
        assert ep.num_turns == 2 and ep.truncated and not ep.terminated
        assert ep.stop_reason == StopReason.COLLECTOR_LIMIT
        assert ep.validate() == []


def test_potential_shaping_rewards(tiny_model, tokenizer):
    gamma = 0.9
    plain = collect(
        _tasks(n=1),
        HFSampler(tiny_model, tokenizer),
        ChatTemplate(tokenizer),
        SamplingParams(max_tokens=3, seed=5),
        [1],
    )[0]
    shaped = collect(
        _tasks(n=1),
        HFSampler(tiny_model, tokenizer),
        ChatTemplate(tokenizer),
        SamplingParams(max_tokens=3, seed=5),
        [1],
        RolloutSettings(shaping_gamma=gamma),
    )[0]
    # Φ after turn k is k/3, Φ(s0) = 0 and Φ(terminal) = 0: r' = r + γΦ(s') − Φ(s)
    phis = [0.0, 1 / 3, 2 / 3, 0.0]
    for k, (a, b) in enumerate(zip(plain.turns, shaped.turns, strict=True)):
        assert b.reward == pytest.approx(a.reward + gamma * phis[k + 1] - phis[k])


def test_stale_weights_do_not_leak_into_collection(tiny_model, tokenizer):
    model = attach_lora(tiny_model, LoraConfig(r=2, alpha=4))
    sampler = HFSampler(model, tokenizer, stale=True)
    assert sampler.policy_version == 0
    sampler.refresh()
    assert sampler.policy_version == 1
    ep = collect(_tasks(n=1), sampler, ChatTemplate(tokenizer), SamplingParams(max_tokens=3), [1])[0]
    assert all(t.policy_version == 1 for t in ep.turns)
