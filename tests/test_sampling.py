"""The transformers sampler: shared-prefix caching, log-probs, stop tokens, top-k."""

from __future__ import annotations

import pytest
import torch

from factories import sample_rows
from turnrl.chat import end_of_turn_ids
from turnrl.sampling.hf import HFSampler, common_prefix_length
from turnrl.train.batch import collate
from turnrl.train.step import token_logprobs
from turnrl.types import SamplingParams


def _contexts(shared=40, tails=(3, 9, 1, 5)):
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, 4000, (shared,), generator=g).tolist()
    return [prefix + torch.randint(100, 4000, (k,), generator=g).tolist() for k in tails]


def test_common_prefix_length():
    assert common_prefix_length([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert common_prefix_length([[5], [6]]) == 0
    assert common_prefix_length([[1, 2], [1, 2]]) == 2


@pytest.mark.parametrize("fast_decode", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_prefix_cache_changes_nothing(tiny_model, tokenizer, temperature, fast_decode):
    params = SamplingParams(temperature=temperature, max_tokens=8, seed=3)
    plain = HFSampler(tiny_model, tokenizer, prefix_cache=False, fast_decode=fast_decode).sample(_contexts(), params)
    cached = HFSampler(tiny_model, tokenizer, prefix_cache=True, fast_decode=fast_decode).sample(_contexts(), params)
    for a, b in zip(plain, cached, strict=True):
        assert a.ids == b.ids and a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5


def test_sampler_logprobs_equal_the_trainers(tiny_model, tokenizer):
    contexts = _contexts()
    samples = HFSampler(tiny_model, tokenizer).sample(contexts, SamplingParams(temperature=1.0, max_tokens=6, seed=1))
    rows = sample_rows(contexts, samples)
    batch = collate(rows, tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(tiny_model, batch)
    mask = batch.loss_mask > 0
    assert torch.allclose(logp[mask], batch.behavior_logprobs[mask], atol=1e-4)


def test_stop_token_ends_the_sample_and_topk_is_returned(tiny_model, tokenizer):
    samples = HFSampler(tiny_model, tokenizer).sample(
        _contexts(), SamplingParams(temperature=1.0, max_tokens=5, top_k_logprobs=4, seed=2)
    )
    stops = end_of_turn_ids(tokenizer)
    for s in samples:
        assert len(s.ids) <= 5 and all(lp <= 0 for lp in s.logprobs)
        assert (s.finish_reason == "stop") == (s.ids[-1] in stops)
        assert not any(t in stops for t in s.ids[:-1])
        assert len(s.topk_ids) == len(s.ids) and all(len(r) == 4 for r in s.topk_ids)
        assert all(r[0] >= r[-1] for r in s.topk_logprobs)


def _next_turns(contexts, samples, seed):
    """Each context extended by its sample and a few 'environment' tokens, as a multi-turn episode grows."""
    g = torch.Generator().manual_seed(seed)
    return [
        c + s.ids + torch.randint(100, 4000, (2 + k % 5,), generator=g).tolist()
        for k, (c, s) in enumerate(zip(contexts, samples, strict=True))
    ]


@pytest.mark.parametrize("fast_decode", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_kept_keys_values_of_earlier_turns_change_nothing(tiny_model, tokenizer, temperature, fast_decode):
    """Three turns: the sampler that feeds only each context's new tokens samples what a fresh one does."""
    kept = HFSampler(tiny_model, tokenizer, fast_decode=fast_decode)
    contexts = _contexts()
    previous, prev_samples = [], []
    for turn in range(3):
        params = SamplingParams(temperature=temperature, max_tokens=8, seed=3 + turn)
        plain = HFSampler(tiny_model, tokenizer, reuse_kv_gib=0, fast_decode=fast_decode).sample(contexts, params)
        got = kept.sample(contexts, params)
        assert (kept.reused_tokens > 0) == (turn > 0)
        if turn:  # every row reused its whole previous context and the tokens it sampled, but the last
            assert kept.reused_tokens == sum(len(c) for c in previous) + sum(len(s.ids) - 1 for s in prev_samples)
        for a, b in zip(plain, got, strict=True):
            assert a.ids == b.ids and a.finish_reason == b.finish_reason
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5
        previous, prev_samples = contexts, got
        contexts = _next_turns(contexts, got, seed=turn)


def test_kept_keys_values_are_dropped_when_the_weights_change(tiny_model, tokenizer):
    sampler = HFSampler(tiny_model, tokenizer)
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=1)
    contexts = _contexts()
    samples = sampler.sample(contexts, params)
    with torch.no_grad():  # an optimizer step updates the weights in place
        next(p for p in tiny_model.parameters() if p.requires_grad).add_(0.01)
    contexts = _next_turns(contexts, samples, seed=0)
    samples = sampler.sample(contexts, params)
    assert sampler.reused_tokens == 0
    contexts = _next_turns(contexts, samples, seed=1)
    sampler.sample(contexts, params)
    assert sampler.reused_tokens > 0  # unchanged weights: reused
    sampler.refresh()
    sampler.sample(_next_turns(contexts, samples, seed=2), params)
    assert sampler.reused_tokens == 0
    off = HFSampler(tiny_model, tokenizer, reuse_kv_gib=0)
    off.sample(contexts, params)
    off.sample(_next_turns(contexts, samples, seed=3), params)
    assert off.reused_tokens == 0 and not off._pasts


def test_a_context_without_a_kept_past_falls_back_to_the_shared_prefix(tiny_model, tokenizer):
    sampler = HFSampler(tiny_model, tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=6, seed=1)
    contexts = _contexts()
    samples = sampler.sample(contexts, params)
    mixed = [*_next_turns(contexts, samples, seed=0)[:3], _contexts(shared=40, tails=(7,))[0][:5] + [9] * 30]
    got = sampler.sample(mixed, params)
    assert sampler.reused_tokens == 0
    assert [s.ids for s in got] == [
        s.ids for s in HFSampler(tiny_model, tokenizer, reuse_kv_gib=0).sample(mixed, params)
    ]


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_preallocated_kv_samples_what_the_growing_cache_does(tiny_model, tokenizer, temperature, prefix_cache):
    """Buffers written in place (``preallocate_kv``) instead of a cache grown by concatenation: over three turns
    (the shared prefix or none, then kept keys/values of earlier turns) the same tokens and the same log-probs,
    bit for bit, at T = 0 and T > 0 (the same draws: the logits are the same). transformers' ``generate`` path."""
    grow = HFSampler(tiny_model, tokenizer, prefix_cache=prefix_cache, preallocate_kv=False, fast_decode=False)
    pre = HFSampler(tiny_model, tokenizer, prefix_cache=prefix_cache, preallocate_kv=True, fast_decode=False)
    contexts = _contexts()
    for turn in range(3):
        params = SamplingParams(temperature=temperature, max_tokens=8, top_k_logprobs=3, seed=5 + turn)
        a, b = grow.sample(contexts, params), pre.sample(contexts, params)
        assert grow.reused_tokens == pre.reused_tokens and (pre.reused_tokens > 0) == (turn > 0)
        for x, y in zip(a, b, strict=True):
            assert x.ids == y.ids and x.finish_reason == y.finish_reason
            assert x.logprobs == y.logprobs and x.topk_ids == y.topk_ids and x.topk_logprobs == y.topk_logprobs
        contexts = _next_turns(contexts, b, seed=turn)


def test_preallocate_kv_is_a_sampler_key_on_by_default(tiny_model, tokenizer):
    from turnrl.config import parse_config
    from turnrl.sampling import SamplerSettings, make_sampler

    for overrides, expected in (({}, True), ({"preallocate_kv": False}, False)):
        cfg = parse_config({"sampler": overrides})
        assert make_sampler(SamplerSettings.from_config(cfg.sampler), tiny_model, tokenizer).preallocate_kv is expected
