# Every target runs inside .venv/ (created by `make setup`, git-ignored).
PY      := .venv/bin/python
VENV_OK := .venv/.installed
SPEC    ?= experiments/smoke.yaml
RESULTS ?= results
DEMO    ?= runs/demo
# make demo runs the smoke sweep into $(DEMO) (git-ignored), so it really runs on a fresh clone;
# results/ holds the committed reference records that make figures renders.

.PHONY: setup test test-fast test-verl lint demo figures tables gpu-wheels gpu-check device-env-check \
	device-env-clean slurm-up slurm-down clean

setup: $(VENV_OK)

$(VENV_OK): pyproject.toml
	test -x $(PY) || python3.11 -m venv .venv || python3 -m venv .venv
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,hf]'
	touch $(VENV_OK)

# The Slurm tests need the local single-node cluster: start it (root, Slurm installed, not running) and stop
# it again afterwards. .ci/run installs and starts it itself; without Slurm those tests skip.
test: setup
	@started=0; \
	if [ "$$(id -u)" = 0 ] && command -v slurmctld >/dev/null 2>&1 && ! sinfo -h >/dev/null 2>&1; then \
	  bash scripts/slurm_up.sh && started=1; \
	fi; \
	$(PY) -m pytest -q; rc=$$?; \
	if [ $$started = 1 ]; then bash scripts/slurm_down.sh; fi; \
	exit $$rc

# verl 0.9.1 lives in its own venv: it needs transformers <5.11, the [hf] extra pins 5.24.0. Every package comes from
# constraints/verl.txt (CPU torch 2.13.0); only the verl tests run there (make test skips them without verl).
VERL_PY := .venv-verl/bin/python
VERL_OK := .venv-verl/.installed

$(VERL_OK): pyproject.toml constraints/verl.txt
	test -x $(VERL_PY) || python3.11 -m venv .venv-verl || python3 -m venv .venv-verl
	$(VERL_PY) -m pip install --quiet --upgrade pip
	$(VERL_PY) -m pip install --quiet -c constraints/verl.txt -e . 'verl==0.9.1' 'torch==2.13.0+cpu' \
	  'transformers==5.10.4' uvicorn pytest
	touch $(VERL_OK)

test-verl: $(VERL_OK)
	$(VERL_PY) -m pytest -q tests/verl_integration

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not slurm"

lint: setup
	$(PY) -m ruff check prefixflow harness tests
	$(PY) -m ruff format --check prefixflow harness tests

demo: setup
	.venv/bin/pf-bench sweep $(SPEC) --out $(DEMO)
	.venv/bin/pf-bench status $(DEMO)
	.venv/bin/pf-bench figures --results $(DEMO) --out $(DEMO)/figures
	@echo "records: $(DEMO)/$$(basename $(SPEC) .yaml)/   figures: $(DEMO)/figures/"

figures: setup
	.venv/bin/pf-bench figures --results $(RESULTS) --out $(RESULTS)/figures
	.venv/bin/pf-bench tables --results $(RESULTS) --out $(RESULTS)/figures

tables: setup
	.venv/bin/pf-bench tables --results $(RESULTS) --out $(RESULTS)/figures

# The lent GPU machine (docs/gpu.md). gpu-wheels (here): the wheels it lacks into wheels/ (< 48 MiB), and the
# stamp of this tree. gpu-check (there, or on any CUDA machine): no .venv, no registry; GPU_PYTHON is the
# interpreter holding torch. device-env-check (here, not in CI: a 3.5 GB torch download): a Python 3.12 venv with
# that machine's versions runs gpu-check's no-venv path and the CUDA-agnostic tests.
GPU_PYTHON    ?= python3
DEVICE_PYTHON ?= $(shell for p in python3.12 $(HOME)/.pyenv/versions/3.12*/bin/python3.12; do \
	$$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { command -v $$p; break; }; done)
DEVICE_PY     := .venv-device/bin/python
DEVICE_OK     := .venv-device/.installed

gpu-wheels: setup
	$(PY) scripts/gpu_wheels.py download

gpu-check:
	GPU_PYTHON=$(GPU_PYTHON) bash scripts/gpu_check.sh

$(DEVICE_OK): scripts/device_env.txt scripts/gpu_wheels.txt
	@test -n "$(DEVICE_PYTHON)" || { echo "device-env-check needs Python 3.12: set DEVICE_PYTHON"; exit 1; }
	test -x $(DEVICE_PY) || $(DEVICE_PYTHON) -m venv .venv-device
	$(DEVICE_PY) -m pip install --quiet --upgrade pip
	$(DEVICE_PY) -m pip install --quiet -r scripts/device_env.txt
	$(DEVICE_PY) -m pip uninstall --quiet -y $$($(DEVICE_PY) scripts/gpu_wheels.py names)  # the machine lacks them
	touch $(DEVICE_OK)

device-env-check: gpu-wheels $(DEVICE_OK)
	bash scripts/device_env_check.sh

device-env-clean:
	rm -rf .venv-device runs/device-env

slurm-up:
	bash scripts/slurm_up.sh

slurm-down:
	bash scripts/slurm_down.sh

clean:
	rm -rf .pytest_cache .ruff_cache build *.egg-info
