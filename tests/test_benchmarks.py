"""The GPU benchmarks on a machine without one: one line that says so, exit 0 (benchmarks/gpu_check.sh
runs them on a GPU)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
GPU_SCRIPTS = sorted((ROOT / "benchmarks").glob("gpu_*.py"))


def test_there_are_gpu_benchmarks():
    assert {p.name for p in GPU_SCRIPTS} >= {"gpu_checkpointing.py", "gpu_paging.py", "gpu_qlora.py"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU message")
@pytest.mark.parametrize("script", GPU_SCRIPTS, ids=lambda p: p.name)
def test_gpu_benchmark_says_it_needs_cuda_in_one_line(script):
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0], out.stdout
