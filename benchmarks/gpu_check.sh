#!/usr/bin/env bash
# The GPU check: lessons 5 and 4's CUDA paths and lessons 7 and 6 top to bottom with their %%gpu_only
# cells, on a real GPU in one run of at most 7 minutes (420 s, counted from this script's start, the
# wheel install included). The parts that do not page come first: smoke, bf16 against fp16, the T4
# ablation, expandable_segments, the Trainer, the bandwidth probe, lessons 7 and 6; then the paging
# demo and sweep, each with only its rows that stay under the free memory (benchmarks/check_on_gpu.py
# lists them; a part gets at most the time left, and one with under 10 s left is skipped and says so).
# Nothing asks for more managed memory than the card has free unless --oversubscribe is given (on the
# lent machine that can hang the GPU: never there); with it, every paging row runs, and the eviction
# probe and the spike too. Results: benchmarks/results/gpu_check.json, rewritten atomically after every
# part (and $OUT/gpu_check.json when the device tool's $OUT is set), so a run cut short still brings
# back what it measured; the log goes to $OUT/gpu_check.log too.
#
#   bash benchmarks/gpu_check.sh [--budget SECONDS] [--oversubscribe] [--json PATH]
#
# On the GPU machine, from the repository root, with the wheels that
# `/work/shared/tools/device-wheels.sh --jupyter` puts in .whl/ carried along: they are installed
# offline (no index), into /tmp/site, before anything runs (at most 120 s). On a machine without CUDA
# nothing is installed: each part says it needs CUDA, the JSON says "device": "cpu", and the exit
# status is 0.
set -uo pipefail
export GPU_CHECK_STARTED=$(date +%s.%N)  # the budget counts from here
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export COURSE_LIB_CHECKPOINTS=${COURSE_LIB_CHECKPOINTS:-/tmp/course_lib_checkpoints}  # the 1B checkpoint, saved once
if command -v nvidia-smi >/dev/null 2>&1 && timeout 20 nvidia-smi -L >/dev/null 2>&1 && compgen -G ".whl/*.whl" >/dev/null; then
    timeout 120 "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
        export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
if [[ -n ${OUT:-} ]]; then
    mkdir -p "$OUT"
    "$py" benchmarks/check_on_gpu.py "$@" 2>&1 | tee "$OUT/gpu_check.log"
else
    "$py" benchmarks/check_on_gpu.py "$@"
fi
