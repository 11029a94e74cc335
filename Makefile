# Every target runs inside .venv/ (created by `make setup`, git-ignored).
PY      := .venv/bin/python
VENV_OK := .venv/.installed
SPEC    ?= experiments/smoke.yaml
RESULTS ?= results
DEMO    ?= runs/demo
# make demo runs the smoke sweep into $(DEMO) (git-ignored), so it really runs on a fresh clone;
# results/ holds the committed reference records that make figures renders.

.PHONY: setup test test-fast lint demo figures tables gpu-check slurm-up slurm-down clean

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

gpu-check: setup
	bash scripts/gpu_check.sh

slurm-up:
	bash scripts/slurm_up.sh

slurm-down:
	bash scripts/slurm_down.sh

clean:
	rm -rf .pytest_cache .ruff_cache build *.egg-info
