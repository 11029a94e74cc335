#!/usr/bin/env bash
# make device-env-check: our code on the lent GPU machine's versions, here (docs/gpu.md). Out of CI: its venv
# downloads torch 2.11.0 with its CUDA libraries (about 3.5 GB, 5 GB on disk).
#
# .venv-device (Python 3.12, scripts/device_env.txt: torch 2.11.0, transformers 5.17.0, ...) stands in for the
# machine's python3; it holds none of the packages that travel as wheels. Then, as on the machine:
#   1. make gpu-check's no-venv path with that interpreter: it installs wheels/ into a target with
#      --no-index --no-deps, imports everything and must stop with the one-line "no CUDA device" message;
#   2. the test suite's CUDA-agnostic subset (-m "not cuda") with that target and the repository on PYTHONPATH;
#      without a Slurm cluster the tests that submit to one skip (PF_SLURM_OPTIONAL=1, tests/support/slurm_marks.py).
# Writes runs/device-env/ (git-ignored): gpu-check's folder, the target, tests.xml and tests.log.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv-device/bin/python
WORK=runs/device-env
TESTS="${DEVICE_TESTS:-tests}"
rm -rf "$WORK" && mkdir -p "$WORK" || exit 1

"$PY" scripts/gpu_env.py stand-in --pins scripts/device_env.txt || exit 1

echo "== gpu-check's no-venv path with $("$PY" --version), expecting 'no CUDA device'"
GPU_PYTHON="$PY" GPU_RESULTS="$WORK/gpu-check" GPU_SITE="$(pwd)/$WORK/site" bash scripts/gpu_check.sh
rc=$?
if [ $rc != 3 ] || ! grep -q "^no CUDA device: " "$WORK/gpu-check/gpu_check.log"; then
  echo "device-env-check: gpu-check exited $rc without the 'no CUDA device' stop" >&2
  exit 1
fi

echo "== the CUDA-agnostic tests ($TESTS) with the carried wheels on PYTHONPATH"
if command -v sinfo >/dev/null 2>&1 && ! sinfo -h >/dev/null 2>&1; then
  echo "no Slurm cluster answers: the tests that submit to it skip (start one with scripts/slurm_up.sh)"
fi
t0=$SECONDS
PF_SLURM_OPTIONAL=1 PYTHONPATH="$(pwd)/$WORK/site:$(pwd)" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
  "$PY" -m pytest -q -p no:cacheprovider -m "not cuda" --junitxml="$WORK/tests.xml" $TESTS 2>&1 | tee "$WORK/tests.log"
rc=${PIPESTATUS[0]}
echo "device-env-check: pytest exit $rc in $((SECONDS - t0))s ($(tail -1 "$WORK/tests.log"))"
exit $rc
