#!/usr/bin/env bash
# The GPU check: every CUDA path of the course on a real GPU, in one run, with its log kept.
#
# Prepare on the development machine (needs the package registry):
#     bash ../shared/tools/device-wheels.sh --jupyter    # bitsandbytes, nbval, nbclient, ipykernel -> .whl/
# Run on the GPU machine, from the repository root (with .whl/ carried along):
#     bash benchmarks/gpu_check.sh
# It runs: the environment check, the test suite (the CUDA tests run instead of skipping), every
# benchmarks/gpu_*.py script, and every lesson and solution under nbval (the %%gpu_only cells run).
# The log goes to $OUT/gpu_check.log when $OUT is set (the device tool), else gpu_check.log.
set -uo pipefail
log=${OUT:-.}/gpu_check.log
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
pytest=(python3 -m pytest -q -p no:cacheprovider -o addopts= -rs)
{
    nvidia-smi
    python3 -m course_lib.cli check
    "${pytest[@]}" tests
    for script in benchmarks/gpu_*.py; do
        echo "== $script"
        python3 "$script"
    done
    "${pytest[@]}" --nbval-lax --nbval-current-env notebooks solutions
} 2>&1 | tee "$log"
