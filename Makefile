# The README's commands. Everything installs into .venv (torch 2.13.0 CPU first, so that no
# dependency range pulls a CUDA build), then the project in editable mode.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0

.PHONY: demo test test-extended test-fast test-compat soak k8s-rendered lint setup clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e '.[dev,etcd,s3]'
	touch $@

setup: $(BIN)/.installed

## The main job: an elastic run of the built-in GPT on 2 local workers (c10d, no services).
demo: setup
	$(BIN)/elastic-train run --run-dir runs/demo $(ARGS)

## Everything the tests need, then the whole suite (what CI runs).
test: setup
	bash scripts/install-test-deps.sh
	$(BIN)/ruff check elastic_train tests examples scripts benchmarks deploy
	$(BIN)/python -m pytest -m "not extended" $(PYTEST_ARGS)

## The scenarios beyond the default suite (more backends of the same proofs; minutes).
test-extended: setup
	$(BIN)/python -m pytest -m extended $(PYTEST_ARGS)

## Unit tests only (seconds).
test-fast: setup
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

## The unit suite and the proofs that lean on torch's internals, on another torch, in a venv
## of its own (.venv-compat/): make test-compat TORCH=torch==2.14.1 (docs/torch-versions.md).
test-compat:
	bash scripts/test-compat.sh "$(TORCH)"

## Faults in sequence across 3 hosts (network namespaces: root), and a table of what they
## cost: make soak ARGS="--backend etcd-v3 --faults 60 --seed 1" (benchmarks/chaos.py).
soak: setup
	bash scripts/install-test-deps.sh
	$(BIN)/python benchmarks/chaos.py $(ARGS)

## After a change to k8s/: keep the real kustomize's output in tests/k8s_rendered (needs
## kubectl or kustomize; the tests compare our renderer with it, and fail until it is fresh).
k8s-rendered: setup
	$(BIN)/python -m tests.kustomize

lint: setup
	$(BIN)/ruff check elastic_train tests examples scripts benchmarks deploy

clean:
	rm -rf $(VENV) runs .pytest_cache
