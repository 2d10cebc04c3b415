"""The packed decoder (``sampler.fast_decode``): the tokens and log-probs of transformers' ``generate``, the
trainer's log-probs, weights that follow each version, and the fallback for a model it cannot run."""

from __future__ import annotations

import pytest
import torch

from factories import perturb_lora, sample_rows
from turnrl.config import LoraConfig
from turnrl.models import attach_lora
from turnrl.sampling.hf import HFSampler
from turnrl.sampling.packed import PackedDecoder
from turnrl.train.batch import collate
from turnrl.train.step import token_logprobs
from turnrl.types import SamplingParams

ATOL = 1e-5


def _groups(shared=30, tails=(4, 9, 2), group=2):
    """Groups of ``group`` identical contexts (a group's first turn) sharing a ``shared``-token prefix."""
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, 4000, (shared,), generator=g).tolist()
    return [prefix + torch.randint(100, 4000, (k,), generator=g).tolist() for k in tails for _ in range(group)]


def _next_turns(contexts, samples, seed):
    g = torch.Generator().manual_seed(seed)
    return [
        c + s.ids + torch.randint(100, 4000, (2 + k % 4,), generator=g).tolist()
        for k, (c, s) in enumerate(zip(contexts, samples, strict=True))
    ]


def _lora(tiny_model):
    model = attach_lora(tiny_model, LoraConfig(r=4, alpha=8))
    perturb_lora(model, seed=0)
    return model


def _assert_same(got, want, atol=ATOL):
    for a, b in zip(got, want, strict=True):
        assert a.ids == b.ids and a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < atol
        assert a.topk_ids == b.topk_ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_packed_decoder_samples_what_generate_does(tiny_model, tokenizer, temperature):
    """Three turns of a LoRA model: groups of identical first contexts (run once, then decoded per row), then
    kept keys/values of earlier turns with the shared prefix kept once: the same tokens as ``generate`` with the
    LoRA merged, log-probs within 1e-5 (at T = 1 the same draws: the logits agree within rounding)."""
    model = _lora(tiny_model)
    fast, slow = HFSampler(model, tokenizer), HFSampler(model, tokenizer, fast_decode=False)
    assert fast.fast_decode_unsupported is None and slow.fast_decode_unsupported == "fast_decode is off"
    contexts = _groups()
    for turn in range(3):
        params = SamplingParams(temperature=temperature, max_tokens=8, top_k_logprobs=3, seed=turn)
        got, want = fast.sample(contexts, params), slow.sample(contexts, params)
        assert fast._decoder is not None and fast.reused_tokens == slow.reused_tokens
        assert (fast.reused_tokens > 0) == (turn > 0)
        _assert_same(got, want)
        contexts = _next_turns(contexts, got, seed=turn)


def test_packed_logprobs_equal_the_trainers(tiny_model, tokenizer):
    model = _lora(tiny_model)
    contexts = _groups()
    samples = HFSampler(model, tokenizer).sample(contexts, SamplingParams(temperature=1.0, max_tokens=6, seed=1))
    batch = collate(sample_rows(contexts, samples), tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch)
    mask = batch.loss_mask > 0
    assert torch.allclose(logp[mask], batch.behavior_logprobs[mask], atol=ATOL)


def test_the_packed_weights_follow_each_version_and_keep_the_frozen_ones(tiny_model, tokenizer):
    """An optimizer step (the LoRA moves): nothing is repacked (the same packed weights), the adapters are taken
    again, and the tokens are ``generate``'s under the new weights; a frozen weight changed in place is
    repacked."""
    model = _lora(tiny_model)
    sampler = HFSampler(model, tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=8, seed=0)
    sampler.sample(_groups(), params)
    dec = sampler._decoder
    packed = [(layer.qkv.weight, layer.o.weight, layer.gate_up.weight) for layer in dec.layers]
    low = dec.layers[0].qkv.lora[1].clone()
    assert dec.layers[0].gate_up.lora is None and dec.head.lora is None
    perturb_lora(model, seed=5)
    got = sampler.sample(_groups(), params)
    _assert_same(got, HFSampler(model, tokenizer, fast_decode=False).sample(_groups(), params))
    assert sampler._decoder is dec
    assert [(layer.qkv.weight, layer.o.weight, layer.gate_up.weight) for layer in dec.layers] == packed
    assert not torch.equal(dec.layers[0].qkv.lora[1], low)
    with torch.no_grad():  # a frozen weight changed in place (its version counter moves)
        model.get_base_model().model.layers[0].mlp.up_proj.weight.mul_(1.5)
    sampler.refresh()
    got = sampler.sample(_groups(), params)
    assert dec.layers[0].gate_up.weight is not packed[0][2] and dec.layers[1].gate_up.weight is packed[1][2]
    _assert_same(got, HFSampler(model, tokenizer, fast_decode=False).sample(_groups(), params))


def test_the_decoder_forward_is_transformers_forward_with_padding_and_a_shared_prefix(tiny_model):
    """Left-padded rows: the logits at the last position equal the model's within 1e-5; the same rows split into
    a shared prefix (kept once) and their own columns give the same logits (cascade attention)."""
    model = _lora(tiny_model).eval()
    dec = PackedDecoder(model)
    g = torch.Generator().manual_seed(0)
    prefix_ids = torch.randint(100, 4000, (1, 12), generator=g)
    own = torch.randint(100, 4000, (3, 6), generator=g)
    ids = torch.cat([prefix_ids.expand(3, -1), own], dim=1)
    attention = torch.ones_like(ids)
    attention[0, 12:14] = 0  # padding inside a row's own columns
    positions = (attention.cumsum(-1) - 1).masked_fill(attention == 0, 0)  # generate's positions
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, -1]
        whole = dec.forward(ids, positions, dec.new_cache(3, 18), 0, attention.bool())
        prefix = dec.new_cache(1, 12)
        dec.forward(prefix_ids, positions[:1, :12], prefix, 0, torch.ones(1, 12, dtype=torch.bool), logits=False)
        split = dec.forward(own, positions[:, 12:], dec.new_cache(3, 6), 0, attention[:, 12:].bool(), prefix)
    assert torch.allclose(whole, want, atol=ATOL) and torch.allclose(split, want, atol=ATOL)


def test_a_model_the_decoder_cannot_run_generates_with_generate(tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=128))
    sampler = HFSampler(model, tokenizer)
    assert "gpt2" in sampler.fast_decode_unsupported
    samples = sampler.sample(_groups(shared=20), SamplingParams(temperature=0.0, max_tokens=4, seed=0))
    assert sampler._decoder is None and all(1 <= len(s.ids) <= 4 for s in samples)


def test_bfloat16_weights_decode_near_the_float32_logprobs(tiny_model, tokenizer):
    """``decode_dtype: bfloat16``: log-probs no longer the trainer's to 1e-5, but within 0.05 of them."""
    model = _lora(tiny_model)
    contexts = _groups()
    sampler = HFSampler(model, tokenizer, decode_dtype="bfloat16")
    samples = sampler.sample(contexts, SamplingParams(temperature=1.0, max_tokens=6, seed=1))
    assert sampler._decoder.dtype == torch.bfloat16
    batch = collate(sample_rows(contexts, samples), tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch)
    mask = batch.loss_mask > 0
    gap = (logp[mask] - batch.behavior_logprobs[mask]).abs().max().item()
    assert ATOL < gap < 0.05, gap


def test_fast_decode_and_its_dtype_are_sampler_keys(tiny_model, tokenizer):
    from turnrl.config import parse_config
    from turnrl.sampling import SamplerSettings, make_sampler

    for overrides, reason, dtype in (
        ({}, None, torch.float32),
        ({"fast_decode": False}, "fast_decode is off", torch.float32),
        ({"decode_dtype": "bfloat16"}, None, torch.bfloat16),
    ):
        cfg = parse_config({"sampler": overrides})
        sampler = make_sampler(SamplerSettings.from_config(cfg.sampler), tiny_model, tokenizer)
        assert sampler.fast_decode_unsupported == reason and sampler._decode_dtype == dtype
        # bfloat16 weights are not the trainer's: loss.mismatch.mode auto turns TRL's correction on
        assert cfg.loss.mismatch.mode == ("mask" if dtype == torch.bfloat16 else "none")
