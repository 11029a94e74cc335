#!/usr/bin/env bash
# make gpu-check: one prepared run on a machine with a CUDA GPU, as that machine is (docs/gpu.md).
#
# No .venv and no registry needed: with GPU_PYTHON (default python3, the interpreter that holds the machine's torch)
# it installs the carried wheels (wheels/, from `make gpu-wheels`) into a temporary target with
# `pip install --no-index --no-deps --target` and puts that target and the repository on PYTHONPATH.
# Then, within GPU_CHECK_SECONDS (360) of command time, so that a rerun fits in the same lease:
#   environment    torch, CUDA, driver and GPU (environment.json); without a CUDA device one line, exit 3
#   cuda-tests     the CUDA-marked tests (events, max_memory_allocated per phase, the pinned pool with its
#                  streams, split attention's fused kernels)
#   align-fp64     Table 3 on the GPU in fp64, ...
#   align-bf16     ... and in bf16 (mixed precision) with the negative controls, each of which must FAIL
#   speed          Llama3 dim 2048, 16 layers (1.5B), bf16, P=4096, S=1024, N=16, one response per microbatch,
#   speed-offload  eager: baseline vs PrefixFlow, then PrefixFlow with offload
#   smoke          the smoke spec on the GPU
#   estimate       the slot of issue 34 item 9 (memory_estimate_slot below)
#   tables         Table 3 and the figures of what ran
# Results: GPU_RESULTS (default runs/gpu, replaced on each run); when $OUT names a folder (the lent machine's
# return folder) also there, as 6 files: summary.md, summary.json, environment.json, gpu_check.log,
# cuda-tests.xml and results.tar.gz (the whole results folder).
# Exit: 0 every step ok; 1 a step failed or ran out of time; 2 bad GPU_RESULTS; 3 no CUDA device (after the
# install and the imports).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY="${GPU_PYTHON:-python3}"
RESULTS="${GPU_RESULTS:-runs/gpu}"
WHEELS="${GPU_WHEELS:-wheels}"
BUDGET="${GPU_CHECK_SECONDS:-360}"
RESERVE=30            # seconds kept for the tables, the summary and the bundle
ESTIMATE_SECONDS=120  # what issue 34 item 9 may add, beyond BUDGET
MARK=.gpu-check       # marks a results folder this script made (and may replace)
BENCH=("$PY" -m harness.cli)
# Llama3 at dim 2048 and 16 layers with Llama 3.2 1B's other shapes (GQA 32/8, FFN 8192, 128k vocabulary).
SPEED_MODEL=(--model llama3:debugmodel --override dim=2048 --override n_layers=16 --override n_heads=32
  --override n_kv_heads=8 --override ffn_dim_multiplier=1.5 --override multiple_of=256 --override vocab_size=128256)
SPEED_SHAPE=(--prefix-len 4096 --suffix-len 1024 --n 16 --microbatch 1 --dtype bf16)

step() {  # step NAME CAP COMMAND...: run it within min(CAP, what BUDGET leaves), record status and seconds
  local name=$1 cap=$2 left t0 rc status
  shift 2
  left=$((BUDGET - (SECONDS - START) - RESERVE))
  [ "$cap" -lt "$left" ] || cap=$left
  if [ "$cap" -lt 5 ]; then
    printf '%s\tskipped\t0\t0\tno time left in %ss\n' "$name" "$BUDGET" >>"$STEPS"
    failed=1
    return
  fi
  echo "== $name (at most ${cap}s)"
  t0=$SECONDS
  timeout --kill-after=10 "$cap" "$@"  # its own process group: a cell's workers stop with it
  rc=$?
  case $rc in 0) status=ok ;; 124 | 137) status=timeout ;; *) status=failed ;; esac
  [ $rc = 0 ] || failed=1
  printf '%s\t%s\t%s\t%s\t\n' "$name" "$status" "$rc" "$((SECONDS - t0))" >>"$STEPS"
  echo "== $name: $status in $((SECONDS - t0))s"
}

# Issue 34 item 9 fills this slot: the fake-tensor estimate of the speed cell's shape (a 1B-class model) for
# both systems, compared with the speed steps' torch.cuda.max_memory_allocated records, the gap stated in the
# summary. Contract: records under $RESULTS/estimate, non-zero exit on a failed estimate, at most
# ESTIMATE_SECONDS. Until `pf-bench run` has --estimate, the step is recorded as skipped.
memory_estimate_slot() {
  if ! "${BENCH[@]}" run --help 2>/dev/null | grep -q -- "--estimate"; then
    printf 'estimate\tskipped\t0\t0\tpf-bench run has no --estimate yet (issue 34 item 9)\n' >>"$STEPS"
    return
  fi
  BUDGET=$((BUDGET + ESTIMATE_SECONDS))
  step estimate "$ESTIMATE_SECONDS" "${BENCH[@]}" run "${SPEED_MODEL[@]}" "${SPEED_SHAPE[@]}" \
    --systems baseline,prefixflow --estimate --out "$RESULTS/estimate"
}

main() {
  START=$SECONDS
  failed=0
  # the no-venv path: the carried wheels into a temporary target, the repository on PYTHONPATH
  local site="${GPU_SITE:-}" wheels rc
  if [ -z "$site" ]; then
    site=$(mktemp -d "${TMPDIR:-/tmp}/pf-gpu-site.XXXXXX") || return 1
    trap "rm -rf '$site'" EXIT  # main runs in the pipeline's subshell: this fires when it ends
  fi
  shopt -s nullglob
  wheels=("$WHEELS"/*.whl)
  if [ ${#wheels[@]} -gt 0 ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      "${wheels[@]}" || { echo "gpu-check: $PY could not install the wheels of $WHEELS/"; return 1; }
    echo "installed ${#wheels[@]} wheels from $WHEELS/ into $site"
  else
    echo "no wheels in $WHEELS/: $PY's own packages must hold everything (the lent machine needs make gpu-wheels)"
  fi
  export PYTHONPATH="$site:$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  if ! git -C "$REPO" rev-parse HEAD >/dev/null 2>&1; then  # no .git travels: the stamp vouches for the tree
    PF_GIT_REV=$("$PY" scripts/gpu_env.py revision --stamp "$WHEELS/REVISION.json") && export PF_GIT_REV
  fi
  if [ ${#wheels[@]} -gt 0 ]; then "$PY" scripts/gpu_env.py requirements --wheels "$WHEELS" || return 1; fi
  "$PY" scripts/gpu_env.py imports || return 1
  "$PY" scripts/gpu_env.py environment --out "$RESULTS/environment.json"
  rc=$?
  [ $rc = 0 ] || return $rc  # 3: the one-line "no CUDA device" message is printed

  step cuda-tests 120 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/ --junitxml="$RESULTS/cuda-tests.xml"
  step align-fp64 45 "${BENCH[@]}" align --dtype fp64 --device cuda --out "$RESULTS"
  step align-bf16 60 "${BENCH[@]}" align --dtype bf16 --device cuda --microbatch 2 --controls --out "$RESULTS"
  local cell=("${SPEED_MODEL[@]}" "${SPEED_SHAPE[@]}" --device cuda --warmup 1 --repeats 5 --out "$RESULTS")
  step speed 110 "${BENCH[@]}" run "${cell[@]}" --systems baseline,prefixflow
  step speed-offload 60 "${BENCH[@]}" run "${cell[@]}" --systems prefixflow --offload
  step smoke 90 "${BENCH[@]}" sweep experiments/smoke.yaml --out "$RESULTS" --executor local --max-jobs 1
  memory_estimate_slot
  RESERVE=5 step tables 25 "${BENCH[@]}" tables --results "$RESULTS" --out "$RESULTS/figures"
  RESERVE=0 step figures 25 "${BENCH[@]}" figures --results "$RESULTS" --out "$RESULTS/figures"
  "$PY" scripts/gpu_env.py summary "$RESULTS" || failed=1
  echo "gpu-check: $((SECONDS - START))s, results in $RESULTS, $([ $failed = 0 ] && echo 'every step ok' || echo 'a step FAILED')"
  return $failed
}

if [ -e "$RESULTS" ] && [ ! -e "$RESULTS/$MARK" ] && [ -n "$(ls -A "$RESULTS" 2>/dev/null)" ]; then
  echo "gpu-check: $RESULTS exists and was not made by gpu-check; set GPU_RESULTS to a new folder" >&2
  exit 2
fi
rm -rf "$RESULTS" && mkdir -p "$RESULTS" && touch "$RESULTS/$MARK" || exit 2
STEPS="$RESULTS/steps.tsv"
: >"$STEPS"
main 2>&1 | tee "$RESULTS/gpu_check.log"
rc=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then  # the lent machine's return folder (<= 8 files)
  tar -czf "$OUT/results.tar.gz" -C "$RESULTS" . || rc=1
  for f in summary.md summary.json environment.json gpu_check.log cuda-tests.xml; do
    [ ! -e "$RESULTS/$f" ] || cp "$RESULTS/$f" "$OUT"/ || rc=1
  done
  echo "returned in \$OUT: $(ls "$OUT" | tr '\n' ' ')"
fi
exit $rc
