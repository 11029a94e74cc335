#!/usr/bin/env bash
# One prepared check for a machine with a CUDA GPU (< 8 minutes): the CUDA-only tests (CUDA events,
# max_memory_allocated per phase, pinned-pool offload) and the smoke spec recorded on the GPU.
# Usage: make gpu-check   (OUT=results/gpu by default; a folder of its own, since cell ids are device-agnostic)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT="${OUT:-results/gpu}"
"$PY" - <<'PY'
import torch
assert torch.cuda.is_available(), "make gpu-check needs a CUDA device (and a CUDA build of torch==2.13.0)"
print("device:", torch.cuda.get_device_name(), "| torch", torch.__version__)
PY
"$PY" -m pytest -q -m cuda tests/
.venv/bin/pf-bench sweep experiments/smoke.yaml --out "$OUT" --executor local --max-jobs 1
.venv/bin/pf-bench status "$OUT"
.venv/bin/pf-bench figures --results "$OUT" --out "$OUT/figures"
echo "GPU records: $OUT   figures: $OUT/figures"
