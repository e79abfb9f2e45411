# Two commands for a newcomer:  `make run`  and  `make test`.
# Both build .venv from pyproject.toml when it is missing or older than pyproject.toml.
PYTHON ?= python3
VENV ?= .venv
# The oldest onnxruntime lmhead supports (pyproject's lower bound): the models lmhead writes
# are loaded there too, by tests/integration/test_runtimes.py.
ORT_OLDEST ?= 1.18.0
OLDEST ?= .venv-oldest
# onnxruntime 1.18 (and numpy < 2) has wheels for Python 3.8-3.12 only: .venv-oldest is made
# with PYTHON when it is one of those, else with python3.12 or python3.11 from PATH; with none,
# the tests that need it skip and say why (OLDEST_PYTHON=... names another interpreter).
ifeq ($(origin OLDEST_PYTHON), undefined)
OLDEST_PYTHON := $(shell for p in $(PYTHON) python3.12 python3.11; do \
	$$p -c 'import sys; sys.exit(sys.version_info >= (3, 13))' 2>/dev/null \
	&& exec $$p -c 'import sys; print(sys.executable)'; done)
endif
# The KServe SDK in its own environment (its server dependencies pin versions lmhead's do not
# share): its gRPC client runs in tests/integration/test_grpc_kserve.py, its CRD models and
# kubernetes-validate's schemas check the manifests (deploy/validate.py).
DEPLOY ?= .venv-deploy
KSERVE_SDK ?= 0.21.0
# Every runtime dependency at pyproject's lower bound (make test-floors).
FLOORS ?= .venv-floors
# Ray Serve (service/hosting/rayserve.py) and its multi-node cluster tests, in their own environment.
RAY_VENV ?= .venv-ray
REPOSITORY ?= models
EXTRAS ?= cpu,dev
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pytest's options in `make test` and `make test-floors`. pytest-xdist runs the suite in
# WORKERS processes side by side: one more than the cores, at most 8. On 2 cores the suite is
# CPU-bound (its servers start, load heads and answer; ~6 CPU-minutes) and 3 workers finished
# first (2, 3, 4, 6: see CONTRIBUTING.md); a worker waiting on a server leaves its core to
# another. Tests that share a module's fixtures, or are marked xdist_group, run one after
# another on one worker (tests/conftest.py). -v prints a line per test as it ends.
WORKERS ?= $(shell $(PYTHON) -c 'import os; print(min((os.cpu_count() or 1) + 1, 8))')
PYTEST_OPTIONS ?= -n $(WORKERS) --dist loadgroup -v --durations=15
# Every line a venv build prints is prefixed with the venv's name: `make test` builds three
# at once. pipefail: pip's failure, not the prefixer's success, is the recipe's.
SHELL := bash
.SHELLFLAGS := -o pipefail -c
TAG = $(call TAG_AS,$(@D))
TAG_AS = 2>&1 | while IFS= read -r line; do printf '%s: %s\n' "$(1)" "$$line"; done
PIP_OPTIONS := --progress-bar off --disable-pip-version-check
# pip's lines as it writes them, not a pipe's buffer at a time.
%/.installed venv-locked: export PYTHONUNBUFFERED = 1

.PHONY: install run demo test test-fast test-floors lint layers typecheck pytest deploy-check ray-test docker-test bench clean mutants

# `make run` and `make test` may start together on a fresh clone: one builds .venv while the
# other waits on the lock, then finds it built (the stamp newer than pyproject.toml) and uses
# it; before, both removed and rebuilt it, and one died. flock is util-linux's (Debian's
# essential set, the image's base included).
$(STAMP): pyproject.toml
	@flock $(VENV).lock $(MAKE) --no-print-directory venv-locked

.PHONY: venv-locked
venv-locked:
	@if [ $(STAMP) -nt pyproject.toml ]; then echo "$(VENV) was built meanwhile"; exit 0; fi; \
	echo "building $(VENV): lmhead and its dependencies ($(EXTRAS)), ~1 min on a first run..."; \
	set -e; rm -rf $(VENV); \
	$(PYTHON) -m venv $(VENV); \
	$(BIN)/python -m pip install $(PIP_OPTIONS) --upgrade pip $(call TAG_AS,$(VENV)); \
	$(BIN)/python -m pip install $(PIP_OPTIONS) -e '.[$(EXTRAS)]' $(call TAG_AS,$(VENV)); \
	touch $(STAMP)

install: $(STAMP)

$(OLDEST)/.installed: Makefile
	@echo "building $(OLDEST): onnxruntime $(ORT_OLDEST), the oldest lmhead supports..."
	rm -rf $(OLDEST)
	$(OLDEST_PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install $(PIP_OPTIONS) "onnxruntime==$(ORT_OLDEST)" "numpy<2" $(TAG)
	touch $@

demo: install
	@echo "demo heads in $(REPOSITORY)/ (written on the first run)..."
	$(BIN)/lmhead demo --repository $(REPOSITORY)

## The main job: make the demo heads on first run, then serve the repository on :8000.
run: demo
	@echo "serving $(REPOSITORY)/ on http://127.0.0.1:8000 (Ctrl-C stops it)..."
	$(BIN)/lmhead serve --repository $(REPOSITORY)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

## The layer order of service/ (pyproject's [tool.importlinter]): fails naming any import that
## runs up a layer, any circle, and any module at the root of service/ placed in no layer.
layers: install
	$(BIN)/lint-imports

pytest: install $(if $(OLDEST_PYTHON),$(OLDEST)/.installed) $(DEPLOY)/.installed
	LMHEAD_OLDEST_PYTHON=$(if $(OLDEST_PYTHON),$(OLDEST)/bin/python) \
	LMHEAD_KSERVE_PYTHON=$(DEPLOY)/bin/python $(BIN)/pytest $(PYTEST_OPTIONS)

## Everything CI checks: install, lint, the layer order, type-check, the whole test suite.
## The three environments build side by side (pip waits on the network much of the time), the
## checks run as soon as .venv is there, then the tests.
test:
	@$(MAKE) --no-print-directory -j3 lint layers typecheck \
	$(if $(OLDEST_PYTHON),$(OLDEST)/.installed) $(DEPLOY)/.installed
	@$(MAKE) --no-print-directory pytest

## The unit tests alone (tests/unit/<layer>/...: in-process, no servers), in seconds.
test-fast: install
	$(BIN)/pytest -n $(WORKERS) --dist loadgroup tests/unit

## The whole test suite with every runtime dependency at the lowest version pyproject allows
## (.ci/floors.py pins them), in its own environment: CI runs it after `make test`.
$(FLOORS)/.installed: pyproject.toml .ci/floors.py Makefile
	$(if $(OLDEST_PYTHON),,$(error the floors need Python 3.11 or 3.12 (onnxruntime 1.18 has no wheels for \
	newer ones): none found; name one with OLDEST_PYTHON=...))
	@echo "building $(FLOORS): every runtime dependency at its floor (.ci/floors.py)..."
	rm -rf $(FLOORS)
	$(OLDEST_PYTHON) -m venv $(FLOORS)
	$(FLOORS)/bin/python -m pip install $(PIP_OPTIONS) --upgrade pip $(TAG)
	$(PYTHON) .ci/floors.py > $(FLOORS)/floors.txt
	$(FLOORS)/bin/python -m pip install $(PIP_OPTIONS) -e '.[cpu,dev]' -c $(FLOORS)/floors.txt $(TAG)
	touch $@

test-floors: $(FLOORS)/.installed
	$(FLOORS)/bin/pytest -p no:cacheprovider $(PYTEST_OPTIONS)

$(DEPLOY)/.installed: Makefile
	@echo "building $(DEPLOY): the KServe SDK $(KSERVE_SDK) and kubernetes-validate..."
	rm -rf $(DEPLOY)
	$(PYTHON) -m venv $(DEPLOY)
	$(DEPLOY)/bin/python -m pip install $(PIP_OPTIONS) "kserve==$(KSERVE_SDK)" kubernetes-validate $(TAG)
	touch $@

## Validate every Kubernetes and KServe manifest offline (CI runs it after `make test`).
deploy-check: $(DEPLOY)/.installed
	$(DEPLOY)/bin/python deploy/validate.py deploy/kubernetes/*.yaml deploy/kserve/*.yaml

$(RAY_VENV)/.installed: pyproject.toml
	@echo "building $(RAY_VENV): lmhead with Ray Serve..."
	rm -rf $(RAY_VENV)
	$(PYTHON) -m venv $(RAY_VENV)
	$(RAY_VENV)/bin/python -m pip install $(PIP_OPTIONS) --upgrade pip $(TAG)
	$(RAY_VENV)/bin/python -m pip install $(PIP_OPTIONS) -e '.[cpu,dev,ray]' $(TAG)
	touch $@

## lmhead on a real three-node Ray cluster (head + two workers on this machine): spread,
## publishing, a killed node, autoscaling, multiplexing (CI runs it after deploy-check).
ray-test: $(RAY_VENV)/.installed
	LMHEAD_RAY_TESTS=1 $(RAY_VENV)/bin/pytest tests/ray

## CI's second stage: build and run the image and the compose service (needs a Docker engine;
## on machines without Docker Hub or a bridge network, ../shared/docker/up.sh provides one).
docker-test: install
	bash .ci/docker

# Mutation testing (make mutants): mutmut in an environment of its own, so .venv and make test
# never change for it; .ci/mutants.toml says what is mutated and which unit tests run.
MUTANTS_VENV ?= .venv-mutants
MUTMUT ?= 3.8.1
MUTANTS_DIR ?= build/mutants
CORES ?= $(shell $(PYTHON) -c 'import os; print(os.cpu_count() or 1)')

$(MUTANTS_VENV)/.installed: pyproject.toml
	@echo "building $(MUTANTS_VENV): lmhead and mutmut $(MUTMUT)..."
	rm -rf $(MUTANTS_VENV)
	$(PYTHON) -m venv $(MUTANTS_VENV)
	$(MUTANTS_VENV)/bin/python -m pip install $(PIP_OPTIONS) --upgrade pip $(TAG)
	$(MUTANTS_VENV)/bin/python -m pip install $(PIP_OPTIONS) -e '.[cpu,dev]' "mutmut==$(MUTMUT)" $(TAG)
	touch $@

## Mutation testing of the head math (runtime/logmath.py), the shaped vocabularies' numpy
## (runtime/vocabulary.py) and the V2 codec (api/codec/v2.py, grpc.py): mutmut mutates a copy
## of the working tree in $(MUTANTS_DIR) and runs the unit tests that reach each mutant (~8 min
## on 2 cores). It lists the survivors and writes the counts to $(MUTANTS_DIR)/mutants/
## mutmut-cicd-stats.json; bench/results-mutants.md holds the last run and why each survivor
## left survives.
mutants: $(MUTANTS_VENV)/.installed
	rm -rf $(MUTANTS_DIR) && mkdir -p $(MUTANTS_DIR)
	tar --exclude=__pycache__ -cf - service tests pyproject.toml | tar -xf - -C $(MUTANTS_DIR)
	cat .ci/mutants.toml >> $(MUTANTS_DIR)/pyproject.toml
	cd $(MUTANTS_DIR) && $(abspath $(MUTANTS_VENV))/bin/mutmut run --max-children $(CORES)
	cd $(MUTANTS_DIR) && $(abspath $(MUTANTS_VENV))/bin/mutmut results
	cd $(MUTANTS_DIR) && $(abspath $(MUTANTS_VENV))/bin/mutmut export-cicd-stats
	$(PYTHON) .ci/mutants.py $(MUTANTS_DIR)/mutants/mutmut-cicd-stats.json

## Every CPU results file the README quotes (~1 h on 2 cores); Ray Serve's needs the ray venv
## (`$(RAY_VENV)/bin/python -m bench.rayserve`), the GPU's a GPU (`python -m bench.gpu`).
bench: install
	$(BIN)/python -m bench.heads --serve --output bench/results-heads.md
	$(BIN)/python -m bench.serve --output bench/results-serve.md
	$(BIN)/python -m bench.swap --large --output bench/results-swap.md
	$(BIN)/python -m bench.shadow --output bench/results-shadow.md
	$(BIN)/python -m bench.protocols --output bench/results-protocols.md
	$(BIN)/python -m bench.latency --output bench/results-latency.md
	$(BIN)/python -m bench.vocabulary --output bench/results-vocabulary.md
	$(BIN)/python -m bench.client --output bench/results-client.md
	$(BIN)/python -m bench.workers --output bench/results-workers.md
	$(BIN)/python -m bench.soak --output bench/results-soak.md
	$(BIN)/python -m bench.fairness --output bench/results-fairness.md
	$(BIN)/python -m bench.storm_memory --output bench/results-storm-memory.md
	$(BIN)/python -m bench.import_head

clean:
	rm -rf $(VENV) $(VENV).lock $(OLDEST) $(DEPLOY) $(FLOORS) $(RAY_VENV) .mypy_cache .pytest_cache .ruff_cache
