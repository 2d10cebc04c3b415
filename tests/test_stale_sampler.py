"""A stale HF sampler generates with the weights of its last refresh, not the trainer's current ones.

Greedy decoding of the tiny model: the sampler's log-probs of the tokens it picked are compared
with the trainer's log-probs (``token_logprobs``) of the same tokens.
"""

import pytest
import torch

from turnrl.chat import ChatTemplate
from turnrl.config import LoraConfig, parse_config
from turnrl.models import attach_lora
from turnrl.sampling.hf import HFSampler
from turnrl.train.batch import Row, collate
from turnrl.train.step import LocalTrainer, StepSettings, token_logprobs, update
from turnrl.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, seed=0)
ATOL = 1e-4


@pytest.fixture()
def setup(tiny_model, tokenizer):
    torch.manual_seed(0)
    model = attach_lora(tiny_model, LoraConfig(r=4, alpha=8))
    ctx = ChatTemplate(tokenizer).initial([{"role": "user", "content": "What is 2 + 3? Answer with a number."}])
    return model, ctx


def _row(ctx: list[int], sample, advantage: float = 1.0) -> Row:
    n = len(sample.ids)
    return Row(
        ids=ctx + sample.ids,
        mask=[0] * len(ctx) + [1] * n,
        advantages=[0.0] * len(ctx) + [advantage] * n,
        behavior_logprobs=[0.0] * len(ctx) + list(sample.logprobs),
        turn=-1,
        episode_id="e",
    )


def _trainer_logprobs(model, ctx: list[int], sample, pad_id: int) -> torch.Tensor:
    """The trainer's log π(y_t) of the sampled tokens (position p scores token p)."""
    batch = collate([_row(ctx, sample)], pad_id)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch)
    return logp[0, len(ctx) :]


def _trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _update(model, ctx, sample, pad_id) -> None:
    """One optimizer step on the sampled tokens that moves the LoRA weights."""
    cfg = parse_config(
        {"loss": {"type": "importance_sampling"}, "sampler": {"temperature": 1.0}, "train": {"lr": 5e-2}}
    )
    before = _trainable(model)
    settings = StepSettings.from_config(cfg)
    update(LocalTrainer(model, settings, pad_id=pad_id), [_row(ctx, sample, advantage=1.0)], settings)
    after = _trainable(model)
    assert any(not torch.equal(before[n], after[n]) for n in before), "the step did not change the LoRA weights"


def test_stale_sampler_matches_trainer_until_update_and_again_after_refresh(setup, tokenizer):
    model, ctx = setup
    pad = tokenizer.pad_token_id
    sampler = HFSampler(model, tokenizer, stale=True)

    # before any update the snapshot is the trainer's weights
    first = sampler.sample([ctx], GREEDY)[0]
    assert len(first.ids) > 0
    before = _trainer_logprobs(model, ctx, first, pad)
    assert torch.allclose(torch.tensor(first.logprobs), before, atol=ATOL)

    _update(model, ctx, first, pad)
    after = _trainer_logprobs(model, ctx, first, pad)
    assert (after - before).abs().max() > 1e-3, "the update did not move the log-probs"

    # after the update the stale sampler still generates with the old weights: same tokens,
    # same log-probs as before, no longer the trainer's; sampling leaves the trainer's weights alone
    weights = _trainable(model)
    stale = sampler.sample([ctx], GREEDY)[0]
    assert all(torch.equal(weights[n], p) for n, p in model.named_parameters() if p.requires_grad)
    assert stale.ids == first.ids
    assert torch.allclose(torch.tensor(stale.logprobs), before, atol=ATOL)
    assert not torch.allclose(torch.tensor(stale.logprobs), after, atol=ATOL)
    assert sampler.policy_version == 0

    # refresh: the sampler takes the trainer's current weights
    sampler.refresh()
    assert sampler.policy_version == 1
    fresh = sampler.sample([ctx], GREEDY)[0]
    now = _trainer_logprobs(model, ctx, fresh, pad)
    assert torch.allclose(torch.tensor(fresh.logprobs), now, atol=ATOL)
    if fresh.ids == first.ids:
        assert not torch.allclose(torch.tensor(fresh.logprobs), before, atol=ATOL)


def test_shared_sampler_sees_the_update_at_once(setup, tokenizer):
    model, ctx = setup
    pad = tokenizer.pad_token_id
    sampler = HFSampler(model, tokenizer, stale=False)
    first = sampler.sample([ctx], GREEDY)[0]
    _update(model, ctx, first, pad)
    again = sampler.sample([ctx], GREEDY)[0]
    assert torch.allclose(torch.tensor(again.logprobs), _trainer_logprobs(model, ctx, again, pad), atol=ATOL)
