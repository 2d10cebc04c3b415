"""The HF sampler's own draw (inverse CDF, one uniform per row) and its merged-LoRA generation."""

from __future__ import annotations

import math

import torch

from factories import perturb_lora, sample_rows
from turnrl.config import LoraConfig
from turnrl.models import attach_lora
from turnrl.sampling.draws import InverseCDFDraws
from turnrl.sampling.hf import HFSampler
from turnrl.sampling.merged_lora import lora_layers
from turnrl.train.batch import collate
from turnrl.train.step import token_logprobs
from turnrl.types import SamplingParams


def _contexts(shared=30, tails=(3, 9, 1, 5)):
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, 4000, (shared,), generator=g).tolist()
    return [prefix + torch.randint(100, 4000, (k,), generator=g).tolist() for k in tails]


def test_inverse_cdf_draws_follow_the_distribution_and_never_draw_a_removed_token():
    """Hand distribution p = softmax(log [0.5, 0.3, 0.15, 0.05, 0]) (the last token removed, score −inf):
    40,000 draws; each frequency within 4 SE of its p, the removed token never drawn (chi-square over 4 cells
    below 18.5, p < 0.001 for 3 degrees of freedom)."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    n = 40_000
    scores = p.log().expand(n, -1).clone()
    draws = InverseCDFDraws(SamplingParams(temperature=1.0, seed=0), "cpu", seed=0)
    out = draws(torch.zeros(n, 1, dtype=torch.long), scores)
    token = out.argmax(-1)
    assert torch.equal(out.gather(-1, token.unsqueeze(-1)).squeeze(-1), torch.zeros(n))  # 0 at the draw
    assert int((out == 0).sum()) == n  # and −inf everywhere else
    assert torch.equal(draws.scores[0], scores)  # the distribution kept is the processed scores
    counts = torch.bincount(token, minlength=5).double()
    assert counts[4] == 0
    expected = p[:4].double() * n
    se = (expected * (1 - p[:4].double())).sqrt()
    assert ((counts[:4] - expected).abs() < 4 * se).all(), counts
    chi2 = float(((counts[:4] - expected) ** 2 / expected).sum())
    assert chi2 < 18.5, chi2


def test_inverse_cdf_draws_are_seeded_per_call_or_per_row():
    scores = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    ids = torch.zeros(6, 1, dtype=torch.long)

    def draw(params, seed, rows=scores):
        return InverseCDFDraws(params, "cpu", seed)(ids[: len(rows)], rows).argmax(-1).tolist()

    call = SamplingParams(temperature=1.0)
    assert draw(call, 3) == draw(call, 3) and draw(call, 3) != draw(call, 4)
    rows = SamplingParams(temperature=1.0, row_seeds=(11, 12, 13, 14, 15, 16))
    alone = SamplingParams(temperature=1.0, row_seeds=(14,))
    assert draw(rows, 0)[3] == draw(alone, 99, scores[3:4])[0]  # a row's draw is its own seed's


def test_merged_lora_samples_what_the_lora_forward_does_and_restores_the_base(tiny_model, tokenizer):
    """A LoRA moved off zero: the sampler that merges it generates the same greedy tokens, with log-probs within
    1e-5 of the unmerged sampler's and of the trainer's; the base weights are the same tensors, unchanged,
    afterwards; after the next weight change the merged weights follow it (transformers' ``generate`` path:
    the packed decoder computes the merged weights itself, tests/test_sampling_packed.py)."""
    model = attach_lora(tiny_model, LoraConfig(r=4, alpha=8))
    perturb_lora(model, seed=0)
    layers = lora_layers(model)
    assert layers
    bases = [(layer.get_base_layer().weight, layer.get_base_layer().weight.data.clone()) for layer in layers]
    pointers = [w.data_ptr() for w, _ in bases]
    contexts = _contexts()
    for turn in range(2):
        params = SamplingParams(temperature=0.0, max_tokens=8, seed=turn)
        plain = HFSampler(model, tokenizer, merge_lora=False, fast_decode=False).sample(contexts, params)
        merged_sampler = HFSampler(model, tokenizer, merge_lora=True, fast_decode=False)
        merged = merged_sampler.sample(contexts, params)
        assert merged_sampler._merged._merged  # the merged path ran
        for a, b in zip(plain, merged, strict=True):
            assert a.ids == b.ids and a.finish_reason == b.finish_reason
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5
        for (w, before), ptr in zip(bases, pointers, strict=True):
            assert w.data_ptr() == ptr and torch.equal(w.data, before)
        assert not any(layer.merged for layer in layers)
        batch = collate(sample_rows(contexts, merged), tokenizer.pad_token_id)
        with torch.no_grad():
            logp, _ = token_logprobs(model, batch)
        mask = batch.loss_mask > 0
        assert torch.allclose(logp[mask], batch.behavior_logprobs[mask], atol=1e-5)
        perturb_lora(model, seed=1 + turn)  # an optimizer step: the merged weights must follow


def test_one_merged_sampler_follows_the_weights_across_calls(tiny_model, tokenizer):
    model = attach_lora(tiny_model, LoraConfig(r=4, alpha=8))
    sampler = HFSampler(model, tokenizer, merge_lora=True, fast_decode=False)
    params = SamplingParams(temperature=0.0, max_tokens=6, top_k_logprobs=2, seed=0)
    contexts = _contexts()
    for seed in range(2):
        perturb_lora(model, seed=seed)
        got = sampler.sample(contexts, params)
        want = HFSampler(model, tokenizer, merge_lora=False, fast_decode=False).sample(contexts, params)
        assert [s.ids for s in got] == [s.ids for s in want]
        pairs = [(x, y) for a, b in zip(got, want, strict=True) for x, y in zip(a.logprobs, b.logprobs, strict=True)]
        gap = max(abs(x - y) for x, y in pairs)
        assert gap < 1e-5 and math.isfinite(gap)
