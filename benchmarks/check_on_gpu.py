"""The GPU check's driver (benchmarks/gpu_check.sh runs it): each part in its own process with a time
budget, most valuable first, and benchmarks/results/gpu_check.json rewritten after every part, so a
run cut short still brings back what it measured.

    python benchmarks/check_on_gpu.py [--budget 450] [--json PATH]

On a machine without CUDA (or without torch) every part is reported as skipped, one line each, and
the JSON says "device": "cpu".
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
# (name, seconds, command): in order of value; each writes its figures to the JSON path it is given
PARTS = [
    ("smoke", 30, [PY, "benchmarks/gpu_qlora.py", "--part", "smoke", "--json"]),
    ("paging-demo", 70, [PY, "benchmarks/gpu_paging.py", "--part", "demo", "--json"]),
    ("unified-memory-probe", 35, [PY, "benchmarks/gpu_paging.py", "--part", "probe", "--json"]),
    ("qlora-ablation-as-t4", 150, [PY, "benchmarks/gpu_qlora.py", "--as-t4", "--part", "ablation", "--json"]),
    ("bf16-vs-fp16-matmul", 15, [PY, "benchmarks/gpu_qlora.py", "--part", "precision", "--json"]),
    ("expandable-segments", 45, [PY, "benchmarks/gpu_qlora.py", "--as-t4", "--part", "expandable", "--json"]),
    ("qlora-trainer", 30, [PY, "benchmarks/gpu_qlora.py", "--as-t4", "--part", "trainer", "--json"]),
    ("paging-sweep", 40, [PY, "benchmarks/gpu_paging.py", "--part", "sweep", "--json"]),
    ("paging-spike", 35, [PY, "benchmarks/gpu_paging.py", "--part", "spike", "--json"]),
]
# run only with the time the parts above leave of the budget: lessons 7 and 6 top to bottom with their
# %%gpu_only cells (activation offload; FSDP2's CPU offload), which have never run on a GPU
IF_TIME_LEFT = [
    ("lesson-7-on-cuda", 100, [PY, "benchmarks/gpu_lessons.py", "notebooks/07_the_rest_of_the_toolbox.ipynb", "--json"]),
    ("lesson-6-on-cuda", 150, [PY, "benchmarks/gpu_lessons.py", "notebooks/06_sharding.ipynb", "--json"]),
]


def environment() -> dict:
    """Device name and versions; "cpu" when there is no CUDA (or no torch)."""
    env = {"device": "cpu", "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        import torch
    except ImportError:
        return {**env, "torch": None, "reason": "torch is not installed"}
    env["torch"] = torch.__version__
    if not torch.cuda.is_available():
        return {**env, "reason": "no CUDA device"}
    env.update(device=torch.cuda.get_device_name(), cuda=torch.version.cuda,
               capability=list(torch.cuda.get_device_capability()))
    for module in ("bitsandbytes", "transformers", "peft"):
        try:
            env[module] = __import__(module).__version__
        except Exception as error:  # noqa: BLE001  a broken install is a finding, not a crash
            env[module] = f"not importable: {error!r}"[:200]
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        env["nvidia_smi"] = smi.stdout.strip()
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=float(os.environ.get("GPU_CHECK_BUDGET", 450)),
                        help="seconds for all parts together (default 450: the run fits in 8 minutes)")
    parser.add_argument("--json", type=Path, default=Path(os.environ.get(
        "GPU_CHECK_JSON", ROOT / "benchmarks" / "results" / "gpu_check.json")))
    args = parser.parse_args(argv)
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    report = {**environment(), "budget_s": args.budget, "parts": {}}

    def save() -> None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=str))
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))

    print(f"gpu check on {report['device']} ({report.get('reason') or report.get('nvidia_smi', '')})", flush=True)
    start = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    for name, budget, command in PARTS + IF_TIME_LEFT:
        entry = {"budget_s": budget, "if_time_left": any(name == n for n, _, _ in IF_TIME_LEFT)}
        report["parts"][name] = entry
        if report["device"] == "cpu":
            entry.update(status="skipped", reason="needs CUDA")
            print(f"== {name}: skipped, needs CUDA", flush=True)
            save()
            continue
        left = args.budget - (time.monotonic() - start)
        if left < 10:
            entry.update(status="skipped", reason="out of time")
            print(f"== {name}: skipped, out of time", flush=True)
            save()
            continue
        limit = min(budget, left)
        figures = scratch / f"{name}.json"
        print(f"== {name} (at {time.monotonic() - start:.0f} s, up to {limit:.0f} s)", flush=True)
        t = time.monotonic()
        # a session of its own, so that a part that runs out of time ends with its children (the
        # processes that hold paged state), not only itself
        child = subprocess.Popen([*command, str(figures)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, start_new_session=True,
                                 env={**os.environ, "GPU_CHECK_PART_SECONDS": f"{limit:.0f}"})  # a part may stop itself
        try:
            output, _ = child.communicate(timeout=limit)
            entry["status"] = "ok" if child.returncode == 0 else f"failed (exit {child.returncode})"
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            output, _ = child.communicate()
            entry["status"] = "timed out"
        entry["seconds"] = round(time.monotonic() - t, 1)
        print(output, end="" if output.endswith("\n") else "\n", flush=True)
        entry["output_tail"] = output[-3000:]
        if figures.exists():
            entry["figures"] = json.loads(figures.read_text())
        print(f"== {name}: {entry['status']} after {entry['seconds']} s", flush=True)
        save()
    report["seconds"] = round(time.monotonic() - start, 1)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
