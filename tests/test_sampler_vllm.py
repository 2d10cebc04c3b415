"""``sampler.backend: vllm``.

Without vLLM: params, the engine arguments, the base written for the engine, adapters
per policy version, and the conversion of vLLM's outputs to :class:`Sample` (on objects
shaped like vLLM's ``RequestOutput``).

With vLLM (marker ``vllm``; skipped, with the reason, where it is not installed): the real
engine, on the policy's device — vLLM's CPU build in CI (``make test-vllm`` runs them in
``.venv-vllm``), the CUDA build on a GPU (``scripts/gpu_check.sh``). One engine serves the
whole module (the embedded model with the main job's LoRA shape, so the training run
reuses it); its log-prob agreement with the trainer is printed in the run's summary.
"""

from __future__ import annotations

import importlib.util
import math
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
    CPU_KV_CACHE_GIB,
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
    assert kw["tensor_parallel_size"] == 1 and kw["max_model_len"] == 2048
    # on CPU, gpu_memory_utilization would be a fraction of the machine's memory: a fixed KV cache instead
    assert "gpu_memory_utilization" not in kw and kw["kv_cache_memory_bytes"] == int(CPU_KV_CACHE_GIB * 2**30)
    assert kw["enable_sleep_mode"] is False  # unsupported on CPU
    sized = VLLMSampler(policy, tokenizer, VLLMSamplerParams(work_dir=str(tmp_path), kv_cache_gib=0.5))
    assert sized.engine_kwargs(tmp_path / "base")["kv_cache_memory_bytes"] == 2**29


def test_engine_arguments_on_a_gpu(policy, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(VLLMSampler, "device_type", property(lambda self: "cuda"))
    kw = VLLMSampler(policy, tokenizer, VLLMSamplerParams(work_dir=str(tmp_path))).engine_kwargs(tmp_path)
    assert kw["gpu_memory_utilization"] == 0.3 and "kv_cache_memory_bytes" not in kw


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
# the real engine: vLLM's CPU build here and in CI, its CUDA build on a GPU

needs_vllm = pytest.mark.skipif(
    not HAS_VLLM,
    reason="needs vLLM, not installed in this environment: make test-vllm runs these in .venv-vllm with"
    " vLLM's CPU build; on a GPU pip install 'turnrl[vllm]' (scripts/gpu_check.sh)",
)
MAIN_JOB_LORA = LoraConfig(r=16, alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
"""configs/number_guess_cpu.yaml's adapter: same engine arguments, so its training run below reuses the engine."""
AGREE_MAX = 1e-3
"""|vLLM − trainer| per token, float32 on both sides (measured: 4.4e-5 on CPU)."""


@pytest.fixture(scope="module")
def engine():
    """The embedded model (or the directory ``$TURNRL_GPU_MODEL``) on its device, and one sampler on one engine."""
    from turnrl.sampling.vllm import _Engine

    model, tok = load_model(ModelConfig(name=os.environ.get("TURNRL_GPU_MODEL", "embedded"), dtype="float32"))
    policy = attach_lora(model, MAIN_JOB_LORA)
    sampler = VLLMSampler(policy, tok, VLLMSamplerParams())
    yield policy, tok, sampler
    _Engine.close()


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


def _zero_lora(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.zero_()


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0], ids=["T0", "T0.7", "T1"])
@pytest.mark.vllm
@needs_vllm
def test_vllm_logprobs_agree_with_the_trainer(engine, temperature, report_line):
    model, tok, sampler = engine
    contexts = _contexts(tok)
    samples = sampler.sample(contexts, SamplingParams(temperature=temperature, max_tokens=24, top_k_logprobs=4))
    trainer, behaviour = _trainer_logprobs(model, tok, contexts, samples, temperature)
    gap = (trainer - behaviour).abs()
    report_line(
        f"vLLM engine ({sampler.device_type}) T={temperature}: |vLLM - trainer| log-prob mean {gap.mean():.2e},"
        f" max {gap.max():.2e} over {gap.numel()} tokens"
    )
    assert gap.max() < AGREE_MAX
    assert all(len(s.topk_ids[0]) == 4 for s in samples)
    if temperature == 0:  # greedy: the sampled token is the top one
        assert all(s.topk_ids[0][0] == s.ids[0] for s in samples)


@pytest.mark.vllm
@needs_vllm
def test_vllm_follows_the_trainers_lora(engine, report_line):
    model, tok, sampler = engine
    contexts = _contexts(tok)
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=5)
    perturb_lora(model, 1)
    with torch.no_grad():  # a visible change of the policy
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(50)
    try:
        samples = sampler.sample(contexts, params)  # a fresh sampler syncs the changed LoRA first
        assert sampler.adapter_name is not None and sampler.lora_request is not None
        trainer, behaviour = _trainer_logprobs(model, tok, contexts, samples, 1.0)
        with model.disable_adapter():
            base, _ = _trainer_logprobs(model, tok, contexts, samples, 1.0)
    finally:
        _zero_lora(model)
    gap, base_gap = (trainer - behaviour).abs(), (base - behaviour).abs()
    report_line(
        f"vLLM engine after a LoRA change: |vLLM - trainer| max {gap.max():.2e};"
        f" |vLLM - base without the LoRA| mean {base_gap.mean():.2e}"
    )
    assert gap.max() < AGREE_MAX
    assert base_gap.mean() > 20 * gap.mean()  # the engine sampled the adapter, not the base


@pytest.mark.vllm
@needs_vllm
def test_a_branched_tree_through_the_prefix_cache(engine, report_line):
    """G1 × G2 = 2 × 2 trees of a 3-turn game with a long system prompt: each later turn's context extends an earlier
    one, whose KV blocks vLLM's prefix cache holds; the sampled log-probs still equal the trainer's on every turn."""
    from toy_envs import CountEnv
    from turnrl.chat import ChatTemplate
    from turnrl.envs import register_env
    from turnrl.rollout.collect import collect
    from turnrl.types import Sample

    class LongCountEnv(CountEnv):
        name = "long_count"

        def initial_messages(self):
            rules = " ".join(f"Rule {i}: answer in one short line." for i in range(80))  # several KV blocks
            return [{"role": "system", "content": rules}, {"role": "user", "content": f"Task {self.task.params['k']}"}]

    register_env("long_count", LongCountEnv)
    model, tok, sampler = engine
    llm = sampler.llm
    seen: list[tuple[list[int], list[int], list[float], int]] = []
    generate = llm.generate

    def recording(prompts, sps, **kw):
        outs = generate(prompts, sps, **kw)
        for prompt, out in zip(prompts, outs, strict=True):
            c = out.outputs[0]
            lps = [float(pos[t].logprob) for pos, t in zip(c.logprobs, c.token_ids, strict=True)]
            seen.append((list(prompt["prompt_token_ids"]), list(c.token_ids), lps, out.num_cached_tokens or 0))
        return outs

    llm.generate = recording
    try:
        tasks = [t.__class__(t.task_id, "long_count", t.params, t.split) for t in CountEnv.default_tasks("train")[:2]]
        episodes = collect(tasks, sampler, ChatTemplate(tok), SamplingParams(max_tokens=8, seed=3), [2, 2])
    finally:
        del llm.generate
    assert len(episodes) == 8
    for group in {e.group_id for e in episodes}:
        leaves = [e for e in episodes if e.group_id == group]
        for i in range(2):
            twins = [e for e in leaves if e.branch[0] == i]
            assert len(twins) == 2 and twins[0].turns[0].action_ids == twins[1].turns[0].action_ids
    first_len = min(len(ctx) for ctx, *_ in seen)
    later = [(ctx, cached) for ctx, _, _, cached in seen if len(ctx) > first_len + 2]  # turns 2 and 3
    block = llm.llm_engine.vllm_config.cache_config.block_size
    assert first_len > 2 * block, (first_len, block)  # the trunk fills whole blocks, which the cache can hold
    assert later and all(cached >= block for _, cached in later), [c for _, c in later]
    cached_frac = sum(c for _, c in later) / sum(len(ctx) for ctx, _ in later)
    contexts = [ctx for ctx, ids, _, _ in seen if ids]
    samples = [Sample(ids, [min(x, 0.0) for x in lps], "stop") for _, ids, lps, _ in seen if ids]
    trainer, behaviour = _trainer_logprobs(model, tok, contexts, samples, 1.0)
    gap = (trainer - behaviour).abs()
    report_line(
        f"vLLM branched tree: {len(seen)} requests; later turns took {cached_frac:.0%} of their prompt tokens from"
        f" the prefix cache (block {block}); |vLLM - trainer| max {gap.max():.2e} over {gap.numel()} tokens"
    )
    assert gap.max() < AGREE_MAX


@pytest.mark.vllm
@needs_vllm
def test_training_steps_of_the_main_job_with_the_vllm_sampler(engine, tmp_path, report_line):
    """Two steps of configs/number_guess_cpu.yaml (smaller) with sampler.backend=vllm, on the module's engine."""
    from turnrl.config import load_config
    from turnrl.sampling.vllm import _Engine
    from turnrl.tracking import read_csv
    from turnrl.train.loop import train

    _, _, sampler = engine
    llm = sampler.llm
    cfg = load_config(
        "configs/number_guess_cpu.yaml",
        [
            "sampler.backend=vllm",
            f"model.name={os.environ.get('TURNRL_GPU_MODEL', 'embedded')}",
            "train.steps=2",
            "rollout.tasks_per_step=2",
            "rollout.group_size=4",
            "eval.before=false",
            "data.num_eval_tasks=1",
            "tracking.plots=false",
            "tracking.report=false",
            f"paths.output_dir={tmp_path}",
        ],
    )
    train(cfg)
    assert _Engine.llm is llm  # the same engine arguments and base: no second engine was started
    rows = read_csv(tmp_path / "number_guess_cpu" / "progress" / "train.csv")
    assert len(rows) == 2
    gaps = [float(r["mismatch/abs_logp_gap_mean"]) for r in rows]
    report_line(
        "vLLM training, 2 steps of the main job: loss "
        + ", ".join(f"{float(r['loss']):.4f}" for r in rows)
        + "; sampler/trainer |log-prob gap| mean per step "
        + ", ".join(f"{g:.2e}" for g in gaps)
    )
    assert all(math.isfinite(float(r["loss"])) for r in rows)
    assert all(g < AGREE_MAX for g in gaps)  # step 2 sampled from the LoRA after step 1's update
