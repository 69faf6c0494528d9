#!/usr/bin/env bash
# The GPU check: every CUDA path of the course on a real GPU, in one run, most important first.
#
#   bash benchmarks/gpu_check.sh --prepare    # here (needs the package registry): wheels -> .whl/
#   bash benchmarks/gpu_check.sh [SECONDS]    # on the GPU machine, from the repository root, with
#                                             # .whl/ carried along; stops starting parts after SECONDS
#                                             # (default 520), so that one device call holds it all
# In order: the environment check; lesson 5's 1B QLoRA ablation as on a T4 (fp16 + GradScaler, 15 GiB
# cap), then with the device's own precision; lesson 4's paged optimizers (gpu_paging.py); lesson 3's
# checkpointing (gpu_checkpointing.py); the test suite (the CUDA tests run instead of skipping); every
# lesson under nbval (the %%gpu_only cells run). Each part gets the time left, no more.
# Everything goes to $OUT/gpu_check.log (the device tool brings $OUT back; else ./gpu_results/), the
# numbers to $OUT/*.json: at most 8 files, the device tool's limit.
set -uo pipefail
if [[ ${1:-} == --prepare ]]; then
    bash ../shared/tools/device-wheels.sh --jupyter || exit
    # lesson 1's planner widget; the machine has no ipywidgets
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d .whl ipywidgets widgetsnbextension jupyterlab_widgets || exit
    du -sh .whl
    exit
fi
budget=${1:-520}
out=${OUT:-gpu_results}
mkdir -p "$out"
log=$out/gpu_check.log
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg

part() {  # part NAME COMMAND...: run COMMAND with the seconds left, say how it ended
    local name=$1 left=$((budget - SECONDS)) started=$SECONDS
    shift
    if ((left < 30)); then
        echo "== $name: not run, out of time"
        return
    fi
    echo "== $name (at ${SECONDS}s, up to ${left}s)"
    timeout --kill-after=10 "$left" "$@"
    local status=$?
    echo "== $name: exit $status after $((SECONDS - started))s$( ((status == 124)) && echo ', out of time')"
}

{
    # the carried wheels and course_lib itself go into the machine's Python (the tests call the
    # course-lib command beside python3); where that Python is read-only, onto PYTHONPATH instead
    if compgen -G ".whl/*.whl" >/dev/null &&
        ! python3 -m pip install -q --no-index --no-deps --no-cache-dir .whl/*.whl; then
        python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/site .whl/*.whl
        export PYTHONPATH=/tmp/site
    fi
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . ||
        export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    part check python3 -m course_lib.cli check
    part qlora-as-t4 python3 benchmarks/gpu_qlora.py --as-t4
    part paging python3 benchmarks/gpu_paging.py
    part checkpointing python3 benchmarks/gpu_checkpointing.py
    part qlora-native python3 benchmarks/gpu_qlora.py
    xdist=(); python3 -c "import xdist" 2>/dev/null && xdist=(-n 8 --dist loadfile)
    part tests python3 -m pytest -q -p no:cacheprovider -o addopts= -rs "${xdist[@]}" tests
    part lessons python3 -m pytest -q -p no:cacheprovider -o addopts= -rs "${xdist[@]}" \
        --nbval-lax --nbval-current-env notebooks
} 2>&1 | tee "$log"
