"""``sampler.backend: vllm``.

CPU tests cover everything that does not need vLLM: params, the engine arguments, the
base written for the engine, adapters per policy version, and the conversion of vLLM's
outputs to :class:`Sample` (on objects shaped like vLLM's ``RequestOutput``). The tests
marked ``gpu`` run the real engine and skip, with the reason, without CUDA and vLLM
(``scripts/gpu_check.sh`` runs them on a GPU machine).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from factories import perturb_lora, sample_rows
from turnrl.config import LoraConfig, ModelConfig, parse_config
from turnrl.models import attach_lora, load_model
from turnrl.sampling import SAMPLERS
from turnrl.sampling.vllm import (
    VLLMSampler,
    VLLMSamplerParams,
    base_fingerprint,
    lora_rank_for,
    plain_base_state_dict,
    to_samples,
    write_base,
)
from turnrl.types import SamplingParams

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture()
def policy():
    model, _ = load_model(ModelConfig(name="tiny"), seed=0)
    return attach_lora(model, LoraConfig(r=8))


def test_config_validates_the_backends_params():
    cfg = parse_config(
        {
            "model": {"name": "tiny"},
            "sampler": {"backend": "vllm", "gpu_memory_utilization": 0.45, "tensor_parallel_size": 2},
        }
    )
    assert cfg.sampler.params == VLLMSamplerParams(gpu_memory_utilization=0.45, tensor_parallel_size=2)
    assert SAMPLERS["vllm"].shares_weights is False
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        parse_config({"model": {"name": "tiny"}, "sampler": {"backend": "vllm", "gpu_memory_utilization": 1.5}})


def test_lora_rank_rounds_up_to_a_size_vllm_accepts():
    assert [lora_rank_for(r) for r in (1, 8, 9, 16, 33, 300)] == [8, 8, 16, 16, 64, 320]
    with pytest.raises(ValueError, match="model.lora.r"):
        lora_rank_for(1000)


def test_engine_arguments(policy, tokenizer, tmp_path):
    sampler = VLLMSampler(policy, tokenizer, VLLMSamplerParams(work_dir=str(tmp_path), max_model_len=2048))
    kw = sampler.engine_kwargs(tmp_path / "base")
    assert kw["enable_lora"] and kw["max_lora_rank"] == 8 and kw["logprobs_mode"] == "processed_logprobs"
    assert kw["model"] == kw["tokenizer"] == str(tmp_path / "base") and kw["dtype"] == "float32"
    assert kw["gpu_memory_utilization"] == 0.3 and kw["tensor_parallel_size"] == 1 and kw["max_model_len"] == 2048


def test_the_base_written_for_the_engine_is_the_policys_base(policy, tokenizer, tmp_path):
    """With earlier iterations merged into it, the base is not the one on disk: it is written out."""
    with torch.no_grad():  # stands in for merged adapters of earlier iterations
        policy.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight.add_(0.5)
    perturb_lora(policy, 1)  # the current LoRA must not be in the base
    path = write_base(policy, tokenizer, tmp_path / "base")
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad(), policy.disable_adapter():
        expected = policy(input_ids=ids).logits
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, expected, atol=1e-6)
    assert (path / "tokenizer.json").exists()
    state = plain_base_state_dict(policy)
    assert not any("lora_" in n or "base_layer" in n for n in state)
    before = base_fingerprint(state)
    with torch.no_grad():
        policy.get_base_model().model.layers[1].mlp.up_proj.weight.add_(0.1)
    assert base_fingerprint(plain_base_state_dict(policy)) != before


def test_a_new_adapter_per_policy_version(policy, tokenizer, tmp_path, monkeypatch):
    made = []

    class FakeLoRARequest:
        def __init__(self, name, int_id, path):
            made.append((name, int_id, path))

    monkeypatch.setattr("turnrl.sampling.vllm._import_vllm", lambda: (None, None, FakeLoRARequest))
    sampler = VLLMSampler(policy, tokenizer, VLLMSamplerParams(work_dir=str(tmp_path)), stale=True)
    sampler.refresh()  # LoRA B == 0: the base is the policy
    assert made == [] and sampler.lora_request is None
    w1 = {n: t.clone() for n, t in perturb_lora(policy, 1).items()}
    sampler.refresh(w1)
    sampler.refresh(perturb_lora(policy, 2))
    assert [m[0] for m in made] == ["turnrl-v2", "turnrl-v3"] and made[0][1] < made[1][1]  # new ids
    saved = load_file(f"{made[0][2]}/adapter_model.safetensors")
    current = dict(policy.named_parameters())
    for name, tensor in w1.items():  # the weights of that refresh, not those of later steps
        assert torch.equal(saved[name.replace(".default", "")], tensor)
        if "lora_B" in name:
            assert not torch.equal(tensor, current[name])


@dataclass
class _Logprob:  # vllm.sequence.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class _Completion:  # vllm.outputs.CompletionOutput
    token_ids: list[int]
    logprobs: list[dict[int, _Logprob]] | None
    finish_reason: str | None


@dataclass
class _RequestOutput:  # vllm.outputs.RequestOutput
    outputs: list[_Completion]


def test_vllm_outputs_become_samples():
    # the sampled token is in each position's dict, besides the top-k (here token 9 at position 1 is outside it)
    pos = [
        {5: _Logprob(-0.1, 1), 6: _Logprob(-2.5, 2)},
        {7: _Logprob(-0.3, 1), 8: _Logprob(-1.4, 2), 9: _Logprob(-4.0, 5)},
        {2: _Logprob(-0.01, 1), 3: _Logprob(-5.0, 2)},
    ]
    out = to_samples(
        [
            _RequestOutput([_Completion([5, 9, 2], pos, "stop")]),
            _RequestOutput([_Completion([7], [{7: _Logprob(0.0, 1)}], "length")]),
        ],
        top_k=2,
    )
    assert out[0].ids == [5, 9, 2] and out[0].logprobs == [-0.1, -4.0, -0.01] and out[0].finish_reason == "stop"
    assert out[0].topk_ids == [[5, 6], [7, 8], [2, 3]] and out[0].topk_logprobs[1] == [-0.3, -1.4]
    assert out[1].ids == [7] and out[1].finish_reason == "length" and out[1].logprobs == [0.0]
    assert to_samples([_RequestOutput([_Completion([5], [pos[0]], "stop")])], top_k=0)[0].topk_ids is None
    with pytest.raises(ValueError, match="no log-probs"):
        to_samples([_RequestOutput([_Completion([5], None, "stop")])], top_k=0)


def test_missing_vllm_is_one_clear_error(policy, tokenizer, tmp_path):
    if HAS_VLLM:
        pytest.skip("vLLM is installed here; this checks the message without it")
    sampler = VLLMSampler(policy, tokenizer, VLLMSamplerParams(work_dir=str(tmp_path)))
    with pytest.raises(ImportError, match=r"pip install 'turnrl\[vllm\]'"):
        sampler.sample([[1, 2, 3]], SamplingParams(max_tokens=2))


# ------------------------------------------------------------------------------------------------
# on a GPU with vLLM

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU for vLLM's engine (none here); scripts/gpu_check.sh runs these on a GPU machine",
)
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (not installed): pip install 'turnrl[vllm]'")


@pytest.fixture(scope="module")
def gpu_policy():
    """The embedded model, or the local directory ``$TURNRL_GPU_MODEL`` (a machine without the GGUF package)."""
    name = os.environ.get("TURNRL_GPU_MODEL", "embedded")
    model, tok = load_model(ModelConfig(name=name, device="cuda", dtype="float32"))
    return attach_lora(model, LoraConfig(r=8)), tok


def _contexts(tok):
    from turnrl.chat import ChatTemplate

    chat = ChatTemplate(tok)
    return [
        chat.initial([{"role": "user", "content": q}])
        for q in ["What is 2 + 2?", "Name a color.", "Say hello.", "Write a haiku about rain."]
    ]


def _trainer_logprobs(model, tok, contexts, samples, temperature):
    from turnrl.train.batch import collate
    from turnrl.train.step import token_logprobs

    rows = sample_rows(contexts, samples)
    batch = collate(rows, tok.pad_token_id).to(next(model.parameters()).device)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, temperature=temperature or 1.0)
    mask = batch.loss_mask > 0
    return logp[mask].float().cpu(), batch.behavior_logprobs[mask].float().cpu()


@gpu
@needs_vllm
@needs_cuda
@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_vllm_logprobs_agree_with_the_trainer(gpu_policy, temperature, tmp_path):
    model, tok = gpu_policy
    contexts = _contexts(tok)
    sampler = VLLMSampler(model, tok, VLLMSamplerParams(work_dir=str(tmp_path), gpu_memory_utilization=0.2))
    samples = sampler.sample(contexts, SamplingParams(temperature=temperature, max_tokens=24, top_k_logprobs=4))
    trainer, behaviour = _trainer_logprobs(model, tok, contexts, samples, temperature)
    gap = (trainer - behaviour).abs()
    print(f"T={temperature}: mean |vLLM - trainer| = {gap.mean():.2e}, max {gap.max():.2e} over {gap.numel()} tokens")
    assert gap.max() < 0.05
    assert all(len(s.topk_ids[0]) == 4 for s in samples)
    if temperature == 0:  # greedy: the sampled token is the top one
        assert all(s.topk_ids[0][0] == s.ids[0] for s in samples)


@gpu
@needs_vllm
@needs_cuda
def test_vllm_follows_the_trainers_lora(gpu_policy, tmp_path):
    model, tok = gpu_policy
    contexts = _contexts(tok)
    sampler = VLLMSampler(model, tok, VLLMSamplerParams(work_dir=str(tmp_path), gpu_memory_utilization=0.2))
    params = SamplingParams(temperature=1.0, max_tokens=16)
    perturb_lora(model, 1)
    with torch.no_grad():  # a visible change of the policy
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(50)
    samples = sampler.sample(contexts, params)  # a fresh sampler syncs the changed LoRA first
    assert sampler.adapter_name == "turnrl-v0"
    trainer, behaviour = _trainer_logprobs(model, tok, contexts, samples, 1.0)
    assert (trainer - behaviour).abs().max() < 0.05
